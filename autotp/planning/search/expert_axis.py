"""Which weights an expert axis splits: the routed experts of a Mixture-of-Experts model.

An expert axis (:class:`autotp.layout.Layout`'s ``ep``) is offered only where the graph has a
routed region (:func:`autotp.planning.rules.routed.routed_region`: grouped matmuls of routed rows
whose tokens the all-to-all variant may send to their experts' ranks). Its weights are the
grouped matmuls' expert weights ``(E, K, N)``, found from the graph (the matmul's weight input,
followed back through views to a parameter), never from names.
"""

from __future__ import annotations

from autotp.planning.rules.experts import GROUPED_MM
from autotp.planning.rules.routed import routed_region
from autotp.tracing.graph import PARAMETER, OpGraph

__all__ = ["routed_expert_weights", "routed_expert_count"]


def routed_expert_weights(graph: OpGraph) -> dict[str, int]:
    """Each routed expert weight's name (its fqn) -> its experts (its first dim), for the grouped
    matmuls of the graph's routed regions; empty where it has none."""
    region = routed_region(graph)
    out: dict[str, int] = {}
    for name in region:
        node = graph[name]
        if node.target not in GROUPED_MM:
            continue
        source = graph[node.inputs[1]]
        while source.is_view and source.inputs:
            source = graph[source.inputs[0]]
        if source.role == PARAMETER:
            out[source.param_fqn] = int(source.output.shape[0])
    return out


def routed_expert_count(graph: OpGraph) -> int:
    """The experts an expert axis may split: the fewest of any routed expert weight (0: none)."""
    return min(routed_expert_weights(graph).values(), default=0)
