"""Uneven splits: a dim whose units (heads, vocabulary rows) do not divide over the ranks.

A model with 20 heads on 8 ranks cannot split its heads evenly, and a plain split of the
``(T, 20 * 64)`` projection output hands a rank two and a half heads, which the head view then
cannot keep split. An **uneven split** ``S(d)~g`` (:class:`autotp.placement.Placement`) deals
whole units of ``g`` elements instead: ``ceil(20 / 8) = 3`` heads to each rank in order, two on
the seventh, none on the last. Every tensor a choice splits is cut into the same units, so an
op that is exact on even pieces (it never mixes positions along the dim: elementwise ops, views,
the features of a matmul, attention's heads) is exact on these: its choice with ``u`` units
gives each tensor it splits the grain ``size / u``, the head view ``(T, 1280) -> (T, 20, 64)``
going from grain 64 to grain 1.

Which unit counts are tried (:func:`unit_counts`): the sizes a view splits a larger dim into
(heads, kv heads) and the dims of parameters (a vocabulary, an odd ffn), where the ranks do not
divide them. Which ops take them (:func:`uneven_choices`): the families above, with their own
rules asked with evenness relaxed (:func:`autotp.planning.rules.common.relaxed`); ops whose arguments count positions along
the dim (a slice of the split dim, cuts into blocks) and a mean over the split dim (each rank's share of it is
uneven) do not. The slowest rank's piece sets the time (:func:`autotp.placement.shard_divisor`).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Callable, Optional

from autotp import ops
from autotp.placement import Placement
from autotp.planning.rules.common import AxisChoice, relaxed
from autotp.tracing.graph import PARAMETER, OpGraph, OpNode

__all__ = ["unit_counts", "takes_uneven", "uneven_choices"]

# ops whose rules may be asked with evenness relaxed: their splits never read positions along the dim
_RULE_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default",
    "aten.embedding.default", "aten.scaled_dot_product_attention.default", "autotp.masked_attention.default",
    "aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default",
    "aten.layer_norm.default", "aten.rms_norm.default", "aten.sum.dim_IntList", "aten.sum.default",
    "aten.mean.dim", "aten.mean.default", "aten.cat.default", "aten.stack.default",
})
_VIEWS_WITHOUT_POSITIONS = frozenset({
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.transpose.int",
    "aten.t.default", "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.expand.default", "aten.select.int", "getitem", "aten.flatten.using_ints",
    "aten.view_as_complex.default", "aten.view_as_real.default", "aten.slice.Tensor",
})

_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, tuple[int, ...]]]" = weakref.WeakKeyDictionary()


def unit_counts(graph: OpGraph, n: int) -> tuple[int, ...]:
    """The unit counts uneven splits are tried with on an axis of ``n`` ranks: static sizes ``u``
    that ``n`` does not divide, where a view splits a larger dim into ``u`` parts (the heads of a
    ``(T, H * hd)`` projection) or a parameter has a dim of ``u`` >= ``4 n`` (a vocabulary)."""
    per_graph = _CACHE.setdefault(graph, {})
    if n in per_graph:
        return per_graph[n]
    from autotp.planning.rules.views import dim_map

    found: set[int] = set()
    for node in graph.nodes:
        if node.is_placeholder:
            if node.role == PARAMETER and not graph.symbolic.get(node.name):
                found.update(s for s in node.output.shape if s >= 4 * n and s % n)
            continue
        if node.target not in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
            continue
        if graph.symbolic.get(node.name) or graph.symbolic.get(node.inputs[0]):
            continue
        mapping = dim_map(node) or {}
        ins, out = node.input_infos[0].shape, node.output.shape
        for o, i in mapping.items():
            small, large = sorted((ins[i], out[o]))
            if small != large and small >= 2 and small % n and large % small == 0:
                found.add(small)
    per_graph[n] = tuple(sorted(found))
    return per_graph[n]


def takes_uneven(node: OpNode) -> bool:
    """Whether ``node``'s rule may be asked for uneven splits (see the module docstring); the cuts
    (split, chunk, a slice) are among them: a cut of blocked pieces into the blocks keeps whole units."""
    if node.is_placeholder:
        return node.role == PARAMETER
    t = node.target
    if len(node.outputs) != 1 and t != "aten.split.Tensor" and t != "aten.chunk.default":
        return False
    return t in _RULE_OPS or t in ops.POINTWISE or t in _VIEWS_WITHOUT_POSITIONS or t in (
        "aten.split.Tensor", "aten.chunk.default", "aten.split_with_sizes.default")


def uneven_choices(node: OpNode, n: int, units: tuple[int, ...], rule: Callable[[], list[AxisChoice]],
                   static: Callable[[int, int], bool]) -> list[AxisChoice]:
    """The uneven twins of ``rule``'s choices (asked within :func:`relaxed`): for each unit count of
    ``units`` that divides every dim a choice splits (each block of a blocked split), the choice
    with each split in those units. A cut of blocked pieces into the blocks (:mod:`.blocks`) is
    exact on whole units of every block as on even pieces of each.
    ``static(k, d)``: whether dim ``d`` of tensor ``k`` (the inputs in order, then the output) has a
    static size; an uneven split needs one (its pieces are fixed at build time)."""
    if not units or not takes_uneven(node):
        return []
    with relaxed():
        choices = rule()
    infos = [*node.input_infos, node.outputs[0]]
    out: list[AxisChoice] = []
    for inputs, output in choices:
        placed = [(k, p) for k, p in enumerate((*inputs, output)) if p is not None and p.is_shard]
        if not placed or any(p.is_uneven or p.is_unequal for _, p in placed):
            continue
        if output.is_partial and node.target in ops.MEAN:
            continue  # each rank's mean would need its own share of the divisor
        if node.target == "aten.slice.Tensor" and any(
                p.dim == node.args.int("dim", node.input_infos[0].ndim) for _, p in placed):
            continue  # a slice along the split dim counts positions in it
        sizes = [infos[k].shape[p.dim] // p.blocks for k, p in placed]  # of one block where blocked
        if not all(static(k, p.dim) for k, p in placed):
            continue
        for u in units:
            if u % n == 0 or any(s % u for s in sizes):
                continue
            grains = {k: s // u for (k, _), s in zip(placed, sizes)}

            def uneven(k: int, p: Optional[Placement]) -> Optional[Placement]:
                return replace(p, grain=grains[k]) if k in grains else p

            choice = (tuple(uneven(k, p) for k, p in enumerate(inputs)), uneven(len(inputs), output))
            if choice not in out:
                out.append(choice)
    return out
