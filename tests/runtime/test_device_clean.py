"""The runtime makes nothing on the CPU for a mesh on another device: parallel modules over a fake
process group of 2 (rank 0's view: every rank runs the same program), their mesh and tensors on the
meta device, run with fake tensors (``tests/helpers/fake_device.py``). A tensor the runtime makes on
the CPU meets the mesh's tensors in its next op and raises, as on a GPU; the first test shows the
harness catches one. Fake tensors compute nothing: these check devices, not values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autotp
from autotp.placement import S
from autotp.planning.planner import plan_graph
from autotp.runtime.module import build_parallel_module
from autotp.tracing.loss import WithLoss
from examples.models import tiny_llama
from tests.helpers.fake_device import DEVICE, DEVICE_MISMATCH, fake_ranks, fake_tensors


def _cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=7)


def _llama_with_loss():
    # vocabulary 2048: the split loss pays off from here (tests/runtime/test_losses.py)
    model, (ids,) = tiny_llama(batch=2, seq=32, n_layer=1, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=2048,
                               device="meta")
    return WithLoss(model, _cross_entropy), (ids, ids)


def _on_device(example):
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=DEVICE) for t in example)


def _step(model, example, pin=None, mode="train", backward=True, plan_of=None):
    """One call of ``model``'s parallel module, and its backward, on fake tensors of the mesh's device;
    returns the output's device, the gradients' devices and the plan (``plan_of(graph)`` where given)."""
    graph = autotp.capture(model, example)
    with fake_ranks() as mesh:
        plan = plan_of(graph) if plan_of else plan_graph(graph, (2,), "cpu-gloo", mode, pin=pin)
        with fake_tensors():
            pm = build_parallel_module(graph, plan, mesh, model)
            out = pm(*_on_device(example))
            out = out if isinstance(out, torch.Tensor) else out[0]
            if backward:
                out.float().sum().backward()
            grads = {p.grad.device for p in pm.parameters() if p.grad is not None}
    return out.device, grads, plan


def test_a_train_step_with_the_vocabulary_split_loss_stays_on_the_device():
    model, example = _llama_with_loss()
    out, grads, plan = _step(model, example, pin={"lm_head.weight": "S(0)"})
    loss = next(n for n in plan.nodes if n.target == "aten.cross_entropy_loss.default")
    assert plan.strategy(loss.name).inputs[0] == (S(1),)  # the split loss ran
    assert out == DEVICE and grads == {DEVICE}


class _ZerosOnTheHost:
    """``torch`` as a module of autotp sees it, but ``zeros_like`` makes its zeros on the CPU: the
    mistake of a tensor made with no ``device=``."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros_like(t, **kwargs):
        return torch.zeros(t.shape, dtype=t.dtype)


def test_the_harness_fails_a_cpu_tensor_made_inside_the_runtime(monkeypatch):
    """The split loss's zeros (``torch.where(mine, picked, zeros)``) made on the CPU: the step raises."""
    import autotp.local.losses as losses

    model, example = _llama_with_loss()
    monkeypatch.setattr(losses, "torch", _ZerosOnTheHost())
    with pytest.raises(Exception, match=DEVICE_MISMATCH):
        _step(model, example, pin={"lm_head.weight": "S(0)"})


def test_an_eval_step_stays_on_the_device():
    model, example = _llama_with_loss()
    model.eval()
    with torch.no_grad():
        out, _, _ = _step(model, example, mode="inference", backward=False)
    assert out == DEVICE


def test_batch_norm_in_training_and_its_backward_stay_on_the_device():
    from tests.runtime.test_batch_norm import ConvNet, _plan_at_the_floor

    with torch.device("meta"):
        model = ConvNet(8).train()
    x = torch.zeros(4, 3, 8, 8, device="meta")
    out, grads, plan = _step(model, (x,), plan_of=_plan_at_the_floor)  # 8 channels: split (test_batch_norm.py)
    norms = [n for n in plan.nodes if n.target == "aten.batch_norm.default"]
    assert norms and all(plan.strategy(n.name).inputs[0] == (S(1),) for n in norms)  # channels split
    assert out == DEVICE and grads == {DEVICE}


def test_gpt2_dropout_masks_and_their_backward_stay_on_the_device():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=4, use_cache=False,
                        attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).train()
    ids = torch.zeros(2, 8, dtype=torch.int64, device="meta")
    out, grads, plan = _step(model, (ids,), pin={"transformer.h.0.mlp.c_fc.weight": "S(1)"})
    assert out == DEVICE and grads == {DEVICE}

