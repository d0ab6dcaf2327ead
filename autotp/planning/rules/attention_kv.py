"""Keys and values repeated for the query heads, and the ring variants that pass them around unrepeated.

Models with fewer key/value heads than query heads (grouped-query attention: Llama, Qwen2, Mistral)
repeat each key/value head for its ``g`` query heads before the attention, as Hugging Face's
``repeat_kv`` does: ``k[:, :, None].expand(b, h_kv, g, s, d).reshape(b, h_kv * g, s, d)``. A ring
(:mod:`autotp.local.ring`) that passes those repeated chunks around sends ``g`` times the bytes it
needs. :func:`kv_repeat` finds the repeat in the graph (an ``unsqueeze`` after the heads dim, an
``expand`` of it to ``g``, a view that merges the two dims, read by the attention alone, for the
keys and the values alike), and the ring variants then carry it in their name (``"ring/kv4"``,
``"ring_balanced/kv4"``: :func:`with_kv_group`). Their local execution copies every ``g``-th head
of the rank's repeated chunk out (the heads it was repeated from: the ring keeps that copy for its
backward, and the repeated chunk is freed after the forward) and runs the ring with ``g`` query
heads to a key/value head, which the ring computes as the attention's own grouping; their shifts
and chunks in flight are priced at ``1/g`` of the repeated bytes. The kept keys and values are
still counted at the repeated size (an upper bound).

Exact in the forward and the backward: the heads taken are the unrepeated tensor's values, and
the gradient the ring returns for each is the sum over its ``g`` query heads, which is what the
repeat's backward sums into the unrepeated tensor; the heads not taken get zero. The variant is
offered only where the attention alone reads the repeated tensor: another reader would keep the
repeated chunk alive beside the copies, past the memory counted for it. A rank must hold whole
groups of heads (the heads it holds, where another axis splits them, a multiple of ``g``), or the
variant is not offered.

>>> ring_of("ring/kv4"), ring_of("ring_balanced"), ring_of("balanced"), kv_group("ring/kv4"), kv_group("ring")
('ring', 'ring_balanced', None, 4, 1)
>>> with_kv_group("ring_balanced", 4), with_kv_group("ring", 1)
('ring_balanced/kv4', 'ring')
"""

from __future__ import annotations

from typing import Optional, Sequence

from autotp.placement import Strategy
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["RING", "RING_BALANCED", "RINGS", "ring_of", "kv_group", "with_kv_group", "kv_repeat", "holds_whole_groups"]

RING = "ring"
RING_BALANCED = "ring_balanced"
RINGS = (RING, RING_BALANCED)
_KV = "/kv"
_VIEWS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")


def ring_of(variant: str) -> Optional[str]:
    """The ring a variant runs (``"ring"`` or ``"ring_balanced"``), whatever its key/value grouping;
    None for a variant that is no ring."""
    base = variant.partition(_KV)[0]
    return base if base in RINGS else None


def kv_group(variant: str) -> int:
    """How many query heads share each key/value head the ring passes around (1: as the op reads them)."""
    _, _, group = variant.partition(_KV)
    return int(group) if group else 1


def with_kv_group(variant: str, group: int) -> str:
    """The ring variant ``variant`` passing its keys and values unrepeated, ``group`` query heads to each."""
    return variant if group == 1 else f"{variant}{_KV}{group}"


def kv_repeat(graph: Optional[OpGraph], node: OpNode) -> int:
    """``g`` where the attention ``node`` reads keys and values each repeated ``g`` times along the
    heads (module docstring), the same ``g`` for both; 1 otherwise (or without a graph)."""
    if graph is None or len(node.inputs) < 3 or node.args.get("enable_gqa"):
        return 1
    groups = {_repeat_of(graph, node, index) for index in (1, 2)}
    return groups.pop() if len(groups) == 1 else 1


def _repeat_of(graph: OpGraph, node: OpNode, index: int) -> int:
    name = node.inputs[index]
    view = graph[name]
    if str(view.target) not in _VIEWS or tuple(graph.consumers(name)) != (node.name,):
        return 1
    expand = graph[view.inputs[0]]
    if str(expand.target) == "aten.clone.default":
        expand = graph[expand.inputs[0]]
    if str(expand.target) != "aten.expand.default" or not expand.inputs:
        return 1
    unsqueeze = graph[expand.inputs[0]]
    out, wide = view.outputs[0].shape, expand.outputs[0].shape
    heads = len(out) - 3  # (..., heads, rows, features)
    if str(unsqueeze.target) != "aten.unsqueeze.default" or len(wide) != len(out) + 1 or heads < 0:
        return 1
    if int(unsqueeze.args.get("dim", -1)) % len(wide) != heads + 1:
        return 1
    one = unsqueeze.outputs[0].shape
    group = wide[heads + 1]
    if one[heads + 1] != 1 or tuple(one[:heads + 1]) + tuple(one[heads + 2:]) != tuple(wide[:heads + 1]) + tuple(
            wide[heads + 2:]):
        return 1
    merged = tuple(wide[:heads]) + (wide[heads] * group,) + tuple(wide[heads + 2:])
    return group if tuple(out) == merged and group > 1 else 1


def holds_whole_groups(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int], group: int) -> bool:
    """Whether every rank holds whole groups of ``group`` repeated heads of the keys and values under
    ``strategy``: the heads evenly split on the other axes (if at all) into pieces of a multiple of ``group``."""
    heads_dim = node.input_infos[1].ndim - 3
    heads = node.input_infos[1].shape[heads_dim]
    if strategy.inputs[1] != strategy.inputs[2]:
        return False
    pieces = 1
    for p, n in zip(strategy.inputs[1], mesh_shape):
        if p.is_shard and p.dim == heads_dim:
            if p.is_uneven or p.is_blocked:
                return False
            pieces *= n
    return heads % pieces == 0 and (heads // pieces) % group == 0
