"""Three-dimensional layouts: pipeline stages, data and tensor parallelism chosen together, priced.

``autotp.plan(model, 64, inputs, pipeline=True)`` prices every layout of 64 devices as
``pp × dp × tp`` (ranks numbered row-major over ``(pp, dp, tp)``: the tensor axis holds neighbouring
ranks and stays inside a node, ``tp`` dividing the profile's ``devices_per_node``), for every
micro-batch size of a few, every schedule (:mod:`autotp.planning.search.schedules`), ZeRO stage and
recompute choice, and keeps the layout of least predicted step that fits the memory budget:

1. **One ILP per (tp, micro-batch).** The model is captured at the micro-batch's size and
   planned by the ILP on the tensor axis ``(tp,)`` with no memory bound (its fastest layout per
   layer: TP, sequence parallelism, where the batch splits). Layers of the stack are tied in the
   ILP, so every stage of a pipeline gets the same layer plan: identical stages are planned once.
   :func:`autotp.planning.search.stages.unit_costs` reads that plan by unit (before the stack, each layer,
   after it).
   For a Mixture-of-Experts model whose routed experts the all-to-all variant may split
   (:mod:`autotp.planning.rules.routed`), layouts ``pp × dp × ep`` too: one ILP per (ep,
   micro-batch) on the expert axis ``(ep,)``, the model captured at ``ep`` ranks' rows (the runtime
   gives every rank of the axis that micro-batch and the plan splits it, as on any planned axis), the experts' weights pinned split by expert there and the ILP
   left to place everything else (it splits the batch and sends the routed rows by all-to-all
   where that prices cheaper, the all-to-alls priced on the axis's link at the busiest rank's
   rows). The plan's collectives run once per micro-batch, as the runtime runs them, the gradient
   sums of the weights replicated over the expert axis among them.
   For a model with attention at long sequence, layouts ``pp × dp × cp × tp`` too: one ILP per
   (cp, tp, micro-batch) on ``(cp,)`` or ``(cp, tp)``, the model captured at the micro-batch whole
   (every rank of the context axis is given it), the inputs read split by sequence on ``cp``, every
   weight whole there and no activation of the sequence's length whole
   (:mod:`autotp.planning.search.context_axis`), the ILP placing the rest; priced as the expert
   axis is, its weights' gradient sums among the plan's collectives of each micro-batch.
2. **Stages.** The stack is cut into ``pp * v`` stages balanced by predicted time
   (:func:`autotp.planning.search.stages.balanced_cut`), the embedding in the first, the head and loss in
   the last; stage ``s`` runs on pipeline rank ``s % pp``.
3. **Data parallelism, priced per stage on its link, as the runtime runs it**: ZeRO 0 (gradients
   all-reduced once per step in DDP's buckets, :mod:`autotp.planning.costs.buckets`: each launched during
   the last micro-batch's backward once its gradients are made, so all but the last bucket's
   all-reduce can hide behind that backward's compute), or FSDP2 with each layer one unit and the
   rest of the stage another, parameters, gradients and optimizer state split over the data axis at the
   optimizer's step. ZeRO 1 gathers every unit once per step and keeps it to the last backward,
   then reduce-scatters the gradients once; ZeRO 3 gathers each unit for every micro-batch's
   forward and backward and reduce-scatters after each backward, holding one layer (and the next,
   prefetched) gathered at a time. These collectives run beside the compute, as FSDP2's prefetch
   runs them: what one micro-batch's forward or backward compute of the stage hides is not
   counted, the rest is; ZeRO 1's reduce-scatter after the last backward is exposed, as is ZeRO
   0's last bucket (and whatever of the others the last backward cannot hide).
4. **The step**: the schedule's orders replayed with each stage's forward and backward seconds and
   the sends between stages on the pipeline axis's link (:func:`autotp.planning.search.schedules.simulate`),
   plus each rank's once-per-step reductions, and the all-reduce over the pipeline axis of each
   weight that stages on two ranks hold (an embedding tied to the head). Memory per rank: its
   stages' state, the gradients they accumulate over the step's micro-batches (whole under ZeRO 0
   and 1, a replica's piece under ZeRO 3) and the most activations its schedule holds at once
   (1F1B's first rank ``pp`` micro-batches'; counted beside the gradients, an upper bound where the
   schedule frees them before the first backward); or, at the optimizer's step, state and gradients.

Each candidate carries why it lost to the chosen one: memory, the bubble, communication or compute.
``autotp.parallelize`` runs the chosen layout (:mod:`autotp.runtime.pipeline`; docs/pipelines.md#limits says what
it leaves out).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from autotp.layout import AXIS_NAMES, CONTEXT, DATA, EXPERT, PIPELINE, TENSOR, Layout
from autotp.planning.costs.buckets import assign_buckets, exposed_all_reduce_s
from autotp.planning.costs.costing import CostModel
from autotp.planning.search.context_axis import context_sizes
from autotp.planning.search.schedules import held_bytes
from autotp.planning.search.schedules import timeline as step_timeline
from autotp.planning.search.stages import UnitCost, balanced_cut, unit_costs
from autotp.tracing.graph import PARAMETER
from autotp.units import format_bytes
from cost_models import HardwareProfile, axis_link_name, collective_time_s, send_time_s

__all__ = ["Candidate", "StageChoice", "PipelineChoice", "price_layout", "layouts", "search_layouts",
           "units_of_plan"]

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# a context axis is offered from this many tokens a sequence (or where the layout asked for names one):
# above the 8192 of Llama 3's pretraining, which ran without one;
# below, the sequence's activations are small beside the weights and splitting it only adds exchanges
CONTEXT_FROM_TOKENS = 16384
SCHEDULE_OPTIONS = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))


@dataclass(frozen=True)
class Candidate:
    """One candidate: the axes (:attr:`layout`, the sizes kept flat here: the fields a plan's file
    and ``pipeline={...}`` name), the schedule (``"none"`` without stages; ``stages_per_rank`` > 1 for
    interleaved 1F1B), micro-batches per step and their size per data-parallel replica, the ZeRO
    stage over the data axis, whether the layers recompute; and, once priced, the predicted step
    (None: it does not fit), its parts on the busiest rank, the bubble, the peak bytes per device
    and why it lost (empty: chosen)."""

    pp: int
    dp: int
    tp: int
    schedule: str
    stages_per_rank: int
    micro_batches: int
    micro_batch_size: int
    zero: int
    recompute: bool
    step_s: Optional[float] = None
    compute_s: Optional[float] = None
    communication_s: Optional[float] = None
    bubble_s: Optional[float] = None
    peak_bytes: Optional[float] = None
    why: str = ""
    ep: int = 1  # the expert axis: experts and each micro-batch's rows split over it
    cp: int = 1  # the context axis: each micro-batch's sequence split over it, the weights replicated

    @property
    def layout(self) -> Layout:
        """The mesh's axes and their roles (:class:`autotp.layout.Layout`)."""
        return Layout(pp=self.pp, dp=self.dp, tp=self.tp, zero=self.zero, ep=self.ep, cp=self.cp)

    @property
    def micro_batch_rows(self) -> int:
        """The rows of one micro-batch as the schedule runs it: ``micro_batch_size`` per rank of the
        expert axis, every rank of it given all ``ep`` ranks' rows, which the plan splits."""
        return self.micro_batch_size * self.ep

    @property
    def bubble_fraction(self) -> Optional[float]:
        return None if self.step_s in (None, 0) else self.bubble_s / self.step_s

    def describe(self) -> str:
        sched = "" if self.pp == 1 else (f", {self.schedule}" + (f" x{self.stages_per_rank}" if self.stages_per_rank > 1
                                                                  else ""))
        ep = f" x ep {self.ep}" if self.ep > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"pp {self.pp} x dp {self.dp}{ep}{cp} x tp {self.tp}{sched}, {self.micro_batches} micro-batches of "
                f"{self.micro_batch_size}{' per rank' if ep else ''}, zero {self.zero}"
                f"{', recompute' if self.recompute else ''}")


@dataclass(frozen=True)
class StageChoice:
    """One stage of the chosen layout: its pipeline rank, the stack's layers ``[first, end)`` it runs,
    whether it holds what comes before or after the stack, its seconds per micro-batch, the bytes
    it sends on, and its bytes of state per device."""

    index: int
    rank: int
    first_layer: int
    end_layer: int
    before: bool
    after: bool
    forward_s: float
    backward_s: float
    send_bytes: float
    state_bytes: float


@dataclass(frozen=True)
class PipelineChoice:
    """What the search chose and priced: the stack it cuts, the links each axis uses, the chosen
    layout with its stages, and the candidates best first (each arrangement of stages and
    micro-batches at its best ZeRO stage and recompute, the top ones; ``priced`` counts every
    layout)."""

    devices: int
    devices_per_node: int
    stack: str
    layers: int
    global_batch: int
    links: tuple[tuple[str, str], ...]
    chosen: Candidate
    stages: tuple[StageChoice, ...]
    candidates: tuple[Candidate, ...]
    priced: int
    search_s: Optional[float] = None  # not saved
    # a stack of layers of a few kinds, priced from the first of each run (layer, layers in the run):
    # the plan is of those layers only (autotp.planning.search.layer_kinds); empty: the whole stack
    kinds: tuple[tuple[int, int], ...] = ()

    @property
    def layout(self) -> Layout:
        """The chosen layout's axes and roles: the mesh ``autotp.parallelize`` runs it on."""
        return self.chosen.layout

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("search_s")
        if not d["kinds"]:  # a plan of the whole stack saves as before
            d.pop("kinds")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PipelineChoice":
        return cls(**{**d, "links": tuple(tuple(x) for x in d["links"]), "chosen": Candidate(**d["chosen"]),
                      "kinds": tuple(tuple(x) for x in d.get("kinds", ())),
                      "stages": tuple(StageChoice(**s) for s in d["stages"]),
                      "candidates": tuple(Candidate(**c) for c in d["candidates"])})


@dataclass(frozen=True)
class _Units:
    """A plan on the tensor axis read by unit, with each parameter's bytes per rank."""

    units: tuple[UnitCost, ...]
    parameters: Mapping[str, tuple[float, float, float, float]]  # params, grads, optimizer, step temporaries


def units_of_plan(plan: Any, graph: Any, layer_paths: Sequence[str]) -> _Units:
    """``plan`` (made by ``plan_graph`` on ``graph``) read by unit of the stack ``layer_paths``."""
    chosen = plan._strategies
    cost = CostModel(plan.mesh, plan.hardware, plan.mode, plan.optimizer, graph)
    units = unit_costs(graph, chosen, cost, layer_paths)
    params = {}
    for n in graph.nodes:
        if n.role == PARAMETER:
            p = cost.node_memory(n, chosen[n.name])
            params[n.name] = (p.parameters_bytes, p.gradients_bytes, p.optimizer_bytes, p.step_temporary_bytes)
    return _Units(tuple(units), params)


def layouts(devices: int, devices_per_node: int, layers: int, batch: int, experts: int = 0,
            sequence: int = 0) -> list[Candidate]:
    """Every layout the search prices (unpriced): ``tp`` dividing a node, ``pp`` at most the layers,
    the batch split evenly over the replicas, micro-batches of :data:`MICRO_BATCH_SIZES`. With
    ``experts`` (a model whose routed experts the all-to-all variant may split), layouts with an
    expert axis too: ``ep`` > 1 dividing the experts, each rank of it a micro-batch of its own rows,
    ``tp`` 1 (the routed rows sit on one axis, every tensor of the experts whole on the others:
    :mod:`autotp.planning.rules.routed`; and a two-axis ILP per layout is ten times a one-axis one).
    With ``sequence`` (the tokens of a model with attention a context axis may split; 0: none),
    layouts with a context axis too: ``cp`` > 1 cutting the sequence into ``2 x cp`` chunks
    (:func:`autotp.planning.search.context_axis.context_sizes`), with ``tp`` 1 or the largest tensor
    axis inside a node beside it (a two-axis ILP each: the search plans a few more, not one per
    ``tp``)."""
    out = []
    for tp in _divisors(devices):
        if tp > devices_per_node or devices_per_node % tp:
            continue
        for pp in _divisors(devices // tp):
            out += _arrangements(pp, devices // (tp * pp), tp, 1, layers, batch)
    for ep in _divisors(devices) if experts else ():
        if ep > 1 and experts % ep == 0:
            for pp in _divisors(devices // ep):
                out += _arrangements(pp, devices // (ep * pp), 1, ep, layers, batch)
    for cp in context_sizes(sequence, devices):
        inside = [tp for tp in _divisors(devices // cp) if devices_per_node % tp == 0]
        for tp in sorted({1, max(inside)}):
            for pp in _divisors(devices // (cp * tp)):
                out += _arrangements(pp, devices // (cp * tp * pp), tp, 1, layers, batch, cp)
    return out


def _arrangements(pp: int, dp: int, tp: int, ep: int, layers: int, batch: int, cp: int = 1) -> list[Candidate]:
    """The candidates of one ``pp x dp x ep x cp x tp``: each micro-batch size, schedule, ZeRO stage and
    recompute choice (none where the layout cannot take the batch or the layers)."""
    out: list[Candidate] = []
    if pp > max(layers, 1) or batch % (dp * ep):
        return out
    per_rank = batch // (dp * ep)  # a replica's rows, each rank of the expert axis its own share
    for b in sorted({b for b in MICRO_BATCH_SIZES if per_rank % b == 0} | ({per_rank} if per_rank
                                                                        <= max(MICRO_BATCH_SIZES) else set())):
        m = per_rank // b
        # as torch.distributed.pipelining runs them: 1F1B needs a micro-batch per stage at least,
        # interleaved 1F1B a whole number of rounds of pp micro-batches
        schedules = [("none", 1)] if pp == 1 else [
            (s, v) for s, v in SCHEDULE_OPTIONS if pp * v <= layers and (v == 1 or m % pp == 0)
            and (s != "1f1b" or m >= pp)]
        for s, v in schedules:
            for zero in ((0, 1, 3) if dp > 1 else (0,)):
                for recompute in (False, True):
                    out.append(Candidate(pp, dp, tp, s, v, m, b, zero, recompute, ep=ep, cp=cp))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Prepared:
    """A layout's stages worked out, before its schedule is replayed: its peak bytes per device and
    a bound no step of it can beat (its busiest rank's work alone, plus the once-per-step reductions)."""

    candidate: Candidate
    stages: tuple[StageChoice, ...]
    peak_bytes: float
    bound_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    compute_s: tuple[float, ...]  # per stage, one micro-batch
    communication_s: tuple[float, ...]
    step_end_s: tuple[float, ...]  # per pipeline rank


def price_layout(layout: Candidate, plan_units: _Units, profile: HardwareProfile, budget_bytes: float
                 ) -> tuple[Candidate, tuple[StageChoice, ...]]:
    """``layout`` priced (see the module's docstring); where it does not fit, its step is None and
    its peak says by how much."""
    prep = _prepare(layout, plan_units, profile)
    return _finish(prep, budget_bytes), prep.stages


def _prepare(layout: Candidate, plan_units: _Units, profile: HardwareProfile) -> _Prepared:
    units = plan_units.units
    n_layers = len(units) - 2
    pp, dp, tp, v, m = layout.pp, layout.dp, layout.tp, layout.stages_per_rank, layout.micro_batches
    n_stages = pp * v
    shape = (pp, dp, layout.ep, layout.cp, tp)  # the links of the pipeline and data axes: the planned axes inside
    dpn = profile.devices_per_node
    pp_link = profile.links[axis_link_name(shape, 0, dpn)]
    dp_link = profile.links[axis_link_name(shape, 1, dpn)]
    again = [u.again_s if layout.recompute and 0 < i <= n_layers else 0.0 for i, u in enumerate(units)]
    seconds = [u.forward_s + u.backward_s + again[i] for i, u in enumerate(units)]
    weights = seconds[1:-1] if n_layers else [0.0]
    weights[0] += seconds[0]
    weights[-1] += seconds[-1]
    cut = balanced_cut(weights, n_stages, ranks=pp if v > 1 else 0, micro_batches=m)
    fwd, bwd, comp, comm, acts, sends, state, opt_step, transient, end_s, grads = ([] for _ in range(11))
    stages = []
    holders: dict[str, set[int]] = {}  # parameter -> the pipeline ranks whose stages hold it
    for k, (a, e) in enumerate(cut):
        idx = list(range(1 + a, 1 + e)) + ([0] if k == 0 else []) + ([n_layers + 1] if k == n_stages - 1 else [])
        us = [units[i] for i in idx]
        f_comp = sum(u.forward_compute_s for u in us)
        f_comm = sum(u.forward_comm_s for u in us)
        b_comp = sum(u.backward_compute_s for u in us) + sum(again[i] for i in idx)
        b_comm = sum(u.backward_comm_s for u in us)
        names = set().union(*(u.parameters for u in us))
        for n in names:
            holders.setdefault(n, set()).add(k % pp)
        p, g, o, t = (sum(plan_units.parameters[n][j] for n in names) for j in range(4))
        buffers = sum(u.buffers_bytes for u in us)
        # what the data axis adds once per step, past the last backward it overlaps
        step_end = 0.0
        during, at_step = p, p + g  # parameters (and gradients) held through the step, at the optimizer's step
        if dp > 1 and layout.zero == 0:  # DDP's buckets over the last micro-batch's backward
            ordered = list(dict.fromkeys(n for i in sorted(idx) for n in units[i].parameters))
            sizes = [plan_units.parameters[n][1] for n in ordered]
            buckets = [sum(sizes[j] for j in b) for b in assign_buckets(sizes)]
            step_end += exposed_all_reduce_s(buckets, lambda b: collective_time_s(dp_link, "all_reduce", b, dp), b_comp)
        elif dp > 1:  # FSDP2 as the runtime runs it (autotp/runtime/pipeline/stage_units.py): each layer of the stage one
            # unit, the rest of the stage (what comes before or after the stack) another; at the
            # optimizer's step every state sharded over the data axis
            at_step, o, t = (p + g) / dp, o / dp, t / dp
            gather = collective_time_s(dp_link, "all_gather", p, dp)
            reduce = collective_time_s(dp_link, "reduce_scatter", g, dp)
            if layout.zero == 1:  # every unit gathered at the step's first forward (prefetched beside its
                # compute) and kept to the last backward; the gradients reduce-scattered after it, exposed
                during = p + p / dp
                step_end += reduce + max(gather - f_comp, 0.0)
            else:  # zero 3: each unit gathered for each micro-batch's forward and backward, reduce-scattered
                # after its backward, beside the compute: only what the compute cannot hide adds. Held at
                # once: the shards, the rest of the stage's unit (whole through the forward) and a layer
                # gathered with the next one prefetched
                root = set().union(*(units[i].parameters for i in idx if not 0 < i <= n_layers))
                layer_bytes = [sum(plan_units.parameters[n][0] for n in set(units[i].parameters) - root)
                               for i in idx if 0 < i <= n_layers]
                during = p / dp + sum(plan_units.parameters[n][0] for n in root) + 2 * max(layer_bytes, default=0.0)
                f_comm += max(gather - f_comp, 0.0)
                b_comm += max(gather + reduce - b_comp, 0.0)
        fwd.append(f_comp + f_comm)
        bwd.append(b_comp + b_comm)
        comp.append(f_comp + b_comp)
        comm.append(f_comm + b_comm)
        acts.append(sum(u.recomputed_activation_bytes if layout.recompute and 0 < i <= n_layers else u.activation_bytes
                        for i, u in zip(idx, us)))
        send = units[e].send_bytes if k < n_stages - 1 else 0.0
        sends.append(send)
        state.append(during + o + buffers)
        opt_step.append(at_step - during + t)  # added to the state: what the optimizer's step holds
        grads.append(g / dp if dp > 1 and layout.zero >= 3 else g)  # accumulated over the micro-batches
        # the backward's first gradients, and the largest working set one op holds in it (an event)
        transient.append(sum(u.transient_bytes for u in us) + max((u.working_bytes for u in us), default=0.0))
        end_s.append(step_end)
        stages.append(StageChoice(k, k % pp, a, e, k == 0, k == n_stages - 1, fwd[-1], bwd[-1], send, state[-1]))
    schedule = layout.schedule if pp > 1 else "1f1b"  # one stage: accumulation, each backward after its forward
    mine = [[k for k in range(n_stages) if k % pp == r] for r in range(pp)]
    held = held_bytes(schedule, pp, m, v, acts)
    peak = max(max(sum(state[k] + grads[k] for k in ks) + held[r] + sum(transient[k] for k in ks),
                   sum(state[k] + opt_step[k] for k in ks)) for r, ks in enumerate(mine))
    # a weight stages on several ranks hold (an embedding tied to the head): after the backward, its
    # gradient summed over the pipeline axis, every rank of it taking part (autotp.runtime.pipeline.module)
    shard = dp if dp > 1 and layout.zero else 1  # ZeRO 1 and 3 hold a replica's piece of the gradient
    tied_s = sum(collective_time_s(pp_link, "all_reduce", plan_units.parameters[n][1] / shard, pp)
                 for n, ranks in holders.items() if len(ranks) > 1)
    ends = tuple(sum(end_s[k] for k in ks) + tied_s for ks in mine)
    bound = max(m * sum(fwd[k] + bwd[k] for k in ks) for ks in mine) + max(ends)
    return _Prepared(layout, tuple(stages), peak, bound, tuple(fwd), tuple(bwd),
                     tuple(send_time_s(pp_link, x) for x in sends[:-1]), tuple(comp), tuple(comm), ends)


def _finish(prep: _Prepared, budget_bytes: float) -> Candidate:
    """The prepared layout's step: its schedule replayed; a layout over the budget is not."""
    layout = prep.candidate
    if prep.peak_bytes > budget_bytes:
        return Candidate(**{**asdict(layout), "peak_bytes": prep.peak_bytes})
    pp, m = layout.pp, layout.micro_batches
    schedule = layout.schedule if pp > 1 else "1f1b"
    t = step_timeline(schedule, pp, m, layout.stages_per_rank, prep.forward_s, prep.backward_s, prep.send_s)
    mine = [[k for k in range(len(prep.stages)) if k % pp == r] for r in range(pp)]
    step = t.span_s + max(prep.step_end_s)
    busiest = max(range(pp), key=lambda r: t.busy_s[r] + prep.step_end_s[r])
    compute = m * sum(prep.compute_s[k] for k in mine[busiest])
    communication = m * sum(prep.communication_s[k] for k in mine[busiest]) + prep.step_end_s[busiest]
    return Candidate(**{**asdict(layout), "step_s": step, "compute_s": compute, "communication_s": communication,
                     "bubble_s": max(step - compute - communication, 0.0), "peak_bytes": prep.peak_bytes})


def search_layouts(devices: int, profile: HardwareProfile, budget_bytes: float, stack: str, layers: int, batch: int,
                   units_for: Callable[..., _Units], keep: int = 20,
                   only: Optional[Mapping[str, Any]] = None, experts: int = 0, sequence: int = 0) -> PipelineChoice:
    """Every layout of :func:`layouts` priced with ``units_for(tp, micro_batch_size)`` (cached by the
    caller; ``units_for(tp, micro_batch_size, ep)`` for a layout with an expert axis, the micro-batch
    size per rank of it; ``units_for(tp, micro_batch_size, ep, cp)`` for one with a context axis;
    ``units_for(tp, micro_batch_size, whole_outputs=True)`` for a plain layout, run as one module
    that returns every output whole, where the others' step reads the loss alone:
    :mod:`autotp.planning.search.step_reads`),
    the fastest that fits chosen. Raises :class:`MemoryBudgetError` when none fits. ``experts``: the
    routed experts of a model the expert axis may split (0: none). ``sequence``: the tokens a context
    axis may split (0: none; :mod:`autotp.planning.search.context_axis`), offered where the sequence
    is long (:data:`CONTEXT_FROM_TOKENS` or more) or ``only`` names a ``cp``.

    Two cuts keep it quick, neither losing the fastest: for each ``tp`` the micro-batch sizes go
    up only while some layout of the last size fits (a larger one holds more); and a layout's
    schedule is replayed only while its bound (its busiest rank's work alone) is under the best
    step found, the layouts taken by bound."""
    from autotp.planning.errors import MemoryBudgetError  # noqa: PLC0415

    t0 = time.perf_counter()
    dpn = profile.devices_per_node
    long = sequence >= CONTEXT_FROM_TOKENS or (only or {}).get(AXIS_NAMES[CONTEXT], 1) != 1
    every = layouts(devices, dpn, layers, batch, experts, sequence if long else 0)
    if only:
        fields = {f.name for f in dataclasses.fields(Candidate)} - {"step_s", "compute_s", "communication_s", "bubble_s",
                                                                  "peak_bytes", "why"}
        unknown = sorted(set(only) - fields)
        if unknown:
            raise ValueError(f"pipeline={dict(only)!r}: {unknown} are not layout fields; expected some of {sorted(fields)}")
        kept = [x for x in every if all(getattr(x, k) == v for k, v in only.items())]
        if not kept:
            values = {k: sorted({getattr(x, k) for x in every}, key=str) for k in only}
            raise ValueError(f"pipeline={dict(only)!r}: no layout of {devices} devices has them; the values that "
                             f"occur: {values}")
        every = kept
    grouped: dict[tuple[int, int, int, int], list[Candidate]] = {}
    for layout in every:
        grouped.setdefault((layout.ep, layout.cp, layout.tp, layout.micro_batch_size), []).append(layout)
    prepared: list[_Prepared] = []
    skipped = 0
    for planned in sorted({key[:3] for key in grouped}):
        ep, cp, tp = planned
        fits_smaller = True
        for b in sorted(key[3] for key in grouped if key[:3] == planned):
            if not fits_smaller:
                skipped += len(grouped[planned + (b,)])
                continue
            units = units_for(tp, b, *((ep, cp) if cp > 1 else (ep,) if ep > 1 else ()))
            # a plain layout runs as one module, which returns every output whole: its own plan
            whole = units_for(tp, b, whole_outputs=True) if any(c.layout.plain for c in grouped[planned + (b,)]) \
                else None
            batch_prepared = [_prepare(layout, whole if layout.layout.plain else units, profile)
                              for layout in grouped[planned + (b,)]]
            prepared += batch_prepared
            fits_smaller = any(p.peak_bytes <= budget_bytes for p in batch_prepared)
    fitting = sorted((p for p in prepared if p.peak_bytes <= budget_bytes), key=lambda p: p.bound_s)
    if not fitting:
        least = min(prepared, key=lambda p: p.peak_bytes)
        raise MemoryBudgetError(
            f"no layout of {devices} devices fits {format_bytes(budget_bytes)} per device: the least, "
            f"{least.candidate.describe()}, needs {format_bytes(least.peak_bytes)}", least.peak_bytes)
    done: list[tuple[Candidate, _Prepared]] = []
    best_s = math.inf
    for p in fitting:
        if p.bound_s >= best_s:
            break
        priced = _finish(p, budget_bytes)
        done.append((priced, p))
        best_s = min(best_s, priced.step_s)
    best, best_prep = min(done, key=lambda lp: (lp[0].step_s, lp[0].pp, lp[0].zero, lp[0].recompute))
    finished = {id(p) for _, p in done}
    bounded = [Candidate(**{**asdict(p.candidate), "peak_bytes": p.peak_bytes,
                         "why": f"at least {_ms(p.bound_s - best.step_s)} slower: its busiest rank's work alone "
                                f"takes {p.bound_s:.3f} s (its schedule not replayed)"})
               for p in fitting if id(p) not in finished]
    over = sorted((_finish(p, budget_bytes) for p in prepared if p.peak_bytes > budget_bytes),
                  key=lambda c: c.peak_bytes)
    ranked = [best] + sorted((_lost(c, best, budget_bytes) for c, _ in done if c is not best),
                             key=lambda c: c.step_s) + bounded + [_lost(c, best, budget_bytes) for c in over]
    # shown: each arrangement of stages and micro-batches once, at its best ZeRO stage and recompute
    seen, shown = set(), []
    for c in ranked:
        key = (c.pp, c.dp, c.ep, c.cp, c.tp, c.schedule, c.stages_per_rank, c.micro_batches)
        if key not in seen:
            seen.add(key)
            shown.append(c)
    shape = (best.pp, best.dp, best.ep, best.cp, best.tp)
    roles = (PIPELINE, DATA, EXPERT, CONTEXT, TENSOR)
    links = tuple((name, axis_link_name(shape, a, dpn)) for a, name in enumerate(roles)
                  if (name != EXPERT or best.ep > 1) and (name != CONTEXT or best.cp > 1))
    return PipelineChoice(devices, dpn, stack, layers, batch, links, best, best_prep.stages, tuple(shown[:keep]),
                          len(prepared) + skipped, time.perf_counter() - t0)


def _ms(seconds: float) -> str:
    return f"+{seconds * 1e3:.1f} ms"


def _lost(c: Candidate, best: Candidate, budget_bytes: float) -> Candidate:
    """``c`` with why it lost to ``best``."""
    if c.step_s is None:
        why = f"memory: {c.peak_bytes / 2**30:.1f} GiB per device over the {budget_bytes / 2**30:.1f} GiB budget"
    elif math.isclose(c.step_s, best.step_s, rel_tol=1e-9):
        why = "as fast (of equals the search keeps fewer stages, then less sharding)"
    else:
        more = {"bubble": c.bubble_s - best.bubble_s, "communication": c.communication_s - best.communication_s,
                "compute": c.compute_s - best.compute_s}
        part = max(more, key=more.get)
        why = f"{part} {_ms(more[part])}"
    return Candidate(**{**asdict(c), "why": why})
