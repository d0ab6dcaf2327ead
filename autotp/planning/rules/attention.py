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
"""

from __future__ import annotations

from typing import Any, Optional

from autotp.masks import MASKED_ATTENTION, MaskSpec, spec_of
from autotp.local.site import Call, LocalSite
from autotp.placement import R, S, Strategy
from autotp.planning.rules.common import AxisChoice, divisible, is_relaxed
from autotp.tracing.graph import OpNode

__all__ = ["MASKED", "CAUSAL", "masked_choices", "attention_mask_of", "attention_work_divisor", "RULES", "LOCAL"]

MASKED = str(MASKED_ATTENTION)
CAUSAL = "aten.scaled_dot_product_attention.default"


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


def _row_offset(site: LocalSite) -> Optional[int]:
    d = site.node.input_infos[0].ndim - 2
    start, stop = site.piece(0, d)
    return None if (start, stop) == (0, site.node.input_infos[0].shape[d]) else start


def local_rows(site: LocalSite) -> Optional[Any]:
    """The described op on a rank's rows of the queries: its mask placed by the rows' offset."""
    start = _row_offset(site)
    return None if start is None else site.called().with_argument("row_offset", start)


def local_causal_rows(site: LocalSite) -> Optional[Any]:
    """``is_causal`` attention on a rank's rows of the queries: the described op with the rows'
    offset (``is_causal`` alone would place the mask from the rank's first row)."""
    if attention_mask_of(site.node) is None:
        return None
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
    size = rows // n
    busiest = max(spec.pairs(size, cols, r * size) for r in range(n))
    return spec.pairs(rows, cols) / max(busiest, 1)


RULES = {MASKED: masked_choices}

LOCAL = {MASKED: local_rows, CAUSAL: local_causal_rows}
