"""Strategies: for every node of an OpGraph, the placements it can take on the mesh.

Rules are written for one mesh axis of size ``n`` (:func:`axis_choices`) and combined over the axes of
the mesh (:func:`node_strategies`): a strategy on a 2-axis mesh is one single-axis choice per axis,
kept when every sharded dim splits evenly (or, for an uneven split ``S(d)~g``, in whole units the
ranks do not divide: :mod:`autotp.planning.rules.uneven`) and no dim is split by two axes. A causal
attention whose query rows one axis splits is offered a second time as balanced rows (the same
placements, another local execution: :func:`autotp.planning.rules.attention.balanced_variants`) and as
a ring (the keys and values split alike: :func:`autotp.planning.rules.attention.ring_variants`).

Every rule here is one whose local execution is exact: running the op on each rank's shards (with
shape arguments rewritten to local shapes, and the masked lookup for a row-split embedding) gives
each rank its shard of the true output. That is what lets the rewrite run local tensors with only
the plan's collectives.

Where to find an op's rules: a rule the user registered (:func:`autotp.register_rule`) first,
then autotp's own (:mod:`autotp.planning.rules`, by op family), then DTensor's op-strategy registry
(:mod:`autotp.planning.choices.dtensor_rules`, the one module that reads DTensor internals, filtering the
registry's answer to what is exact on local shards); an op neither knows is run replicated,
with one warning per op kind. Own rules stay for the ops they cover because the registry's
versions of those do not fit a runtime that runs each aten op on local pieces, or miss options:
the row-split embedding is a ``_MaskPartial`` there; ``linear``, ``layer_norm``, ``softmax.int``,
``matmul`` and ``scaled_dot_product_attention`` exist there only as decompositions, slow to trace
(~0.1-0.5 s each) and, for causal attention, not traceable at all (its mask comes from a factory
op); views, ``expand`` and ``new_*`` factories carry shape arguments DTensor rewrites before
running them (autotp's rewrite does the same, from the rules here); a mean passes a pending sum
through here and not there. tests/planning/test_dtensor_rules.py compares the two lists for the ops both
know and pins the difference; every strategy from either source is checked exact on local shards
(tests/planning/test_strategies.py, tests/planning/test_dtensor_rules.py).

>>> import torch, autotp
>>> from autotp.planning.choices.strategies import node_strategies
>>> g = autotp.capture(torch.nn.Linear(4, 8, bias=False), (torch.randn(2, 4),))
>>> [str(s) for s in node_strategies(g, g.ops()[0], (2,))]
['(R, R) -> R', '(R, S(0)) -> S(1)', '(S(1), S(1)) -> P', '(S(0), R) -> S(0)', '(P, R) -> P']
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterable, Optional, Sequence

from autotp import ops
from autotp.placement import R, S, Strategy, dim_divisor
from autotp.planning.rules import BUILTIN, user_choices
from autotp.planning.rules.attention import balanced_variants, ring_variants
from autotp.planning.rules.blocks import (
    block_counts,
    blocked_variants,
    cut_choices,
    parameter_variants,
    slice_range,
    static_cut,
)
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.planning.rules.experts import disjoint_choices
from autotp.planning.rules.routed import routed_choices
from autotp.planning.rules.factories import factory_choices
from autotp.planning.rules.pointwise import pointwise_choices
from autotp.planning.rules.uneven import uneven_choices, unit_counts
from autotp.planning.rules.views import SPLITS, dim_map, split_choices, view_choices
from autotp.tracing.aliasing import storage_roots, writes_in_place
from autotp.tracing.graph import BUFFER, PARAMETER, OpGraph, OpNode

log = logging.getLogger(__name__)

__all__ = ["AxisChoice", "axis_choices", "node_strategies", "all_strategies", "stored_strategy"]


def _placeholder_choices(node: OpNode, n: int, graph: Optional[OpGraph] = None) -> list[AxisChoice]:
    """A parameter, and a buffer outside the state dict that the graph writes in place (a KV cache:
    each rank keeps the heads it reads), may be stored split; other buffers (the state dict holds
    them whole; a mask or frequencies only read, which code outside the graph may read too),
    constants and user inputs are replicated (R -> S is a free slice on the edge)."""
    if node.role == PARAMETER or (node.role == BUFFER and not node.persistent and graph is not None
                                  and node.name in written_buffers(graph)):
        shape = node.output.shape
        return [((), R)] + [((), S(d)) for d in range(len(shape)) if divisible(shape[d], n)]
    return [((), R)]


def written_buffers(graph: OpGraph) -> frozenset[str]:
    """The buffers of ``graph`` that an op writes into in place (through a view of them, too);
    found once per graph and kept on it."""
    found = graph.__dict__.get("_autotp_written_buffers")
    if found is None:
        root = storage_roots(graph)
        found = frozenset(root[n.inputs[0]] for n in graph.nodes
                          if writes_in_place(n) and graph[root[n.inputs[0]]].role == BUFFER)
        object.__setattr__(graph, "_autotp_written_buffers", found)  # a frozen dataclass: a cache, not a field
    return found


def _replicated(node: OpNode, n: int) -> list[AxisChoice]:
    return [((R,) * len(node.inputs), R)]


class _Warned:
    """Op kinds already warned about, per planning run (no global state)."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()


def _factory_or_all(node: OpNode) -> tuple:
    """Input slots of the replicated choice: None where the node reads only dtype and device."""
    return (None,) * len(node.inputs) if node.target in ops.FACTORY else (R,) * len(node.inputs)


def axis_choices(node: OpNode, n: int, warned: Optional[_Warned] = None,
                 graph: Optional[OpGraph] = None) -> list[AxisChoice]:
    """The single-axis choices of ``node`` on an axis of ``n`` ranks.

    An op no own rule covers is looked up in DTensor's registry (which needs ``graph``, the
    node's OpGraph, for the exported fx node); if that has nothing either, it runs replicated.
    With ``graph``, blocked splits are added where a cut downstream reads a dim in blocks
    (:mod:`autotp.planning.rules.blocks`), and sums of disjoint parts (``Pd``) where the node passes
    on the rows of experts placed whole on ranks (:mod:`autotp.planning.rules.experts`).
    """
    if n == 1:  # an axis of one rank: splitting across it changes nothing and only adds steps
        return [(tuple(None if c is None else R for c in _factory_or_all(node)), R)]
    registered = None if node.is_placeholder else user_choices(node, n)
    if registered is not None:
        return registered
    choices = _choices(node, n, warned, graph)
    if graph is None:
        return choices
    choices = choices + [c for c in disjoint_choices(node, n, graph) if c not in choices]
    choices = choices + [c for c in routed_choices(node, n, graph) if c not in choices]
    units = unit_counts(graph, n)

    def static(k: int, d: int) -> bool:
        return _static(graph, node, k, d)

    if units:
        choices = choices + [c for c in uneven_choices(node, n, units, lambda: _choices(node, n, None, graph), static)
                             if c not in choices]
    counts = block_counts(graph)
    plain = [c for c in choices if not any(p is not None and p.is_uneven for p in (*c[0], c[1]))]

    def blocked_choices() -> list[AxisChoice]:
        if node.is_placeholder:
            return parameter_variants(node, n, counts) if node.role == PARAMETER else []
        sliced = slice_range(node)
        static_dim = static_cut(node, graph) or sliced is not None and _static(graph, node, 0, sliced[0])
        extra = [c for c in cut_choices(node, n, counts) if c not in plain] if static_dim else []
        return extra + blocked_variants(node, n, plain, counts)

    blocked = blocked_choices()
    if units and counts:  # whole units of every block (25 heads of q, k and v over 8 ranks)
        blocked += [c for c in uneven_choices(node, n, units, blocked_choices, static) if c not in blocked and any(p is not None and p.is_blocked for p in (*c[0], c[1]))]
    return choices + blocked


def _choices(node: OpNode, n: int, warned: Optional[_Warned], graph: Optional[OpGraph]) -> list[AxisChoice]:
    """The choices of autotp's own rules, else DTensor's registry, else the replicated one."""
    if node.is_placeholder:
        return _placeholder_choices(node, n, graph)
    t = node.target
    if t in ops.FACTORY:
        return factory_choices(node, n)
    rule = BUILTIN.get(t)
    choices = rule(node, n) if rule is not None else None
    if choices is not None:
        return choices
    if len(node.outputs) == 1 and len(node.inputs) >= 1:
        if t in ops.POINTWISE:
            return pointwise_choices(node, n)
        mapping = dim_map(node, getattr(graph, "symbolic", None))
        if mapping is not None:
            return view_choices(node, n, mapping)
    if len(node.inputs) == 1 and t in SPLITS:
        return split_choices(node, n)
    if graph is not None:
        from autotp.planning.choices.dtensor_rules import registry_axis_choices  # imports torch.distributed.tensor

        choices = registry_axis_choices(graph, node, n)
        if choices is not None:
            return choices
    if all(info.numel <= 1 for info in (*node.input_infos, *node.outputs)):
        return _replicated(node, n)  # scalars only (a cache's position counter): nothing to split, nothing to warn of
    if warned is not None and t not in warned.kinds:
        warned.kinds.add(t)
        log.warning("autotp: no sharding rule for %s (first seen at node %s); it runs replicated", t, node.name)
    return _replicated(node, n)


def _static(graph: OpGraph, node: OpNode, k: int, d: int) -> bool:
    """Whether dim ``d`` of ``node``'s ``k``-th tensor (its inputs in order, then its output) has a
    static size."""
    name = node.inputs[k] if k < len(node.inputs) else node.name
    expressions = graph.symbolic.get(name)
    return not expressions or expressions[0][d] is None


def _valid(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim splits evenly over the axes that split it (or, for an uneven split, into
    whole units the ranks do not divide), and no dim is split twice; routed rows (``St``, ``Se``,
    ``Pt``) on one axis. The other axes may split what the rows do not (the experts' features: the
    rows' last dim, a partial sum of them), never the rows themselves (dim 0, split there already)."""
    tensors = list(zip(strategy.inputs, node.input_infos)) + [(strategy.output, o) for o in node.outputs[:1]]
    routed = {a for placements, _ in tensors if placements is not None for a, p in enumerate(placements) if p.routed}
    if len(routed) > 1:
        return False
    for placements, info in tensors:
        if placements is None:
            continue
        if sum(p.is_blocked for p in placements) > 1:  # one blocked dim per tensor (one view runs it)
            return False
        for p, n in zip(placements, mesh_shape):
            if p.is_unequal and (p.dim >= info.ndim or sum(p.sizes) != info.shape[p.dim]
                                 or any(b % n for b in p.sizes)):
                return False
            if p.is_uneven and (p.dim >= info.ndim or info.shape[p.dim] % (p.grain * p.blocks)
                                or (info.shape[p.dim] // p.blocks // p.grain) % n == 0):
                return False
        seen: set[int] = set()
        for p in placements:
            if p.is_shard:
                if p.dim in seen or p.dim >= info.ndim:
                    return False
                seen.add(p.dim)
        for d in seen:
            if info.shape[d] % dim_divisor(placements, mesh_shape, d):
                return False
    return True


def node_strategies(graph: OpGraph, node: OpNode, mesh_shape: Sequence[int],
                    warned: Optional[_Warned] = None) -> list[Strategy]:
    """All strategies of ``node`` on a mesh of ``mesh_shape``, in a fixed order."""
    per_axis = [axis_choices(node, n, warned, graph) for n in mesh_shape]
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    for combo in itertools.product(*per_axis):
        inputs = tuple(
            None if any(c[0][k] is None for c in combo) else tuple(c[0][k] for c in combo)
            for k in range(len(node.inputs))
        )
        s = Strategy(inputs, tuple(c[1] for c in combo))
        if s not in seen and _valid(node, s, mesh_shape):
            seen.add(s)
            out.append(s)
    return out + balanced_variants(node, out, mesh_shape) + ring_variants(node, out, mesh_shape, graph)


def stored_strategy(node: OpNode, placements: Sequence, mesh_shape: Sequence[int]) -> Optional[Strategy]:
    """The strategy of a buffer outside the state dict that an earlier plan of the model stores as
    ``placements`` (a cache its graph wrote, which this graph only reads): it stays as stored, and the
    ops that read it take it from there. None where ``placements`` cannot hold the buffer's shape."""
    if node.role != BUFFER or node.persistent:
        return None
    strategy = Strategy((), tuple(placements))
    return strategy if _valid(node, strategy, mesh_shape) else None


def all_strategies(graph: OpGraph, mesh_shape: Sequence[int], nodes: Optional[Iterable[OpNode]] = None
                   ) -> dict[str, list[Strategy]]:
    """Strategies of every node (or of ``nodes``), keyed by node name."""
    warned = _Warned()
    return {n.name: node_strategies(graph, n, mesh_shape, warned) for n in (nodes if nodes is not None else graph.nodes)}
