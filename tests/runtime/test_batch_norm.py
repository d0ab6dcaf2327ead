"""Batch norm in training on split data (synchronized batch norm, autotp/local/batch_norm.py).

Every training strategy of a batch norm on (2,) and (2, 2), run as the rewrite runs it on threaded
ranks, gives one device's output, input gradient, weight and bias gradients (each rank's own sums,
added over the axes that split the batch, as the plan's gradient reduction adds them) and running
statistics, the same on every rank. Then whole convnets: a training step of the parallel module
with the batch split (channels the ranks do not divide) and with the channels split equals one
process in its output, every gradient and every buffer, runs exactly the plan's collectives, and,
switched to eval, computes with the running statistics the step left.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp.local.batch_norm import ShardedBatchNorm
from autotp.placement import P, S
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.planner import plan_graph
from autotp.planning.rules.norms import channel_axes, stat_axes
from examples.ranks import run_threads
from tests.helpers.local_exactness import _assemble, _local
from tests.helpers.observed import CollectiveLog, assert_as_planned
from tests.helpers.turns import run_threads_tracing_in_turns

C = 4


def _bn_graph(affine: bool = True, track: bool = True):
    bn = nn.BatchNorm2d(C, affine=affine, track_running_stats=track).train()
    x = torch.randn(4, C, 4, 4)
    graph = autotp.capture(bn, (x,))
    (node,) = [n for n in graph.ops() if n.target == "aten.batch_norm.default"]
    return graph, node


def _piece_range(size, placements, mesh, coord, axes):
    start, length = 0, size
    for a in axes:
        step = length // mesh[a]
        start, length = start + coord[a] * step, step
    return start, start + length


def _rank(rank, world, mesh_shape, node, strategy, tensors):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{k}" for k in range(len(mesh_shape))))
    coord = tuple(mesh.get_coordinate())
    groups = [mesh.get_group(a) for a in range(len(mesh_shape))]
    x, weight, bias, grad = tensors
    stats, chans = stat_axes(node, strategy), channel_axes(node, strategy)
    start, stop = _piece_range(C, strategy.inputs[0], mesh_shape, coord, chans)
    module = ShardedBatchNorm(start, stop, C, [groups[a] for a in stats], [groups[a] for a in chans],
                              [f"a{a}" for a in stats])
    q = strategy.inputs
    x_local = _local(x, q[0], coord, mesh_shape, 0).clone().requires_grad_()
    params = [_local(t, q[k], coord, mesh_shape, 0).clone().requires_grad_() if t is not None else None
              for k, t in ((1, weight), (2, bias))] if weight is not None else [None, None]
    running = [torch.zeros(C), torch.ones(C)] if len(node.inputs) > 3 or weight is None and len(node.inputs) > 1 else [None, None]
    y = module(x_local, *params, *running, True, 0.1, 1e-5, False)
    (y * _local(grad, strategy.output, coord, mesh_shape, 0)).sum().backward()
    return coord, y.detach(), x_local.grad, [p.grad if p is not None else None for p in params], running


@pytest.mark.parametrize("affine,track", [(True, True), (False, False)])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_every_training_strategy_equals_one_device(mesh_shape, affine, track):
    torch.manual_seed(0)
    graph, node = _bn_graph(affine, track)
    x = torch.randn(4, C, 4, 4) * 3 + 1
    weight, bias = (torch.randn(C), torch.randn(C)) if affine else (None, None)
    grad = torch.randn(4, C, 4, 4)
    ref_x = x.clone().requires_grad_()
    ref_params = [t.clone().requires_grad_() if t is not None else None for t in (weight, bias)]
    ref_running = [torch.zeros(C), torch.ones(C)] if track else [None, None]
    ref = F.batch_norm(ref_x, *ref_running, *ref_params, training=True, momentum=0.1, eps=1e-5)
    (ref * grad).sum().backward()
    strategies = [s for s in node_strategies(graph, node, mesh_shape) if stat_axes(node, s) or channel_axes(node, s)]
    kinds = {(bool(stat_axes(node, s)), bool(channel_axes(node, s))) for s in strategies}
    assert kinds == ({(True, False), (False, True)} | ({(True, True)} if len(mesh_shape) == 2 else set())), kinds
    world = 1
    for n in mesh_shape:
        world *= n
    for strategy in strategies:
        what = f"{strategy} on {mesh_shape}"
        results = run_threads(_rank, world, mesh_shape, node, strategy, (x, weight, bias, grad))
        outs = {c: y for c, y, *_ in results}
        torch.testing.assert_close(_assemble(outs, strategy.output, mesh_shape, what), ref.detach(),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} output: {m}")
        grads = {c: g for c, _, g, *_ in results}
        torch.testing.assert_close(_assemble(grads, strategy.inputs[0], mesh_shape, what), ref_x.grad,
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} input gradient: {m}")
        stats = stat_axes(node, strategy)
        for k, ref_p in enumerate(ref_params):
            if ref_p is None:
                continue
            # the weight's gradient: cut like the weight, partial over the axes that split the batch
            placements = tuple(P if a in stats else strategy.inputs[1 + k][a] for a in range(len(mesh_shape)))
            got = _assemble({c: ps[k] for c, _, _, ps, _ in results}, placements, mesh_shape, what)
            torch.testing.assert_close(got, ref_p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} param {k}: {m}")
        for _, _, _, _, running in results:  # every rank holds every channel's running statistics
            for got, want in zip(running, ref_running):
                if want is not None:
                    torch.testing.assert_close(got, want, msg=lambda m: f"{what} running statistics: {m}")


class ConvNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.bn2(self.depthwise(h)))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _step(rank, world, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = autotp.parallelize(copy.deepcopy(model), mesh, (x,), plan=plan, dynamic_dims=False)
    with CollectiveLog(mesh) as forward:
        out = pm(x)
    with CollectiveLog(mesh) as backward:
        out.pow(2).sum().backward()
    assert_as_planned(forward, plan, "forward")
    assert_as_planned(backward, plan, "backward")
    grads = {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}
    buffers = {n: b.clone() for n, b in pm.named_buffers() if not n.startswith("_autotp")}
    pm.eval()  # batch norm now reads the running statistics the step left
    with torch.no_grad():
        evaluated = pm(x)
    return out.detach(), grads, buffers, forward.kind_counts(), evaluated


def _plan_at_the_floor(graph):
    """The plan under the least memory any plan needs: it must split the activations."""
    with pytest.raises(autotp.MemoryBudgetError) as err:
        plan_graph(graph, (2,), "cpu-gloo", memory_budget=1)
    return plan_graph(graph, (2,), "cpu-gloo", memory_budget=err.value.minimum_bytes * 1.01)


@pytest.mark.parametrize("width,split", [(5, "batch"), (8, "channel")])  # 5 channels do not split on 2 ranks
def test_a_training_step_with_batch_norm_equals_one_process(width, split):
    torch.manual_seed(0)
    model = ConvNet(width).train()
    x = torch.randn(4, 3, 8, 8)
    graph = autotp.capture(model, (x,))
    plan = _plan_at_the_floor(graph)
    norms = [n for n in graph.ops() if n.target == "aten.batch_norm.default"]
    want_placed = {(S(0),)} if split == "batch" else {(S(1),)}
    assert {plan.strategy(n.name).inputs[0] for n in norms} == want_placed, [str(plan.strategy(n.name)) for n in norms]
    ref = copy.deepcopy(model)
    want = ref(x)
    want.pow(2).sum().backward()
    ref.eval()
    with torch.no_grad():
        want_eval = ref(x)
    # each rank traces (parallelize, then eval()): in turns, as torch.export must not trace beside another thread
    for out, grads, buffers, kinds, evaluated in run_threads_tracing_in_turns(_step, 2, plan, model, x):
        torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * (1 + p.grad.abs().max().item()),
                                       msg=lambda m, name=name: f"{name}: {m}")
        for name, b in ref.named_buffers():  # running statistics and the batch count, on every rank
            torch.testing.assert_close(buffers[name], b, msg=lambda m, name=name: f"{name}: {m}")
        # the statistics summed across the ranks (batch), or the running statistics put together (channels)
        assert kinds["all_reduce"] >= (2 if split == "batch" else 1) * len(norms), kinds
        torch.testing.assert_close(evaluated, want_eval, rtol=1e-4, atol=1e-5)


def _frozen_backbone_rank(rank, world, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = autotp.parallelize(copy.deepcopy(model), mesh, (x,), hardware="h100-sxm", dynamic_dims=False)
    out = pm(x)
    out.pow(2).sum().backward()
    grads = {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in pm.named_buffers() if not n.startswith("_autotp")}
    pm.train()  # every module in train mode, as nn.Module.train sets them: the backbone's statistics too
    with torch.no_grad():
        trained = pm(x)
    pm.eval()
    with torch.no_grad():
        evaluated = pm(x)
    return out.detach(), grads, buffers, trained, evaluated, sorted(map(str, pm.plans))


def test_a_submodule_in_eval_mode_keeps_its_mode():
    """A model in train mode whose backbone the user put in eval mode (frozen batch norm): the parallel
    module runs each module in its own mode, as the model does; ``train()`` and ``eval()`` then set every
    module, as ``nn.Module.train`` does."""
    torch.manual_seed(0)
    model = ConvNet(8).train()
    with torch.no_grad():  # running statistics far from the batch's, so the two modes differ
        for bn in (model.bn, model.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2.0)
    model.bn.eval()
    x = torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    want = ref(x)
    want.pow(2).sum().backward()
    with torch.no_grad():  # the module's calls in turn: train mode updates both norms' statistics
        after = copy.deepcopy(ref)
        want_train = after.train()(x)
        want_eval = after.eval()(x)
    assert (want - want_train).abs().max() > 1e-2  # the frozen norm changes the output
    for out, grads, buffers, trained, evaluated, modes in run_threads_tracing_in_turns(_frozen_backbone_rank, 2,
                                                                                          model, x):
        torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * (1 + p.grad.abs().max().item()),
                                       msg=lambda m, name=name: f"{name}: {m}")
        for name, b in ref.named_buffers():  # the frozen norm's statistics untouched, the other's updated
            torch.testing.assert_close(buffers[name], b, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(trained, want_train, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(evaluated, want_eval, rtol=1e-4, atol=1e-5)
        assert modes == ["(True, ('bn',))", "False", "True"], modes
