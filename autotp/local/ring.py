"""Ring attention: queries, keys and values all split along the sequence, the keys and values
passed around the ranks while each computes (:mod:`autotp.planning.rules.attention`, variant ``"ring"``).

Rank ``r`` of ``n`` holds chunk ``r`` of ``n`` equal chunks of the rows of q, k, v (and of the
output). Step ``t`` (``0 .. T``) computes its query rows against the key/value chunk
``(r - t) mod n`` it holds then (the mask's block placed by ``row_offset = r * c`` and
``col_offset = chunk * c``), and merges the block's output into the rows' running output by the
log-sum-exp (the online softmax), exactly; between steps each rank sends the chunk it holds to rank
``r + 1`` and receives one from rank ``r - 1``. ``T`` (:func:`ring_steps`) is the last shift whose
chunk some rank's mask may read: ``n - 1`` under a causal mask, fewer under a window narrower than
the sequence. A block the mask forbids entirely (a chunk after the rank's own, under a causal mask)
is skipped, and each block goes through the query rows in chunks of ``chunk_rows`` against the
keys the chunk may read, as :func:`autotp.masks.masked_attention` does. The padding vector is
whole on every rank: a block reads its columns.

The backward (:class:`_Ring`, an autograd Function) runs the ring again: from the output, its
gradient and the log-sum-exp kept by the forward, each step adds the block's part to the query
rows' gradient and to the gradients of the key/value chunk held, and passes that chunk and its two
float32 gradient accumulators on to the next rank together; after the last step the gradients are
sent back to the chunk's own rank in one transfer. Every transfer is one ``all_to_all_single``
whose only non-empty piece goes to one rank, issued before the step's block is computed and
waited for after, so a backend that runs collectives on their own stream overlaps the two. A rank
holds its own k/v chunk, the one it computes with and the one arriving, never the whole k/v.

**Balanced** (``balanced=True``, variant ``"ring_balanced"``): the placements are the same (rank
``r`` holds rows ``2r`` and ``2r + 1`` of ``2n`` equal chunks, in order), but one all-to-all first
exchanges q, k and v together for chunks ``r`` and ``2n - 1 - r``
(:func:`autotp.local.attention.to_balanced`), the ring runs on those (the rank's two row chunks
against the two key/value chunks held, each block placed by its chunks' global offsets), and one
all-to-all sends the output home; autograd sends the gradients of q, k and v back the same way.
Under a causal mask every rank then scores the same pairs (two chunk blocks a step), where in order
the last rank reads every chunk and the first one only its own.

The block is computed as matmuls in float32 (scores, softmax by the log-sum-exp, weights times
values), not by a fused kernel: the flash kernels do not return the log-sum-exp under an arbitrary
mask on every device.

>>> ring_steps(MaskSpec(), 16, 4), ring_steps(MaskSpec(window=4), 16, 4), ring_steps(MaskSpec(window=6), 16, 4)
(3, 1, 2)
>>> ring_chunks(1, 4), ring_chunks(1, 4, balanced=True)
((1,), (1, 6))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.local.attention import from_balanced, rank_chunks, to_balanced
from autotp.masks import CHUNK_ROWS, MaskSpec

__all__ = ["RingAttention", "ring_steps", "ring_chunks"]


def ring_chunks(rank: int, n: int, balanced: bool = False) -> tuple[int, ...]:
    """The chunks of the sequence whose rows rank ``rank`` computes and whose keys and values it
    starts the ring with: chunk ``rank`` of ``n``, or balanced chunks ``rank`` and ``2n - 1 - rank``
    of ``2n``."""
    return rank_chunks(rank, n) if balanced else (rank,)


def _reads(spec: MaskSpec, row_chunk: int, key_chunk: int, size: int) -> bool:
    """Whether any row of chunk ``row_chunk`` may read a key of chunk ``key_chunk`` (chunks of ``size``)."""
    lo, hi = spec.key_range((row_chunk * size, (row_chunk + 1) * size), (key_chunk * size, (key_chunk + 1) * size))
    return hi > lo


def ring_steps(spec: MaskSpec, rows: int, n: int, balanced: bool = False) -> int:
    """The shifts of the ring: the largest ``t < n`` such that some rank's rows (:func:`ring_chunks`)
    may read a key chunk of the rank ``t`` before its own; 0 where none may."""
    size = rows // (2 * n if balanced else n)

    def read(r: int, t: int) -> bool:
        return any(_reads(spec, a, b, size) for a in ring_chunks(r, n, balanced)
                   for b in ring_chunks((r - t) % n, n, balanced))

    return next((t for t in range(n - 1, 0, -1) if any(read(r, t) for r in range(n))), 0)


def _send(x: torch.Tensor, to: int, source: int, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` (flat) sent to rank ``to`` of ``group``, one of its size received from ``source``; the
    result is waited for where it is first read."""
    out_sizes, in_sizes = [0] * n, [0] * n
    in_sizes[to], out_sizes[source] = x.numel(), x.numel()
    return funcol.all_to_all_single(x.contiguous(), out_sizes, in_sizes, group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(x: torch.Tensor, *like: torch.Tensor) -> list[torch.Tensor]:
    return [part.view(t.shape) for part, t in zip(x.split([t.numel() for t in like]), like)]


class _Blocks:
    """One rank's query rows against the key/value chunks it holds at one step: the grouped shapes
    and masks. The local rows are pieces of ``size`` rows, each starting at a global row of
    ``row_starts``; the keys held, pieces of ``size`` starting at the global columns a step gives."""

    def __init__(self, spec: MaskSpec, padding: Optional[torch.Tensor], scale: float, size: int,
                 row_starts: tuple[int, ...], chunk_rows: int) -> None:
        self.spec, self.padding, self.scale = spec, padding, scale
        self.size, self.row_starts, self.chunk_rows = size, row_starts, chunk_rows

    def each(self, col_starts: tuple[int, ...], device: torch.device):
        """``(r0, r1, lo, hi, mask)``: local query rows, the local columns they may read (non-empty)
        and the block's mask, broadcastable to the grouped scores ``(..., Hk, G, rows, cols)``."""
        size = self.size
        for i, row0 in enumerate(self.row_starts):
            for r0 in range(0, size, self.chunk_rows):
                r1 = min(size, r0 + self.chunk_rows)
                for j, col0 in enumerate(col_starts):
                    lo, hi = self.spec.key_range((row0 + r0, row0 + r1), (col0, col0 + size))
                    if hi <= lo:
                        continue
                    mask = self.spec.block((row0 + r0, row0 + r1), (lo, hi), device=device)
                    if self.padding is not None:
                        mask = mask & self.padding[:, None, None, None, lo:hi]
                    yield i * size + r0, i * size + r1, j * size + lo - col0, j * size + hi - col0, mask

    def scores(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * self.scale
        return s.masked_fill(~mask, float("-inf"))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least (float64 stays float64): the dtype the ring computes and sums in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _grouped(q: torch.Tensor, heads: int) -> torch.Tensor:
    """``(..., H, S, D)`` as ``(..., Hk, H // Hk, S, D)``: each key head's query heads together."""
    return q.unflatten(-3, (heads, q.shape[-3] // heads))


class _Ring(torch.autograd.Function):
    """The ring's forward and backward (module docstring); ``q`` grouped, float32 math."""

    @staticmethod
    def forward(ctx, q, k, v, ring):  # noqa: D102 - autograd's
        blocks, n, rank, steps = ring.blocks(q), ring.n, ring.rank, ring.steps
        qf = _wide(q)
        out = qf.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = qf.new_full(q.shape[:-1], float("-inf"))
        held = (k, v)
        for t in range(steps + 1):
            arriving = _send(_flat(*held), (rank + 1) % n, (rank - 1) % n, n, ring.group) if t < steps else None
            kf, vf = _wide(held[0]), _wide(held[1])
            for r0, r1, lo, hi, mask in blocks.each(ring.key_starts(t), q.device):
                s = blocks.scores(qf[..., r0:r1, :], kf[..., lo:hi, :], mask)
                part = torch.logsumexp(s, -1)
                both = torch.logaddexp(lse[..., r0:r1], part)
                finite = torch.isfinite(both)
                old = torch.where(finite, torch.exp(lse[..., r0:r1] - both), 0.0)
                weights = torch.where(finite.unsqueeze(-1), torch.exp(s - both.unsqueeze(-1)), 0.0)
                out[..., r0:r1, :] = out[..., r0:r1, :] * old.unsqueeze(-1) + torch.matmul(
                    weights, vf[..., lo:hi, :].unsqueeze(-3))
                lse[..., r0:r1] = both
            if arriving is not None:
                held = _unflat(_wait(arriving), k, v)
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd's
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        blocks, n, rank, steps = ring.blocks(q), ring.n, ring.rank, ring.steps
        qf, gf = _wide(q), _wide(grad)
        delta = (gf * _wide(out)).sum(-1)
        base = torch.where(torch.isfinite(lse), lse, 0.0)
        dq = torch.zeros_like(qf)
        held, dk, dv = (k, v), torch.zeros_like(_wide(k)), torch.zeros_like(_wide(v))
        for t in range(steps + 1):
            arriving = _send(_flat(*held), (rank + 1) % n, (rank - 1) % n, n, ring.group) if t < steps else None
            kf, vf = _wide(held[0]), _wide(held[1])
            for r0, r1, lo, hi, mask in blocks.each(ring.key_starts(t), q.device):
                s = blocks.scores(qf[..., r0:r1, :], kf[..., lo:hi, :], mask)
                p = torch.exp(s - base[..., r0:r1].unsqueeze(-1))
                g = gf[..., r0:r1, :]
                dv[..., lo:hi, :] += torch.matmul(p.transpose(-1, -2), g).sum(-3)
                ds = p * (torch.matmul(g, vf[..., lo:hi, :].unsqueeze(-3).transpose(-1, -2))
                          - delta[..., r0:r1].unsqueeze(-1))
                dq[..., r0:r1, :] += torch.matmul(ds, kf[..., lo:hi, :].unsqueeze(-3)) * blocks.scale
                dk[..., lo:hi, :] += torch.matmul(ds.transpose(-1, -2), qf[..., r0:r1, :]).sum(-3) * blocks.scale
            if arriving is not None:  # the chunk's gradients go on with it
                sums = _send(_flat(dk, dv), (rank + 1) % n, (rank - 1) % n, n, ring.group)
                held = _unflat(_wait(arriving), k, v)
                dk, dv = _unflat(_wait(sums), dk, dv)
        if steps:  # the gradients of the chunk held last, home to its rank
            dk, dv = _unflat(_wait(_send(_flat(dk, dv), (rank - steps) % n, (rank + steps) % n, n, ring.group)), dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


@dataclass(frozen=True)
class _Call:
    """One call's ring: the module's fields and the call's padding vector (the autograd context's)."""

    spec: MaskSpec
    scale: Optional[float]
    rows: int
    n: int
    rank: int
    steps: int
    chunk_rows: int
    group: dist.ProcessGroup
    padding: Optional[torch.Tensor]
    balanced: bool

    @property
    def size(self) -> int:
        """Rows of one chunk: a rank holds one (in order) or two (balanced)."""
        return self.rows // (2 * self.n if self.balanced else self.n)

    def key_starts(self, t: int) -> tuple[int, ...]:
        """The global first column of each key/value chunk held at step ``t``."""
        return tuple(c * self.size for c in ring_chunks((self.rank - t) % self.n, self.n, self.balanced))

    def blocks(self, q: torch.Tensor) -> _Blocks:
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _Blocks(self.spec, self.padding, scale, self.size, self.key_starts(0), self.chunk_rows)


class RingAttention(nn.Module):
    """``masked_attention`` of this rank's chunk of the sequence (queries, keys and values alike),
    the keys and values passed around a ring (module docstring); called with ``(q, k, v, padding)``,
    the padding vector ``(B, S)`` whole. ``balanced``: the ring runs on chunks ``r`` and
    ``2n - 1 - r`` of ``2n`` (module docstring)."""

    def __init__(self, spec: MaskSpec, scale: Optional[float], rows: int, n: int, rank: int,
                 group: dist.ProcessGroup, axis_name: str, chunk_rows: int = CHUNK_ROWS,
                 balanced: bool = False) -> None:
        super().__init__()
        pieces = 2 * n if balanced else n
        if rows % pieces:
            raise ValueError(f"{'balanced ' if balanced else ''}ring attention over {n} ranks: {rows} rows do not "
                             f"cut into {pieces} equal chunks")
        self.spec, self.scale, self.rows, self.n, self.rank = spec, scale, rows, n, rank
        self.group, self.axis_name, self.chunk_rows, self.balanced = group, axis_name, chunk_rows, balanced
        self.steps = ring_steps(spec, rows, n, balanced)

    def extra_repr(self) -> str:
        chunks = (f"chunks {list(rank_chunks(self.rank, self.n))} of {2 * self.n}" if self.balanced
                  else f"chunk {self.rank} of {self.n}")
        return f"{self.spec}, {chunks} over {self.axis_name}, {self.steps} shifts"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        if q.shape[-2] * self.n != self.rows or k.shape[-2] != q.shape[-2] or q.shape[-3] % k.shape[-3]:
            raise ValueError(f"ring attention over {self.n} ranks of {self.rows} rows: q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}; expected {self.rows // self.n} rows of each, and key heads "
                             "that divide the query heads")
        call = _Call(self.spec, self.scale, self.rows, self.n, self.rank, self.steps, self.chunk_rows, self.group,
                     padding, self.balanced)
        dim = q.ndim - 2
        if self.balanced:  # this rank's chunks 2r, 2r + 1 for r, 2n - 1 - r: one all-to-all
            q, k, v = to_balanced((q, k, v), dim, self.rank, self.n, self.group)
        out = _Ring.apply(_grouped(q, k.shape[-3]), k, v, call).flatten(-4, -3)
        return from_balanced((out,), dim, self.rank, self.n, self.group)[0] if self.balanced else out
