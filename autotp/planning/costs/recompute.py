"""Activation recompute, as the planner sees it: which layers may recompute their activations.

A chain of tied layers (:func:`autotp.planning.choices.tying.find_chains`: ``layers.0`` … ``layers.31``) is where
recompute pays: every layer is alike, so the planner decides *how many* of a chain's ``L`` layers
recompute (an integer ``k`` in the ILP, :mod:`autotp.planning.solve.solver`), and the first ``k`` do. The first
ones, because backward reaches them last: by then the activations of every later layer are freed,
so the one layer being recomputed never adds to the peak unless every layer recomputes.

A recomputed layer keeps, of its activations, only those read outside it (the layer's output, which
is the next layer's input); in the backward it runs its forward again, compute and forward
collectives both (:func:`autotp.planning.costs.program.program` lists those as phase ``"recompute"``). The runtime
runs each recomputed layer as one checkpointed submodule (:mod:`autotp.runtime.recompute`).

>>> import torch, autotp
>>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
>>> [[r.path for r in chain] for chain in layer_chains(autotp.capture(m, (torch.randn(2, 8),)))]
[['1', '2']]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from autotp.planning.choices.tying import find_chains
from autotp.tracing.aliasing import storage_roots, writes_in_place
from autotp.tracing.graph import OpGraph

__all__ = ["Layer", "layer_chains", "recomputed_nodes", "check_recompute", "recompute_saved_bytes"]


@dataclass(frozen=True)
class Layer:
    """One layer of a chain: its module path, its nodes (graph order) and those read outside it."""

    path: str
    nodes: tuple[str, ...]
    outputs: tuple[str, ...]


def layer_chains(graph: OpGraph, chains_found: Sequence[Sequence[str]] | None = None) -> list[list[Layer]]:
    """The chains of tied layers that can recompute: each layer carries a gradient somewhere and can
    run as one call (nothing it reads from outside is computed from its own nodes). ``chains_found``:
    :func:`autotp.planning.choices.tying.find_chains`' answer, if already at hand."""
    paths_of = [tuple(paths) for paths in (find_chains(graph) if chains_found is None else chains_found)]
    wanted = {path for paths in paths_of for path in paths}
    members: dict[str, list[str]] = {path: [] for path in wanted}
    for node in graph.ops():  # one pass: a layer's nodes are those run inside its module
        for path in wanted.intersection(node.module_stack):
            members[path].append(node.name)
    chains = []
    for paths in paths_of:
        layers = [_layer(graph, path, members[path]) for path in paths]
        if all(layer is not None for layer in layers):
            chains.append(layers)
    return chains


def _layer(graph: OpGraph, path: str, nodes: list[str]) -> Layer | None:
    inside = set(nodes)
    if not any(graph[n].requires_grad for n in nodes):
        return None
    # a node outside read by the layer must not depend on the layer (the layer could not run as one
    # call); such a node lies between the layer's first node and its last, so only those are looked at
    tainted: set[str] = set()
    first, last = graph.position(nodes[0]), graph.position(nodes[-1])
    for node in graph.nodes[first + 1:last]:  # topological order
        if node.name not in inside and any(src in inside or src in tainted for src in node.inputs):
            tainted.add(node.name)
    if tainted and any(src in tainted for n in nodes for src in graph[n].inputs):
        return None
    # an op that writes into a tensor made outside (or a view of one): running the layer again
    # would read it changed
    root = storage_roots(graph)
    if any(writes_in_place(graph[n]) and root[n] not in inside for n in nodes):
        return None
    outputs = tuple(n for n in nodes if n in graph.outputs or any(c not in inside for c in graph.consumers(n)))
    return Layer(path, tuple(nodes), outputs)


def recomputed_nodes(graph: OpGraph, paths: Iterable[str]) -> dict[str, str]:
    """Node name → the recomputed layer (module path) it belongs to."""
    wanted = set(paths)
    out: dict[str, str] = {}
    for node in graph.ops():
        for path in node.module_stack:
            if path in wanted:
                out[node.name] = path
                break
    return out


def check_recompute(recompute: object) -> None:
    """``recompute`` is None (the planner decides), True (every layer of every chain) or False (none)."""
    if recompute is not None and not isinstance(recompute, bool):
        raise ValueError(f"recompute {recompute!r}: expected None (the planner decides which layers recompute), "
                         f"True (every repeated layer) or False (none)")


def recompute_saved_bytes(chains: Sequence[Sequence[Layer]], layers: Mapping[int, int],
                          activations: Mapping[str, float]) -> float:
    """Activation bytes per device that recomputing the first ``layers[g]`` layers of each chain ``g``
    frees (:func:`autotp.planning.costs.recompute_counts.freed_bytes`)."""
    from autotp.planning.costs.recompute_counts import (  # noqa: PLC0415 - a module of numbers, no import cycle
        freed_bytes,
    )

    total = 0.0
    for g, k in layers.items():
        first = chains[g][0]  # tied layers: every one holds what the first does
        saved = sum(activations[n] for n in first.nodes if n not in first.outputs)
        total += freed_bytes(k, len(chains[g]), saved, sum(activations[n] for n in first.nodes))
    return total
