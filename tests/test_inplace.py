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

from autotp.collectives import RedistributeStep
from autotp.placement import P, R, S
from exactness import assert_step_matches_one_process


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
    from autotp.planner import plan_graph

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
