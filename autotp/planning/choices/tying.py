"""Layer tying: find structurally identical sibling modules so they share one set of ILP variables.

Two sibling modules (children of the same module in the graph's ``nn_module_stack``) are tied when
their node sequences are identical (same ops, same non-tensor arguments, same shapes and dtypes,
same wiring inside the module, and the same parameters used only inside it) AND they are links of
one chain: the later module reads a tensor computed from the earlier one (made inside it, or by the
parent's own nodes from its output, as a residual add ``h = h + layer(h)`` written in the parent
is), and every tensor it reads from outside is either read by the earlier module too (the rotary
tables, the mask) or computed from the earlier one, from no member outside the chain, and from no
other sibling that ran after the earlier one began (a grouped-query block's ``o_proj`` reads what
``q_proj`` made, and what ``k_proj`` and ``v_proj`` made after it: not a link). That is a
stack of layers, where every layer sits in the same context, so one strategy serves them all; the
first and last layer of a stack may gain a little from their own (3e-4 of the step on a 3-layer
GPT, tests/planning/test_tying.py), which tying gives up for a problem a stack's depth smaller.
Siblings that match but sit in different places are left free: ``q_proj`` and ``o_proj`` of one
attention block are both ``Linear(d, d)``, yet one reads the block's input and the other the
attention output, and the best plan splits them differently. Names never matter: ``layers.3`` ties
to ``layers.0`` because their graphs match and each feeds the next. Node ``k`` of a tied module
then takes the strategy of node ``k`` of the first module of its chain.

>>> import torch, autotp
>>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
>>> g = autotp.capture(m, (torch.randn(2, 8),))
>>> reps = find_repeats(g)
>>> {name: rep for name, rep in reps.items() if name != rep}  # layer 0 reads the user input, 1 and 2 a layer
{'p_2_weight': 'p_1_weight', 'p_2_bias': 'p_1_bias', 'linear_2': 'linear_1'}
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Optional

from autotp.tracing.graph import OP, PARAMETER, OpGraph

__all__ = ["find_repeats", "find_chains", "tie", "module_members", "signature", "outside_reads"]


def _members(graph: OpGraph) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
    """Nodes of every module path, children of every path, and the top-level paths."""
    members: dict[str, list[str]] = defaultdict(list)
    children: dict[str, list[str]] = defaultdict(list)
    tops: list[str] = []
    for node in graph.ops():
        stack = node.module_stack
        for i, path in enumerate(stack):
            members[path].append(node.name)
            parent = stack[i - 1] if i else None
            siblings = children[parent] if parent is not None else tops
            if path not in siblings:
                siblings.append(path)
    return members, children, tops


def module_members(graph: OpGraph) -> dict[str, list[str]]:
    """The op nodes of every module path, in graph order."""
    return _members(graph)[0]


def signature(graph: OpGraph, names: list[str], fixed: Mapping[str, str]) -> tuple[tuple, list[str]]:
    """A hashable description of a module's subgraph, and its private parameters in first-use order
    (with the placements ``fixed`` gives them: layers whose weights must stay apart are not alike)."""
    local = {n: i for i, n in enumerate(names)}
    inside = set(names)
    params: list[str] = []
    entries = []
    for name in names:
        node = graph[name]
        refs = []
        for src in node.inputs:
            if src in local:
                refs.append(("i", local[src]))
            elif graph[src].role == PARAMETER and all(c in inside for c in graph.consumers(src)):
                if src not in params:
                    params.append(src)
                refs.append(("p", params.index(src), graph[src].output, graph[src].requires_grad, fixed.get(src)))
            else:
                refs.append(("e", graph[src].role))
        entries.append((node.target, node.args, node.input_infos, node.outputs, node.requires_grad,
                        tuple(refs)))
    return tuple(entries), params


def outside_reads(graph: OpGraph, names: list[str]) -> list[str]:
    """Op nodes outside ``names`` that the nodes in ``names`` read (parameters and inputs excluded)."""
    inside = set(names)
    return list(dict.fromkeys(src for n in names for src in graph[n].inputs
                              if src not in inside and graph[src].role == OP))


def _member_ancestry(graph: OpGraph, member_names: list[list[str]], depth: int
                     ) -> dict[str, tuple[frozenset[int], int]]:
    """For every node, the members (by index) it is computed from through the parent's own nodes,
    and the last graph position of a node of another sibling it is computed from (-1: none).

    Members' nodes give their index and stop there; a node inside another sibling (its module
    stack deeper than ``depth``, the members' parent's) gives its position and stops there too, so
    a tensor computed from a member through some other module is not counted as the member's.
    """
    owner = {n: i for i, names in enumerate(member_names) for n in names}
    above: dict[str, tuple[frozenset[int], int]] = {}
    none: tuple[frozenset[int], int] = (frozenset(), -1)
    for at, node in enumerate(graph.nodes):  # topological order
        if node.name in owner:
            above[node.name] = (frozenset((owner[node.name],)), -1)
        elif len(node.module_stack) > depth:
            above[node.name] = (frozenset(), at)
        else:
            sources = [above.get(src, none) for src in node.inputs]
            above[node.name] = (frozenset().union(*(m for m, _ in sources)), max((o for _, o in sources), default=-1))
    return above


def _chains(graph: OpGraph, members: dict[str, list[str]], group: list[tuple[str, list[str]]]
            ) -> list[list[tuple[str, list[str]]]]:
    """Split a group of matching siblings (in graph order) into chains of consecutive links."""
    if len(group) < 2:
        return [list(group)]
    names = [members[path] for path, _ in group]
    depth = graph[names[0][0]].module_stack.index(group[0][0])  # the members' place in a module stack
    above = _member_ancestry(graph, names, depth)
    chains: list[list[int]] = []
    for j in range(len(group)):
        if chains:
            prev, links = chains[-1][-1], set(chains[-1])
            prev_reads = set(outside_reads(graph, names[prev]))
            start = graph.position(names[prev][0])
            reads = outside_reads(graph, names[j])

            def carries_prev(r: str) -> bool:
                # the previous link's output, and no other member's; another sibling's output only if
                # made before the previous link began (context, as a position table): q and o of one
                # attention block are not links, though o reads what q (and k, v after it) made
                mine, other = above[r]
                return prev in mine and mine <= links and other < start

            if reads and all(r in prev_reads or carries_prev(r) for r in reads) and any(
                    prev in above[r][0] for r in reads):
                chains[-1].append(j)
                continue
        chains.append([j])
    return [[group[j] for j in chain] for chain in chains]


def find_repeats(graph: OpGraph) -> dict[str, str]:
    """Map every node name to the name of the node whose strategy it takes (itself when untied)."""
    return _tie(graph, {})[0]


def find_chains(graph: OpGraph) -> list[tuple[str, ...]]:
    """The module paths of every chain of tied layers (two or more), in graph order: the layers
    that activation recompute may choose (:mod:`autotp.planning.costs.recompute`).

    >>> import torch, autotp
    >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    >>> find_chains(autotp.capture(m, (torch.randn(2, 8),)))
    [('1', '2')]
    """
    return _tie(graph, {})[1]


def tie(graph: OpGraph, fixed: Optional[Mapping[str, str]] = None) -> tuple[dict[str, str], list[tuple[str, ...]]]:
    """:func:`find_repeats` and :func:`find_chains` at once. ``fixed``: placements some parameter nodes
    must keep (by node name, as text); layers whose kept placements differ are not tied (a graph planned
    again over a module whose weights are stored by an earlier plan that gave its layers their own)."""
    return _tie(graph, fixed or {})


def _tie(graph: OpGraph, fixed: Mapping[str, str]) -> tuple[dict[str, str], list[tuple[str, ...]]]:
    rep = {n.name: n.name for n in graph.nodes}
    chains_found: list[tuple[str, ...]] = []
    members, children, tops = _members(graph)

    def visit(paths: Iterable[str]) -> None:
        groups: dict[tuple, list[tuple[str, list[str]]]] = {}
        order: list[tuple] = []
        for path in paths:
            sig, params = signature(graph, members[path], fixed)
            if sig not in groups:
                groups[sig] = []
                order.append(sig)
            groups[sig].append((path, params))
        for sig in order:
            for chain in _chains(graph, members, groups[sig]):
                if len(chain) < 2:
                    visit(children.get(chain[0][0], []))
                    continue
                first_path, first_params = chain[0]
                chains_found.append(tuple(path for path, _ in chain))
                for path, params in chain[1:]:
                    for mine, theirs in zip(members[path], members[first_path]):
                        rep[mine] = theirs
                    for mine, theirs in zip(params, first_params):
                        rep[mine] = theirs

    visit(tops)
    return rep, chains_found
