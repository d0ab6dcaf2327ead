"""Causal attention on a rank's query rows with the work balanced (:mod:`autotp.planning.rules.attention`).

The query rows are split over ``n`` ranks in order (``S`` of the sequence dim: rank ``r`` holds
chunks ``2r`` and ``2r + 1`` of ``2n`` equal chunks), the keys and values whole. Under a causal mask
the rows of the last chunks read the most keys, so in that order the last rank does about twice the
mean. :class:`BalancedRows` computes instead the rows of chunks ``r`` and ``2n - 1 - r`` on rank
``r`` (a short chunk and a long one: the same pairs on every rank, as torchtitan and Megatron lay
out context parallelism): one all-to-all sends each half of the rank's queries to the rank that
computes its rows, the masked kernel runs on each of the two chunks with its rows' offset
(:func:`autotp.masks.masked_attention`), and one all-to-all sends each chunk's output back to the
rank that holds those rows. The backward runs the two all-to-alls the other way (autograd through
``all_to_all_single_autograd``). The keys, values and padding stay whole: nothing of them moves.

>>> rank_chunks(0, 2), rank_chunks(1, 2)
((0, 3), (1, 2))
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.masks import MaskSpec, masked_attention

__all__ = ["BalancedRows", "rank_chunks", "to_balanced", "from_balanced"]


def rank_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two of ``2n`` chunks of the rows whose attention rank ``rank`` computes balanced."""
    return rank, 2 * n - 1 - rank


def _computer(chunk: int, n: int) -> int:
    return chunk if chunk < n else 2 * n - 1 - chunk


def _holder(chunk: int, n: int) -> int:
    return chunk // 2


def _exchange(x: torch.Tensor, dim: int, held: tuple[int, ...], wanted: tuple[int, ...], to: Callable[[int], int],
              source: Callable[[int], int], n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunks ``held`` of ``x`` (equal pieces along ``dim``, in that order) sent each to rank
    ``to(chunk)``; returns chunks ``wanted`` (each from rank ``source(chunk)``) in that order. One
    all-to-all: each rank sends its chunks in the order of their ranks then their numbers, and
    receives them in the order of their sources then their numbers."""
    pieces = dict(zip(held, x.movedim(dim, 0).chunk(len(held), 0)))
    size = x.shape[dim] // len(held)
    send = sorted(held, key=lambda c: (to(c), c))
    receive = sorted(wanted, key=lambda c: (source(c), c))
    in_sizes = [size * sum(to(c) == j for c in held) for j in range(n)]
    out_sizes = [size * sum(source(c) == j for c in wanted) for j in range(n)]
    buffer = torch.cat([pieces[c] for c in send], 0).contiguous()
    got = funcol.all_to_all_single_autograd(buffer, out_sizes, in_sizes, group)
    got = funcol.wait_tensor(got) if isinstance(got, funcol.AsyncCollectiveTensor) else got
    arrived = dict(zip(receive, got.split(size, 0)))
    return torch.cat([arrived[c] for c in wanted], 0).movedim(0, dim)


def _together(tensors: tuple[torch.Tensor, ...], dim: int, held: tuple[int, ...], wanted: tuple[int, ...],
              to: Callable[[int], int], source: Callable[[int], int], n: int,
              group: dist.ProcessGroup) -> list[torch.Tensor]:
    """:func:`_exchange` of each of ``tensors`` (two chunks along ``dim`` each), all in one all-to-all:
    each tensor's chunks flattened side by side into one ``(2, ...)`` buffer."""
    if len(tensors) == 1:
        return [_exchange(tensors[0], dim, held, wanted, to, source, n, group)]
    flat = [t.movedim(dim, 0).reshape(len(held), -1) for t in tensors]
    got = _exchange(torch.cat(flat, 1), 0, held, wanted, to, source, n, group)
    return [part.reshape(t.movedim(dim, 0).shape).movedim(0, dim).to(t.dtype)
            for part, t in zip(got.split([f.shape[1] for f in flat], 1), tensors)]


def to_balanced(tensors: tuple[torch.Tensor, ...], dim: int, rank: int, n: int,
                group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each of ``tensors``, this rank's chunks ``2r, 2r + 1`` of ``2n`` along ``dim`` (the rows in
    order), exchanged for the chunks it computes balanced (:func:`rank_chunks`), in one all-to-all
    (autograd sends the gradients back)."""
    return _together(tensors, dim, (2 * rank, 2 * rank + 1), rank_chunks(rank, n), lambda c: _computer(c, n),
                     lambda c: _holder(c, n), n, group)


def from_balanced(tensors: tuple[torch.Tensor, ...], dim: int, rank: int, n: int,
                  group: dist.ProcessGroup) -> list[torch.Tensor]:
    """:func:`to_balanced` the other way: the chunks computed here sent home, the rows in order."""
    return _together(tensors, dim, rank_chunks(rank, n), (2 * rank, 2 * rank + 1), lambda c: _holder(c, n),
                     lambda c: _computer(c, n), n, group)


class BalancedRows(nn.Module):
    """``masked_attention`` of this rank's contiguous query rows, computed as two balanced chunks
    (module docstring); called with ``(q, k, v, padding)``, ``q`` this rank's rows, the others whole."""

    def __init__(self, spec: MaskSpec, scale: Optional[float], enable_gqa: bool, rows: int, n: int, rank: int,
                 group: dist.ProcessGroup, axis_name: str) -> None:
        super().__init__()
        if rows % (2 * n):
            raise ValueError(f"balanced rows: {rows} query rows do not cut into 2 x {n} equal chunks")
        self.spec, self.scale, self.enable_gqa = spec, scale, enable_gqa
        self.rows, self.n, self.rank, self.group, self.axis_name = rows, n, rank, group, axis_name

    def extra_repr(self) -> str:
        return (f"{self.spec}, rows of chunks {list(rank_chunks(self.rank, self.n))} of {2 * self.n} "
                f"over {self.axis_name}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        # the rows a call brings (a dynamic length may differ from the traced ``rows``): two chunks a rank
        n, dim = self.n, q.ndim - 2
        if q.shape[dim] % 2:
            raise ValueError(f"balanced rows over {self.axis_name}: this rank holds {q.shape[dim]} query rows, "
                             f"which do not cut into its 2 chunks; expected a sequence length divisible by {2 * n}")
        chunk = q.shape[dim] // 2
        (rows,) = to_balanced((q,), dim, self.rank, n, self.group)
        outs = [masked_attention(part, k, v, padding, self.spec, row_offset=c * chunk, scale=self.scale,
                                 enable_gqa=self.enable_gqa)
                for c, part in zip(rank_chunks(self.rank, n), rows.chunk(2, dim))]
        return from_balanced((torch.cat(outs, dim),), dim, self.rank, n, self.group)[0]
