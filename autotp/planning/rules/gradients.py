"""Replicated ops that pass a partial gradient on: the ``Rg`` variants of a node's strategies.

A node that reads a tensor replicated on a mesh axis while it works on shards there returns a
partial gradient for it: each rank's piece of the sum. Without more, the gradient is summed (an
all_reduce, or the reduce-scatter of a gather) right where it is read. But the backward of any op
is linear in its output's gradient, so an op that runs replicated on the axis (every tensor it reads
and writes is ``R`` there, hence the same on every rank) may take partial sums as its output's
gradient and hand partial sums to its inputs. The sum then happens further up, on a tensor that may
be smaller (the hidden states a token dispatch copies ``k`` times), or that is gathered or reduced
for other readers anyway (then it costs nothing more).

For each such strategy this adds a copy whose output is ``Rg`` on the axis: the value is ``R``, its
gradient partial. The costs keep it consistent (:meth:`autotp.planning.costs.costing.CostModel.edge_s`): every
reader of an ``Rg`` output must return a partial gradient there (a whole one added to partial sums
would be counted once per rank), a graph output is returned with a whole gradient, and the
gradient reductions move to the reads of the node's own inputs (:mod:`autotp.planning.solve.solver`).

Only training plans have them, and only nodes where they can lower the cost: one floating-point
output that carries a gradient and is not a graph output, not an in-place op, every reader able to
return a partial gradient there (it has a strategy that reads the output replicated while working
on shards, or may be ``Rg`` itself), and either

* an output larger than each input that carries a gradient (a token dispatch, an expand, a
  repeat): the sum moves to fewer bytes; or
* one input that carries a gradient, of the output's size, made by a node that has them (a cast, a
  copy or a view after such an op), so that the partial sum can get back to where it shrinks; or
* one such input that other nodes read too: the op (a view beside them, as DeepSeek's
  ``hidden.view(-1, d)`` for the routed experts beside the shared ones) can then read it as they do,
  and share the gather they need and its backward reduce-scatter, instead of gathering it again.

Every other replicated op could pass the sum on too, but only to a tensor as large or larger; where
that would join a reduction paid anyway, the reduction at the op's own output is no dearer. Offering
them all made the ILP of the Llama 3 70B shape on (8, 8) 70% larger and its solve 3.6 times slower,
for the same plan; offered as above, its solve takes 4.3 s against 3 s without any, and the plan
gains: the grouped-query ``expand`` of k and v heads passes its gradient on (503.5 ms a step
predicted against 506.7 ms).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from autotp.placement import Rg, Strategy
from autotp.tracing.aliasing import writes_in_place
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["partial_gradient_variants"]


def _may_pass(graph: OpGraph, node: OpNode, outputs: frozenset) -> bool:
    """Whether ``node`` may leave its output's gradient partial on some axis (before its readers)."""
    if node.is_placeholder or node.target == "getitem" or len(node.outputs) != 1:
        return False
    if not node.requires_grad or not node.output.is_float or node.name in outputs:
        return False
    if writes_in_place(node):
        return False  # in place (aten.add_.Tensor): its input is its output
    return any(graph[i].requires_grad for i in node.inputs)


def partial_gradient_variants(graph: OpGraph, mesh_ndim: int, rep: Mapping[str, str],
                              strategies: Mapping[str, Sequence[Strategy]]) -> dict[str, list[Strategy]]:
    """``strategies`` (per representative, as :func:`autotp.planning.choices.tying.tie` groups the nodes) with, for the
    nodes that may use them, a copy of each strategy replicated on an axis whose output is ``Rg``
    there, after the strategies it had. Tied nodes get them only if every node of the tie may."""
    outputs = frozenset(graph.outputs)
    instances: dict[str, list[OpNode]] = defaultdict(list)
    for n in graph.nodes:
        instances[rep[n.name]].append(n)
    shrinks: set[str] = set()  # nodes whose partial sum can get back to where it shrinks
    for n in graph.nodes:
        if _may_pass(graph, n, outputs):
            grads = [graph[i] for i in n.inputs if graph[i].requires_grad]
            numel = [i.outputs[0].numel for i in grads]
            if max(numel) < n.output.numel or (len(grads) == 1 and numel[0] == n.output.numel and (
                    grads[0].name in shrinks or len(graph.consumers(grads[0].name)) > 1)):
                shrinks.add(n.name)
    may = {r for r in strategies if all(n.name in shrinks for n in instances[r])}
    out = {r: list(sts) for r, sts in strategies.items()}
    for r in sorted(may):
        for a in range(mesh_ndim):
            if not all(_readers_may_return_partial(graph, n, a, rep, strategies, may) for n in instances[r]):
                continue
            for st in strategies[r]:
                if not st.partial_grads_on(a):  # runs replicated on a: every tensor plain R there
                    output = tuple(Rg if b == a else p for b, p in enumerate(st.output))
                    out[r].append(Strategy(st.inputs, output))
    return out


def _readers_may_return_partial(graph: OpGraph, node: OpNode, axis: int, rep: Mapping[str, str],
                                strategies: Mapping[str, Sequence[Strategy]], may: set) -> bool:
    for c in graph.consumers(node.name):
        reader = graph[c]
        if rep[c] in may:
            continue
        ks = [k for k, i in enumerate(reader.inputs) if i == node.name]
        if not any(st.sharded_on(axis) and all(st.inputs[k] is not None and st.inputs[k][axis].is_replicate
                                                 for k in ks) for st in strategies[rep[c]]):
            return False
    return True
