"""A plan's costs by layer of a stack, and the stack cut into balanced pipeline stages.

A pipeline cuts a model between the layers of its stack (``model.layers.0`` … ``model.layers.79``:
:func:`autotp.tracing.repeats.find_stacks`, found from the modules' structure, never from names).
:func:`unit_costs` reads a plan of the whole graph (one micro-batch, on the tensor-parallel axis)
and sums, per *unit*, what the pipeline needs to know: what runs before the stack (inputs,
embedding), each layer, and what runs after it (final norm, head, loss):

- the forward and backward seconds of one micro-batch, compute and communication apart (each
  node's compute and the collectives and copies the plan runs at it, as the planner prices them);
- the bytes of state (parameters, gradients, optimizer) and of activations kept for the backward
  (and, for a layer that recomputes, only what leaves it), per rank;
- on an expert axis (:class:`autotp.layout.Layout`), the gradient sums of the weights replicated
  over it are the plan's backward all-reduces, run once per micro-batch as any of the plan's
  collectives (the runtime sums them where the plan reads the weight, not once a step);
- the bytes that cross each cut: the tensors made at or before a unit and read after it (the
  residual stream; masks and rotary tables made before the stack), as each rank holds them. The
  model's inputs never cross: every stage reads its inputs where it runs.

:func:`balanced_cut` splits the layers into contiguous stages of least slowest-stage time, the
first stage with what comes before the stack and the last with what comes after (a min-max
partition of a chain, by bisection on the bound and a greedy fill; a chain needs no general graph
algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from autotp.placement import Strategy
from autotp.planning.costs.costing import CostModel
from autotp.planning.costs.program import program
from autotp.planning.costs.recompute import recomputed_nodes
from autotp.tracing.graph import BUFFER, INPUT, PARAMETER, OpGraph

__all__ = ["UnitCost", "unit_costs", "balanced_cut"]


@dataclass(frozen=True)
class UnitCost:
    """One unit of the chain (before the stack, a layer, after it), per micro-batch and per rank."""

    forward_compute_s: float
    forward_comm_s: float
    backward_compute_s: float
    backward_comm_s: float
    again_s: float  # the forward again, compute and collectives, where the unit recomputes
    parameters: tuple[str, ...]  # parameter nodes the unit reads (a tied weight in every unit reading it)
    activation_bytes: float
    recomputed_activation_bytes: float  # what it keeps when it recomputes: what leaves it
    transient_bytes: float
    buffers_bytes: float
    send_bytes: float  # crossing the cut after this unit
    working_bytes: float = 0.0  # the largest working set one of its ops holds in its backward (an event)

    @property
    def forward_s(self) -> float:
        return self.forward_compute_s + self.forward_comm_s

    @property
    def backward_s(self) -> float:
        return self.backward_compute_s + self.backward_comm_s


def unit_of_nodes(graph: OpGraph, layer_paths: Sequence[str]) -> dict[str, int]:
    """Each node's unit: 0 before the stack, ``1 + i`` in layer ``i``, ``len(layer_paths) + 1`` after.
    A parameter or buffer goes with the first op that reads it; an op outside every layer goes
    before the stack if it comes before layer 0's last node, else after the stack."""
    n_layers = len(layer_paths)
    index = {lp: i for i, lp in enumerate(layer_paths)}
    unit: dict[str, int] = {}
    first_pos = last_pos = None
    for pos, n in enumerate(graph.nodes):
        if n.is_placeholder or not n.module_path:
            continue
        parts = n.module_path.split(".")
        i = next((index[p] for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if p in index), None)
        if i is not None:
            unit[n.name] = 1 + i
            if i == 0 and first_pos is None:
                first_pos = pos
            if i == n_layers - 1:
                last_pos = pos
    if first_pos is None or last_pos is None:
        raise ValueError(f"the stack's layers {layer_paths[0]} … {layer_paths[-1]} have no ops in the graph")
    for pos, n in enumerate(graph.nodes):
        if n.name in unit or n.is_placeholder:
            continue
        unit[n.name] = 0 if pos < first_pos else n_layers + 1 if pos > last_pos else _between(graph, n.name, unit)
    for n in graph.nodes:
        if n.is_placeholder:
            readers = [unit[c] for c in graph.consumers(n.name) if c in unit]
            unit[n.name] = min(readers) if readers else 0
    return unit


def _between(graph: OpGraph, name: str, unit: Mapping[str, int]) -> int:
    """An op among the layers but in none: with the layer of its latest input."""
    known = [unit[i] for i in graph[name].inputs if i in unit]
    return max(known) if known else 0


def unit_costs(graph: OpGraph, chosen: Mapping[str, Strategy], cost: CostModel,
               layer_paths: Sequence[str]) -> list[UnitCost]:
    """The costs of each unit (see the module's docstring) under the strategies ``chosen``."""
    unit = unit_of_nodes(graph, layer_paths)
    n_units = len(layer_paths) + 2
    acc = [dict(fc=0.0, fm=0.0, bc=0.0, bm=0.0, again=0.0, act=0.0, left=0.0, tr=0.0, buf=0.0, send=0.0, work=0.0)
           for _ in range(n_units)]
    params: list[set] = [set() for _ in range(n_units)]
    spec = cost.mesh
    recomputed = recomputed_nodes(graph, layer_paths)  # priced apart: added where a layer recomputes
    colls, copies = program(graph, chosen, spec, cost.train, recomputed)
    for n in graph.nodes:
        a, s = acc[unit[n.name]], chosen[n.name]
        # the collectives an op runs inside itself (routed experts' all-to-alls, a loss on split
        # classes) are in the program's list, priced below with the others: not in its compute too
        inner = (0.0, 0.0) if n.is_placeholder or n.is_view else (
            cost.inner_collectives_s(n, s, backward=False), cost.inner_collectives_s(n, s))
        fwd = cost.node_forward_s(n, s) - inner[0]
        total = cost.node_compute_s(n, s, graph.gradient_reads(n.name)) - inner[1]
        a["fc"] += fwd
        a["bc"] += total - fwd
        if n.name in recomputed:
            a["again"] += fwd
        parts = cost.node_memory(n, s)
        a["act"] += parts.activations_bytes
        a["tr"] += parts.transient_bytes
        if not (n.is_placeholder or n.is_view):
            a["work"] = max(a["work"], cost.working_bytes(n, s))
        a["buf"] += parts.buffers_bytes
        if n.role == PARAMETER:
            for c in graph.consumers(n.name):
                params[unit.get(c, unit[n.name])].add(n.name)
            params[unit[n.name]].add(n.name)
    last = n_units - 1
    for c in colls:
        seconds = cost.collective_s(c.kind, spec.axis_names.index(c.mesh_axis), c.bytes)
        a = acc[unit.get(c.at, last)]
        if c.phase == "forward":
            a["fm"] += seconds
        elif c.phase == "recompute":
            a["again"] += seconds
        else:
            a["bm"] += seconds
    for c in copies:
        seconds = cost.copy_s(c.bytes, c.dtype)
        a = acc[unit.get(c.at, last)]
        a["again" if c.phase == "recompute" else "fm" if c.phase == "forward" else "bm"] += seconds
    # what crosses each cut, and what a recomputing layer keeps: the tensors read in a later unit
    for n in graph.nodes:
        if n.role in (PARAMETER, BUFFER, INPUT):
            continue
        later = [unit[c] for c in graph.consumers(n.name) if unit[c] > unit[n.name]]
        if not later:
            continue
        local = sum(cost.local_bytes(o, chosen[n.name].output) for o in n.outputs)
        acc[unit[n.name]]["left"] += local if n.requires_grad else 0.0
        for u in range(unit[n.name], max(later)):
            acc[u]["send"] += local
    return [UnitCost(a["fc"], a["fm"], a["bc"], a["bm"], a["again"], tuple(sorted(params[u])), a["act"],
                     min(a["left"], a["act"]), a["tr"], a["buf"], a["send"], a["work"]) for u, a in enumerate(acc)]


def balanced_cut(seconds: Sequence[float], parts: int, ranks: int = 0, micro_batches: int = 1) -> list[tuple[int, int]]:
    """``seconds`` of a chain's units split into ``parts`` contiguous runs of at least one unit each,
    ``[(start, end), ...]``: the longest run as short as it can be. Of the cuts that achieve it, the
    more even of two is kept (the bisection's greedy fill, or the cut nearest the even shares).
    With ``ranks`` (runs going round that many ranks, as interleaved stages do), both the busiest
    rank's work and the longest run count: of three cuts (those two, and one by unit count with the
    longer runs in whole rounds first), each as it is and with its boundaries moved a unit at a
    time while that evens the ranks, the one of least estimated step with ``micro_batches`` is kept."""
    n = len(seconds)
    if not 1 <= parts <= n:
        raise ValueError(f"{n} units cannot make {parts} stages of at least one unit each")
    options = [_min_max_cut(seconds, parts), _even_cut(seconds, parts)]
    if ranks <= 1:
        return min(options, key=lambda cut: (max(sum(seconds[a:b]) for a, b in cut),
                                             sum(sum(seconds[a:b]) ** 2 for a, b in cut)))
    q, extra = divmod(n, parts)  # by count: the longer runs first, whole rounds of the ranks at a time
    sizes = [q + 1] * extra + [q] * (parts - extra)
    bounds = [sum(sizes[:k]) for k in range(parts + 1)]
    options.append(list(zip(bounds, bounds[1:])))
    tried = options + [_even_out(seconds, cut, ranks) for cut in options]
    return min(tried, key=lambda cut: _step_estimate(seconds, cut, ranks, micro_batches))


def _step_estimate(seconds: Sequence[float], cut: list[tuple[int, int]], ranks: int, micro_batches: int) -> float:
    """A step's rough length under an interleaved schedule: every micro-batch through the busiest
    rank, plus one longest run per rank the warm-up and the drain wait on."""
    runs = [sum(seconds[a:b]) for a, b in cut]
    busiest = max(sum(runs[k] for k in range(r, len(runs), ranks)) for r in range(ranks))
    return micro_batches * busiest + (ranks - 1) * max(runs)


def _rank_key(seconds: Sequence[float], cut: list[tuple[int, int]], ranks: int) -> tuple[float, float, float]:
    runs = [sum(seconds[a:b]) for a, b in cut]
    loads = [sum(runs[k] for k in range(r, len(runs), ranks)) for r in range(ranks)]
    return (round(max(loads), 12), round(max(runs), 12), sum(x * x for x in loads))


def _even_out(seconds: Sequence[float], cut: list[tuple[int, int]], ranks: int) -> list[tuple[int, int]]:
    """``cut`` with its boundaries moved one unit at a time while that makes the busiest rank's
    work less, then the longest run, then the ranks' loads more even."""
    bounds = [a for a, _ in cut] + [cut[-1][1]]
    best = _rank_key(seconds, cut, ranks)
    for _ in range(20 * len(cut)):
        moved = False
        for i in range(1, len(bounds) - 1):
            for step in (-1, 1):
                j = bounds[i] + step
                if not bounds[i - 1] < j < bounds[i + 1]:
                    continue
                trial = bounds[:i] + [j] + bounds[i + 1:]
                key = _rank_key(seconds, list(zip(trial, trial[1:])), ranks)
                if key < best:
                    bounds, best, moved = trial, key, True
        if not moved:
            break
    return list(zip(bounds, bounds[1:]))


def _even_cut(seconds: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Each boundary where the running sum comes nearest its even share, one unit at least per run."""
    n = len(seconds)
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    bounds, last = [0], 0
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        lo, hi = last + 1, n - (parts - k)
        i = min(range(lo, hi + 1), key=lambda j: abs(prefix[j] - target))
        bounds.append(i)
        last = i
    bounds.append(n)
    return list(zip(bounds, bounds[1:]))


def _min_max_cut(seconds: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """The least longest run: bisection on the bound, each tried by a greedy fill."""
    n = len(seconds)

    def runs(bound: float) -> list[tuple[int, int]] | None:
        out, start, total = [], 0, 0.0
        for i, s in enumerate(seconds):
            if s > bound:
                return None
            if total + s > bound:
                out.append((start, i))
                start, total = i, 0.0
            total += s
        out.append((start, n))
        return out if len(out) <= parts else None

    lo, hi = max(seconds), sum(seconds)
    for _ in range(60):
        mid = (lo + hi) / 2
        if runs(mid) is None:
            lo = mid
        else:
            hi = mid
    cut = runs(hi)
    assert cut is not None
    while len(cut) < parts:  # split the longest run of several units: never above the bound
        k = max((i for i, (a, b) in enumerate(cut) if b - a > 1), key=lambda i: sum(seconds[cut[i][0]:cut[i][1]]))
        a, b = cut[k]
        cut[k:k + 1] = [(a, b - 1), (b - 1, b)]
    return cut
