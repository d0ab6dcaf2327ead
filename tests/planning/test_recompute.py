"""Activation recompute chosen by the planner (autotp.planning.costs.recompute, the ILP's recompute rows) and the
optimizer whose state the memory counts.

- the planner recomputes layers only where memory is short, and then the plan fits a budget that no
  plan without recompute fits; what it frees and costs is counted by hand from the graph; on slow
  links it recomputes rather than shards, and that plan is the faster one;
- on 2 ranks the recomputing module's outputs and gradients equal one process, and the collectives
  that run (recomputation included) are the plan's;
- a dropout inside a recomputed layer draws the same mask again (gradients equal the same plan
  without recompute, bit for bit);
- the optimizer's state follows the optimizer named; bad arguments are refused before the capture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.planning.costs.recompute import layer_chains
from autotp.planning.planner import plan_graph
from examples.models import tiny_llama
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog, assert_as_planned, planned


@pytest.fixture(scope="module")
def llama():
    model, (x,) = tiny_llama(batch=4, seq=32, n_layer=4)
    return model, x, autotp.capture(model, (x,))


def _activation_bytes(graph, names):
    """What the cost model keeps per node for the backward, read node by node on one rank (what it
    keeps is tested against autograd's saved tensors in tests/planning/test_memory.py)."""
    from autotp.mesh import MeshSpec
    from autotp.placement import R, Strategy
    from autotp.planning.costs.costing import CostModel
    from cost_models import load_profile

    cost = CostModel(MeshSpec.of((1,)), load_profile("h100-sxm"), "train", graph=graph)
    whole = lambda n: Strategy(tuple((R,) for _ in graph[n].inputs), (R,))  # noqa: E731
    return sum(cost.node_memory(graph[n], whole(n)).activations_bytes for n in names)


_SHORT: dict = {}  # id of the module's graph -> its short budget, and the plan made under it


def _short(graph) -> float:
    """A budget on (2,) that no plan meets without recompute and some plan meets with it: halfway
    between the two least memories (worked out once per graph)."""
    if (id(graph), "budget") not in _SHORT:
        _SHORT[id(graph), "budget"] = _short_uncached(graph)
    return _SHORT[id(graph), "budget"]


def _short_plan(graph):
    """The plan of the graph on (2,) under :func:`_short`, its recompute search run to the end (once)."""
    if (id(graph), "plan") not in _SHORT:
        _SHORT[id(graph), "plan"] = plan_graph(graph, (2,), "h100-sxm", "train", _short(graph))
    return _SHORT[id(graph), "plan"]


def _short_uncached(graph) -> float:
    least = []
    for recompute in (False, None):
        with pytest.raises(autotp.MemoryBudgetError) as err:
            plan_graph(graph, (2,), "h100-sxm", "train", 1, recompute=recompute)
        least.append(err.value.minimum_bytes)
    assert least[1] < least[0]
    return (least[0] + least[1]) / 2


def test_forced_recompute_frees_and_costs_what_the_layers_hold(llama):
    model, x, graph = llama
    keep = plan_graph(graph, (1,), "h100-sxm", "train", recompute=False)
    again = plan_graph(graph, (1,), "h100-sxm", "train", recompute=True)
    chains = layer_chains(graph)
    assert [[layer.path for layer in c] for c in chains] == [[f"layers.{i}" for i in range(4)]]
    assert again.recompute == tuple(f"layers.{i}" for i in range(4)) and keep.recompute == ()
    layers = chains[0]
    freed = sum(_activation_bytes(graph, [n for n in layer.nodes if n not in layer.outputs]) for layer in layers)
    live_again = _activation_bytes(graph, layers[0].nodes)  # the layer being recomputed, in the backward
    assert again.memory.recompute_saved_bytes == freed - live_again > 0
    assert keep.memory.activations_bytes - again.memory.activations_bytes == freed - live_again
    # the forward of every op in the four layers runs again (one rank: no collectives)
    from autotp.mesh import MeshSpec
    from autotp.planning.costs.costing import CostModel
    from cost_models import load_profile

    cost = CostModel(MeshSpec.of((1,)), load_profile("h100-sxm"), "train")
    forward_s = sum(cost.node_forward_s(graph[n], again.strategy(n)) for layer in layers for n in layer.nodes)
    assert again.time.recompute_s == pytest.approx(forward_s)
    assert again.time.total_s == pytest.approx(keep.time.total_s + forward_s)
    assert "recompute" in again.report() and "layers.{0..3}.mlp.down_proj" in again.report()


def test_planner_recomputes_only_when_memory_is_short(llama):
    _, _, graph = llama
    free = plan_graph(graph, (2,), "h100-sxm", "train")
    assert free.recompute == ()
    # a budget no plan fits without recompute (the minimum of keeping every activation is above it)
    budget = _short(graph)
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, (2,), "h100-sxm", "train", budget, recompute=False)
    assert err.value.minimum_bytes > budget
    tight = _short_plan(graph)  # the plan under that budget, made once for the tests of this file
    assert tight.recompute and tight.memory.total_bytes <= budget
    assert tight.recompute == tuple(f"layers.{i}" for i in range(len(tight.recompute)))  # the first layers
    again = [c for c in tight.collectives() if c.phase == "recompute"]
    assert tight.time.recompute_s > 0
    lines = tight.report().splitlines()
    assert any(line.startswith("Recompute: ") and f"{len(again)} collectives" in line for line in lines)
    saved = autotp.Plan.from_json(tight.to_json())
    assert saved.recompute == tight.recompute and saved.to_json() == tight.to_json()
    # a plan edited to recompute what is not a layer of the stack is refused against the model
    edited = dataclasses.replace(tight, recompute=("layers.0.mlp",))
    with pytest.raises(autotp.PlanError, match="layers.0.mlp, which the model does not have as layers"):
        edited.check_matches(graph, edited.mesh)


def test_recompute_wins_over_sharding_where_links_are_slow(llama):
    """On links 10^4 times slower than NVLink, 80% of the free plan's memory: keeping weights whole and
    recomputing a layer or two costs less than any plan that shards (both priced by the same model),
    and the planner takes it; the plan without recompute at that budget is slower."""
    from cost_models import load_profile

    _, _, graph = llama
    slow = load_profile("h100-sxm").scaled_links(1e-4)
    free = plan_graph(graph, (2,), slow, "train")
    budget = 0.8 * free.memory.total_bytes
    chosen = plan_graph(graph, (2,), slow, "train", budget)
    sharded = plan_graph(graph, (2,), slow, "train", budget, recompute=False)
    assert chosen.recompute and set(chosen.module_styles().values()) == {"replicate"}
    assert chosen.memory.total_bytes <= budget
    assert chosen.time.total_s < sharded.time.total_s
    assert free.recompute == ()


def _run_recompute(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from autotp.runtime.recompute import Recompute

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    assert sorted(m.path for m in pm.modules() if isinstance(m, Recompute)) == sorted(plan.recompute)
    with CollectiveLog(mesh) as fwd:
        out = pm(x)
    assert_as_planned(fwd, plan, "forward")
    with CollectiveLog(mesh) as bwd:
        out.float().pow(2).mean().backward()
    assert_as_planned(bwd, plan, "backward")  # the recomputed layers' forward collectives included
    return out.detach(), {n: p.grad.full_tensor() for n, p in pm.named_parameters()}


def test_recomputing_module_is_exact_and_runs_the_planned_collectives(llama):
    model, x, graph = llama
    plan = _short_plan(graph)
    assert plan.recompute and planned(plan, "recompute")
    ref = model(x)
    ref.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for out, got in run_threads(_run_recompute, 2, graph, plan, model, x):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=name)


def _run_other_size(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    out = pm(x)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.full_tensor() for n, p in pm.named_parameters()}


def test_recomputing_module_runs_at_other_sizes():
    """Traced with dynamic batch and sequence, every layer recomputing: a batch and length other than
    the example's gives the model's outputs and gradients."""
    model, (x,) = tiny_llama(batch=4, seq=16, n_layer=3)
    graph = autotp.capture(model, (x,), None)
    plan = plan_graph(graph, (2,), "h100-sxm", "train", recompute=True)
    assert plan.recompute == ("layers.0", "layers.1", "layers.2") and plan.dynamic_dims
    other = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = model(other)
    ref.float().pow(2).mean().backward()
    for out, got in run_threads(_run_other_size, 2, graph, plan, model, other):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())


class _DropBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.dropout(F.gelu(self.up(x)), 0.3, self.training))


class _DropStack(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_DropBlock(dim) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _run_dropout(rank, world, graph, plans, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = []
    for plan in plans:
        pm = build_parallel_module(graph, plan, mesh, model, seed=7)
        steps = []
        for _ in range(2):  # the second step draws new masks, and recomputes them again
            pm.zero_grad(set_to_none=True)
            out = pm(x)
            out.pow(2).sum().backward()
            steps.append((out.detach(), {n: p.grad.full_tensor() for n, p in pm.named_parameters()}))
        results.append(steps)
    return results


def test_dropout_in_a_recomputed_layer_draws_the_same_mask():
    model = _DropStack().train()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "h100-sxm", "train", recompute=True)
    assert len(plan.recompute) == 2  # blocks.1 and blocks.2 form the chain (blocks.0 reads the input)
    without = dataclasses.replace(plan, recompute=())  # the same layout, every activation kept
    for kept, recomputed in run_threads(_run_dropout, 2, graph, [without, plan], model, x):
        for (out_a, grads_a), (out_b, grads_b) in zip(kept, recomputed):
            assert torch.equal(out_a, out_b)
            for name in grads_a:
                assert torch.equal(grads_a[name], grads_b[name]), name
        assert not torch.equal(kept[0][0], kept[1][0])  # masks change from step to step


def test_optimizer_state_follows_the_optimizer_named(llama):
    _, _, graph = llama
    params = sum(p.output.nbytes for p in (graph[q.node] for q in graph.parameters))
    adamw = plan_graph(graph, (1,), "h100-sxm", "train")
    sgd = plan_graph(graph, (1,), "h100-sxm", "train", optimizer="sgd")
    momentum = plan_graph(graph, (1,), "h100-sxm", "train", optimizer="sgd_momentum")
    mixed = plan_graph(graph, (1,), "h100-sxm", "train",
                       optimizer=autotp.OptimizerSpec("adamw", master_dtype_bytes=4, state_dtype_bytes=4))
    assert adamw.memory.parameters_bytes == params  # float32 parameters, replicated on one rank
    assert (adamw.memory.optimizer_bytes, sgd.memory.optimizer_bytes, momentum.memory.optimizer_bytes) == (
        2 * params, 0, params)
    assert mixed.memory.optimizer_bytes == 3 * params  # fp32 master + two fp32 moments of fp32 weights
    assert "sgd_momentum" in momentum.report()
    assert autotp.Plan.from_json(mixed.to_json()).optimizer == mixed.optimizer


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": "lion"}, "optimizer 'lion': expected one of adamw"),
    ({"recompute": "yes"}, "recompute 'yes': expected None"),
    ({"recompute": True}, "no stack of identical layers"),
    ({"recompute": True, "mode": "inference"}, "only in train mode"),
])
def test_bad_arguments_are_refused_before_the_capture(kwargs, match):
    model = nn.Linear(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        autotp.plan(model, (2,), (torch.randn(2, 8),), **kwargs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_recompute_search_says_what_the_time_limit_left_unsolved(llama, monkeypatch):
    """The search over recompute counts stops at the deadline with a plan in hand; the plan's status
    says how many counts went unsolved, where a search that ran its course (or that the bound from
    below ended) says nothing of the kind."""
    from autotp.planning.costs import recompute_counts
    from autotp.planning.solve import solver

    tries = [{0: 1}, {0: 2}, {0: 4}]
    solved = []

    def solve_at(counts):
        solved.append(counts[0])
        return ("s", None, 10.0 - counts[0], True, counts)  # each count better than the last

    best, _, untried = recompute_counts.search(tries, solve_at, lambda c: 0.0, 0.0, ())
    assert (solved, untried, best[2]) == ([1], 2, 9.0)  # past the deadline after the first solve
    solved.clear()
    best, _, untried = recompute_counts.search(tries, solve_at, lambda c: 0.0, float("inf"), ())
    assert (solved, untried, best[2]) == ([1, 2, 4], 0, 6.0)
    solved.clear()
    _, _, untried = recompute_counts.search(tries, solve_at, lambda c: 100.0, 0.0, ())
    assert (solved, untried) == ([1], 0)  # the bound ended it, not the time limit

    _, _, graph = llama
    real = recompute_counts.search
    monkeypatch.setattr(solver, "search", lambda tries, solve_at, floor_s, deadline, failures: real(
        tries, solve_at, lambda c: 0.0, 0.0, failures))  # no bound, the deadline already past
    cut = plan_graph(graph, (2,), "h100-sxm", "train", _short(graph))
    assert cut.recompute and "the time limit left" in cut.report(), cut.report().splitlines()[-3:]
    monkeypatch.setattr(solver, "search", real)
    assert "time limit" not in _short_plan(graph).report()


class _WritesIntoItsInput(nn.Module):
    def __init__(self, through_view: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.through_view = through_view

    def forward(self, x):
        if self.through_view:
            x[..., :4].mul_(2.0)  # a write into the layer's input, made outside it, through a view
        return x + self.lin(x).tanh()


class _WritingStack(nn.Module):
    def __init__(self, through_view: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_WritesIntoItsInput(through_view) for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x) * 1.0
        return x


def test_a_layer_that_writes_into_its_input_through_a_view_is_not_recomputed():
    """Running such a layer again in the backward would read its input as the first run left it
    (autograd refuses: a variable needed for the gradient was modified in place); the same layers
    without the write may recompute."""
    x = torch.randn(2, 4, 16)
    writing = autotp.capture(_WritingStack(through_view=True), (x.clone(),))
    assert any(n.target == "aten.mul_.Tensor" for n in writing.nodes)
    assert layer_chains(writing) == []
    plain = autotp.capture(_WritingStack(through_view=False), (x.clone(),))
    assert [[layer.path for layer in chain] for chain in layer_chains(plain)] == [["layers.0", "layers.1"]]
