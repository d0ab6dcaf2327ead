"""Replicated ops that pass partial gradients on (``Rg``): a token dispatch copies each token to ``k``
slots, column- and row-split expert weights work on the slots, and the slots are summed back per
token. Without ``Rg`` the slots' partial gradient is summed where the first split weight reads them,
``k`` times the hidden states' bytes; with it, the copy runs replicated, passes the partial sums
back to the hidden states, and they are summed there, ``k`` times fewer bytes. Planned at real width,
exact on 2 ranks with the collectives the plan lists, and never where a reader returns a whole gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
import autotp.planning.planner
from autotp.mesh import MeshSpec
from autotp.placement import R, Rg, S, Strategy, parse_placements
from autotp.planning.costs.costing import INFEASIBLE_S, CostModel
from autotp.planning.planner import plan_graph
from tests.helpers.plans import solver_objective
from autotp.tracing.graph import TensorInfo
from cost_models import load_profile
from examples.ranks import run_threads
from tests.helpers.exactness import assert_step_matches_one_process
from tests.helpers.observed import CollectiveLog, assert_as_planned


class Dispatch(nn.Module):
    """Each of ``tokens`` tokens goes to ``k`` slots; one MLP per slot; the slots summed back."""

    def __init__(self, tokens: int, hidden: int, ffn: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.register_buffer("slot_token", torch.arange(tokens).repeat_interleave(k), persistent=False)

    def forward(self, x):  # (tokens, hidden)
        slots = self.norm(x)[self.slot_token]  # (tokens * k, hidden)
        y = self.down(torch.relu(self.up(slots)))
        return x + y.view(x.shape[0], self.k, -1).sum(1)


def _dispatch_node(plan) -> str:
    return next(n.name for n in plan.nodes if n.target == "aten.index.Tensor")


def test_partial_gradient_placement_prints_parses_and_reads_as_r():
    assert str(Rg) == "Rg" and Rg.is_replicate and Rg != R
    assert parse_placements("RgS(0)") == (Rg, S(0))
    assert Strategy.parse("(R, R) -> Rg").output == (Rg,)
    assert Strategy.parse("(R, R) -> Rg").partial_grads_on(0) and not Strategy.parse("(R, R) -> R").partial_grads_on(0)
    with pytest.raises(ValueError, match="only R may leave its gradient partial"):
        autotp.placement.Placement("S", 0, grad_partial=True)


def test_only_a_reader_returning_a_partial_gradient_may_read_rg():
    cost = CostModel(MeshSpec.of((8,)), load_profile("h100-sxm"), "train")
    info = TensorInfo((64, 64), "float32")
    assert cost.edge_s(info, (Rg,), (R,), True, (0,)) == 0.0  # the reader works on shards: partial too
    assert cost.edge_s(info, (Rg,), (R,), True, ()) == INFEASIBLE_S  # a whole gradient added to partial ones
    assert cost.edge_s(info, (Rg,), (S(0),), True, ()) == INFEASIBLE_S  # a slice's backward gathers whole
    assert cost.edge_s(info, (Rg,), (S(0),), False, ()) == cost.edge_s(info, (R,), (S(0),), False, ())


def _plans(model, x, mesh, hardware):
    graph = autotp.capture(model, (x,))
    with_rg = plan_graph(graph, mesh, hardware, "train")
    original = autotp.planning.planner.partial_gradient_variants
    autotp.planning.planner.partial_gradient_variants = lambda graph, ndim, rep, strategies: strategies
    try:
        without = plan_graph(graph, mesh, hardware, "train")
    finally:
        autotp.planning.planner.partial_gradient_variants = original
    return graph, with_rg, without


def test_a_token_dispatch_sums_the_partial_gradient_on_the_hidden_states():
    tokens, hidden, k = 2048, 2048, 4
    with torch.device("meta"):  # no weights initialized on the CPU: the plan reads shapes alone
        model = Dispatch(tokens, hidden, 4 * hidden, k)
    graph, plan, without = _plans(model, torch.empty(tokens, hidden, device="meta"), (8,), "h100-sxm")
    assert plan.parameter_placements["up.weight"] == "S(0)" and plan.parameter_placements["down.weight"] == "S(1)"
    dispatch = _dispatch_node(plan)
    assert plan.strategy(dispatch).output == (Rg,), plan.strategy(dispatch)
    hidden_bytes, slot_bytes = tokens * hidden * 4, tokens * k * hidden * 4
    moved = [c for c in plan.collectives() if c.bytes > 1e6]
    assert moved and all(c.bytes <= hidden_bytes for c in moved), [str(c) for c in moved]
    # without Rg the slots' gradient (or the slots themselves) move, k times the bytes
    assert any(c.bytes == slot_bytes for c in without.collectives()), [str(c) for c in without.collectives()]
    assert plan.predicted_time().total_s < without.predicted_time().total_s
    report = plan.report()
    assert "Gradients passed on as partial sums" in report and f"aten.index.Tensor [{tokens * k}, {hidden}]" in report
    assert "partial sums" not in without.report()
    assert "Rg" not in str(plan_graph(graph, (8,), "h100-sxm", "inference").nodes)  # no gradient, no Rg


def _step_logged(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    forward, backward = CollectiveLog(mesh), CollectiveLog(mesh)
    with forward:
        out = pm(x)
    with backward:
        out.pow(2).sum().backward()
    assert_as_planned(forward, plan, "forward")
    assert_as_planned(backward, plan, "backward")
    return True


def test_a_plan_with_rg_is_exact_and_runs_the_collectives_it_lists():
    torch.manual_seed(0)
    model, x = Dispatch(512, 512, 2048, 4), torch.randn(512, 512)
    graph, plan, _ = _plans(model, x, (2,), "h100-sxm")  # priced for NVLink, run on 2 gloo threads
    assert plan.strategy(_dispatch_node(plan)).output == (Rg,), plan.strategy(_dispatch_node(plan))
    assert plan.parameter_placements["up.weight"] != "R"
    assert_step_matches_one_process(graph, plan, model, x)
    assert all(run_threads(_step_logged, 2, graph, plan, model, x))
    # the plan survives its JSON form, Rg included
    again = autotp.Plan.from_json(plan.to_json())
    assert again.strategy(_dispatch_node(plan)).output == (Rg,)


@pytest.mark.slow  # the mechanism is in the default suite: the dispatch tests above
def test_qwen_moe_sums_the_routed_tokens_gradient_on_the_tokens_and_is_exact():
    """Qwen1.5-MoE's experts read the routed copy of the tokens (4 per token, sorted by expert): the
    copy runs replicated and passes its partial gradient back to the tokens, whose gather's
    reduce-scatter sums it, so at real width no collective moves the copy (before, it was gathered
    forward and reduce-scattered backward, one more activation collective a block). The tiny model's
    plan on 2 ranks leaves the copy's gradient partial too, and is exact. (The router and the shared
    expert's gate read the same tokens with whole gradients, and the plan gathers them a second time
    for those: 5 activation collectives a block, where Megatron's layout has 4, the zoo's row says.)"""
    from benchmarks import zoo

    arch = next(a for a in zoo.ARCHS if a.name == "qwen2_moe")
    if zoo.missing(arch):  # an older transformers than the Makefile installs
        pytest.skip(f"this transformers has no {zoo.missing(arch)}")
    row = zoo.run_arch(arch, exact=True)
    assert row["megatron_weights"] and row["ratio_ok"] and row["is_exact"], row
    model, inputs = zoo.build(arch, 2, tiny=False)
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, zoo.MESH, zoo.HARDWARE, "train")
    dispatch = {n.name for n in plan.nodes if n.target == "aten.index.Tensor"
                and graph[graph[n.name].inputs[0]].output.numel < graph[n.name].output.numel}
    assert len(dispatch) == 2 and not [str(c) for c in plan.collectives() if c.at in dispatch], \
        [str(c) for c in plan.collectives() if c.at in dispatch]
    model, inputs = zoo.build(arch, 2, tiny=True)
    graph = autotp.capture(model, inputs)
    with pytest.raises(autotp.MemoryBudgetError) as least:  # the budget the zoo's exact check plans under
        plan_graph(graph, (2,), "cpu-gloo", "train", 1.0, recompute=False)
    budget = int(least.value.minimum_bytes * zoo.TINY_BUDGET_SCALE) + 1
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", budget, recompute=False)
    # the dispatch: an index whose output (tokens x 2 slots) is larger than what it indexes (tokens)
    dispatch = [n.name for n in plan.nodes if n.target == "aten.index.Tensor"
                and graph[graph[n.name].inputs[0]].output.numel < graph[n.name].output.numel]
    assert len(dispatch) == 2 and all(plan.strategy(n).output == (Rg,) for n in dispatch), \
        [(n, str(plan.strategy(n))) for n in dispatch]


class SwiGLUDispatch(Dispatch):
    """The dispatched copy read by two column-split linears (one value, two readers)."""

    def __init__(self, tokens: int, hidden: int, ffn: int, k: int) -> None:
        super().__init__(tokens, hidden, ffn, k)
        self.gate = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x):
        slots = self.norm(x)[self.slot_token]
        y = self.down(torch.nn.functional.silu(self.gate(slots)) * self.up(slots))
        return x + y.view(x.shape[0], self.k, -1).sum(1)


def test_on_two_axes_the_solver_prices_what_an_rg_value_moves_on_the_other_axis():
    """An Rg value read by two readers that share one redistribution on the other axis: that
    redistribution is in the solver's objective (it once priced it as infeasible and dropped it, so the
    objective fell short of the plan's predicted time by that collective)."""
    tokens, hidden = 1024, 512
    with torch.device("meta"):
        model = SwiGLUDispatch(tokens, hidden, 2 * hidden, 4)
    graph = autotp.capture(model, (torch.empty(tokens, hidden, device="meta"),))
    with solver_objective() as objective:
        plan = plan_graph(graph, (2, 2), "h100-sxm", "train")
    assert any("Rg" in n.strategy for n in plan.nodes), [n.strategy for n in plan.nodes]
    assert objective["s"] == pytest.approx(plan.predicted_time().total_s, rel=1e-9)


class PositionTable(nn.Module):
    """A learned table broadcast over the batch by ``expand`` (a view of the parameter)."""

    def __init__(self, batch: int, seq: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.batch = batch
        self.pos = nn.Parameter(torch.randn(1, seq, hidden) * 0.1)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        h = x + self.pos.expand(self.batch, -1, -1)
        return self.down(torch.relu(self.up(h)))


def test_a_broadcast_parameter_sums_its_gradient_on_the_parameter_not_on_the_broadcast():
    """``expand`` is a view that follows its input, but merged into a parameter (which is never Rg) it
    would lose its Rg option: the expanded tensor's gradient, batch times the table, all-reduced."""
    batch, seq, hidden = 16, 128, 512
    model, x = PositionTable(batch, seq, hidden, 4 * hidden), torch.randn(batch, seq, hidden)
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "h100-sxm", "train")
    expand = next(n.name for n in plan.nodes if n.target == "aten.expand.default")
    assert plan.strategy(expand).output == (Rg,), plan.strategy(expand)
    table_bytes = seq * hidden * 4
    backward = [c for c in plan.collectives() if c.phase == "backward"]
    assert backward and all(c.bytes <= table_bytes for c in backward), [str(c) for c in backward]
    assert_step_matches_one_process(graph, plan, model, x)


class ReadTwice(nn.Module):
    """The normalized tokens read by one MLP directly and, through a view, by another (DeepSeek's
    shared and routed experts)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.a_up, self.a_down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)
        self.b_up, self.b_down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # (B, T, hidden)
        h = self.norm(x)
        flat = h.view(-1, h.shape[-1])  # (B * T, hidden)
        b = self.b_down(torch.relu(self.b_up(flat))).view(x.shape)
        return x + self.a_down(torch.relu(self.a_up(h))) + b


def test_a_view_beside_other_readers_passes_its_gradient_on_and_shares_their_gather():
    """Three blocks: between them the tokens are split along the sequence (a reduce-scatter), and each
    block gathers its normalized tokens for both MLPs. The view runs replicated and passes its partial
    gradient on (Rg), so it reads what the other MLP reads: one gather, whose backward reduce-scatters
    both partial gradients at once. Without it the view's path gathered the tokens again, forward and
    backward. 8192 tokens: at 2048, as ``h100-sxm`` prices an H100 (collectives at eager PyTorch's
    latency, matmuls at 0.7 of the peak), one all-reduce per block is the cheaper plan."""
    batch, seq, hidden = 1, 8192, 2048
    with torch.device("meta"):  # built on the CPU, its weights took seconds to initialize
        model = nn.Sequential(*[ReadTwice(hidden, 4 * hidden) for _ in range(3)])
    graph = autotp.capture(model, (torch.empty(batch, seq, hidden, device="meta"),))
    plan = plan_graph(graph, (8,), "h100-sxm", "train")
    views = [n.name for n in graph.nodes if n.target == "aten.view.default" and n.output.ndim == 2]
    assert len(views) == 3 and all(plan.strategy(v).output == (Rg,) for v in views), [plan.strategy(v) for v in views]
    tokens_bytes = batch * seq * hidden * 4
    gathers = [c for c in plan.collectives() if c.kind == "all_gather" and c.bytes >= tokens_bytes]
    scatters = [c for c in plan.collectives() if c.kind == "reduce_scatter" and c.bytes >= tokens_bytes]
    # blocks 2 and 3 each gather their tokens once forward; the backward gathers the gradients of the
    # two reduce-scatters' outputs and reduce-scatters the tokens' once per block
    assert sorted((c.phase, len([d for d in gathers if d.phase == c.phase])) for c in gathers) == [
        ("backward", 2), ("backward", 2), ("forward", 2), ("forward", 2)], [str(c) for c in plan.collectives()]
    assert len(scatters) == 4, [str(c) for c in plan.collectives()]

    torch.manual_seed(0)
    small, x = nn.Sequential(ReadTwice(256, 1024), ReadTwice(256, 1024)), torch.randn(2, 128, 256)
    graph = autotp.capture(small, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "train")
    views = [n.name for n in graph.nodes if n.target == "aten.view.default" and n.output.ndim == 2]
    assert all(plan.strategy(v).output == (Rg,) for v in views), [plan.strategy(v) for v in views]
    assert_step_matches_one_process(graph, plan, small, x)
    assert all(run_threads(_step_logged, 2, graph, plan, small, x))


class DenseExperts(nn.Module):
    """Every token through every expert, weighted by its router score (Llama 4's MoE as transformers
    writes it: ``hidden.repeat(experts, 1)``), beside a shared MLP."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)
        self.up, self.down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # (tokens, hidden)
        h = self.norm(x)
        scores = torch.sigmoid(self.router(h)).t().reshape(-1, 1)  # (experts * tokens, 1)
        routed = (h.repeat(self.experts, 1) * scores).view(self.experts, x.shape[0], -1)
        y = torch.bmm(torch.relu(torch.bmm(routed, self.w_in)), self.w_out).sum(0)
        return x + y + self.down(torch.relu(self.up(h)))


def test_experts_fed_by_a_repeat_make_only_their_own_copies_and_share_the_gather():
    """Split by experts, each rank makes only its experts' copies of the tokens (the repeat split from
    a whole input), so its gradient is partial like the shared MLP's: one gather of the tokens per
    block forward, and the copies (8 times the tokens) never move. Made whole and cut, the copies'
    gradient was gathered in the backward and the tokens gathered twice (26.7 ms a step predicted
    against 23.9 ms)."""
    tokens, hidden = 4096, 2048
    with torch.device("meta"):  # built on the CPU, its weights took seconds to initialize
        model = nn.Sequential(*[DenseExperts(hidden, 2 * hidden, 8) for _ in range(3)])
    graph = autotp.capture(model, (torch.empty(tokens, hidden, device="meta"),))
    plan = plan_graph(graph, (8,), "h100-sxm", "train")
    repeats = [n.name for n in graph.nodes if n.target == "aten.repeat.default"]
    assert len(repeats) == 3 and all(plan.strategy(r).output[0].is_shard for r in repeats), [
        plan.strategy(r) for r in repeats]
    tokens_bytes = tokens * hidden * 4
    assert all(c.bytes <= tokens_bytes for c in plan.collectives()), [str(c) for c in plan.collectives()]
    gathers = [c for c in plan.collectives() if c.phase == "forward" and c.kind == "all_gather"
               and c.bytes == tokens_bytes]
    assert len(gathers) == 2, [str(c) for c in plan.collectives()]  # blocks 2 and 3 (the input is whole)

    torch.manual_seed(0)
    small, x = nn.Sequential(DenseExperts(256, 512, 4), DenseExperts(256, 512, 4)), torch.randn(64, 256)
    graph = autotp.capture(small, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "train")
    assert all(plan.strategy(n.name).output[0].is_shard for n in graph.nodes if n.target == "aten.repeat.default")
    assert_step_matches_one_process(graph, plan, small, x)
    assert all(run_threads(_step_logged, 2, graph, plan, small, x))
