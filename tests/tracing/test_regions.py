"""Blocks under ``torch.no_grad()`` inside ``forward()`` (PhiMoE's router does this): inlined into
the graph with their operands read through ``detach`` (``autotp/tracing/regions.py``), then planned and
placed like any other op. The parallel step equals one process's, gradients that do not exist
there included. Blocks with autocast switched off are inlined as they are; autocast on is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from examples.ranks import run_threads


class _NoGradGate(nn.Module):
    """A gate scored under ``no_grad`` scales an MLP's output: the gate gets no gradient."""

    def __init__(self, dim: int = 64, ffn: int = 256) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 4)
        self.up = nn.Linear(dim, ffn)
        self.down = nn.Linear(ffn, dim)

    def forward(self, x):
        with torch.no_grad():
            keep = (self.gate(x).amax(-1, keepdim=True) > 0).to(x.dtype)
        return x + self.down(F.gelu(self.up(x))) * keep


class _GradBackOn(_NoGradGate):
    """``torch.enable_grad()`` inside ``torch.no_grad()``: ``up`` takes gradients again, the gate none."""

    def forward(self, x):
        with torch.no_grad():
            scale = self.gate(x).sigmoid().mean(-1, keepdim=True)
            with torch.enable_grad():
                hidden = self.up(x)
        return self.down(F.gelu(hidden) * scale)


def _step(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.weights.checkpoint import full_tensor
    from autotp.runtime.module import build_parallel_module
    from autotp.runtime.shards import placements_of

    pm = build_parallel_module(graph, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), model)
    out = pm(x)
    out.pow(2).sum().backward()
    return out.detach(), {n: None if p.grad is None else full_tensor(p.grad, placements_of(p))
                          for n, p in pm.named_parameters()}


def _sharded_plan(graph):
    from autotp.planning.planner import plan_graph

    try:
        plan_graph(graph, (2,), "cpu-gloo", "train", 1.0, recompute=False)
    except autotp.MemoryBudgetError as err:
        return plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.05) + 1, recompute=False)
    raise AssertionError("a budget of one byte was met")


def _assert_step_matches_one_process(graph, plan, model, x) -> None:
    """Output and every gradient on 2 threaded ranks equal one process's; a gradient one process does
    not have, the ranks do not have either. Tolerances scale with the largest value."""
    ref = model(x)
    ref.pow(2).sum().backward()
    for out, grads in run_threads(_step, 2, graph, plan, model, x):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6 * max(1.0, ref.abs().max().item()))
        for name, p in model.named_parameters():
            if p.grad is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5,
                                           atol=1e-6 * max(1.0, p.grad.abs().max().item()))


class _ClampedInPlace(_NoGradGate):
    """An activation written in place under ``no_grad`` (clamped, then masked) is the same tensor
    after it, its gradient history kept: ``up`` takes a gradient through it, the gate none."""

    def forward(self, x):
        hidden = self.up(x)
        with torch.no_grad():
            hidden.clamp_(-0.5, 0.5)
            hidden[self.gate(x).amax(-1) > 0] = 0.0  # index_put_ with a mask over (batch, tokens)
        return self.down(F.gelu(hidden))


class _AutocastOff(_NoGradGate):
    """A scale computed with autocast switched off (as rotary tables are, in float32): its gate takes
    gradients as any other layer."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            scale = self.gate(x.float()).sigmoid().mean(-1, keepdim=True)
        return self.down(F.gelu(self.up(x)) * scale.to(x.dtype))


class _Nested(_NoGradGate):
    """``torch.no_grad()`` around an autocast-off block."""

    def forward(self, x):
        with torch.no_grad():
            with torch.autocast("cpu", enabled=False):
                scale = self.gate(x).sigmoid()
        return self.down(F.gelu(self.up(x))) * scale.mean()


class _ReshapedInPlace(_NoGradGate):
    """``unsqueeze_`` under ``no_grad``: the tensor handed on has the new shape (B, T, 1), which the
    operand outside the region does not; with B == T == width a wrong shape would broadcast silently."""

    def forward(self, x):  # (64, 64, 64)
        keep = (x.sum(-1) > 0).to(x.dtype)
        with torch.no_grad():
            keep = keep.unsqueeze_(-1)
        return self.down(F.gelu(self.up(x))) * keep


def test_a_write_that_reshapes_its_operand_in_a_region_is_read_with_its_new_shape():
    torch.manual_seed(0)
    model = _ReshapedInPlace()
    x = torch.randn(64, 64, 64, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    _assert_step_matches_one_process(graph, _sharded_plan(graph), model, x)


@pytest.mark.parametrize("cls, grad_mode", [(_NoGradGate, torch.enable_grad), (_GradBackOn, torch.enable_grad),
                                            (_ClampedInPlace, torch.enable_grad), (_NoGradGate, torch.no_grad),
                                            (_Nested, torch.enable_grad)])
def test_a_no_grad_block_is_planned_and_the_step_equals_one_process(cls, grad_mode):
    """``grad_mode``: the mode autotp is called in (under ``no_grad`` the model's own blocks would leave
    no trace in the export: capture turns gradients on)."""
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    with grad_mode():
        graph = autotp.capture(model, (x,))
    assert not any("wrap_with_set_grad_enabled" in n.target for n in graph.nodes)
    # what the block reads comes through detach, and what the gate computes takes no gradient
    gate = [n for n in graph.nodes if n.module_path == "gate"]
    assert gate and not any(n.requires_grad for n in gate)
    assert any(n.target == "aten.detach.default" for n in graph.nodes)
    up = [n for n in graph.nodes if n.module_path == "up" and n.target.startswith("aten.linear")]
    assert up and all(n.requires_grad for n in up)  # outside the block, or with gradients back on

    plan = _sharded_plan(graph)
    assert plan.module_styles()["up"] != "replicate"  # the MLP is split around the inlined block
    _assert_step_matches_one_process(graph, plan, model, x)
    assert model.gate.weight.grad is None and model.up.weight.grad is not None


class _AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # kept as the higher-order op wrap_with_autocast
            return self.fc(x).float()


def test_an_autocast_region_in_forward_is_named_with_its_module_and_the_fix():
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(_AutocastInside(), (torch.randn(2, 8),))
    message = str(info.value)
    assert "torch.autocast" in message and "wrap_with_autocast" in message
    assert "what to do: cast explicitly" in message and "_AutocastInside.forward()" in message


class _RescalesOnce(nn.Module):
    """Divides a weight in place on its first call in eval mode, as RWKV does, then remembers it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rescaled = False

    def forward(self, x):
        if not self.training and not self.rescaled:
            with torch.no_grad():
                self.fc.weight.view(-1).div_(2.0)  # through a view: the write lands in the parameter
            self.rescaled = True
        return self.fc(x)


def test_a_write_into_a_parameter_inside_forward_is_refused_until_it_has_run():
    """The trace would keep the write and repeat it on every call (the flag is Python state): refused,
    naming the op, the parameter and the fix; after one call (the write done) the model captures."""
    model = _RescalesOnce().eval()
    before = model.fc.weight.detach().clone()
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(model, (torch.randn(2, 8),))
    message = str(info.value)
    assert "aten.div_" in message and "'fc.weight'" in message and "call the model once first" in message
    assert torch.equal(model.fc.weight, before)  # the user's model is as it was (export traced fake tensors)
    model(torch.randn(2, 8))
    graph = autotp.capture(model, (torch.randn(2, 8),))
    assert not any(n.target.startswith("aten.div_") for n in graph.nodes)


def test_an_autocast_off_block_is_inlined_as_it_is_and_the_step_equals_one_process():
    torch.manual_seed(0)
    model = _AutocastOff()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    assert not any("wrap_with" in n.target or n.target == "aten.detach.default" for n in graph.nodes)
    assert all(n.requires_grad for n in graph.nodes if n.module_path == "gate" and n.target.startswith("aten.linear"))
    _assert_step_matches_one_process(graph, _sharded_plan(graph), model, x)
    assert model.gate.weight.grad is not None


class _AutocastOnInside(_NoGradGate):
    def forward(self, x):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                scale = self.gate(x).sigmoid().float()
        return self.down(F.gelu(self.up(x))) * scale.mean()


def test_a_region_inside_another_is_inlined_and_autocast_on_inside_one_is_refused():
    """no_grad around an autocast-off block: both inlined (the gate computes without a gradient);
    autocast on inside a no_grad block: refused naming both regions."""
    graph = autotp.capture(_Nested(), (torch.randn(2, 8, 64),))
    assert not any("wrap_with" in n.target for n in graph.nodes)
    assert not any(n.requires_grad for n in graph.nodes if n.module_path == "gate")
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(_AutocastOnInside(), (torch.randn(2, 8, 64),))
    message = str(info.value)
    assert "the wrap_with_set_grad_enabled region" in message and "(wrap_with_autocast)" in message
    assert "what to do" in message
