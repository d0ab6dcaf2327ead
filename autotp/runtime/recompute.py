"""Activation recompute at run time: each recomputed layer of a plan as one checkpointed submodule.

The planner chooses the layers (:mod:`autotp.planning.costs.recompute`); the rewrite moves each one's
nodes, collectives included, into a :class:`Recompute` run under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, run to the layer's end (checkpoint's
early stop off, so the collectives after its last saved tensor run again as the plan lists them); a
dropout inside draws the same mask when it runs again (:class:`RecomputeContext`).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Sequence

import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autotp.local.dropout import SeededAttention, ShardedDropout, SharedRandom

__all__ = ["Layer", "Recompute", "RecomputeContext", "apply_recompute", "group_layers"]


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


class Layer(nn.Module):
    """One layer of the rewritten graph run as it is: a unit a wrapper can hold (FSDP2's, in a
    pipeline stage whose data axis shards its parameters layer by layer)."""

    def __init__(self, body: torch.fx.GraphModule, path: str, dropouts: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.body = body
        self.path = path

    def extra_repr(self) -> str:
        return f"layer={self.path!r}"

    def forward(self, *args):
        return self.body(*args)


def apply_recompute(gm: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str],
                    prefix: str = "") -> torch.fx.GraphModule:
    """Move the nodes of each layer (``layer_of``: fx node → layer path) into a :class:`Recompute`
    submodule called where the layer's first node was; the rest of the graph reads its outputs.
    ``prefix`` starts the submodules' names (a second graph of the same module names its own)."""
    return group_layers(gm, layer_of, f"autotp_{prefix}recompute_", Recompute)


def group_layers(gm: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str], name: str,
                 make=Layer) -> torch.fx.GraphModule:
    """Move the nodes of each layer (``layer_of``: fx node → layer path) into a submodule
    ``make(body, path, dropouts)`` named ``name`` and a count, called where the layer's first node
    was (or after the last thing it reads); the rest of the graph reads its outputs. A parameter or
    buffer whose reads all moved moves with them: the submodule holds it, under its name in the
    model, and the graph no longer does."""
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
        dropouts = [m for m in body.modules() if isinstance(m, (ShardedDropout, SharedRandom, SeededAttention))]
        unit = f"{name}{i}"
        gm.add_module(unit, make(body, path, dropouts))
        order = {n: j for j, n in enumerate(gm.graph.nodes)}
        last_input = max(inputs, key=order.__getitem__, default=None)
        # the call goes where the layer starts, or after the last thing it reads if that comes later
        # (autotp.planning.costs.recompute._layer made sure nothing it reads depends on it)
        if last_input is not None and any(order[u] < order[last_input] for n in outputs for u in n.users
                                          if u not in inside):
            raise NotImplementedError(f"layer {path} cannot be recomputed as one call: a node outside it reads "
                                      f"it before it has read all its inputs")
        where = (gm.graph.inserting_before(last_input.next) if last_input is not None and order[last_input] > order[nodes[0]]
                 else gm.graph.inserting_before(nodes[0]))
        with where:
            call = gm.graph.call_module(unit, tuple(inputs))
            results = [gm.graph.call_function(operator.getitem, (call, j)) for j in range(len(outputs))]
        for n, r in zip(outputs, results):
            n.replace_all_uses_with(r, delete_user_cb=lambda user: user not in inside)
        moved = {n.target for n in nodes if n.op == "call_module"}
        moved_state = {n.target for n in nodes if n.op == "get_attr"}
        for n in reversed(nodes):
            gm.graph.erase_node(n)
        # each module lives once in the tree: in the layer's body now (tools that name modules by
        # their path, as CommDebugMode does, see one path each)
        for target in moved - {n.target for n in gm.graph.nodes if n.op == "call_module"}:
            delattr(gm, target)
        # ... and each parameter and buffer whose reads all moved
        for target in moved_state - {n.target for n in gm.graph.nodes if n.op == "get_attr"}:
            owner, _, attr = target.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, attr)
    gm.graph.lint()
    gm.recompile()
    return gm
