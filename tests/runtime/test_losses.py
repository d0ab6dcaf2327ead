"""The loss planned with the model (``loss_fn=``): cross-entropy on logits split by vocabulary runs
on the split logits, and equals one process's loss and gradients, with exactly the plan's collectives."""

from __future__ import annotations

import copy as copy_module

import pytest
import torch
import torch.nn.functional as F

import autotp
from autotp.placement import R, S
from autotp.planning.planner import plan_graph
from autotp.tracing.loss import WithLoss
from examples.models import tiny_llama
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog, assert_as_planned

VOCAB = 2048  # the split pays off from here (two small all-reduces against a gather of the logits)


def _model():
    torch.manual_seed(0)
    return tiny_llama(batch=2, seq=32, n_layer=1, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=VOCAB)


def _loss(reduction: str):
    def cross_entropy(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=7,
                               reduction=reduction)
    return cross_entropy


def _rank(rank, world, graph, plan, model, inputs, reduction, targets):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # the model built once (the threads share one random generator), the graph traced once, here (torch.export is not for threads); parallelize(loss_fn=) runs in
    # benchmarks/memory.py and tests/test_examples.py, on processes
    pm = build_parallel_module(graph, plan, mesh, WithLoss(model, _loss(reduction)))
    fwd, bwd = CollectiveLog(mesh), CollectiveLog(mesh)
    with fwd:
        loss = pm(*inputs, targets)
    with bwd:
        (loss.sum() if reduction == "none" else loss).backward()
    assert_as_planned(fwd, plan, "forward")
    assert_as_planned(bwd, plan, "backward")
    losses = [str(m) for name, m in pm.named_modules() if "vocab_parallel_loss" in name]
    return loss.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}, losses


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_on_logits_split_by_vocabulary_equals_one_process(reduction):
    model, inputs = _model()
    targets = torch.randint(0, VOCAB, inputs[0].shape, generator=torch.Generator().manual_seed(1))
    targets[0, :5] = 7  # ignored rows count in no mean
    copy = copy_module.deepcopy(model)
    ref = _loss(reduction)(model(*inputs), targets)
    (ref.sum() if reduction == "none" else ref).backward()
    graph = autotp.capture(WithLoss(model, _loss(reduction)), (*inputs, targets))
    plan = plan_graph(graph, (2,), "cpu-gloo", pin={"lm_head.weight": "S(0)"})
    loss_node = next(n for n in plan.nodes if n.target == "aten.cross_entropy_loss.default")
    assert plan.strategy(loss_node.name).inputs[0] == (S(1),), loss_node  # the logits read split, not gathered
    # two all-reduces of per-row statistics (4 and 8 bytes a row), nothing logits-sized moved
    rows = inputs[0].numel()
    at_loss = sorted(c.bytes for c in plan.collectives() if c.at == loss_node.name)
    assert at_loss == [4 * rows, 8 * rows], at_loss
    assert all(c.bytes < rows * VOCAB for c in plan.collectives()), [str(c) for c in plan.collectives()]
    for loss, grads, modules in run_threads(_rank, 2, graph, plan, copy, inputs, reduction, targets):
        assert len(modules) == 1 and f"reduction={reduction}" in modules[0], modules
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(),
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_with_loss_is_the_model_under_its_own_names():
    model, inputs = _model()
    model.config = {"vocab": VOCAB}  # what a Hugging Face model carries: read through the wrapper
    wrapped = WithLoss(model, _loss("mean"))
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert wrapped.state_dict().keys() == model.state_dict().keys()
    assert wrapped.config is model.config
    targets = torch.zeros_like(inputs[0])
    torch.testing.assert_close(wrapped(*inputs, targets), _loss("mean")(model(*inputs), targets))
    torch.testing.assert_close(wrapped(*inputs, targets=targets), wrapped(*inputs, targets))
    wrapped.eval()
    assert not model.training and not wrapped.training
    with pytest.raises(TypeError, match="no targets given"):
        WithLoss(model, _loss("mean"))()
    with pytest.raises(TypeError, match="loss_fn is a str"):
        autotp.plan(model, (2,), (*inputs, targets), loss_fn="cross_entropy")


def test_a_weighted_or_smoothed_loss_reads_its_logits_whole():
    """Class weights and label smoothing sum over the classes again: no split rule is offered."""
    model, inputs = _model()
    targets = torch.zeros_like(inputs[0])
    for loss_fn in (lambda x, t: F.cross_entropy(x.reshape(-1, VOCAB), t.reshape(-1), label_smoothing=0.1),
                    lambda x, t: F.cross_entropy(x.reshape(-1, VOCAB), t.reshape(-1), weight=torch.ones(VOCAB))):
        plan = autotp.plan(model, (2,), (*inputs, targets), hardware="cpu-gloo", loss_fn=loss_fn,
                           pin={"lm_head.weight": "S(0)"})
        node = next(n for n in plan.nodes if n.target == "aten.cross_entropy_loss.default")
        assert plan.strategy(node.name).inputs[0] == (R,), node
