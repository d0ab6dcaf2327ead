"""Activation recompute: which layers may recompute their activations, and the rewrite that does it.

A chain of tied layers (:func:`autotp.tying.find_chains`: ``layers.0`` … ``layers.31``) is where
recompute pays: every layer is alike, so the planner decides *how many* of a chain's ``L`` layers
recompute (an integer ``k`` in the ILP, :mod:`autotp.solver`), and the first ``k`` do. The first
ones, because backward reaches them last: by then the activations of every later layer are freed,
so the one layer being recomputed never adds to the peak unless every layer recomputes.

A recomputed layer keeps, of its activations, only those read outside it (the layer's output, which
is the next layer's input); in the backward it runs its forward again, compute and forward
collectives both (:func:`autotp.program.program` lists those as phase ``"recompute"``). The rewrite
moves each recomputed layer's nodes, collectives included, into a submodule run under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, run to the layer's end (checkpoint's
early stop off, so the collectives after its last saved tensor run again as listed); a dropout
inside draws the same mask when it runs again (:class:`RecomputeContext`).

>>> import torch, autotp
>>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
>>> [[r.path for r in chain] for chain in layer_chains(autotp.capture(m, (torch.randn(2, 8),)))]
[['1', '2']]
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autotp.aliasing import storage_roots, writes_in_place
from autotp.graph import OpGraph
from autotp.tying import find_chains

__all__ = ["Layer", "layer_chains", "recomputed_nodes", "check_recompute", "recompute_saved_bytes", "Recompute", "RecomputeContext", "apply_recompute"]


@dataclass(frozen=True)
class Layer:
    """One layer of a chain: its module path, its nodes (graph order) and those read outside it."""

    path: str
    nodes: tuple[str, ...]
    outputs: tuple[str, ...]


def layer_chains(graph: OpGraph, chains_found: Sequence[Sequence[str]] | None = None) -> list[list[Layer]]:
    """The chains of tied layers that can recompute: each layer carries a gradient somewhere and can
    run as one call (nothing it reads from outside is computed from its own nodes). ``chains_found``:
    :func:`autotp.tying.find_chains`' answer, if already at hand."""
    chains = []
    for paths in (find_chains(graph) if chains_found is None else chains_found):
        layers = [_layer(graph, path) for path in paths]
        if all(layer is not None for layer in layers):
            chains.append(layers)
    return chains


def _layer(graph: OpGraph, path: str) -> Layer | None:
    nodes = [n.name for n in graph.ops() if path in n.module_stack]
    inside = set(nodes)
    if not any(graph[n].requires_grad for n in nodes):
        return None
    # a node outside read by the layer must not depend on the layer (the layer could not run as one call)
    tainted: set[str] = set()
    for node in graph.nodes:  # topological order
        if node.name not in inside and any(src in inside or src in tainted for src in node.inputs):
            tainted.add(node.name)
    if any(src in tainted for n in nodes for src in graph[n].inputs):
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
    frees (:func:`autotp.recompute_counts.freed_bytes`)."""
    from autotp.recompute_counts import freed_bytes  # noqa: PLC0415 - a module of numbers, no import cycle

    total = 0.0
    for g, k in layers.items():
        first = chains[g][0]  # tied layers: every one holds what the first does
        saved = sum(activations[n] for n in first.nodes if n not in first.outputs)
        total += freed_bytes(k, len(chains[g]), saved, sum(activations[n] for n in first.nodes))
    return total


class RecomputeContext:
    """The two contexts ``checkpoint``'s ``context_fn`` asks for, per call: the forward's records the
    call counts of the layer's dropouts, the recomputation's sets them back for its run (so each
    dropout draws the mask it drew in the forward) and restores them after."""

    def __init__(self, dropouts: Sequence[nn.Module]) -> None:
        self.dropouts = tuple(dropouts)

    def __call__(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        saved: list[int] = []

        @contextlib.contextmanager
        def forward():
            saved[:] = [d.calls for d in self.dropouts]
            yield

        @contextlib.contextmanager
        def again():
            after = [d.calls for d in self.dropouts]
            for d, calls in zip(self.dropouts, saved):
                d.calls = calls
            try:
                yield
            finally:
                for d, calls in zip(self.dropouts, after):
                    d.calls = calls

        return forward(), again()


class Recompute(nn.Module):
    """Runs ``body`` (one layer of the rewritten graph) keeping only its inputs; its backward runs the
    body again (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, body: torch.fx.GraphModule, path: str, dropouts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.body = body
        self.path = path
        self._context = RecomputeContext(dropouts)

    def extra_repr(self) -> str:
        return f"layer={self.path!r}"

    def forward(self, *args):
        # the whole layer runs again, not only up to its last saved tensor (checkpoint's early stop):
        # its collectives after that point (the sum of a row-split output) run again too, as the plan lists
        with set_checkpoint_early_stop(False):
            return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._context)


def apply_recompute(gm: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str],
                    prefix: str = "") -> torch.fx.GraphModule:
    """Move the nodes of each layer (``layer_of``: fx node → layer path) into a :class:`Recompute`
    submodule called where the layer's first node was; the rest of the graph reads its outputs.
    ``prefix`` starts the submodules' names (a second graph of the same module names its own)."""
    by_layer: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in layer_of:
            by_layer.setdefault(layer_of[node], []).append(node)
    for i, (path, nodes) in enumerate(by_layer.items()):
        inside = set(nodes)
        inputs: list[torch.fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        sub = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {a: sub.placeholder(f"in_{j}") for j, a in enumerate(inputs)}
        for n in nodes:
            env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(tuple(env[n] for n in outputs))
        body = torch.fx.GraphModule(gm, sub, class_name="AutotpLayer")
        from autotp.dropout import ShardedDropout  # noqa: PLC0415 - dropout imports nothing of this

        dropouts = [m for m in body.modules() if isinstance(m, ShardedDropout)]
        name = f"autotp_{prefix}recompute_{i}"
        gm.add_module(name, Recompute(body, path, dropouts))
        order = {n: j for j, n in enumerate(gm.graph.nodes)}
        last_input = max(inputs, key=order.__getitem__, default=None)
        # the call goes where the layer starts, or after the last thing it reads if that comes later
        # (autotp.recompute._layer made sure nothing it reads depends on it)
        if last_input is not None and any(order[u] < order[last_input] for n in outputs for u in n.users
                                          if u not in inside):
            raise NotImplementedError(f"layer {path} cannot be recomputed as one call: a node outside it reads "
                                      f"it before it has read all its inputs")
        where = (gm.graph.inserting_before(last_input.next) if last_input is not None and order[last_input] > order[nodes[0]]
                 else gm.graph.inserting_before(nodes[0]))
        with where:
            call = gm.graph.call_module(name, tuple(inputs))
            results = [gm.graph.call_function(operator.getitem, (call, j)) for j in range(len(outputs))]
        for n, r in zip(outputs, results):
            n.replace_all_uses_with(r, delete_user_cb=lambda user: user not in inside)
        moved = {n.target for n in nodes if n.op == "call_module"}
        for n in reversed(nodes):
            gm.graph.erase_node(n)
        # each module lives once in the tree: in the layer's body now (tools that name modules by
        # their path, as CommDebugMode does, see one path each)
        for target in moved - {n.target for n in gm.graph.nodes if n.op == "call_module"}:
            delattr(gm, target)
    gm.graph.lint()
    gm.recompile()
    return gm
