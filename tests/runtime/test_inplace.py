"""Ops that write in place after a collective (``h += attn`` after a reduce-scatter, as Falcon's
decoder does): a collective's result is its own tensor, and the rewrite copies a redistributed value
(a slice of the input is a view of it) before an op writes into it, so the write neither fails under
autograd nor changes the tensor it was redistributed from."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotp.local.collectives import RedistributeStep
from autotp.placement import P, R, S
from tests.helpers.exactness import assert_step_matches_one_process


@pytest.fixture()
def two_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("src, dst", [(R, S(1)), (S(0), R), (S(1), R), (P, S(0)), (P, S(1)), (P, R), (S(1), S(0))])
def test_a_collective_step_can_be_written_in_place(two_fake_ranks, src, dst):
    """What a collective returns is its own (a view of its buffer drops the view relation): writing
    into it under autograd neither raises nor touches the input."""
    step = RedistributeStep(src, dst, "tp", two_fake_ranks, 2, 0)
    x = torch.randn(4, 8, requires_grad=True)
    before = x.detach().clone()
    out = step(x)
    out.add_(1.0)
    assert torch.equal(x.detach(), before)
    out.sum().backward()
    assert x.grad is not None


class _ResidualInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):  # (B, T, 64)
        h = self.down(F.gelu(self.up(x)))
        h += x  # in place, after the sum (or reduce-scatter) of a row-split output
        return h


def test_in_place_add_after_a_collective_is_exact():
    import autotp
    from autotp.planning.planner import plan_graph

    model = _ResidualInPlace()
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    try:
        plan_graph(graph, (2,), "cpu-gloo", "train", 1.0, recompute=False)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.05) + 1, recompute=False)
    assert {"colwise", "rowwise"} <= set(plan.module_styles().values())
    assert plan.collective_counts().get(("forward", "all_reduce"), 0) + plan.collective_counts().get(
        ("forward", "reduce_scatter"), 0) > 0
    assert_step_matches_one_process(graph, plan, model, x)


class _KeysWrittenThroughViews(nn.Module):
    """Keys built as DeepSeek's attention builds them: an empty tensor filled through two slices
    (``copy_`` into views), then read by attention under its own name, not through the copies."""

    def __init__(self, dim: int = 32, heads: int = 4, nope: int = 8, rope: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.nope, self.rope = heads, nope, rope
        self.q = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.k = nn.Linear(dim, heads * nope, bias=False)
        self.shared = nn.Linear(dim, rope, bias=False)  # one rotary key for every head
        self.o = nn.Linear(heads * (nope + rope), dim, bias=False)

    def forward(self, x):  # (B, T, dim)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope = self.k(x).view(b, t, self.heads, self.nope).transpose(1, 2)
        k_rope = self.shared(x).view(b, 1, t, self.rope).expand(-1, k_nope.shape[1], -1, -1)
        keys = k_nope.new_empty(*k_nope.shape[:-1], self.nope + self.rope)
        keys[..., : self.nope].copy_(k_nope)
        keys[..., self.nope:].copy_(k_rope)
        out = F.scaled_dot_product_attention(q, keys, keys)  # (B, heads, T, nope + rope)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


HEADS_SPLIT = {"q.weight": "S(0)", "k.weight": "S(0)", "o.weight": "S(1)"}


def test_the_chain_to_a_write_through_a_view_is_pinned_and_later_reads_are_versioned():
    """The reads from the empty keys to each copy_ (the slice, the copy_'s first input) are pinned;
    attention's read of the keys comes after two writes; the residual ``h += x``, whose result is
    read through the add_ node alone, pins nothing."""
    import autotp
    from autotp.tracing.aliasing import pinned_reads, read_versions

    model = _KeysWrittenThroughViews()
    graph = autotp.capture(model, (torch.randn(2, 8, 32),))
    empty = next(n for n in graph.nodes if n.target == "aten.new_empty.default")
    copies = [n for n in graph.nodes if n.target == "aten.copy_.default"]
    assert len(copies) == 2
    want = set()
    for c in copies:
        want |= {(c.name, 0), (c.inputs[0], 0)}
        assert graph[c.inputs[0]].inputs[0] == empty.name  # copy_(slice(keys), ...)
    assert pinned_reads(graph) == want
    attention = next(n for n in graph.nodes if "scaled_dot_product" in n.target)
    versions = read_versions(graph)
    assert [versions.get((attention.name, k), 0) for k in range(3)] == [0, 2, 2]

    residual = autotp.capture(_ResidualInPlace(), (torch.randn(2, 8, 64),))
    assert any(n.target == "aten.add_.Tensor" for n in residual.nodes)
    assert pinned_reads(residual) == frozenset()


def test_a_write_through_a_view_of_a_replicated_tensor_lands_where_it_is_read():
    """With the heads split (pinned), the empty keys could be left whole and their slices read split
    (a local chunk, no collective): the copies would then write into those chunks, and attention
    would read the uninitialized keys (NaN or garbage). The plan keeps each write in the storage
    attention reads, and the step is exact."""
    import autotp
    from autotp.tracing.aliasing import pinned_reads
    from autotp.placement import plain
    from autotp.planning.planner import plan_graph

    model = _KeysWrittenThroughViews()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", None, recompute=False, pin=HEADS_SPLIT)
    attention = next(n for n in graph.nodes if "scaled_dot_product" in n.target)
    assert plan.strategy(attention.name).inputs[1][0].is_shard  # the heads are split in attention
    for consumer, k in pinned_reads(graph):
        producer = graph[consumer].inputs[k]
        assert plan.strategy(consumer).inputs[k] == plain(plan.strategy(producer).output), (consumer, producer)
    assert_step_matches_one_process(graph, plan, model, x)


class _TwoHalves(nn.Module):
    """Two column-split projections written into the halves of an empty tensor, then read back:
    ``how`` says through which views the writes and the reads go."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.a = nn.Linear(16, 32, bias=False)
        self.b = nn.Linear(16, 32, bias=False)
        self.o = nn.Linear(32, 16, bias=False)

    def forward(self, x):  # (B, T, 16)
        buf = x.new_empty(*x.shape[:-1], 64)
        if self.how == "view made before":  # a view of the tensor taken before the writes, read after
            pairs = buf.view(*x.shape[:-1], 2, 32)
            buf[..., :32].copy_(self.a(x))
            buf[..., 32:].copy_(self.b(x))
            return self.o(pairs[..., 0, :] * pairs[..., 1, :])
        if self.how == "narrow":  # a view op outside autotp.ops.VIEW (its schema says it aliases)
            buf.narrow(-1, 0, 32).copy_(self.a(x))
            buf.narrow(-1, 32, 32).copy_(self.b(x))
            return self.o(buf[..., :32] * buf[..., 32:])
        square = x.new_zeros(x.shape[0], 32, 32)  # "diagonal"
        square.diagonal(dim1=1, dim2=2).copy_(self.a(x)[:, 0])
        return self.o(square.sum(1)[:, None, :] * self.b(x))


@pytest.mark.parametrize("how", ["view made before", "narrow", "diagonal"])
def test_writes_through_other_views_land_where_they_are_read(how):
    """With the projections' columns split (pinned), the tensor could be made split another way and
    read through a redistribution made before the writes, or written through a view autotp did not
    know: the reads would see uninitialized memory. Each is exact."""
    import autotp
    from autotp.planning.planner import plan_graph

    model = _TwoHalves(how)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    pin = {"a.weight": "S(0)", "b.weight": "S(0)", "o.weight": "S(1)"}
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", None, recompute=False, pin=pin)
    assert_step_matches_one_process(graph, plan, model, x)


class _HalfScaledInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32, bias=False)
        self.b = nn.Linear(16, 32, bias=False)
        self.o = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.a(x)
        heads = h.view(*h.shape[:-1], 4, 8)  # a view made before the write, read after it
        h[..., :8].mul_(0.5)  # through a slice of the whole last dim: only a whole h reads it as it is
        return self.o(heads.flatten(2) * self.b(x))


def test_pins_that_leave_an_in_place_write_no_plan_are_named_not_blamed_on_memory():
    import autotp
    from autotp.planning.planner import plan_graph

    graph = autotp.capture(_HalfScaledInPlace(), (torch.randn(4, 6, 16),))
    pin = {"a.weight": "S(0)", "b.weight": "S(0)", "o.weight": "S(1)"}
    with pytest.raises(ValueError, match="in-place write") as err:
        plan_graph(graph, (2,), "cpu-gloo", "train", None, recompute=False, pin=pin)
    assert not isinstance(err.value, autotp.MemoryBudgetError)
    assert plan_graph(graph, (2,), "cpu-gloo", "train", None, recompute=False).parameter_placements  # unpinned: a plan


class _WritesElsewhere(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        if self.how == "foreach":
            torch._foreach_mul_([a, b], 2.0)
            return a + b
        out = torch.empty_like(a)
        torch.mul(a.detach(), 2.0, out=out)  # out= under autograd only with no gradient to take
        return out + b


@pytest.mark.parametrize("how, op, argument", [("foreach", "aten._foreach_mul_.Scalar", "self"),
                                               ("out", "aten.mul.out", "out")])
def test_a_write_into_an_argument_the_planner_does_not_follow_is_refused(how, op, argument):
    """Only writes into an op's first tensor are kept in one storage by the plan (``pinned_reads``):
    a write through ``out=`` or into a list of tensors would land in a redistributed copy unseen."""
    import autotp

    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(_WritesElsewhere(how), (torch.randn(2, 8),))
    message = str(info.value)
    assert f"{op} (node" in message and f"writes into its argument '{argument}'" in message
    assert "what to do: use the form that returns its result" in message
