"""The working memory of attention under a described mask: what one kernel call holds at once
beyond its inputs, its output and what autograd keeps (:mod:`autotp.planning.rules.attention`).

:func:`autotp.masks.masked_attention` goes through a rank's query rows in chunks of
:data:`autotp.masks.CHUNK_ROWS`, each against the keys its mask may read, and builds each chunk's
mask as it runs it: the block, a boolean a pair (:meth:`autotp.masks.MaskSpec.block`), ANDed with
the padding vector where there is one (a boolean a pair per row of the padding's batch), and the
additive mask ``scaled_dot_product_attention`` makes of it, in the queries' dtype; the fused kernel
computes the scores in tiles, so neither is per head. The same two are built again in the
backward, where each chunk is run again (:class:`autotp.masks._RecomputedAttention`). So one call
holds, at once, ``(1 + e) x`` (``e`` the queries' element bytes) the pairs of its largest chunk's
rectangle (``chunk rows x`` the keys it may read), times the padding's rows where padded.

The ring (:mod:`autotp.local.ring`) computes each block's scores as float32 matmuls, one per head:
its backward holds :data:`RING_BLOCK_SCORES` block-sized float32 tensors per head at once (the
scores, their exponentials, the values' products less the row's delta, and the scores' gradient),
beside the block's mask and its negation.

A ``scaled_dot_product_attention(is_causal=True)`` that no variant splits by rows, and a chunk that
is exactly causal without padding (:func:`autotp.masks.masked_attention` runs it as ``is_causal``),
build no mask: nothing. The figure is the busiest rank's largest call (:func:`working_bytes`); the
cost model prices it as an event of the backward, beside every activation still kept
(:meth:`autotp.planning.costs.costing.CostModel.working_bytes`).

>>> from autotp.masks import MaskSpec
>>> largest_rectangle(MaskSpec(), [(3072, 1024, 0, 4096)])   # a chunk of 1024 rows against every key
4194304
"""

from __future__ import annotations

from typing import Sequence

from autotp.local.attention import rank_chunks
from autotp.local.ring import ring_chunks, ring_steps
from autotp.masks import CHUNK_ROWS, MaskSpec
from autotp.placement import Strategy, shard_divisor
from autotp.planning.rules.attention import (BALANCED, CAUSAL, MASKED, RING_BALANCED, attention_mask_of, ring_axis,
                                            rows_axis)
from autotp.planning.rules.attention_kv import ring_of
from autotp.tracing.graph import OpNode, dtype_bytes

__all__ = ["working_bytes", "largest_rectangle", "RING_BLOCK_SCORES"]

RING_BLOCK_SCORES = 4  # float32 block-sized tensors per head the ring's backward holds at once

# a kernel call: (first global row, rows, first global column, columns)
Call = tuple[int, int, int, int]


def largest_rectangle(spec: MaskSpec, calls: Sequence[Call], padded: bool = False,
                      chunk_rows: int = CHUNK_ROWS) -> int:
    """The most ``rows x keys`` pairs one chunk of ``calls`` builds a mask for; 0 where every call
    runs without one (exactly causal and not ``padded``)."""
    most = 0
    for row0, rows, col0, cols in calls:
        if (not padded and spec.causal and spec.window is None and rows == cols
                and row0 + spec.diagonal == col0):
            continue  # is_causal: the kernel's own mask
        for r0 in range(0, rows, chunk_rows):
            r1 = min(rows, r0 + chunk_rows)
            lo, hi = spec.key_range((row0 + r0, row0 + r1), (col0, col0 + cols))
            most = max(most, (r1 - r0) * (hi - lo))
    return most


def _local(node: OpNode, k: int, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """Elements of input ``k`` on a rank."""
    info = node.input_infos[k]
    return info.numel / shard_divisor(info.shape, strategy.inputs[k], mesh_shape)


def _rank_calls(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> list[list[Call]]:
    """Each rank's kernel calls under ``strategy``: the rows in order (each rank its piece), the two
    balanced chunks, or a ring's blocks (each row chunk against each key chunk held, step by step);
    every key, or the ring's chunks of them."""
    q = node.input_infos[0]
    rows, cols, d = q.shape[-2], node.input_infos[1].shape[-2], q.ndim - 2
    if ring_of(strategy.variant) is not None:
        n, balanced = mesh_shape[ring_axis(node, strategy)], ring_of(strategy.variant) == RING_BALANCED
        size, steps = rows // (2 * n if balanced else n), ring_steps(attention_mask_of(node), rows, n, balanced)
        return [[(a * size, size, b * size, size) for t in range(steps + 1) for a in ring_chunks(r, n, balanced)
                 for b in ring_chunks((r - t) % n, n, balanced)] for r in range(n)]
    if strategy.variant == BALANCED:
        n = mesh_shape[rows_axis(node, strategy)]
        size = rows // (2 * n)
        return [[(c * size, size, 0, cols) for c in rank_chunks(r, n)] for r in range(n)]
    pieces = 1
    for p, n in zip(strategy.inputs[0], mesh_shape):
        if p.is_shard and p.dim == d:
            pieces *= n
    size = rows // pieces
    return [[(r * size, size, 0, cols)] for r in range(pieces)]


def working_bytes(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """Bytes the busiest rank's largest masked kernel call holds at once (module docstring); 0 for
    a node that is not attention under a description, or one that runs without a built mask."""
    spec = attention_mask_of(node)
    if spec is None or not strategy.inputs or any(p is None for p in strategy.inputs[:3]):
        return 0.0
    split = any(p.is_shard and p.dim == node.input_infos[0].ndim - 2 for p in strategy.inputs[0])
    if node.target == CAUSAL and not split:
        return 0.0  # is_causal as traced: the kernel's own mask
    padded = node.target == MASKED and len(node.inputs) > 3 and strategy.inputs[3] is not None
    pad_rows = _local(node, 3, strategy, mesh_shape) / node.input_infos[3].shape[-1] if padded else 1.0
    pairs = max(largest_rectangle(spec, calls, padded) for calls in _rank_calls(node, strategy, mesh_shape))
    element = dtype_bytes(node.input_infos[0].dtype)
    if ring_of(strategy.variant) is None:
        return pairs * pad_rows * (1 + element)
    q = node.input_infos[0]
    rank_rows = q.shape[-2] // mesh_shape[ring_axis(node, strategy)]
    heads = _local(node, 0, strategy, mesh_shape) / (rank_rows * q.shape[-1])  # batch x heads on a rank
    return pairs * (heads * RING_BLOCK_SCORES * max(element, 4) + 2 * pad_rows)

