"""Experts written as a list of modules, found from the graph, so a plan can say why they stay apart.

A Mixture-of-Experts layer whose experts are an ``nn.ModuleList`` of alike modules, each run on the
same input and their outputs joined by one ``stack`` or ``cat`` (every expert on every token,
weighted by a dense gate), has no expert dim to split: each expert's weights are tensors of their
own, and a rank can hold one whole or a piece of it, not "experts 0 to 31". The planner plans each
as its own module (split by features as an MLP is, or kept whole with the tokens split), and the
stacked ``(N, E, d)`` outputs are whole, or partial sums, on every rank. One batched parameter per
projection (``w1 (E, d, f)``, run with ``einsum``) is the same layer with an expert dim the planner
can split (docs/training.md, "Experts of your own"; docs/design.md, "Whole experts on ranks", says
why autotp does not stack the list itself).

:func:`expert_lists` finds such joins by structure, never by name: at least two inputs of a
``stack`` or ``cat``, each made by a different child module of the join's module, those modules
alike (the same ops, shapes and arguments, each with parameters of its own:
:func:`autotp.planning.choices.tying.signature`) and reading the same tensors from outside.
:func:`warn_expert_lists` logs one warning per graph naming them.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from autotp.planning.choices.tying import module_members, outside_reads, signature
from autotp.tracing.graph import OpGraph

__all__ = ["ExpertList", "expert_lists", "warn_expert_lists"]

log = logging.getLogger(__name__)

JOINS = frozenset({"aten.stack.default", "aten.cat.default"})


@dataclass(frozen=True)
class ExpertList:
    """Alike modules run on one input whose outputs one join (``stack``, ``cat``) puts together."""

    join: str  # the join's node
    modules: tuple[str, ...]  # the modules, in the join's order

    def describe(self) -> str:
        shown = ", ".join(self.modules[:2]) + (f", ... {self.modules[-1]}" if len(self.modules) > 2 else "")
        return (f"{len(self.modules)} alike modules ({shown}) run on one input and joined at node {self.join}: "
                f"experts written as a list of modules are planned each as its own module, never whole on "
                f"ranks (no expert dim to split); one batched parameter per projection, (experts, in, out), run "
                f"with einsum or a grouped matmul, can be (docs/training.md, 'Experts of your own')")


def expert_lists(graph: OpGraph) -> list[ExpertList]:
    """The joins of alike modules' outputs in ``graph`` (see the module docstring)."""
    members = module_members(graph)
    found = []
    for node in graph.ops():
        if node.target not in JOINS or len(node.inputs) < 2:
            continue
        depth = len(node.module_stack)
        branches = []
        for src in node.inputs:
            stack = graph[src].module_stack
            if len(stack) <= depth or tuple(stack[:depth]) != tuple(node.module_stack):
                break
            branches.append(stack[depth])
        if len(branches) != len(node.inputs) or len(set(branches)) != len(branches):
            continue
        shapes = [signature(graph, members[b], {}) for b in branches]
        reads = [outside_reads(graph, members[b]) for b in branches]
        if shapes[0][1] and all(s[0] == shapes[0][0] and s[1] for s in shapes) and all(r == reads[0] for r in reads):
            found.append(ExpertList(node.name, tuple(branches)))
    return found


_WARNED: "weakref.WeakSet[OpGraph]" = weakref.WeakSet()


def warn_expert_lists(graph: OpGraph) -> None:
    """Log each of :func:`expert_lists` once per graph."""
    if graph in _WARNED:
        return
    _WARNED.add(graph)
    for found in expert_lists(graph):
        log.warning("autotp: %s", found.describe())
