"""Gradients of a tensor read several times are added up, and the cost model prices each addition.

``OpGraph.gradient_reads`` counts the gradients that flow back into a node's output; autograd adds
``gradient_reads - 1`` of them. A toy model with a residual, a tensor multiplied by itself and a weight
tied to two layers runs its backward under a dispatch mode that records every addition, and its count
per shape must equal the graph's.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp.mesh import MeshSpec
from autotp.placement import R, S, Strategy
from autotp.planning.costs.costing import CostModel
from autotp.planning.planner import predicted_time
from cost_models import load_profile


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, idx):  # (4, 6)
        h = self.emb(idx)  # read by lin and the residual add
        h = h + self.lin(h)  # read by the norm, the product below (twice) and the head
        z = self.norm(h) * h * h
        return z @ self.emb.weight.t() + h.sum(-1, keepdim=True)  # the embedding's weight, tied


class _NoGradientReaders(nn.Module):
    """Readers that take no gradient back: a detached copy, a tensor shaped like it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, idx):
        h = self.lin(self.emb(idx))
        return h * h.detach() + torch.zeros_like(h) + torch.ones_like(h) * self.lin(h)


class _Adds(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(("aten.add.Tensor", "aten.add_.Tensor")):
            self.shapes[tuple(args[0].shape)] += 1
        return func(*args, **(kwargs or {}))


def _graph_and_run(model_class=_Toy):
    torch.manual_seed(0)
    model, idx = model_class(), torch.randint(0, 16, (4, 6))
    graph = autotp.capture(model, (idx,))
    out = model(idx)
    adds = _Adds()
    with adds:
        out.backward(torch.ones_like(out))
    return graph, adds.shapes


def _wanted(graph) -> collections.Counter:
    want: collections.Counter = collections.Counter()
    for n in graph.nodes:
        reads = graph.gradient_reads(n.name)
        if reads > 1:
            want[n.output.shape] += reads - 1
    return want


def test_gradient_reads_count_the_additions_autograd_runs():
    graph, seen = _graph_and_run()
    want = _wanted(graph)
    assert want[(16, 8)] == 1  # the tied weight: the lookup's gradient and the head's
    assert want[(4, 6, 8)] >= 4  # the two residual reads, the norm, the product's three
    assert seen == want


def test_readers_that_take_no_gradient_back_add_nothing():
    """``h`` is read by a product, ``detach``, ``zeros_like`` and a linear: two gradients come back
    (and the linear, used twice, gets two for its weight and two for its bias)."""
    graph, seen = _graph_and_run(_NoGradientReaders)
    assert _wanted(graph) == seen == collections.Counter({(4, 6, 8): 1, (8, 8): 1, (8,): 1})


def test_each_addition_is_priced_on_the_local_shard():
    """A tensor with r gradient reads adds r - 1 memory-bound kernels of 3x its local bytes; none in
    inference. Sharding the tensor halves each addition's bytes."""
    graph, _ = _graph_and_run()
    profile = load_profile("cpu-gloo")
    train = CostModel(MeshSpec.of((2,)), profile, "train")
    inference = CostModel(MeshSpec.of((2,)), profile, "inference")
    weight = next(n for n in graph.nodes if n.role == "parameter" and n.output.shape == (16, 8))
    reads = graph.gradient_reads(weight.name)
    assert reads == 2
    whole, split = Strategy((), (R,)), Strategy((), (S(0),))
    nbytes = 16 * 8 * 4
    assert train.node_compute_s(weight, whole, reads) == pytest.approx(train.copy_s(3 * nbytes, "float32"))
    assert train.node_compute_s(weight, split, reads) == pytest.approx(train.copy_s(3 * nbytes / 2, "float32"))
    assert train.node_compute_s(weight, whole, 1) == 0.0
    assert inference.node_compute_s(weight, whole, reads) == 0.0


def test_the_predicted_step_includes_the_additions():
    """On one device, the step's compute grows by the toy's five additions, counted by hand: the tied
    weight's two gradients (16 x 8) summed once, the lookup's output (4 x 6 x 8) read by the linear and
    the residual add once, the residual's output read four times three times."""
    graph, _ = _graph_and_run()
    plan = autotp.plan(_Toy(), (1,), (torch.randint(0, 16, (4, 6)),), hardware="cpu-gloo", mode="train")
    cost = CostModel(plan.mesh, load_profile("cpu-gloo"), "train")
    chosen = dict(plan.strategies)
    without = sum(cost.node_compute_s(n, chosen[n.name]) for n in graph.nodes)  # one read each: no sums
    by_hand = cost.copy_s(3 * 16 * 8 * 4, "float32") + 4 * cost.copy_s(3 * 4 * 6 * 8 * 4, "float32")
    assert predicted_time(graph, chosen, plan.mesh, cost).compute_s == pytest.approx(without + by_hand)
    assert plan.predicted_time().compute_s == pytest.approx(without + by_hand)
