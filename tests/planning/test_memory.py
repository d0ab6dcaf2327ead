"""The memory a plan predicts (autotp/planning/costs/saved.py, costing.py, solver.py): what autograd saves,
the copies readers keep, the phases of a step and the forward of an inference plan, each against a
measurement or a hand count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
import autotp.planning.solve.ilp
from autotp.planning.planner import plan_graph
from autotp.planning.solve.solver import MEMORY_MARGIN
from examples.models import tiny_llama


def _saved_bytes(model: nn.Module, inputs: tuple) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one forward, leaving out
    the parameters and inputs (they live anyway), as ``saved_tensors_hooks`` sees them."""
    alive = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *inputs)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in alive:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())


def _replicated(model: nn.Module, inputs: tuple, **kwargs):
    graph = autotp.capture(model, inputs)
    return plan_graph(graph, (2,), "cpu-gloo", pin={n: "R" for n, _ in model.named_parameters()}, **kwargs)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        h = self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return (x + h).tanh()


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_activations_are_what_autograd_saves(name):
    """A replicated plan's activations equal the storages autograd keeps (within 2%: attention's
    log-sum-exp is priced per row, as the kernel allocates it), not every output with a gradient."""
    torch.manual_seed(0)
    if name == "mlp":
        model, inputs = _MLP(), (torch.randn(8, 16, 64),)
    else:
        model, inputs = tiny_llama(batch=2, seq=64, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=256)
    predicted = _replicated(model, inputs, recompute=False).memory.activations_bytes
    measured = _saved_bytes(model, inputs)
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
    outputs = sum(n.output.nbytes for n in autotp.capture(model, inputs).ops() if n.requires_grad and not n.is_view)
    # what the old count priced, every output with a gradient, misses by more than the 2% above
    assert abs(outputs / measured - 1) > 0.1, (outputs, measured)


class _Unlisted(nn.Module):
    """atan and erf are in neither table of autotp/planning/costs/saved.py; each backward reads its input."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)

    def forward(self, x):
        return torch.erf(torch.atan(self.up(x))).sum(-1)


def test_an_op_without_a_saved_tensors_entry_is_counted_high_not_low():
    """An op the tables do not know keeps every floating input it reads: here exactly what autograd
    keeps (atan's and erf's inputs); never the nothing that would let a plan over-fill a budget."""
    torch.manual_seed(0)
    model, inputs = _Unlisted(), (torch.randn(8, 16, 64),)
    predicted = _replicated(model, inputs, recompute=False).memory.activations_bytes
    measured = _saved_bytes(model, inputs)
    assert measured > 0 and predicted >= measured and abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_a_gathered_input_a_reader_keeps_counts_whole():
    """up's output is split by columns; down, pinned whole, gathers it and keeps the gathered copy
    for its weight's gradient: the plan counts the hidden tensor whole, a hand count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    graph = autotp.capture(model, (x,))
    split = plan_graph(graph, (2,), "cpu-gloo", pin={"0.weight": "S(0)", "0.bias": "S(0)", "1.weight": "S(1)"})
    whole = plan_graph(graph, (2,), "cpu-gloo", pin={"0.weight": "S(0)", "0.bias": "S(0)", "1.weight": "R"})
    hidden = 32 * 256 * 4
    assert whole.memory.activations_bytes - split.memory.activations_bytes == hidden / 2


def test_the_peak_is_the_optimizer_step_where_parameters_dominate():
    """Large weights, one row: AdamW's step holds parameters, gradients, two states and one
    parameter-sized temporary (5 x P), more than the backward's start (3 x P and the activations)."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    plan = _replicated(model, (torch.randn(1, 512),))
    mem = plan.memory_per_device()
    p = sum(t.numel() * 4 for t in model.parameters())
    assert mem.peak_phase == "optimizer step"
    assert mem.phases()["optimizer step"] == pytest.approx(5 * p)
    assert mem.total_bytes == mem.peak_bytes == max(mem.phases().values())
    assert plan.memory_timeline() == mem.phases()
    assert "at its peak, the optimizer step" in plan.report()


def test_an_inference_plan_counts_the_forward_fullest_step():
    """Without autograd an output lives until its last reader: the fullest step is the second ReLU,
    which reads the wide linear's output while writing its own (2 x batch x 512 floats)."""
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)).eval()
    x = torch.randn(16, 8)
    graph = autotp.capture(model, (x,), training=False)
    plan = plan_graph(graph, (2,), "cpu-gloo", "inference", pin={n: "R" for n, _ in model.named_parameters()})
    assert plan.memory.activations_bytes == 2 * 16 * 512 * 4
    params = sum(t.numel() * 4 for t in model.parameters())
    assert plan.memory.total_bytes == params + 2 * 16 * 512 * 4


def test_a_plan_under_a_budget_leaves_the_margin_free():
    torch.manual_seed(0)
    model, inputs = tiny_llama(batch=2, seq=64, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=256)
    graph = autotp.capture(model, inputs)
    roomy = plan_graph(graph, (2,), "cpu-gloo", recompute=False).memory.total_bytes
    with pytest.raises(autotp.MemoryBudgetError, match="keeps free") as err:
        plan_graph(graph, (2,), "cpu-gloo", memory_budget=1, recompute=False)
    budget = (err.value.minimum_bytes + roomy) / 2
    plan = plan_graph(graph, (2,), "cpu-gloo", memory_budget=budget, recompute=False)
    assert plan.memory.total_bytes <= budget * (1 - MEMORY_MARGIN)


def _measured_step(rank, world, graph, plan, model, inputs):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from benchmarks.memory import LiveBytes

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        pm(*inputs).backward()
        optimizer.step()

    step()
    step()
    meter = LiveBytes()
    meter.track_training(pm, optimizer, inputs)
    with meter:
        step()
    return meter.peak


@pytest.mark.parametrize("pins", ["megatron", "planner"])
def test_the_predicted_peak_is_what_a_step_holds(pins):
    """A Llama block and its cross-entropy on 2 threads, three AdamW steps: the third's peak, counted
    storage by storage (benchmarks/memory.py's meter), is within 10% of the plan's figure."""
    import copy

    import torch.nn.functional as F

    from autotp.tracing.loss import WithLoss
    from examples.ranks import run_threads

    model, (ids,) = tiny_llama(batch=2, seq=64, n_layer=1, dim=64, n_head=4, n_kv_head=2, ffn_dim=256, vocab=1024)
    targets = torch.randint(0, 1024, ids.shape, generator=torch.Generator().manual_seed(1))
    wrapped = WithLoss(model, lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten()))
    graph = autotp.capture(wrapped, (ids, targets))
    pin = None
    if pins == "megatron":
        pin = {n: "S(1)" if n.endswith(("o_proj.weight", "down_proj.weight")) else
               "S(0)" if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                     "up_proj.weight", "lm_head.weight")) else "R" for n, _ in model.named_parameters()}
    plan = plan_graph(graph, (2,), "cpu-gloo", pin=pin, recompute=False)
    predicted = plan.memory_per_device().total_bytes
    for measured in run_threads(_measured_step, 2, graph, plan, copy.deepcopy(wrapped), (ids, targets)):
        assert 0.9 <= predicted / measured <= 1.1, (predicted, measured, plan.memory_timeline())


@pytest.mark.parametrize("blocks", [("mlp", "mlp"), ("mlp", "mlp", "mlp")])
def test_the_least_a_budget_error_states_is_a_budget_a_plan_fits(blocks):
    """The error's minimum is the least peak of any plan (one solve minimizing it), with the margin:
    a user who raises the budget to it gets a plan. A bound from each node's cheapest choice alone
    leaves out the copies a plan's reads keep, and fell below every plan here (a budget 2% over it
    found none)."""
    from tests.helpers.properties import Case, build

    case = Case(blocks=blocks, dim=8, heads=1, head_dim=4, batch=1, seq=8, mesh=(4,), mode="train", slack=0.0, seed=0)
    graph = autotp.capture(*build(case))
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, case.mesh, "cpu-gloo", memory_budget=1)
    least = err.value.minimum_bytes
    assert f"raise the budget to at least {least} bytes" in str(err.value)
    plan = plan_graph(graph, case.mesh, "cpu-gloo", memory_budget=least)
    # within the rows' bound, margin kept: the rows count each tied instance at its own figure (the
    # last block's output is returned, not saved by a next block: counted at the first's, the rows
    # missed 256 bytes and a plan recomputing a block came out 2% over)
    assert plan.memory.peak_bytes <= least * (1 - MEMORY_MARGIN) * 1.0001  # the margin kept, to the solver's gap, (plan.memory, plan.recompute)


def test_a_least_solve_the_time_limit_stops_before_any_plan_is_solved_again(monkeypatch):
    """A minimizing solve stopped before it found a plan (a large two-axis ILP spends its 2 s in
    presolve) has no peak to state: it is solved again for longer, never stated as 0 bytes."""
    from autotp.planning.solve import solver
    from tests.helpers.properties import Case, build

    case = Case(blocks=("mlp", "mlp"), dim=8, heads=1, head_dim=4, batch=1, seq=8, mesh=(4,), mode="train", slack=0.0,
                seed=0)
    graph = autotp.capture(*build(case))
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, case.mesh, "cpu-gloo", memory_budget=1)
    least = err.value.minimum_bytes
    real, limits = solver.solve_with_first_solver, []

    def stopped_at_once(prob, time_limit_s, problem):  # the first least solve stops before a plan
        least_solve = "least_start" in prob.constraints
        first = least_solve and not any(is_least for is_least, _ in limits)
        limits.append((least_solve, time_limit_s))
        return real(prob, 1e-6 if first else time_limit_s, problem)

    monkeypatch.setattr(solver, "solve_with_first_solver", stopped_at_once)
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, case.mesh, "cpu-gloo", memory_budget=1)
    assert err.value.minimum_bytes == least and least > 0
    assert sum(is_least for is_least, _ in limits) >= 2  # solved again


def test_a_solve_the_time_limit_stops_before_any_plan_is_no_plan(monkeypatch):
    """Stopped before it found a plan, the solver leaves every variable at 0: read as a choice, that
    was strategy 0 everywhere, a plan far over the budget, returned with no error. It is a solver
    failure that says to raise the time limit."""
    from autotp.planning.solve import ilp, solver
    from tests.helpers.properties import Case, build

    case = Case(blocks=("mlp", "mlp"), dim=8, heads=1, head_dim=4, batch=1, seq=8, mesh=(4,), mode="train", slack=0.0,
                seed=0)
    graph = autotp.capture(*build(case))
    real = solver.solve_with_first_solver
    monkeypatch.setattr(solver, "solve_with_first_solver",
                        lambda prob, time_limit_s, problem: real(prob, 1e-6, problem))  # stopped in presolve
    with pytest.raises(ilp.SolverError, match="no plan found within its time limit"):
        plan_graph(graph, case.mesh, "cpu-gloo", recompute=False)


def _jamba(layers: int = 4, hidden: int = 64, seq: int = 64):
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    config = JambaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                         expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                         mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)
    return JambaForCausalLM(config), (torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0)),)


@pytest.mark.slow
def test_the_least_budget_named_for_jamba_is_the_least_that_plans():
    """Jamba (its ILP takes seconds to prove optimal): the least solve had 2 s, stopped at a plan's
    peak and named 8.9 MiB, above the plan with no budget (8.3 MiB), while 6.2 MiB planned. With the
    plan's own time limit it is the least: that budget plans (the solve for the fastest plan under it
    finds none in its time, and the least-memory plan, which fits, is the plan), 3% under it is
    refused naming it."""
    graph = autotp.capture(*_jamba(), dynamic_dims=False, unroll=True)
    free = plan_graph(graph, (2,), "cpu-gloo").memory.peak_bytes
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, (2,), "cpu-gloo", memory_budget=1)
    least = err.value.minimum_bytes
    assert "did not prove" not in str(err.value)
    assert least < free / (1 - MEMORY_MARGIN)  # the free plan is no least plan here
    plan = plan_graph(graph, (2,), "cpu-gloo", memory_budget=least)
    assert plan.memory.peak_bytes <= least * (1 - MEMORY_MARGIN) + 1
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, (2,), "cpu-gloo", memory_budget=least * 0.97)
    assert err.value.minimum_bytes == least


def test_the_least_autotp_plan_names_says_which_trace_it_is_for_and_plans():
    """autotp.plan traces static sizes, autotp.parallelize dynamic ones by default: the least plan
    names says it is the static trace's and how to get parallelize's; that least, and the least of the
    dynamic trace it points to, each plan on their own path, and a budget under either is refused."""
    from tests.helpers.captures import captures_shared

    model, inputs = tiny_llama(batch=2, seq=16, n_layer=1, device="meta")
    with captures_shared() as captured:  # the capture was most of this test's time
        for dynamic in (False, None):
            with pytest.raises(autotp.MemoryBudgetError) as err:
                autotp.plan(model, (2,), inputs, hardware="cpu-gloo", memory_budget=1, dynamic_dims=dynamic)
            said = "for the model traced with static sizes" in str(err.value)
            assert said == (dynamic is False) and (not said or "plan with dynamic_dims=None" in str(err.value))
            least = err.value.minimum_bytes
            plan = autotp.plan(model, (2,), inputs, hardware="cpu-gloo", memory_budget=least, dynamic_dims=dynamic)
            assert plan.memory.peak_bytes <= least * (1 - MEMORY_MARGIN) + 1
            with pytest.raises(autotp.MemoryBudgetError) as err:
                autotp.plan(model, (2,), inputs, hardware="cpu-gloo", memory_budget=least * 0.97,
                            dynamic_dims=dynamic)
            assert err.value.minimum_bytes == least
    assert len(captured) == 2  # one static and one dynamic trace, each planned three times
