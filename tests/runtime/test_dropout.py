"""Dropout in train mode on two ranks (autotp.runtime.dropout): one mask per replicated value, independent
masks per shard, the keep rate 1 - p, and gradients that follow the masks applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.ranks import run_threads

P = 0.5


class DropNet(nn.Module):
    """Dropout on a column-split activation (``up``'s output, read by the row-split ``down``) and on
    the replicated input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):  # (B, 64)
        return self.down(F.dropout(self.up(x), P, self.training)) + F.dropout(x, P, self.training)


def _prepare():
    import autotp
    from autotp.planning.planner import plan_graph

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(DropNet().train(), (x,))
    try:
        plan_graph(graph, (2,), "cpu-gloo", "train", 1.0)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.05) + 1)
    return graph, plan, x


def _run(rank, world, graph, plan, x, model):
    """Two steps; each step's masks as every dropout module drew them (a forward hook), the output,
    and the gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.dropout import ShardedDropout
    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model, seed=1234)  # (built once: seeding is process-wide)
    masks: dict[tuple, list] = {}
    for m in pm.modules():
        if isinstance(m, ShardedDropout):
            m.register_forward_hook(lambda mod, args, out: masks.setdefault(mod.shard_key and ("shard",) or (), [])
                                    .append(out[1].clone()))
    steps = []
    for _ in range(2):  # masks must change from call to call
        pm.zero_grad(set_to_none=True)
        y = pm(x)
        y.pow(2).sum().backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in pm.named_parameters()}
        steps.append((y.detach(), grads))
    return sorted(m.shard_key for m in pm.modules() if isinstance(m, ShardedDropout)), masks, steps


def test_shards_get_independent_masks_and_replicas_one_mask():
    graph, plan, x = _prepare()
    styles = plan.module_styles()
    assert (styles["up"], styles["down"]) == ("colwise", "rowwise"), styles
    (keys0, masks0, steps0), (keys1, masks1, steps1) = run_threads(_run, 2, graph, plan, x, DropNet())
    assert keys0 == [(), (0,)] and keys1 == [(), (1,)], "one dropout on a shard, one on a replicated value"
    ref = DropNet()
    for step in range(2):
        shard0, shard1 = masks0[("shard",)][step], masks1[("shard",)][step]
        rep0, rep1 = masks0[()][step], masks1[()][step]
        assert shard0.shape == (16, 128) and rep0.shape == (16, 64)
        assert torch.equal(rep0, rep1), "ranks applied different masks to the same replicated value"
        assert not torch.equal(shard0, shard1), "the two halves of up's output got the same mask"
        full = torch.cat([shard0, shard1], dim=1)  # colwise: rank 0 holds the first 128 columns
        for keep in (full, rep0):  # keep rate 1 - p, within 5 standard deviations
            assert abs(keep.float().mean().item() - (1 - P)) < 5 * (P * (1 - P) / keep.numel()) ** 0.5
        # the same masks applied by hand to the original model: same output and gradients on both ranks
        ref.zero_grad(set_to_none=True)
        y_ref = ref.down(ref.up(x) * full / (1 - P)) + x * rep0 / (1 - P)
        y_ref.pow(2).sum().backward()
        for y, grads in (steps0[step], steps1[step]):
            torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())
    assert not torch.equal(masks0[()][0], masks0[()][1]), "the masks did not change between calls"


def test_dropout_off_is_the_plain_op():
    from autotp.runtime.dropout import ShardedDropout
    from autotp.runtime.rewrite import has_active_dropout

    import autotp

    x = torch.randn(4, 64)
    graph = autotp.capture(DropNet().eval(), (x,))
    assert not has_active_dropout(graph)
    with pytest.raises(ValueError, match="dropout probability 1.5"):
        ShardedDropout(1.5, 0, 0, ())


class LabelDrop(nn.Module):
    """Random ops beside dropout: class labels dropped at random (as classifier-free guidance trains)
    and noise drawn like the input, on the replicated batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, labels, x):  # (B,), (B, 64)
        labels = torch.where(torch.rand(labels.shape[0]) < 0.5, 10, labels)
        h = self.embed(labels) + x + 0.1 * torch.randn_like(x)
        return self.down(self.up(h).relu())


def _random_rank(rank, world, graph, plan, inputs, model):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.dropout import SharedRandom
    from autotp.runtime.module import build_parallel_module

    torch.manual_seed(100 + rank)  # ranks seeded differently, as a data loader's seed often is
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model, seed=1234)
    drawn: list = []
    for m in pm.modules():
        if isinstance(m, SharedRandom):
            m.register_forward_hook(lambda mod, args, out: drawn.append((mod.name, out.clone())))
    outs = [pm(*inputs).detach() for _ in range(2)]
    return outs, drawn


def test_other_random_ops_draw_the_same_values_on_every_rank():
    import autotp
    from autotp.planning.planner import plan_graph

    inputs = (torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2)),
              torch.randn(16, 64, generator=torch.Generator().manual_seed(1)))
    graph = autotp.capture(LabelDrop().train(), inputs)
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin={"up.weight": "S(0)", "down.weight": "S(1)"})
    assert plan.module_styles()["up"] == "colwise"
    (outs0, drawn0), (outs1, drawn1) = run_threads(_random_rank, 2, graph, plan, inputs, LabelDrop())
    assert [n for n, _ in drawn0] == ["aten.rand.default", "aten.randn_like.default"] * 2
    for (_, a), (_, b) in zip(drawn0, drawn1):
        assert torch.equal(a, b), "ranks drew different values for a tensor they both hold whole"
    assert not torch.equal(drawn0[0][1], drawn0[2][1]), "the draws did not change between calls"
    ref = LabelDrop()
    labels, x = inputs
    for call in range(2):  # the model applied by hand to the values drawn: both ranks' outputs
        drop, noise = drawn0[2 * call][1], drawn0[2 * call + 1][1]
        want = ref.down(ref.up(ref.embed(torch.where(drop < 0.5, 10, labels)) + x + 0.1 * noise).relu())
        for outs in (outs0, outs1):
            torch.testing.assert_close(outs[call], want, rtol=1e-5, atol=1e-6)
