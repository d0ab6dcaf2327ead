"""Views that follow their input: merged into it before the ILP, so that choosing the producer's
strategy fixes theirs and they add no variables of their own.

A view (or a cast to the same dtype, a copy) whose only input has no other reader can take, for
each placement that input takes, the one strategy that reads it: any redistribution its readers
need can then happen after it, on as many bytes, so no option is lost by merging. A view that may
leave its gradient partial (``Rg``, :mod:`autotp.planning.rules.gradients`) where its input may not is not
merged: merged, it would lose that option.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from autotp import ops
from autotp.placement import Strategy, plain
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["merge_followers", "is_follower"]


def is_follower(node: OpNode) -> bool:
    """A view, or an op that returns its input unchanged (a cast to the same dtype, a copy)."""
    if node.is_placeholder or len(node.inputs) != 1 or node.target == "getitem" or len(node.outputs) != 1:
        return False
    if node.is_view:
        return True
    return node.target in ops.NO_OP and node.input_infos[0] == node.output


def merge_followers(graph: OpGraph, strategies: Mapping[str, Sequence[Strategy]], rep: Mapping[str, str],
                    reps: Sequence[str]) -> tuple[dict[str, str], dict[str, list[int]], dict[str, str]]:
    """Per representative (``reps``; ``rep`` maps every node to its own): its group root, the map
    from the root's strategy index to its own, and, for merged ones, the representative it follows."""
    root = {r: r for r in reps}
    fmap = {r: list(range(len(strategies[r]))) for r in reps}
    parent: dict[str, str] = {}
    instances: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        instances[rep[n.name]].append(n.name)
    outputs = set(graph.outputs)
    for r in reps:
        node = graph[r]
        if not is_follower(node):
            continue
        u = rep[node.inputs[0]]
        if any(rep[graph[i].inputs[0]] != u or graph.consumers(graph[i].inputs[0]) != (i,)
               or graph[i].inputs[0] in outputs for i in instances[r]):
            continue
        # keyed by what the view reads and whether its output's gradient is partial (Rg) on each
        # axis: it follows a producer whose output is Rg with its own Rg variant
        by_input: dict[tuple, list[int]] = defaultdict(list)
        for idx, st in enumerate(strategies[r]):
            by_input[(st.inputs[0], _grad_flags(st.output))].append(idx)
        root_flags = {_grad_flags(strategies[u][fmap[u][s]].output) for s in range(len(strategies[root[u]]))}
        if any(flags not in root_flags for _, flags in by_input):
            continue  # the view may be Rg where its input may not
        mine = []
        for s_root in range(len(strategies[root[u]])):
            p = strategies[u][fmap[u][s_root]].output
            match = by_input.get((plain(p), _grad_flags(p)), [])
            if len(match) != 1:
                break
            mine.append(match[0])
        else:
            root[r], fmap[r], parent[r] = root[u], mine, u
    return root, fmap, parent


def _grad_flags(placements: tuple) -> tuple[bool, ...]:
    return tuple(p.grad_partial for p in placements)
