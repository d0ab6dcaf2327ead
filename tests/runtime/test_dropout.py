"""Dropout in train mode on two ranks (autotp.local.dropout): one mask per replicated value, independent
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

    from autotp.local.dropout import ShardedDropout
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
    from autotp.local.dropout import ShardedDropout
    from autotp.planning.rules.randomness import has_active_dropout

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

    from autotp.local.dropout import SharedRandom
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


def test_attention_dropout_draws_from_a_seeded_fork_of_the_global_generator():
    """``scaled_dot_product_attention(dropout_p > 0)`` takes no generator: SeededAttention runs it
    with the global generator forked and seeded per call, so the same shard key gives the same
    dropped weights whatever the caller's seed, another key or call other ones, the caller's
    generator goes on as if nothing had drawn, and the backward replays the forward's mask."""
    from autotp.local.dropout import SeededAttention

    aten = torch.ops.aten.scaled_dot_product_attention.default
    q, k, v = (torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    leaf = v.clone().requires_grad_()

    def call(key, seed, calls=0, value=v):
        torch.manual_seed(seed)
        a = SeededAttention(aten, base_seed=7, stream=0, shard_key=key)
        a.calls = calls
        out = a(q, k, value, None, 0.5)
        return out, torch.rand(3)  # what the caller's generator draws next

    (a0, after0), (a1, after1) = call((0,), 1), call((0,), 2)
    assert torch.equal(a0, a1), "the same shard key dropped different weights under different global seeds"
    torch.manual_seed(1)
    assert torch.equal(after0, torch.rand(3)), "the caller's generator state moved"
    assert not torch.equal(a0, call((1,), 1)[0]) and not torch.equal(a0, call((0,), 1, calls=1)[0])
    assert not torch.equal(a0, aten(q, k, v, None, 0.0)), "nothing was dropped"
    out, _ = call((0,), 1, value=leaf)
    out.sum().backward()
    eye = torch.zeros(2, 4, 8, 16)
    eye[..., :8] = torch.eye(8)
    weights = call((0,), 4, value=eye)[0][..., :8]  # the dropped attention weights themselves (v = I)
    torch.testing.assert_close(a0, weights @ v)
    # out = weights @ v: d sum(out) / dv[j] = the weights of column j summed over the rows, if the
    # backward used the forward's mask
    torch.testing.assert_close(leaf.grad, weights.sum(-2).unsqueeze(-1).expand_as(leaf.grad))


class DropAttention(nn.Module):
    """One attention layer whose weights drop at rate P (transformers' ``attention_dropout``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(3))
        self.o = nn.Linear(32, 32, bias=False)

    def heads(self, x):  # (B, T, 32) -> (B, 4, T, 8)
        return x.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)

    def forward(self, x):
        q, k, v = (self.heads(p(x)) for p in self.qkv)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(x.shape))


def _attention_rank(rank, world, graph, plan, x, model):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.local.dropout import SeededAttention
    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model, seed=1234)
    (att,) = [m for m in pm.modules() if isinstance(m, SeededAttention)]
    seeds = []
    for _ in range(2):
        seeds.append(att.seed())
        out = pm(x)
    return att.shard_key, seeds, out.detach()


def test_attention_dropout_on_split_heads_draws_per_piece_and_matches_the_model_by_hand():
    """Heads split over 2 ranks: each rank's attention is seeded by its piece (keys (0,), (1,)); the
    output equals the model applied by hand with each half of the heads dropped under its rank's seed,
    on both ranks, and the second call draws anew."""
    import autotp
    from autotp.planning.planner import plan_graph
    from autotp.planning.rules.randomness import has_active_dropout

    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(DropAttention().train(), (x,))
    assert has_active_dropout(graph)
    pin = {**{f"qkv.{i}.weight": "S(0)" for i in range(3)}, "o.weight": "S(1)"}
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)
    (key0, seeds0, out0), (key1, seeds1, out1) = run_threads(_attention_rank, 2, graph, plan, x, DropAttention())
    assert (key0, key1) == ((0,), (1,)) and seeds0[0] != seeds1[0] and seeds0[0] != seeds0[1]
    ref = DropAttention()
    q, k, v = (ref.heads(p(x)) for p in ref.qkv)
    pieces = []
    for r, seed in enumerate((seeds0[1], seeds1[1])):
        torch.manual_seed(seed)
        h = slice(2 * r, 2 * r + 2)
        pieces.append(F.scaled_dot_product_attention(q[:, h], k[:, h], v[:, h], dropout_p=P))
    want = ref.o(torch.cat(pieces, 1).transpose(1, 2).reshape(x.shape))
    for out in (out0, out1):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
