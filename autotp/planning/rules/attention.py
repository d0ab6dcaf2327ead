"""Attention under a described mask (``autotp::masked_attention``) and causal attention split by
query rows: each rank builds the mask of its own rows.

:mod:`autotp.tracing.masks` replaces an ``(S_q, S_k)`` mask tensor proven causal, windowed and/or
padded by its description (:class:`autotp.masks.MaskSpec`). Attention is independent
across the batch and the heads, and each query row reads the keys on its own: the rules split
either, or the query rows with the keys and values whole, for the described op and for
``scaled_dot_product_attention(..., is_causal=True)`` alike. A rank holding rows ``r0 .. r1`` of
the queries runs the op with ``row_offset = r0`` (:func:`local_rows`), so its mask is the block of
its rows: nothing of the mask crosses ranks. Its work is the mask's pairs in its rows, so a causal
attention split by rows in order is priced at its busiest (last) rank's share
(:func:`attention_work_divisor`), not at ``1/n``.

**Balanced rows** (strategy variant ``"balanced"``, :func:`balanced_variants`): the same placements
as the row split of a causal attention without a window (queries and output ``S`` of the sequence
on one mesh axis, keys and values whole), but rank ``r`` computes the rows of chunks ``r`` and
``2n - 1 - r`` of ``2n`` equal chunks, every rank the same pairs (:mod:`autotp.local.attention`):
priced at the busiest rank's pairs of its two chunks (the mean, for a causal mask), plus two
all-to-alls of the rank's rows forward (its queries out, their outputs back) and two backward
(:func:`attention_collectives`). Offered where the rows cut into ``2n`` chunks, beside the plain
row split: the planner takes whichever prices lower.

**The ring** (variant ``"ring"``, :func:`ring_variants`): the row split with the keys and values
split on the same axis (as many keys as queries; the padding vector whole), run by
:class:`autotp.local.ring.RingAttention`, which passes each rank's key/value chunk around the ranks.
Priced at the busiest rank's pairs, as the rows in order; its shifts are its inner collectives
(:func:`attention_collectives`), run while it computes (:func:`overlapped_collectives`: the op costs the
longer of the two), and its chunks in flight are a transient of its backward
(:func:`ring_transient_bytes`). Not offered under dropout.

**The balanced ring** (variant ``"ring_balanced"``): the ring's placements, offered beside it where
balanced rows are (a causal mask without a window, rows in ``2n`` equal chunks); inside, q, k and v
are exchanged for chunks ``r`` and ``2n - 1 - r`` (one all-to-all), the ring runs on those and the
output goes home (one all-to-all; the gradients the same two backward). Priced at the mean pairs,
as balanced rows, its shifts under that work as the ring's and its two exchanges each way on top
(:func:`attention_collectives`, :func:`overlapped_collectives`); its memory is the ring's.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from autotp.local.attention import BalancedRows, rank_chunks
from autotp.local.ring import RingAttention, ring_steps
from autotp.local.site import Call, LocalSite
from autotp.masks import MASKED_ATTENTION, MaskSpec, spec_of
from autotp.placement import R, S, Strategy, shard_divisor
from autotp.planning.rules.attention_kv import (RING, RING_BALANCED, RINGS, holds_whole_groups, kv_group, kv_repeat,
                                                ring_of, with_kv_group)
from autotp.planning.rules.common import AxisChoice, divisible, is_relaxed
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["MASKED", "CAUSAL", "BALANCED", "RING", "RING_BALANCED", "RINGS", "masked_choices", "attention_mask_of",
           "attention_work_divisor", "balanced_variants", "ring_variants", "attention_collectives",
           "ring_transient_bytes", "overlapped_collectives", "rows_axis", "ring_axis", "RULES", "LOCAL"]

MASKED = str(MASKED_ATTENTION)
CAUSAL = "aten.scaled_dot_product_attention.default"
BALANCED = "balanced"
EXCHANGED = (BALANCED, *RINGS)  # the variants whose local execution is a module of their own


def _base(variant: str) -> str:
    """The variant without its key/value grouping (:mod:`autotp.planning.rules.attention_kv`)."""
    return ring_of(variant) or variant


def attention_mask_of(node: OpNode) -> Optional[MaskSpec]:
    """The mask an attention node computes under, where it is a description: the described op's,
    or ``MaskSpec()`` for ``is_causal=True``; None for any other node."""
    if node.target == MASKED:
        return spec_of(node.args)
    if node.target == CAUSAL and node.args.get("is_causal", False):
        return MaskSpec()
    return None


def masked_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """q, k, v (and the padding vector): the batch, the heads, or the query rows with keys whole."""
    q, k = node.input_infos[0], node.input_infos[1]
    padded = len(node.inputs) > 3
    choices: list[AxisChoice] = [((R,) * len(node.inputs), R)]
    for d in range(q.ndim - 2):
        if divisible(q.shape[d], n) and divisible(k.shape[d], n):
            # the padding vector (B, S_k) splits with the batch (where it is not one row for all)
            pad = (S(0) if d == 0 and node.input_infos[3].shape[0] == q.shape[0] else R,) if padded else ()
            choices.append(((S(d), S(d), S(d), *pad), S(d)))
    d = q.ndim - 2
    if not is_relaxed() and divisible(q.shape[d], n):  # rows read their positions: never cut unevenly
        choices.append(((S(d), R, R, *((R,) if padded else ())), S(d)))
    return choices


def _row_offset(site: LocalSite) -> Optional[Any]:
    """Where this rank's query rows start in the whole: an int, or, where the rows' dim is dynamic,
    the graph's value of the rank's local rows times the pieces before it (the split is even, so
    that is its start at any length a call brings, not the traced one's)."""
    d = site.node.input_infos[0].ndim - 2
    start, stop = site.piece(0, d)
    if (start, stop) == (0, site.node.input_infos[0].shape[d]):
        return None
    dims = (site.graph.symbolic.get(site.node.inputs[0]) or ((),))[0] if site.graph is not None else ()
    if len(dims) <= d or dims[d] is None:
        return start
    rows = site.call(torch.ops.aten.sym_size.int, (site.args[0], d))
    return site.call(operator.mul, (rows, start // (stop - start)))


def local_rows(site: LocalSite) -> Optional[Any]:
    """The described op on a rank's rows of the queries: its mask placed by the rows' offset (or,
    balanced, the rows of two chunks exchanged: :func:`local_exchanged`)."""
    if _base(site.strategy.variant) in EXCHANGED:
        return local_exchanged(site)
    start = _row_offset(site)
    return None if start is None else site.called().with_argument("row_offset", start)


def local_exchanged(site: LocalSite) -> Any:
    """Attention whose strategy is balanced rows or a ring: :class:`autotp.local.attention.BalancedRows`
    or :class:`autotp.local.ring.RingAttention` (balanced for the balanced ring) on the mesh axis that
    splits the rows, called with the queries, keys, values (and padding)."""
    names = [a.name for a in site.target._schema.arguments]
    given = {**dict(zip(names, site.args)), **site.kwargs}
    if site.node.target == MASKED:
        q, k, v, padding = (given[a] for a in names[:4])
    else:
        (q, k, v), padding = (given[a] for a in ("query", "key", "value")), None
    spec, rows = attention_mask_of(site.node), site.node.input_infos[0].shape[-2]
    ring = ring_of(site.strategy.variant)
    if ring is not None:
        axis, group = ring_axis(site.node, site.strategy), kv_group(site.strategy.variant)
        if group > 1:  # the heads the keys and values were repeated from: every group's first, copied out
            heads_dim, heads = site.node.input_infos[1].ndim - 3, site.node.input_infos[1].shape[-3]
            k, v = (site.call(torch.ops.aten.clone.default,
                              (site.call(torch.ops.aten.slice.Tensor, (t, heads_dim, 0, heads, group)),),
                              {"memory_format": torch.contiguous_format}) for t in (k, v))
        module = RingAttention(spec, given.get("scale"), rows, site.mesh_shape[axis], site.coordinate[axis],
                               site.groups[axis], site.axis_names[axis], balanced=ring == RING_BALANCED)
        return site.call_module(module, "ring_attention", (q, k, v, padding))
    axis = rows_axis(site.node, site.strategy)
    module = BalancedRows(spec, given.get("scale"), bool(given.get("enable_gqa", False)), rows,
                          site.mesh_shape[axis], site.coordinate[axis], site.groups[axis], site.axis_names[axis])
    return site.call_module(module, "balanced_attention", (q, k, v, padding))


def local_causal_rows(site: LocalSite) -> Optional[Any]:
    """``is_causal`` attention on a rank's rows of the queries: the described op with the rows'
    offset (``is_causal`` alone would place the mask from the rank's first row)."""
    if attention_mask_of(site.node) is None:
        return None
    if _base(site.strategy.variant) in EXCHANGED:
        return local_exchanged(site)
    start = _row_offset(site)
    if start is None:
        return None
    names = [a.name for a in site.target._schema.arguments]
    given = {**dict(zip(names, site.args)), **site.kwargs}
    return Call(MASKED_ATTENTION, (given["query"], given["key"], given["value"], None, True, None, 0),
                {"row_offset": start, "scale": given.get("scale"), "enable_gqa": bool(given.get("enable_gqa", False))})


def attention_work_divisor(node: OpNode, strategy: Strategy, axis: int, n: int) -> Optional[float]:
    """The whole mask's pairs over the busiest rank's, where ``strategy`` splits the query rows of a
    described or causal attention on ``axis`` (rows in ``n`` pieces in order); None otherwise."""
    spec = attention_mask_of(node)
    if spec is None or not strategy.inputs or strategy.inputs[0] is None:
        return None
    q, placement = node.input_infos[0], strategy.inputs[0][axis]
    if not (placement.is_shard and placement.dim == q.ndim - 2):
        return None
    rows, cols = q.shape[-2], node.input_infos[1].shape[-2]
    if _base(strategy.variant) in (BALANCED, RING_BALANCED):  # two chunks of rows each
        size = rows // (2 * n)
        busiest = max(sum(spec.pairs(size, cols, c * size) for c in rank_chunks(r, n)) for r in range(n))
    else:
        size = rows // n
        busiest = max(spec.pairs(size, cols, r * size) for r in range(n))
    return spec.pairs(rows, cols) / max(busiest, 1)


def rows_axis(node: OpNode, strategy: Strategy) -> Optional[int]:
    """The one mesh axis that splits the query rows, with keys and values whole and the output's
    rows split alike; None where no axis does, or more than one."""
    if not strategy.inputs or any(p is None for p in strategy.inputs[:3]):
        return None
    d = node.input_infos[0].ndim - 2
    axes = [a for a, p in enumerate(strategy.inputs[0]) if p.is_shard and p.dim == d]
    if len(axes) != 1:
        return None
    a = axes[0]
    whole = strategy.inputs[1][a].is_replicate and strategy.inputs[2][a].is_replicate
    return a if whole and strategy.output[a] == strategy.inputs[0][a] else None


def _exchangeable(node: OpNode) -> Optional[MaskSpec]:
    """The mask of an attention whose rows a variant may exchange: described or causal, no dropout,
    not under relaxed evenness; None otherwise."""
    spec = attention_mask_of(node)
    if spec is None or is_relaxed() or float(node.args.get("dropout_p") or 0.0) > 0:
        return None
    return spec


def _balances(node: OpNode, n: int) -> bool:
    """Whether an attention's rows may be computed balanced over ``n`` ranks: a causal mask without
    a window, rows that cut into ``2n`` equal chunks."""
    spec = _exchangeable(node)
    return spec is not None and spec.window is None and node.input_infos[0].shape[-2] % (2 * n) == 0


def balanced_variants(node: OpNode, strategies: Sequence[Strategy], mesh_shape: Sequence[int]) -> list[Strategy]:
    """The balanced rows of each of ``strategies`` that splits the query rows of a causal attention
    without a window on one mesh axis (keys, values whole) into ``2n`` equal chunks; none in
    relaxed evenness or under dropout."""
    if _exchangeable(node) is None:
        return []
    out = []
    for strategy in strategies:
        a = rows_axis(node, strategy)
        if a is not None and not strategy.variant and _balances(node, mesh_shape[a]):
            out.append(replace(strategy, variant=BALANCED))
    return out


def ring_variants(node: OpNode, strategies: Sequence[Strategy], mesh_shape: Sequence[int],
                  graph: Optional[OpGraph] = None) -> list[Strategy]:
    """The ring of each of ``strategies`` that splits the query rows of a described or causal
    attention on one mesh axis (keys, values whole), as many keys as queries: the keys and values
    split on that axis alike (:mod:`autotp.local.ring`); the padding vector stays whole. Where the
    rows balance (a causal mask without a window, ``2n`` equal chunks), the balanced ring too. Where
    ``graph`` shows the keys and values repeated for the query heads and a rank holds whole groups
    of them, each ring passes them unrepeated (:mod:`autotp.planning.rules.attention_kv`). None in
    relaxed evenness or under dropout."""
    if _exchangeable(node) is None or node.input_infos[1].shape[-2] != node.input_infos[0].shape[-2]:
        return []
    group = kv_repeat(graph, node)
    out = []
    for strategy in strategies:
        a = rows_axis(node, strategy)
        if a is None or strategy.variant:
            continue
        inputs = list(strategy.inputs)
        for k in (1, 2):
            inputs[k] = tuple(strategy.inputs[0][a] if b == a else p for b, p in enumerate(inputs[k]))
        ring = replace(strategy, inputs=tuple(inputs), variant=RING)
        g = group if group > 1 and holds_whole_groups(node, ring, mesh_shape, group) else 1
        rings = (RING, RING_BALANCED) if _balances(node, mesh_shape[a]) else (RING,)
        out += [replace(ring, variant=with_kv_group(r, g)) for r in rings]
    return out


def ring_axis(node: OpNode, strategy: Strategy) -> Optional[int]:
    """The mesh axis a ring strategy (either) passes keys and values around: the one that splits the
    rows of the queries, keys and values; None for any other strategy."""
    if ring_of(strategy.variant) is None or not strategy.inputs or any(p is None for p in strategy.inputs[:3]):
        return None
    d = node.input_infos[0].ndim - 2
    return next((a for a, p in enumerate(strategy.inputs[0]) if p.is_shard and p.dim == d), None)


def _ring_chunk_bytes(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """A rank's key and value chunks as the ring passes them (unrepeated, where its variant says), in bytes."""
    return _local_bytes(node, strategy, mesh_shape, (1, 2)) / kv_group(strategy.variant)


def _wide_ratio(node: OpNode) -> float:
    """The keys' gradients' bytes over the keys': the ring sums them in float32 at least."""
    info = node.input_infos[1]
    element = info.nbytes / max(info.numel, 1)
    return max(element, 4.0) / element


def _local_bytes(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int], inputs: Sequence[int]) -> float:
    """The rank's pieces of ``inputs`` (indices) together, in bytes."""
    return sum(node.input_infos[k].nbytes / shard_divisor(node.input_infos[k].shape, strategy.inputs[k], mesh_shape)
               for k in inputs)


def overlapped_collectives(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int],
                           train: bool = True) -> list[tuple[str, str, int, float]]:
    """The inner collectives (:func:`attention_collectives`) that run while the op computes, so
    that the op costs the longer of the two: a ring's shifts, each issued before the step's block and
    waited for after it. ``T`` shifts of the rank's key and value chunks forward
    (:func:`autotp.local.ring.ring_steps`); backward ``T`` of them again and ``T + 1`` of their
    gradients (float32), the last home. Each shift sends ``C`` bytes to one rank: it is listed as an
    all-to-all of ``C n / (n - 1)``, the buffer whose all-to-all sends ``C`` out of each rank, and
    priced so. None for any other strategy."""
    a = ring_axis(node, strategy)
    if a is None or attention_mask_of(node) is None:
        return []
    n = mesh_shape[a]
    steps = ring_steps(attention_mask_of(node), node.input_infos[0].shape[-2], n,
                       ring_of(strategy.variant) == RING_BALANCED)
    chunk = _ring_chunk_bytes(node, strategy, mesh_shape) * n / (n - 1)
    grads = chunk * _wide_ratio(node)
    out = [("all_to_all", "forward", a, chunk)] * steps
    if train and steps:
        out += [("all_to_all", "backward", a, chunk)] * steps + [("all_to_all", "backward", a, grads)] * (steps + 1)
    return out


def attention_collectives(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int],
                          train: bool = True) -> list[tuple[str, str, int, float]]:
    """``(kind, phase, axis, bytes)`` of the all-to-alls balanced rows or a ring run inside.

    Balanced rows: the rank's queries out and its outputs back forward; the outputs' and the
    queries' gradients backward. The ring: its shifts (:func:`overlapped_collectives`). The balanced
    ring: its shifts, and around them the rank's queries, keys and values out together and its
    outputs back forward, the outputs' gradients out and the queries', keys' and values' back
    backward, each one all-to-all of the rank's pieces."""
    if attention_mask_of(node) is None:
        return []
    phases = ("forward", "backward") if train else ("forward",)
    if ring_of(strategy.variant) is not None:
        shifts = overlapped_collectives(node, strategy, mesh_shape, train)
        if ring_of(strategy.variant) == RING or ring_axis(node, strategy) is None:
            return shifts
        a = ring_axis(node, strategy)
        qkv = _local_bytes(node, strategy, mesh_shape, (0,)) + _ring_chunk_bytes(node, strategy, mesh_shape)
        out = node.outputs[0].nbytes / shard_divisor(node.outputs[0].shape, strategy.output, mesh_shape)
        exchanges = {phase: [("all_to_all", phase, a, qkv), ("all_to_all", phase, a, out)] for phase in phases}
        return exchanges["forward"] + shifts + exchanges.get("backward", [])
    if strategy.variant != BALANCED:
        return []
    a = rows_axis(node, strategy)
    if a is None:
        return []
    sizes = [info.nbytes / shard_divisor(info.shape, placements, mesh_shape)
             for info, placements in ((node.input_infos[0], strategy.inputs[0]), (node.outputs[0], strategy.output))]
    return [("all_to_all", phase, a, size) for phase in phases for size in sizes]


def ring_transient_bytes(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """What the ring's backward holds beyond the tensors kept for it: the key and value chunk it
    computes with and the one arriving, and their float32 gradient accumulators, held and
    arriving; 0 for any other strategy."""
    a = ring_axis(node, strategy)
    if a is None:
        return 0.0
    chunk = _ring_chunk_bytes(node, strategy, mesh_shape)
    return 2 * chunk * (1 + _wide_ratio(node))


RULES = {MASKED: masked_choices}

LOCAL = {MASKED: local_rows, CAUSAL: local_causal_rows}
