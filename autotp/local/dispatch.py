"""Routed rows sent to the ranks that hold their experts and back: the all-to-all expert split.

Each rank of an axis of ``n`` ranks holds its own tokens and the experts ``[r E/n, (r+1) E/n)``.
Its tokens' routed rows, sorted by expert, come with its own cumulative counts ``offs`` ``(E,)``
(expert ``e`` owns rows ``[offs[e-1], offs[e])`` of this rank's rows). A grouped matmul on them
runs in three parts:

1. :class:`ExpertRoutes`, once per MoE layer, from ``offs``: each rank's count for each expert is
   sent to the rank holding that expert (an all-to-all of ``E`` integers), and the rows each rank
   sends and receives are read on the host in one read (``all_to_all_single`` takes its split sizes
   as host integers: one host sync per MoE layer, in the forward only; the backward reuses them).
   The received rows come ordered by source rank, then expert; :class:`Routes` holds the gather
   that sorts them by local expert (stable, so by source within an expert) and its inverse, and
   the local experts' offsets over the received rows.
2. :class:`DispatchedGroupedMM`: the rows sent (all-to-all), sorted by local expert, and the
   grouped matmul with this rank's experts' weights on them. Its output lives on the expert's rank.
3. :class:`CombinedGroupedMM`: the grouped matmul on those rows, put back in source order and sent
   back (all-to-all): each rank gets its own rows, in its own order.

A per-expert table added to the rows between (gpt-oss's biases, ``(E, N)`` split by experts as the
weights are) follows the rows to their experts' ranks: :class:`ExpertTableRows` looks up each
received row's expert's row in this rank's part of the table, nothing sent.

Dropless: every row reaches its expert whatever the routing (the buffers are the sizes the counts
give), so the result is the one process's, row for row. Both all-to-alls are autograd-aware (their
backward is the reverse all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

__all__ = ["Routes", "ExpertRoutes", "DispatchedGroupedMM", "CombinedGroupedMM", "ExpertTableRows"]


@dataclass(frozen=True, eq=False)
class Routes:
    """Where one rank's routed rows go and what it receives, for one MoE layer.

    ``sent_rows[j]``: rows this rank sends to rank ``j`` (its rows of ``j``'s experts);
    ``received_rows[j]``: rows it receives from rank ``j``. ``order``: the received rows (by source,
    then expert) gathered into local-expert order; ``restore``: its inverse. ``offsets``: the local
    experts' cumulative counts over the received rows (int32, as the grouped matmul takes them);
    ``experts``: the local expert of each received row in that order.
    """

    sent_rows: tuple[int, ...]
    received_rows: tuple[int, ...]
    order: torch.Tensor
    restore: torch.Tensor
    offsets: torch.Tensor
    experts: torch.Tensor


class ExpertRoutes(nn.Module):
    """``offs`` ``(E,)`` of this rank's rows -> :class:`Routes`, over ``group`` of ``n`` ranks each
    holding ``E / n`` consecutive experts."""

    def __init__(self, experts: int, n: int, group: Any) -> None:
        super().__init__()
        if n < 1 or experts % n:
            raise ValueError(f"{experts} experts over {n} ranks: expected a whole number of experts per rank")
        self.experts, self.n = experts, n
        self.__dict__["group"] = group  # a process group, not a module

    def extra_repr(self) -> str:
        return f"{self.experts} experts over {self.n} ranks"

    def forward(self, offs: torch.Tensor) -> Routes:
        if offs.shape != (self.experts,):
            raise ValueError(f"offsets of shape {tuple(offs.shape)}: expected ({self.experts},), one per expert")
        local = self.experts // self.n
        counts = torch.diff(offs.long(), prepend=offs.new_zeros(1, dtype=torch.long))  # (E,) this rank's rows per expert
        received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group)).view(self.n, local)
        sizes = torch.cat([counts.view(self.n, local).sum(1), received.sum(1)]).tolist()  # the one host read
        sent, got = tuple(sizes[:self.n]), tuple(sizes[self.n:])
        total = sum(got)
        expert = torch.arange(local, device=offs.device).repeat(self.n)  # the local expert of each (source, expert) block
        keys = torch.repeat_interleave(expert, received.flatten(), output_size=total)
        order = torch.sort(keys, stable=True).indices
        restore = torch.empty_like(order)
        restore[order] = torch.arange(total, device=offs.device)
        per_expert = received.sum(0)
        offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
        experts = torch.repeat_interleave(torch.arange(local, device=offs.device), per_expert, output_size=total)
        return Routes(sent, got, order, restore, offsets, experts)


def _exchange(x: torch.Tensor, received: tuple[int, ...], sent: tuple[int, ...], group: Any) -> torch.Tensor:
    """Rows ``sent[j]`` of ``x`` (in order) to rank ``j``; ``received[j]`` rows from each, by source."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), list(received), list(sent), group)
    return funcol.wait_tensor(out)


class _RoutedGroupedMM(nn.Module):
    """A grouped matmul of ``op`` on this rank's experts, with rows moved over ``group``."""

    moves = ""

    def __init__(self, op: Any, group: Any) -> None:
        super().__init__()
        self.__dict__["op"] = op  # an op overload, not a module
        self.__dict__["group"] = group  # a process group, not a module

    def extra_repr(self) -> str:
        return f"{self.op}: {self.moves} (all_to_all)"


class DispatchedGroupedMM(_RoutedGroupedMM):
    """``op(x, weight, offs)`` where ``x`` holds this rank's rows sorted by expert and ``weight`` this
    rank's experts: the rows sent to their experts' ranks, the result on those ranks in local-expert
    order (what :class:`CombinedGroupedMM` takes)."""

    moves = "rows sent to their experts' ranks"

    def forward(self, x: torch.Tensor, weight: torch.Tensor, routes: Routes) -> torch.Tensor:
        if x.shape[0] != sum(routes.sent_rows):
            raise ValueError(f"{x.shape[0]} rows given; the routes send {sum(routes.sent_rows)}")
        here = _exchange(x, routes.received_rows, routes.sent_rows, self.group)
        return self.op(here[routes.order], weight, routes.offsets)


class CombinedGroupedMM(_RoutedGroupedMM):
    """``op(x, weight, offs)`` on the rows this rank's experts received (local-expert order), each
    row sent back to the rank it came from, in that rank's order."""

    moves = "rows sent back to their tokens' ranks"

    def forward(self, x: torch.Tensor, weight: torch.Tensor, routes: Routes) -> torch.Tensor:
        if x.shape[0] != sum(routes.received_rows):
            raise ValueError(f"{x.shape[0]} rows given; this rank's experts received {sum(routes.received_rows)}")
        out = self.op(x, weight, routes.offsets)
        return _exchange(out[routes.restore], routes.sent_rows, routes.received_rows, self.group)


class ExpertTableRows(nn.Module):
    """``table[ids]`` for the rows this rank's experts received: ``table`` holds this rank's experts'
    rows of a per-expert table (``(E / n, N)``), and each received row (local-expert order, as
    :class:`DispatchedGroupedMM` gives them) gets its expert's row. The gradient stays with the
    expert's rank, as the weights' does."""

    def forward(self, table: torch.Tensor, routes: Routes) -> torch.Tensor:
        return table[routes.experts]
