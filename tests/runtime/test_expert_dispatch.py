"""The all-to-all expert split's local code (autotp/local/dispatch.py) on 2 threaded ranks: each
rank's routed rows, sorted by expert with its own offsets, sent to the ranks holding their experts,
through both grouped matmuls with an activation between, and back, equal one process running the
same rows through every expert: outputs, the rows' gradients and the experts' weights' gradients.
The routing is skewed (an expert with no rows, a rank sending nothing to the other), dropless."""

from __future__ import annotations

import pytest
import torch

from autotp.local.dispatch import CombinedGroupedMM, DispatchedGroupedMM, ExpertRoutes
from examples.ranks import run_threads

pytest.importorskip("transformers")
from transformers.integrations import moe  # noqa: E402  (registers transformers::grouped_mm_fallback)

OP = torch.ops.transformers.grouped_mm_fallback.default
EXPERTS, K, HIDDEN, N = 4, 8, 6, 2
# each rank's rows' experts: rank 0 sends nothing to rank 1 (experts 2, 3), expert 2 gets no rows, and
# rank 0 receives experts 0 and 1 from both ranks (sorted again by expert)
IDS = ([0, 0, 1, 1, 1], [0, 1, 3, 3, 3, 0])


def rows(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.tensor(IDS[rank])
    ids, _ = torch.sort(ids)
    x = torch.randn(len(ids), K, generator=g)
    offs = torch.cumsum(torch.bincount(ids, minlength=EXPERTS), 0).to(torch.int32)
    return x, offs


def weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(EXPERTS, K, HIDDEN, generator=g), torch.randn(EXPERTS, HIDDEN, K, generator=g)


def _rank(rank, world):
    import torch.distributed as dist

    w1, w2 = weights()
    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    w1, w2 = w1[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
    x, offs = rows(rank)
    x.requires_grad_()
    group = dist.group.WORLD
    routes = ExpertRoutes(EXPERTS, world, group)(offs)
    hidden = torch.nn.functional.silu(DispatchedGroupedMM(OP, group)(x, w1, routes))
    out = CombinedGroupedMM(OP, group)(hidden, w2, routes)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, w1.grad, w2.grad, routes.sent_rows, routes.received_rows


def test_rows_sent_to_their_experts_and_back_equal_one_process():
    w1, w2 = weights()
    w1.requires_grad_(), w2.requires_grad_()
    expected = []
    for rank in range(2):
        x, offs = rows(rank)
        x.requires_grad_()
        out = OP(torch.nn.functional.silu(OP(x, w1, offs)), w2, offs)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        expected.append((out.detach(), x.grad))
    results = run_threads(_rank, 2)
    assert [r[4] for r in results] == [(5, 0), (3, 3)]  # rows sent to each rank
    assert [r[5] for r in results] == [(5, 3), (0, 3)]  # rows received from each rank
    for (out, x_grad, *_), (want, want_grad) in zip(results, expected):
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x_grad, want_grad)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), w1.grad)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), w2.grad)


def test_routes_refuse_experts_that_do_not_split_evenly():
    with pytest.raises(ValueError, match="5 experts over 2 ranks"):
        ExpertRoutes(5, 2, None)
