"""A context axis: the sequence split over an axis the ILP plans, the weights replicated over it.

A context axis (:class:`autotp.layout.Layout`'s ``cp``) is offered only where the graph has
attention (a scaled-dot-product or described-mask attention op) and the sequence, dim 1 of the
model's first input, cuts into ``2 x cp`` equal chunks (what the balanced causal rows of
:mod:`autotp.planning.rules.attention` need). On that axis the plan is held to two things, the ILP
placing everything else (:func:`hold_context_axis`):

- **the inputs split by sequence**: every op that reads a user input of the sequence's length
  (``input_ids``, ``labels``, positions) reads it split along dim 1 there (the input itself is given
  whole to every rank of the axis, so the split is a local slice); an input some reader of which has
  no such split (a padding of the labels, say) is left to the ILP, and a graph whose first input
  cannot be read so is refused;
- **the weights replicated**: every parameter is stored whole on the axis and every op that reads
  one (or a view of it) reads it whole, so their gradients are partial sums over the axis, which the
  plan sums where it reads each weight (as the expert axis sums the weights its experts do not hold);
- **no activation whole**: an op whose output has a dim of the sequence's length (two dims or more)
  does not compute it whole on every rank of the axis, where it can do otherwise: it is split (by
  sequence, or by heads between all-to-alls) or a partial sum. Without this a small model's plan
  gathers the sequence after the embedding and runs every op whole on every rank, the axis then
  splitting nothing (the same step as one device, for the cost of a gather): what a context axis is
  for, memory per rank falling with it, is the activations split.

What comes between is the ILP's: attention takes its query rows split (keys and values gathered
where it reads them), balanced causal rows, or its heads (all-to-alls from the sequence split),
whichever prices cheapest.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from autotp.placement import Placement, Strategy
from autotp.planning.rules.attention import CAUSAL, MASKED
from autotp.tracing.graph import INPUT, PARAMETER, OpGraph

__all__ = ["ATTENTION", "SEQUENCE_DIM", "context_sequence", "context_sizes", "hold_context_axis"]

ATTENTION = frozenset({CAUSAL, MASKED})
SEQUENCE_DIM = 1  # of the model's inputs: (batch, sequence, ...)


def context_sequence(graph: OpGraph) -> int:
    """The sequence a context axis may split: dim 1 of the graph's first tensor input of two dims or
    more, where the graph has attention; 0 where it has none (or no such input)."""
    if not any(n.target in ATTENTION for n in graph.nodes):
        return 0
    first = _first_input(graph)
    return int(first.output.shape[SEQUENCE_DIM]) if first is not None else 0


def context_sizes(sequence: int, devices: int) -> list[int]:
    """The context axis sizes > 1 of ``devices`` that cut ``sequence`` into ``2 x cp`` equal chunks."""
    return [cp for cp in range(2, devices + 1) if devices % cp == 0 and sequence and sequence % (2 * cp) == 0]


def _first_input(graph: OpGraph):
    return next((n for n in graph.nodes if n.role == INPUT and len(n.outputs) == 1 and n.output.ndim > SEQUENCE_DIM),
                None)


def _sequence_split(p: Optional[Placement]) -> bool:
    return p is not None and p.is_shard and p.dim == SEQUENCE_DIM and not (p.is_blocked or p.is_uneven or p.routed)


def _whole(p: Optional[Placement]) -> bool:
    return p is None or (p.is_replicate and not p.grad_partial)


def hold_context_axis(graph: OpGraph, axis: int, rep: Mapping[str, str], strat_rep: dict[str, list[Strategy]],
                      axis_size: int) -> None:
    """Keep, on mesh axis ``axis`` (of ``axis_size`` ranks), only the strategies of a context axis (module
    docstring): the readers of the sequence's inputs reading them split by sequence, every parameter
    stored whole and read whole. Raises ``ValueError`` where the first input's sequence does not
    divide over the axis or its readers cannot read it split."""
    first = _first_input(graph)
    sequence = context_sequence(graph)
    if first is None or not sequence or sequence % axis_size:
        raise ValueError(f"a context axis of {axis_size} ranks splits the sequence (dim {SEQUENCE_DIM} of the first "
                         f"input) of a model with attention; "
                         + ("the model has no attention op" if first is not None and not sequence else
                            "the inputs have no such dim" if first is None else
                            f"its sequence is {sequence}, which does not divide by {axis_size}"))
    for n in graph.nodes:
        if n.role != INPUT or len(n.outputs) != 1 or n.output.ndim <= SEQUENCE_DIM:
            continue
        if n.output.shape[SEQUENCE_DIM] != sequence:
            continue
        held = _held_readers(graph, n.name, rep, strat_rep, lambda s, k: _sequence_split(s.inputs[k][axis]))
        if held is None and n.name == first.name:
            readers = ", ".join(sorted({graph[c].target for c in graph.consumers(n.name)}))
            raise ValueError(f"a context axis splits the first input {n.name!r} by sequence (dim {SEQUENCE_DIM}), and "
                             f"an op reading it ({readers}) has no such split")
        strat_rep.update(held or {})
    for n in graph.nodes:
        if n.role != PARAMETER or rep[n.name] != n.name:
            continue
        stored = [s for s in strat_rep[n.name] if _whole(s.output[axis])]
        if not stored:  # every parameter can be replicated
            raise ValueError(f"a context axis replicates every weight, and {n.param_fqn} has no replicated placement")
        strat_rep[n.name] = stored
        todo = [n.name]
        while todo:
            source = todo.pop()
            held = _held_readers(graph, source, rep, strat_rep, lambda s, k: _whole(s.inputs[k][axis]))
            if held is None:
                raise ValueError(f"a context axis replicates every weight, and an op reading {n.param_fqn} cannot read "
                                 f"it whole")
            strat_rep.update(held)
            todo += [c for c in graph.consumers(source) if graph[c].is_view]
    for n in graph.nodes:
        if n.is_placeholder or rep[n.name] != n.name or not any(o.ndim > 1 and sequence in o.shape for o in n.outputs):
            continue
        split = [s for s in strat_rep[n.name] if not s.output[axis].is_replicate]
        if split:
            strat_rep[n.name] = split


def _held_readers(graph: OpGraph, source: str, rep: Mapping[str, str], strat_rep: Mapping[str, list[Strategy]],
                  reads: Callable[[Strategy, int], bool]) -> Optional[dict[str, list[Strategy]]]:
    """Each reader of ``source`` (by representative) -> its strategies that read it as ``reads`` says
    at every slot it reads it from; None where a reader has no such strategy."""
    out: dict[str, list[Strategy]] = {}
    for consumer in graph.consumers(source):
        c = rep[consumer]
        slots = [k for k, src in enumerate(graph[consumer].inputs) if src == source]
        kept = [s for s in out.get(c, strat_rep[c]) if all(s.inputs[k] is None or reads(s, k) for k in slots)]
        if not kept:
            return None
        out[c] = kept
    return out
