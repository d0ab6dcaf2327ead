"""Whole experts with the tokens split: routed rows sent to their experts' ranks by all-to-all.

The variant of the expert split (:mod:`autotp.planning.rules.experts`) in which the tokens are split
over the same mesh axis as the experts (as DeepSeek-V3 and torchtitan lay it out: the expert axis
borrows the batch or sequence split). Each rank routes its own tokens, sorts its routed rows by
expert and counts them, sends each row to the rank holding its expert (all-to-all), runs its
experts on the rows it received, sends the results back (all-to-all), weighs them and sums each
token's ``k`` rows, its tokens staying split. Dropless: every row reaches its expert.

It is a **region** of the graph, found from its ops and shapes (:func:`routed_region`): two grouped
matmuls split by experts that read one offsets node, the sort of the routed expert ids those
offsets count, and the rows put back in token order and summed over ``k``
(``view (T, k, N)`` then ``sum`` over dim 1: the exit). Its values on a rank are what the model
computes from that rank's tokens alone (placement ``St``, :mod:`autotp.placement`): every op between
runs as it is on them (sizes made local), the counts are the rank's own (``Pt``: summed over the
ranks, the whole batch's), and the rows between the two grouped matmuls are those routed to this
rank's experts (``Se``). The first grouped matmul sends the rows and the second sends them back
(:mod:`autotp.local.dispatch`). A per-expert table gathered by the sorted expert ids
(:func:`autotp.planning.rules.experts.expert_table_gathers`: gpt-oss's biases) follows the rows:
added between the grouped matmuls it is ``Se``, the table split ``S(0)`` with the weights and each
received row given its expert's row on the expert's rank (:func:`local_table_rows`); added after the
combine it is ``St``, the table read whole (``R``) on the tokens' rank. The exit is exact as ``S(0)`` of the tokens because each token's
output depends on its own rows alone (dropless routing, each row through its own expert, the rows
put back where they came from). A value of the region read outside it, another op in it (a
capacity limit that drops rows by what other tokens chose), or shapes that do not split evenly:
no region, nothing offered.

The routed rows sit on one mesh axis. Another axis may split each expert by its features as
Megatron splits one MLP (expert x tensor parallelism): every op of the region takes its usual
choices there (the first grouped matmul's weight by output features, the second's by input
features, a partial sum), and runs as it is on the columns it holds; the all-to-alls move a rank's
columns of its rows (a partial sum over the other axis moves whole rows, summed after they are
back). The rows' dim is never split by a second axis.

Costs: the grouped matmuls and the ops between at the busiest rank's received rows
(:func:`autotp.planning.rules.experts.busiest_rows`); two all-to-alls of rows forward (the
dispatch sized by the busiest rank's rows of the first grouped matmul's input, the combine by its
rows of the second's output), the same two backward, and one all-to-all of ``E`` counts
(:func:`routed_collectives`), each row at the bytes a rank holds of it; the received rows the first
grouped matmul keeps for its backward (:func:`routed_kept_bytes`).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional, Sequence

from autotp import ops
from autotp.local.dispatch import CombinedGroupedMM, DispatchedGroupedMM, ExpertRoutes, ExpertTableRows
from autotp.local.site import Call, LocalSite
from autotp.placement import Placement, Pt, R, S, Se, St, Strategy, shard_divisor
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.planning.rules.experts import GROUPED_MM, SORTS, busiest_rows, expert_split, expert_table_gathers
from autotp.planning.rules.views import SPLITS
from autotp.tracing.aliasing import writes_first_argument
from autotp.tracing.graph import OP, OpGraph, OpNode

__all__ = ["routed_region", "routed_choices", "routed_work_divisor", "routed_collectives", "routed_kept_bytes",
           "COUNT_BYTES", "LOCAL"]

COUNT_BYTES = 8  # each rank's count of rows per expert, exchanged as int64

_ROLE_PLACEMENT = {"t": St, "e": Se, "p": Pt, "x": S(0)}
_SUM = "aten.sum.dim_IntList"
_SLICE = "aten.slice.Tensor"
_GATHER = "aten.index.Tensor"
_ARANGE = "aten.arange.default"
_REGIONS: "weakref.WeakKeyDictionary[OpGraph, Mapping[str, tuple[str, int, int]]]" = weakref.WeakKeyDictionary()


def _passes_rows(node: OpNode, held: set[str]) -> bool:
    """An op between the grouped matmuls that keeps each row to itself: one tensor elementwise, a
    cut or a slice of the last dim (gpt-oss's ``x[..., ::2]``), an item of a cut, or two such rows
    combined elementwise, in place or not."""
    if node.target == "getitem" or node.target in ops.CASTS:
        return True
    if node.target in SPLITS or node.target == _SLICE:
        return node.args.get("dim", 0) in (-1, node.input_infos[0].ndim - 1)
    in_place = writes_first_argument(node.target)  # out.add_(bias): the op of out-of-place form
    target = node.target.replace("_.", ".", 1) if in_place else node.target
    return target in ops.POINTWISE and all(i in held for i in node.inputs)


def _ancestors(graph: OpGraph, name: str) -> set[str]:
    seen, stack = set(), [name]
    while stack:
        for i in graph[stack.pop()].inputs:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def _one_region(graph: OpGraph, first: OpNode, second: OpNode) -> Optional[dict[str, tuple[str, int, int]]]:
    """The roles of the nodes of the region around two grouped matmuls of one offsets node, each
    with the region's routed rows and tokens."""
    offsets = graph[first.inputs[2]]
    tables = {g for g, o in expert_table_gathers(graph).items() if o == offsets.name}
    between = {first.name}
    for node in graph.nodes[graph.position(first.name) + 1:graph.position(second.name)]:
        if any(i in between for i in node.inputs):
            if not _passes_rows(node, between | tables):
                return None
            between.add(node.name)
    between |= {t for t in tables if any(c in between for c in graph.consumers(t))}  # a bias on the rows: with them
    if second.inputs[0] not in between or any(c not in between and c != second.name
                                              for b in between for c in graph.consumers(b)):
        return None
    counts, at = [], offsets  # up from the offsets: casts and a cumulative sum to the histogram
    while at.target != "aten.histc.default":
        if len(at.inputs) != 1 or at.target not in ops.CASTS | {"aten.cumsum.default"}:
            return None
        counts.append(at.name)
        at = graph[at.inputs[0]]
    counts.append(at.name)
    sort = next((graph[a] for a in sorted(_ancestors(graph, at.name), key=graph.position)
                 if graph[a].target in SORTS), None)
    if sort is None or sort.input_infos[0].ndim != 1:
        return None
    rows = sort.input_infos[0].shape[0]
    exit_ = next((n for n in graph.nodes[graph.position(second.name):] if n.target == _SUM
                  and n.input_infos[0].ndim == 3 and tuple(n.args["dim"]) == (1,)
                  and n.input_infos[0].shape[0] * n.input_infos[0].shape[1] == rows
                  and second.name in _ancestors(graph, n.name)), None)
    if exit_ is None:
        return None
    inside = {sort.name}
    for node in graph.nodes[graph.position(sort.name) + 1:graph.position(exit_.name) + 1]:
        if any(i in inside for i in node.inputs):
            inside.add(node.name)
    feeding = _ancestors(graph, exit_.name)
    if any(n != exit_.name and n not in feeding for n in inside) or not between <= inside:
        return None  # a value of the region read outside it
    tokens = exit_.outputs[0].shape[0]
    roles = {n: "t" for n in inside}
    roles.update({n: "e" for n in between})
    roles.update({n: "p" for n in counts})
    roles[exit_.name] = "x"
    for n in list(inside):
        for i in graph[n].inputs:
            if i not in roles and graph[i].target == _ARANGE and graph[i].output.shape == (rows,):
                roles[i] = "t"  # positions of the rows, made on each rank for its own
    return {n: (role, rows, tokens) for n, role in roles.items()}


def routed_region(graph: OpGraph) -> Mapping[str, tuple[str, int, int]]:
    """Node -> ``(role, rows, tokens)`` in a routed region (module docstring) of ``rows`` routed rows
    of ``tokens`` tokens; roles: ``"t"`` this rank's tokens' rows (``St``), ``"e"`` the rows routed
    to this rank's experts (``Se``), ``"p"`` this rank's counts (``P``), ``"x"`` the exit (``S(0)``
    of the tokens). Empty where the graph has none."""
    if graph in _REGIONS:
        return _REGIONS[graph]
    by_offsets: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        if expert_split(node):
            by_offsets.setdefault(node.inputs[2], []).append(node)
    roles: dict[str, tuple[str, int, int]] = {}
    for pair in by_offsets.values():
        if len(pair) == 2:
            found = _one_region(graph, *pair)
            if found is not None and not set(found) & set(roles):
                roles.update(found)
    _REGIONS[graph] = roles
    return roles


def routed_choices(node: OpNode, n: int, graph: OpGraph) -> list[AxisChoice]:
    """The one choice of a node of a routed region on an axis of ``n`` ranks: its region inputs in
    their roles' placements, a grouped matmul's weight split by experts ``S(0)``, any other input
    (the tokens, their routing: ``rows`` or ``tokens`` long) split by tokens ``S(0)``, the rank's
    own in order, a per-expert table ``S(0)`` where gathered for the experts' rows (``Se``) and ``R``
    where gathered for the rank's own rows; none where the tokens or the experts do not split evenly,
    or another input enters."""
    roles = routed_region(graph)
    if node.name not in roles or n == 1:
        return []
    role, rows, tokens = roles[node.name]
    if not divisible(tokens, n):
        return []
    table = node.name in expert_table_gathers(graph)
    inputs = []
    for k, i in enumerate(node.inputs):
        info = node.input_infos[k]
        if i in roles:
            inputs.append(_ROLE_PLACEMENT[roles[i][0]])
        elif (expert_split(node) and k == 1 or table and k == 0 and role == "e") and divisible(info.shape[0], n):
            inputs.append(S(0))  # the experts' weights, or their table gathered on their ranks
        elif table and k == 0 and role == "t":
            inputs.append(R)  # a table gathered for the rank's own rows: every expert's row
        elif graph[i].role == OP and info.ndim and info.shape[0] in (rows, tokens):
            inputs.append(S(0))
        else:
            return []
    return [(tuple(inputs), _ROLE_PLACEMENT[role])]


def _routed_axis(strategy: Strategy, axis: int) -> bool:
    return any(p is not None and p[axis].routed for p in (*strategy.inputs, strategy.output))


def routed_work_divisor(node: OpNode, strategy: Strategy, axis: int, n: int) -> Optional[float]:
    """Where ``strategy`` holds routed rows on ``axis``: ops on the rows routed to this rank's
    experts (``Se``: the grouped matmuls, the ops between) do the busiest rank's share; None elsewhere."""
    if not _routed_axis(strategy, axis):
        return None
    rows = [info.shape[0] for p, info in zip((*strategy.inputs, strategy.output), (*node.input_infos, node.outputs[0]))
            if p is not None and p[axis] == Se]
    if not rows:
        return float(n)
    return rows[0] / busiest_rows(rows[0], n)


def _row_bytes(info: Any, placements: Sequence[Placement], mesh_shape: Sequence[int], axis: int) -> float:
    """Bytes of one row as a rank holds it: the row's other dims cut by the other mesh axes (the
    experts' features split over a second axis: a piece of each row moves, or a partial sum of all of it)."""
    others = [R if a == axis else p for a, p in enumerate(placements)]
    return info.nbytes / info.shape[0] / shard_divisor(info.shape, others, mesh_shape)


def routed_collectives(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int],
                       train: bool = True) -> list[tuple[str, str, int, float]]:
    """``(kind, phase, axis, bytes)`` of the all-to-alls a grouped matmul of a routed region runs
    inside itself: the dispatch (``St`` rows in, ``Se`` out) exchanges the counts, then sends the
    rows; the combine (``Se`` in, ``St`` out) sends the results back. Each rows' all-to-all is
    sized by the busiest rank's rows and runs again in the backward (the gradients' way back)."""
    if not expert_split(node):
        return []
    out: list[tuple[str, str, int, float]] = []
    for a, n in enumerate(mesh_shape):
        x, o = strategy.inputs[0][a], strategy.output[a]
        if (x, o) == (St, Se):
            info, placements = node.input_infos[0], strategy.inputs[0]
            out.append(("all_to_all", "forward", a, float(node.input_infos[1].shape[0] * COUNT_BYTES)))
        elif (x, o) == (Se, St):
            info, placements = node.outputs[0], strategy.output
        else:
            continue
        size = busiest_rows(info.shape[0], n) * _row_bytes(info, placements, mesh_shape, a)
        out.append(("all_to_all", "forward", a, size))
        if train:
            out.append(("all_to_all", "backward", a, size))
    return out


def routed_kept_bytes(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """Bytes the dispatching grouped matmul keeps for its backward beside its own output: the
    received rows (the busiest rank's), which its weight's gradient reads."""
    if not expert_split(node):
        return 0.0
    info = node.input_infos[0]
    return sum(busiest_rows(info.shape[0], n) * _row_bytes(info, strategy.inputs[0], mesh_shape, a)
               for a, n in enumerate(mesh_shape) if (strategy.inputs[0][a], strategy.output[a]) == (St, Se))


def _axis(site: LocalSite) -> Optional[int]:
    axes = [a for a in range(len(site.mesh_shape)) if _routed_axis(site.strategy, a)]
    if len(axes) > 1:
        raise ValueError(f"node {site.node.name}: routed rows on mesh axes {axes}; one axis at most")
    return axes[0] if axes else None


def _routes(site: LocalSite, offs: Any, experts: int, a: int) -> Any:
    """The routes of the rows ``offs`` counts (:class:`ExpertRoutes`), made once per offsets node:
    the grouped matmuls and the tables gathered for their rows read the same."""
    routes = getattr(offs, "meta", {}).get("autotp_routes")
    if routes is None:
        routes = site.call_module(ExpertRoutes(experts, site.mesh_shape[a], site.groups[a]), "expert_routes", (offs,))
        if hasattr(offs, "meta"):
            offs.meta["autotp_routes"] = routes
    return routes


def local_routed(site: LocalSite) -> Optional[Any]:
    """A grouped matmul of a routed region: the dispatch (rows sent, this rank's experts run) or the
    combine (this rank's experts run, rows sent back). None for any other split."""
    a = _axis(site)
    if a is None or not expert_split(site.node):
        return None
    x, weight, offs = site.args[:3]
    group = site.groups[a]
    routes = _routes(site, offs, site.node.input_infos[1].shape[0], a)
    if site.strategy.output[a] == Se:
        return site.call_module(DispatchedGroupedMM(site.target, group), "dispatched_grouped_mm", (x, weight, routes))
    return site.call_module(CombinedGroupedMM(site.target, group), "combined_grouped_mm", (x, weight, routes))


def local_positions(site: LocalSite) -> Optional[Call]:
    """``arange(rows)`` made ``St``: this rank's rows numbered from 0 (positions in its own rows)."""
    a = _axis(site)
    if a is None:
        return None
    end = site.node.output.shape[0] // site.mesh_shape[a]
    return site.called(args=(end, *site.args[1:]))


def local_table_rows(site: LocalSite) -> Optional[Any]:
    """A per-expert table gathered for the rows routed to this rank's experts (``Se``: a bias added
    between the grouped matmuls): each received row's expert's row of this rank's part of the table
    (:class:`ExpertTableRows`). None for any other gather."""
    a = _axis(site)
    if a is None or site.strategy.output[a] != Se or site.graph is None:
        return None
    offsets = expert_table_gathers(site.graph)[site.node.name]
    routes = _routes(site, site.value(offsets), site.node.input_infos[0].shape[0], a)
    return site.call_module(ExpertTableRows(), "expert_table_rows", (site.args[0], routes))


LOCAL = {**{name: local_routed for name in sorted(GROUPED_MM)}, _ARANGE: local_positions, _GATHER: local_table_rows}
