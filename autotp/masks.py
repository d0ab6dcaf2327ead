"""Attention under a described mask: causal, a sliding window, a per-key padding vector, built
only where a kernel call needs it, never as a ``(S_q, S_k)`` tensor in the graph.

A traced Hugging Face decoder builds its mask in the graph as a ``(B, 1, S_q, S_k)`` boolean
tensor (positions compared, the padding ``attention_mask`` AND-ed in) and calls
``scaled_dot_product_attention`` with it. :mod:`autotp.tracing.masks` proves from the graph which
such masks are a :class:`MaskSpec` (with, or without, a padding vector) and replaces the call by
``autotp::masked_attention`` (:func:`masked_attention`), which holds the description instead of
the tensor; an exactly causal mask becomes ``is_causal=True`` instead.

The description places a query row ``i`` and a key column ``j`` by their indices in the whole
``(S_q, S_k)`` grid: ``row_offset`` and ``col_offset`` say where the q and k/v a call is handed
start in it, so a rank holding any chunk of the query rows (a row split today; a sequence split
with balanced causal chunks and exchanged keys later) builds the mask of exactly its block.
The kernel goes through the query rows in chunks of ``chunk_rows`` and hands each chunk only the
keys its mask can allow (up to the chunk's last row under a causal mask, from its first row's
window start under a window), so a causal attention computes about half the score matrix and a
window ``S x w``, as its FLOPs are counted (:meth:`MaskSpec.pairs`), and no mask bigger than
``chunk_rows x`` the keys of the chunk exists at once. A block that is exactly causal and has no
padding runs as ``is_causal=True`` (the flash kernel where there is one).

Rows that no key is allowed for (a left-padded row, under a causal mask) come out zero, with zero
gradients, as ``scaled_dot_product_attention`` gives them for an all-False mask row.

>>> import torch
>>> spec = MaskSpec(causal=True, window=2)
>>> spec.block((0, 3), (0, 3)).int().tolist()
[[1, 0, 0], [1, 1, 0], [0, 1, 1]]
>>> spec.pairs(3, 3)
5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["MaskSpec", "masked_attention", "MASKED_ATTENTION", "CHUNK_ROWS"]

CHUNK_ROWS = 1024  # query rows per kernel call: a 1024 x 128k bool mask is 128 MiB


@dataclass(frozen=True)
class MaskSpec:
    """Which key column ``j`` a query row ``i`` may read, by their indices in the whole grid:
    with ``d = i - j + diagonal``, ``d >= 0`` where ``causal`` and ``d < window`` where a window
    is given (a window without ``causal`` is not described). ``diagonal`` is the query's position
    less the key's at ``i = j = 0`` (0 where both start at the same position). A padding vector,
    where there is one, is ANDed in per key: it is a tensor, not part of the description."""

    causal: bool = True
    window: Optional[int] = None
    diagonal: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and (not self.causal or self.window < 1):
            raise ValueError(f"a mask description with window={self.window}, causal={self.causal}: a window "
                             "is described only under a causal mask, and at least 1 wide")

    def key_range(self, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[int, int]:
        """The columns of ``cols`` (global ``(start, stop)``) any row of ``rows`` may read:
        ``(start, stop)``, empty where none may."""
        lo, hi = cols
        if self.causal:
            hi = min(hi, rows[1] - 1 + self.diagonal + 1)
        if self.window is not None:
            lo = max(lo, rows[0] + self.diagonal - self.window + 1)
        return lo, max(lo, hi)

    def block(self, rows: tuple[int, int], cols: tuple[int, int], device: Optional[torch.device] = None) -> torch.Tensor:
        """The ``(rows, cols)`` block of the mask (global ``(start, stop)`` each): True where allowed.

        One boolean tensor of the block's size and nothing else of it: with local indices ``a``,
        ``b`` of the block, ``d = i - j + diagonal = shift - (b - a)`` where ``shift = rows[0] -
        cols[0] + diagonal``, so ``d >= 0`` keeps the diagonals ``b - a <= shift`` (``tril_``) and
        ``d < window`` those with ``b - a > shift - window`` (``triu_``), both in place."""
        allowed = torch.ones((rows[1] - rows[0], cols[1] - cols[0]), dtype=torch.bool, device=device)
        shift = rows[0] - cols[0] + self.diagonal
        if self.causal:
            allowed.tril_(shift)
        if self.window is not None:
            allowed.triu_(shift - self.window + 1)
        return allowed

    def row_pairs(self, row: int, cols: int) -> int:
        """How many of ``cols`` key columns global row ``row`` may read (padding aside)."""
        lo, hi = self.key_range((row, row + 1), (0, cols))
        return hi - lo

    def pairs(self, rows: int, cols: int, row_start: int = 0) -> int:
        """The (row, column) pairs the mask allows for rows ``row_start .. row_start + rows`` of a
        grid of ``cols`` keys (padding aside): what a kernel that skips masked blocks computes.
        In closed form: a causal square ``S (S + 1) / 2``, a window about ``S w``."""
        if not self.causal:
            return rows * cols
        total = 0
        # the allowed count per row, min(i + diagonal + 1, cols) less what the window cuts, is
        # piecewise linear in the row: summed in closed form between the rows where it bends
        # the allowed count per row is piecewise linear in the row, bending only next to where
        # the diagonal, the window's edge or the last column passes a row: summed in closed form
        # between those rows
        edges = [-self.diagonal, cols - self.diagonal]
        if self.window is not None:
            edges += [self.window - self.diagonal, cols + self.window - self.diagonal]
        bends = sorted({row_start, row_start + rows,
                        *(e + o for e in edges for o in (-1, 0, 1) if row_start < e + o < row_start + rows)})
        for a, b in zip(bends, bends[1:]):
            first, last = self.row_pairs(a, cols), self.row_pairs(b - 1, cols)
            total += (first + last) * (b - a) // 2
        return total


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: Optional[torch.Tensor],
                     spec: MaskSpec, row_offset: int = 0, col_offset: int = 0, scale: Optional[float] = None,
                     enable_gqa: bool = False, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask)`` where ``mask`` is ``spec`` on the block of
    rows ``row_offset ..`` and columns ``col_offset ..`` ANDed with ``padding`` (``(B, S_k)``
    booleans over the keys handed in, True where a key is read; None: every key), built a chunk of
    query rows at a time against the keys the chunk may read. Under autograd the chunks' masks
    are not kept for the backward: each chunk's attention is run again there, its mask rebuilt
    (a mask kept per chunk would add up to the ``S_q x S_k`` tensor this avoids)."""
    rows, cols = q.shape[-2], k.shape[-2]
    if padding is None and spec.window is None and spec.causal and rows == cols and row_offset + spec.diagonal == col_offset:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    chunks = _Chunks(spec, row_offset, col_offset, rows, cols, chunk_rows, padding, scale, enable_gqa)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _RecomputedAttention.apply(q, k, v, chunks)
    return chunks.forward(q, k, v)


@dataclass(frozen=True)
class _Chunks:
    """The kernel calls of one masked attention: each chunk of query rows against its keys."""

    spec: MaskSpec
    row_offset: int
    col_offset: int
    rows: int
    cols: int
    chunk_rows: int
    padding: Optional[torch.Tensor]
    scale: Optional[float]
    enable_gqa: bool

    def each(self):
        """``(r0, r1, lo, hi)``: local query rows and the local key columns they may read."""
        for r0 in range(0, self.rows, self.chunk_rows):
            r1 = min(self.rows, r0 + self.chunk_rows)
            lo, hi = self.spec.key_range((self.row_offset + r0, self.row_offset + r1),
                                         (self.col_offset, self.col_offset + self.cols))
            yield r0, r1, lo - self.col_offset, hi - self.col_offset

    def one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r0: int, r1: int, lo: int, hi: int) -> torch.Tensor:
        """Rows ``r0:r1`` of the output from ``q``'s rows and ``k``, ``v``'s columns ``lo:hi`` (those given)."""
        mask = self.spec.block((self.row_offset + r0, self.row_offset + r1),
                               (self.col_offset + lo, self.col_offset + hi), device=q.device)
        if self.padding is not None:
            mask = mask & self.padding[:, None, None, lo:hi]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.enable_gqa)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for r0, r1, lo, hi in self.each():
            if hi <= lo:  # no key allowed for any row: zeros, as the kernel gives an all-False row
                outs.append(q.new_zeros((*q.shape[:-2], r1 - r0, v.shape[-1])))
            else:
                outs.append(self.one(q[..., r0:r1, :], k[..., lo:hi, :], v[..., lo:hi, :], r0, r1, lo, hi))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


class _RecomputedAttention(torch.autograd.Function):
    """The chunks run without autograd; the backward runs each again and takes its gradients."""

    @staticmethod
    def forward(ctx, q, k, v, chunks):  # noqa: D102 - autograd's
        ctx.chunks = chunks
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return chunks.forward(q, k, v)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd's
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for r0, r1, lo, hi in ctx.chunks.each():
            if hi <= lo:
                continue
            with torch.enable_grad():
                qc, kc, vc = (t.detach().requires_grad_() for t in (q[..., r0:r1, :], k[..., lo:hi, :], v[..., lo:hi, :]))
                out = ctx.chunks.one(qc, kc, vc, r0, r1, lo, hi)
                gq, gk, gv = torch.autograd.grad(out, (qc, kc, vc), grad[..., r0:r1, :])
            dq[..., r0:r1, :] += gq
            dk[..., lo:hi, :] += gk
            dv[..., lo:hi, :] += gv
        return dq, dk, dv, None


_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? padding, bool causal, int? window, int diagonal=0, "
           "int row_offset=0, int col_offset=0, float? scale=None, bool enable_gqa=False) -> Tensor")

_LIBRARY = torch.library.Library("autotp", "FRAGMENT")
_LIBRARY.define("masked_attention" + _SCHEMA)


def _masked_attention_op(q, k, v, padding, causal, window, diagonal=0, row_offset=0, col_offset=0, scale=None,
                         enable_gqa=False):
    return masked_attention(q, k, v, padding, MaskSpec(causal, window, diagonal), row_offset, col_offset, scale,
                            enable_gqa)


# composite: autograd goes through the kernel calls it makes, and on meta or fake tensors it runs as is
_LIBRARY.impl("masked_attention", _masked_attention_op, "CompositeImplicitAutograd")

MASKED_ATTENTION = torch.ops.autotp.masked_attention.default
"""The op the graph calls: ``masked_attention(q, k, v, padding, causal, window, diagonal,
row_offset, col_offset, scale, enable_gqa)``; its node's arguments are a :class:`MaskSpec`'s fields."""


def spec_of(args) -> MaskSpec:
    """The :class:`MaskSpec` of a ``masked_attention`` node's arguments by name (``OpNode.args``)."""
    return MaskSpec(bool(args.get("causal", True)), args.get("window"), int(args.get("diagonal", 0) or 0))
