"""Where a plan puts a Mixture-of-Experts layer's experts, and a plan made to put them elsewhere.

A **routed MoE layer** is found from the graph, never from names: the grouped matmuls of tokens
sorted by expert (:func:`autotp.planning.rules.experts.expert_split`) that read one offsets node,
with their expert weights (each matmul's weight input followed back through views to a
parameter). Layers whose grouped matmuls have the same shapes are one **kind** (Qwen3-MoE's
layers are one kind; a model whose MoE layers differ in width has several).

A grouped matmul's strategy places its experts one of four ways (:func:`placement_of`):

- ``"features"``: each expert's weight split by its features on some axis (``S(1)``/``S(2)``), as
  Megatron splits one MLP, by experts on none;
- ``"whole"``: whole experts on the ranks of an axis (``S(0)``), every token on every rank, the
  output a sum of disjoint parts (``Pd``) that one all-reduce completes;
- ``"routed"``: whole experts on the ranks of an axis with the tokens split there and each routed
  row sent to its expert's rank and back by all-to-all (``St``/``Se``,
  :mod:`autotp.planning.rules.routed`);
- ``"replicated"``: every expert whole on every rank.

:func:`keep_placement` narrows a plan's strategies so that the given layers' grouped matmuls
place their experts one way and their weights are stored so (split by experts for ``whole`` and
``routed``, by features for ``features``), the ILP free in everything else: the best plan with
that placement, which :mod:`autotp.planning.result.expert_choice` prices beside the chosen one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from autotp.placement import Strategy, format_placements
from autotp.planning.rules.experts import expert_split
from autotp.tracing.graph import PARAMETER, OpGraph

__all__ = ["PLACEMENTS", "MoeLayer", "moe_layers", "moe_kinds", "placement_of", "describe_placement",
           "keep_placement"]

PLACEMENTS = ("features", "whole", "routed", "replicated")

_WORDS = {"features": "split by features", "whole": "whole on ranks, every token on every rank",
          "routed": "whole on ranks, tokens sent by all-to-all",
          "replicated": "replicated (every expert on every rank)"}


@dataclass(frozen=True)
class MoeLayer:
    """One routed MoE layer: its offsets node, its grouped matmuls (graph order), the parameter
    each reads as its expert weight (None where the weight is no parameter), the experts and the
    routed rows (tokens times top-k)."""

    offsets: str
    grouped: tuple[str, ...]
    weights: tuple[Optional[str], ...]
    experts: int
    rows: int
    shapes: tuple[tuple[int, ...], ...]  # each grouped matmul's weight shape: the layer's kind


def _weight_parameter(graph: OpGraph, name: str) -> Optional[str]:
    source = graph[graph[name].inputs[1]]
    while source.is_view and source.inputs:
        source = graph[source.inputs[0]]
    return source.param_fqn if source.role == PARAMETER else None


def moe_layers(graph: OpGraph) -> tuple[MoeLayer, ...]:
    """The graph's routed MoE layers, in graph order (empty for a dense model)."""
    by_offsets: dict[str, list[str]] = {}
    for node in graph.nodes:
        if expert_split(node):
            by_offsets.setdefault(node.inputs[2], []).append(node.name)
    layers = []
    for offsets, grouped in by_offsets.items():
        first = graph[grouped[0]]
        layers.append(MoeLayer(offsets, tuple(grouped), tuple(_weight_parameter(graph, g) for g in grouped),
                               int(first.input_infos[1].shape[0]), int(first.input_infos[0].shape[0]),
                               tuple(tuple(graph[g].input_infos[1].shape) for g in grouped)))
    return tuple(layers)


def moe_kinds(graph: OpGraph) -> tuple[tuple[MoeLayer, ...], ...]:
    """The routed MoE layers grouped by kind (the same grouped matmul weight shapes), kinds in the
    order of their first layer."""
    kinds: dict[tuple, list[MoeLayer]] = {}
    for layer in moe_layers(graph):
        kinds.setdefault(layer.shapes, []).append(layer)
    return tuple(tuple(k) for k in kinds.values())


def placement_of(strategy: Strategy) -> tuple[str, Optional[int], tuple[int, ...]]:
    """How a grouped matmul's strategy places its experts: one of :data:`PLACEMENTS`, the axis that
    splits the experts (None for ``features`` and ``replicated``), and the axes that split each
    expert by its features."""
    weight = strategy.inputs[1] or ()
    every = (*strategy.inputs, strategy.output)
    experts = [a for a, p in enumerate(weight) if p.is_shard and p.dim == 0]
    features = tuple(a for a, p in enumerate(weight) if p.is_shard and p.dim != 0)
    if experts:
        a = experts[0]
        routed = any(p is not None and p[a].routed for p in every)
        return ("routed" if routed else "whole"), a, features
    return ("features" if features else "replicated"), None, features


def describe_placement(kind: str, axis: Optional[int] = None, features: Sequence[int] = (),
                       axis_names: Sequence[str] = ()) -> str:
    """``kind`` in words, with the axes: "whole on ranks, tokens sent by all-to-all, over tp"."""
    def name(a: int) -> str:
        return axis_names[a] if a < len(axis_names) else f"axis {a}"

    text = _WORDS[kind]
    if axis is not None:
        text += f", over {name(axis)}"
        if features:
            text += f", each expert by features over {', '.join(map(name, features))}"
    elif features:
        text += f" over {', '.join(map(name, features))}"
    return text


def _stored(placements: Sequence, kind: str) -> bool:
    experts = any(p.is_shard and p.dim == 0 for p in placements)
    if kind in ("whole", "routed"):
        return experts
    if kind == "features":
        return not experts and any(p.is_shard for p in placements)
    return all(p.kind == "R" for p in placements)


def keep_placement(graph: OpGraph, rep: Mapping[str, str], strategies: dict[str, list[Strategy]],
                   wanted: Mapping[str, str]) -> None:
    """Narrow ``strategies`` (per representative of ``rep``) so that each grouped matmul of
    ``wanted`` (node name -> one of :data:`PLACEMENTS`) places its experts so, and its expert
    weight is stored so. A ``ValueError`` says which layer cannot, and how it can place them."""
    for name, kind in wanted.items():
        if kind not in PLACEMENTS:
            raise ValueError(f"experts of {name}: {kind!r}; expected one of {', '.join(PLACEMENTS)}")
        node = graph[name]
        where = node.module_path or "the model"
        r = rep[name]
        kept = [s for s in strategies[r] if placement_of(s)[0] == kind]
        if not kept:
            offered = sorted({placement_of(s)[0] for s in strategies[r]})
            raise ValueError(f"the grouped matmul at {where} ({name}) cannot place its experts {_WORDS[kind]} on this "
                             f"mesh with these pins; it can place them: {', '.join(_WORDS[k] for k in offered)}")
        strategies[r] = kept
        weight = graph[node.inputs[1]]
        while weight.is_view and weight.inputs:
            weight = graph[weight.inputs[0]]
        if weight.role != PARAMETER:
            continue
        w = rep[weight.name]
        stored = [s for s in strategies[w] if _stored(s.output, kind)]
        if not stored:
            offered = ", ".join(sorted({format_placements(s.output) for s in strategies[w]}))
            raise ValueError(f"the expert weight {weight.param_fqn} cannot be stored {_WORDS[kind]} with these pins; "
                             f"it can take {offered}")
        strategies[w] = stored
