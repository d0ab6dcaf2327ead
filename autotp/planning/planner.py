"""``autotp.plan``: capture → strategies → costing → ILP → :class:`~autotp.planning.result.plan.Plan`.

>>> import torch, autotp
>>> plan = autotp.plan(torch.nn.Linear(64, 64), (8,), (torch.randn(4, 64),), hardware="h100-sxm",
...                    mode="inference")
>>> plan.mesh.shape, plan.mode
((8,), 'inference')
"""

from __future__ import annotations

import time
from typing import Any, Collection, Mapping, Optional, Sequence

import torch

from autotp.layout import AXIS_NAMES, CONTEXT, Layout
from autotp.mesh import MeshSpec
from autotp.placement import Strategy, format_placements, parse_placements, piece_sizes
from autotp.planning.choices.expert_lists import warn_expert_lists
from autotp.planning.choices.expert_placements import keep_placement
from autotp.planning.choices.strategies import all_strategies, stored_strategy
from autotp.planning.choices.tying import tie
from autotp.planning.costs.costing import MODES, CostModel, MemoryParts
from autotp.planning.costs.program import Collective, LocalCopy, program
from autotp.planning.costs.recompute import check_recompute, layer_chains, recompute_saved_bytes, recomputed_nodes
from autotp.planning.errors import MemoryBudgetError
from autotp.planning.result.explain import ExplainContext
from autotp.planning.result.plan import (
    MemoryPerDevice,
    NodeChoice,
    Plan,
    PlannedInput,
    PredictedTime,
    SolveStats,
    UnevenSplit,
    module_choices,
)
from autotp.planning.rules.gradients import partial_gradient_variants
from autotp.planning.search.context_axis import context_sequence, hold_context_axis
from autotp.planning.search.expert_axis import routed_expert_count, routed_expert_weights
from autotp.planning.search.mesh_search import mesh_shapes, search_meshes
from autotp.planning.search.step_reads import for_a_step
from autotp.planning.solve.solver import solve
from autotp.tracing.dynamic import requirements
from autotp.tracing.export import capture
from autotp.tracing.graph import BUFFER, INPUT, OpGraph
from autotp.tracing.heap import old_objects_frozen
from autotp.tracing.loss import WithLoss
from cost_models import HardwareProfile, hardware_origin, optimizer_spec, resolve_hardware

__all__ = ["plan", "plan_graph", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}


def parse_bytes(value: Any) -> Optional[float]:
    """``40e9``, ``"40GB"``, ``"16GiB"``, ``"512M"`` → bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory_budget {value!r}: expected a positive number of bytes")
        return float(value)
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        num = text.rstrip("KMGTIB")
        unit = text[len(num):]
        try:
            number = float(num)
        except ValueError:
            number = -1.0
        if unit in _UNITS and number > 0:
            return number * _UNITS[unit]
    raise ValueError(f"memory budget {value!r}: expected bytes as a number or a string such as '40GB' or '16GiB'")


def _pinned_nodes(graph: OpGraph, pins: Mapping[str, str]) -> dict[str, str]:
    """The pins by the name of the node of the parameter or buffer they pin (names the graph lacks
    are left to :func:`_apply_pins`, which says so)."""
    nodes = {p.fqn: p.node for p in graph.parameters}
    nodes.update({n.param_fqn: n.name for n in graph.nodes if n.role == BUFFER})
    return {nodes[fqn]: text for fqn, text in pins.items() if fqn in nodes}


def _apply_pins(graph: OpGraph, spec: MeshSpec, rep: Mapping[str, str], strat_rep: dict[str, list],
                pin: Optional[Mapping[str, str]], readers: bool = True) -> None:
    """Keep only the strategies that give each pinned parameter its pinned placements, and, with
    ``readers``, the strategies of the ops that read it that compute with that shard."""
    if not pin:
        return
    wanted: dict[str, tuple] = {}
    buffers = {n.param_fqn: n.name for n in graph.nodes if n.role == BUFFER}  # a cache may be pinned too
    for fqn, text in pin.items():
        try:
            node_name = graph.parameter(fqn).node
        except KeyError:
            if fqn not in buffers:
                raise ValueError(f"pin: the model has no parameter {fqn!r}") from None
            node_name = buffers[fqn]
        try:
            placements = parse_placements(text)
        except ValueError as err:
            raise ValueError(f"pin {fqn}: {err}; expected placements such as 'S(0)' or, on 2 axes, 'RS(0)'") from None
        if placements is None or len(placements) != spec.ndim:
            raise ValueError(f"pin {fqn}: {text!r} gives {0 if placements is None else len(placements)} placements; "
                             f"the mesh {spec} has {spec.ndim} axes")
        node = rep[node_name]
        if wanted.get(node, placements) != placements:
            raise ValueError(f"pin {fqn}: {text!r} conflicts with the pin of a structurally identical layer "
                             f"({format_placements(wanted[node])}); pin repeated layers alike")
        wanted[node] = placements
    for node, placements in wanted.items():
        kept = [s for s in strat_rep[node] if s.output == placements]
        stored = None if kept or readers else stored_strategy(graph[node], placements, spec.shape)
        if stored is not None:  # a cache an earlier graph wrote split, which this one only reads
            kept = [stored]
        if not kept:
            options = ", ".join(sorted({format_placements(s.output) for s in strat_rep[node]}))
            raise ValueError(f"pin: {format_placements(placements)} is not a placement of {graph[node].param_fqn} "
                             f"(shape {list(graph[node].output.shape)}) on mesh {spec}; it can take {options}")
        strat_rep[node] = kept
        # the ops that read the weight compute with that shard (a pin is a layout, not only storage);
        # through a view of it (a transposed weight), the ops that read the view
        todo = [(node, placements)] if readers else []
        while todo:
            source, held = todo.pop()
            for consumer in graph.consumers(source):
                c = rep[consumer]
                ks = [k for k, src in enumerate(graph[consumer].inputs) if src == source]
                reading = [s for s in strat_rep[c] if all(s.inputs[k] == held for k in ks)]
                if not reading:
                    raise ValueError(f"pin {graph[node].param_fqn}: {format_placements(placements)} cannot be read "
                                     f"by {graph[consumer].target} at {graph[consumer].module_path or 'the model'}")
                strat_rep[c] = reading
                outputs = {s.output for s in reading}
                if graph[consumer].is_view and len(outputs) == 1:
                    todo.append((consumer, outputs.pop()))


def predicted_time(graph: OpGraph, chosen: Mapping[str, Strategy], spec: MeshSpec, cost: CostModel,
                   steps: Optional[tuple[Sequence[Collective], Sequence[LocalCopy]]] = None,
                   recomputed: Collection[str] = (), rep: Optional[Mapping[str, str]] = None) -> PredictedTime:
    """Seconds of one step under ``chosen``: every node's compute (and the forward again of the
    ``recomputed`` nodes), and every collective and local copy the program runs
    (:func:`autotp.planning.costs.program.program`, or ``steps`` if given), each priced by ``cost``.
    ``rep``: the tied nodes' representatives (:func:`autotp.planning.choices.tying.tie`), which compute
    alike under one strategy: priced once each. The collectives an op runs inside itself are in the
    program's list, so they count there, once, and not in the op's compute (the solver's objective
    has them with the op)."""
    colls, copies = steps if steps is not None else program(graph, chosen, spec, cost.train, recomputed)
    seconds: dict[tuple, float] = {}
    compute_s = 0.0
    for n in graph.nodes:
        reads = graph.gradient_reads(n.name)
        key = (rep[n.name], reads) if rep is not None else (n.name, reads)
        if key not in seconds:
            inner_s = 0.0 if n.is_placeholder or n.is_view else cost.inner_collectives_s(n, chosen[n.name])
            seconds[key] = cost.node_compute_s(n, chosen[n.name], reads) - inner_s
        compute_s += seconds[key]
    again_s = sum(cost.node_forward_s(graph[n], chosen[n]) - cost.inner_collectives_s(graph[n], chosen[n], backward=False)
                  for n in recomputed if not (graph[n].is_placeholder or graph[n].is_view))
    compute_s += again_s
    comm = [cost.collective_s(c.kind, spec.axis_names.index(c.mesh_axis), c.bytes) for c in colls]
    copy = [cost.copy_s(c.bytes, c.dtype) for c in copies]
    again_s += (sum(t for t, c in zip(comm, colls) if c.phase == "recompute")
                + sum(t for t, c in zip(copy, copies) if c.phase == "recompute"))
    return PredictedTime(compute_s, sum(comm) + sum(copy), again_s)


@old_objects_frozen()  # the collector's full passes walk the plan's objects, not the graph's and torch's
def plan_graph(graph: OpGraph, mesh: Any, hardware: Any = None, mode: str = "train",
               memory_budget: Any = None, time_limit_s: float = 60.0, capture_s: float = 0.0,
               pin: Optional[Mapping[str, str]] = None, optimizer: Any = "adamw",
               recompute: Optional[bool] = None, hardware_source: Optional[str] = None,
               keep: Optional[Mapping[str, str]] = None, explainable: bool = True,
               experts: Optional[Mapping[str, str]] = None, context: Optional[str] = None) -> Plan:
    """Plan an already captured graph (see :func:`plan`). ``hardware_source`` says in the report where
    the profile came from (default: "given", or the default of :func:`plan` when ``hardware`` is None).
    ``keep``: placements the parameters must be stored with, as ``pin`` but leaving the ops that read
    them free to redistribute them (another mode's graph of a module whose weights are in place).
    ``explainable``: the plan keeps the graph and these arguments for ``plan.explain`` (in memory only).
    ``experts``: grouped matmul node -> how it places its experts (``"features"``, ``"whole"``,
    ``"routed"``, ``"replicated"``; :mod:`autotp.planning.choices.expert_placements`), its expert
    weight stored so: the best plan with those experts placed so (the report prices the others).
    ``context``: the name of a mesh axis that is a context axis: the inputs split by sequence on it and
    every weight replicated (:mod:`autotp.planning.search.context_axis`), the ILP placing the rest."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    check_recompute(recompute)
    optimizer = optimizer_spec(optimizer)
    spec = MeshSpec.of(mesh)
    profile = resolve_hardware(hardware)
    budget = parse_bytes(memory_budget)
    if budget is None:
        budget = float(profile.device.memory_bytes)

    t0 = time.perf_counter()
    warn_expert_lists(graph)
    rep, chain_paths = tie(graph, _pinned_nodes(graph, keep or {}))  # weights stored apart stay apart
    reps = [n for n in graph.nodes if rep[n.name] == n.name]
    strat_rep = all_strategies(graph, spec.shape, reps)
    _apply_pins(graph, spec, rep, strat_rep, pin)
    _apply_pins(graph, spec, rep, strat_rep, keep, readers=False)
    if context is not None:
        if context not in spec.axis_names:
            raise ValueError(f"context={context!r}: the mesh {spec} has no such axis; expected one of {spec.axis_names}")
        axis = spec.axis_names.index(context)
        hold_context_axis(graph, axis, rep, strat_rep, spec.shape[axis])
    if experts:
        keep_placement(graph, rep, strat_rep, experts)
    if mode == "train":  # replicated ops that pass partial gradients on (Rg)
        strat_rep = partial_gradient_variants(graph, spec.ndim, rep, strat_rep)
    strategies = {n.name: strat_rep[rep[n.name]] for n in graph.nodes}
    strategies_s = time.perf_counter() - t0

    cost = CostModel(spec, profile, mode, optimizer, graph)
    chains = layer_chains(graph, chain_paths) if cost.train and recompute is not False else []
    if recompute is True and not chains:
        raise ValueError("recompute=True: " + ("activations are kept for a backward only in train mode"
                                               if not cost.train else
                                               "the model has no stack of identical layers that can recompute"))
    solution = solve(graph, strategies, rep, cost, budget, time_limit_s, chains, recompute)
    chosen = {name: strategies[name][i] for name, i in solution.choice.items()}
    layers = [layer for g, k in sorted(solution.recompute.items()) for layer in chains[g][:k]]
    recomputed = recomputed_nodes(graph, [layer.path for layer in layers])

    colls, copies = program(graph, chosen, spec, cost.train, recomputed)
    parts: dict[str, MemoryParts] = {}
    alike: dict[tuple, MemoryParts] = {}  # tied nodes with equal memory keys commit equal bytes
    for n in graph.nodes:
        key = (rep[n.name], cost.memory_key(n))
        if key not in alike:
            alike[key] = cost.node_memory(n, chosen[n.name])
        parts[n.name] = alike[key]
    saved = recompute_saved_bytes(chains, solution.recompute, {n: p.activations_bytes for n, p in parts.items()})
    memory = MemoryPerDevice(
        parameters_bytes=sum(p.parameters_bytes for p in parts.values()),
        gradients_bytes=sum(p.gradients_bytes for p in parts.values()),
        optimizer_bytes=sum(p.optimizer_bytes for p in parts.values()),
        activations_bytes=(sum(p.activations_bytes for p in parts.values()) - saved + cost.copies_bytes(graph, chosen)
                           if cost.train else cost.forward_peak_bytes(graph, chosen)),
        budget_bytes=budget, recompute_saved_bytes=saved, buffers_bytes=sum(p.buffers_bytes for p in parts.values()),
        transient_bytes=max(sum(p.transient_bytes for p in parts.values()), cost.backward_events_bytes(graph, chosen)),
        step_temporary_bytes=sum(p.step_temporary_bytes for p in parts.values()), mode=mode,
    )
    stats = SolveStats(
        solver=solution.solver, status=solution.status, optimal=solution.optimal, variables=solution.variables,
        constraints=solution.constraints, representatives=solution.representatives, nodes=len(graph.nodes),
        capture_s=capture_s, strategies_s=strategies_s, solve_s=solution.seconds, unrolled=graph.unrolled,
    )
    result = Plan(
        model_type=graph.model_type, mesh=spec, mode=mode, hardware=profile,
        nodes=tuple(NodeChoice(n.name, n.target, n.module_path, n.outputs[0].shape, str(chosen[n.name]))
                    for n in graph.nodes),
        parameter_placements={p.fqn: format_placements(chosen[p.node].output) for p in graph.parameters},
        collective_list=tuple(colls), time=predicted_time(graph, chosen, spec, cost, (colls, copies), recomputed, rep),
        memory=memory, stats=stats,
        modules=module_choices(graph, chosen),
        dynamic_dims=tuple(graph.dynamic),
        divisibility=requirements(graph.symbolic, graph.nodes, chosen, spec.shape),
        recompute=tuple(layer.path for layer in layers), optimizer=optimizer,
        uneven=uneven_splits(graph, chosen, spec),
        training=graph.training,
        inputs=tuple(PlannedInput(n.name, tuple(n.outputs[0].shape), n.outputs[0].dtype)
                     for n in graph.nodes if n.role == INPUT),
        hardware_source=hardware_source or hardware_origin(hardware),
        buffer_placements={n.param_fqn: format_placements(chosen[n.name].output) for n in graph.nodes
                           if n.role == BUFFER and any(p.kind != "R" for p in chosen[n.name].output)},
        unread_outputs=tuple(graph.unread_outputs),
    )
    if explainable:  # what plan.explain solves again with (autotp.planning.result.explain); never saved
        def solve_again(pins: dict[str, str], placed: Optional[Mapping[str, str]] = None) -> Plan:
            return plan_graph(graph, spec, profile, mode, budget, time_limit_s, pin=pins, optimizer=optimizer,
                              recompute=recompute, keep=keep, explainable=False,
                              experts={**(experts or {}), **(placed or {})})

        object.__setattr__(result, "_context", ExplainContext(graph, dict(pin or {}), solve_again))
    return result


def uneven_splits(graph: OpGraph, chosen: Mapping[str, Strategy], spec: MeshSpec) -> tuple[UnevenSplit, ...]:
    """The parameters the plan splits unevenly, with the units each rank holds."""
    out = []
    for param in graph.parameters:
        for axis, p in enumerate(chosen[param.node].output):
            if p.is_uneven:
                pieces = piece_sizes(param.info.shape[p.dim], p, spec.shape[axis])
                out.append(UnevenSplit(param.fqn, tuple(param.info.shape), str(p), spec.axis_names[axis],
                                       tuple(size // p.grain for size in pieces)))
    return tuple(out)


def plan(model: torch.nn.Module, mesh: Any, example_inputs: Any, hardware: Any = None, mode: str = "train",
         memory_budget: Any = None, time_limit_s: float = 60.0, pin: Optional[Mapping[str, str]] = None,
         dynamic_dims: Any = False, optimizer: Any = "adamw", recompute: Optional[bool] = None,
         loss_fn: Any = None, pipeline: Any = False) -> Plan:
    """Choose how to split every op of ``model`` over ``mesh``.

    ``mesh`` is a ``DeviceMesh`` or a shape such as ``(8,)`` or ``(2, 4)`` (no processes needed), or a
    device count such as ``64``: the mesh is then chosen too, the plan of least predicted step over
    the shapes of that many devices (one axis, or two with the second inside a node as the profile's
    ``devices_per_node`` allows), each candidate in ``plan.mesh_search`` and the report
    (:mod:`autotp.planning.search.mesh_search`);
    ``hardware`` a built-in profile name, a profile JSON path or a ``HardwareProfile`` (default
    ``"h100-sxm"``, whatever the machine: the report says so); ``mode`` ``"train"`` (the model traced in
    the mode it is in) or ``"inference"`` (traced in eval mode, no backward priced); ``memory_budget`` bytes per device
    (a number or a string like ``"40GB"``; default: the profile's device memory). ``pin`` fixes the
    placements of chosen parameters, and the ops that read them compute with those shards, e.g.
    ``{"layers.0.mlp.up_proj.weight": "S(0)"}`` (colwise); the solver decides the rest.
    ``dynamic_dims`` (default False: all sizes the example's; see :func:`autotp.parallelize`) only
    adds the dynamic dims and what the plan needs of them to the report: the plan is the same.
    ``optimizer`` names the optimizer whose state the memory counts: ``"adamw"`` (default), ``"adam"``,
    ``"sgd_momentum"``, ``"sgd"``, ``"adafactor"`` (none counted) or a ``cost_models.OptimizerSpec``
    (state dtype, fp32 master weights of mixed precision). ``recompute``: None (default) lets the
    planner recompute layers of repeated blocks when memory is short, where that costs less than
    sharding more (:mod:`autotp.planning.costs.recompute`); True recomputes every repeated layer, False none.
    ``loss_fn``: a function of the model's output and the targets (``F.cross_entropy``), planned
    with the model (:class:`autotp.tracing.loss.WithLoss`): its tensors are priced and split, and
    the example inputs then end with the targets (positionally, or ``targets=`` in a dict).
    ``pipeline``: with a device count in train mode, price three-dimensional layouts too, pipeline
    stages of the model's stack of layers times data times tensor parallelism, with micro-batches,
    schedule, ZeRO stage and recompute (:mod:`autotp.planning.search.pipeline_search`); the plan returned
    is the chosen layout's tensor-parallel plan of one micro-batch, with ``plan.pipeline`` saying
    the rest. ``pipeline`` may also be a dict of layout fields the search keeps to (``pp``, ``dp``,
    ``tp``, ``ep``, ``cp``, ``schedule``, ``stages_per_rank``, ``micro_batches``, ``micro_batch_size``,
    ``zero``, ``recompute``), e.g. ``{"pp": 2, "tp": 2}`` or ``{"cp": 2}`` (a context axis, which the
    search otherwise offers from 16384 tokens a sequence): the best layout that has them.
    ``parallelize`` runs the plan's layout (:mod:`autotp.runtime.pipeline.module`).
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    optimizer_spec(optimizer)
    check_recompute(recompute)
    devices = mesh if isinstance(mesh, int) and not isinstance(mesh, bool) else None
    if pipeline and (devices is None or mode != "train"):
        raise ValueError(f"pipeline=True searches the layout of a device count in train mode; given mesh={mesh!r}, "
                         f"mode={mode!r}: give the number of devices (e.g. 64) and mode='train'")
    if pipeline and (recompute is not None or dynamic_dims is not False):
        raise ValueError(f"pipeline=True chooses recompute itself and plans static sizes; given recompute={recompute!r}, "
                         f"dynamic_dims={dynamic_dims!r}: leave both out")
    if devices is not None:
        mesh_shapes(devices)  # a device count: the mesh is chosen too (autotp/planning/search/mesh_search.py)
    else:
        MeshSpec.of(mesh)  # reject a bad mesh before the (slow) capture
    profile = resolve_hardware(hardware)
    parse_bytes(memory_budget)
    if loss_fn is not None:
        model = WithLoss(model, loss_fn)
    if pipeline:
        return _plan_layout(model, devices, example_inputs, profile, hardware, memory_budget, time_limit_s, pin,
                            optimizer, pipeline if isinstance(pipeline, Mapping) else None)
    t0 = time.perf_counter()
    # an inference plan is of the model in eval mode (no dropout; batch norm reads its statistics)
    # stacks of alike layers traced at three layers and unrolled (autotp/tracing/repeats.py): the same
    # graph as a whole trace, in a time that does not grow with depth
    graph = capture(model, example_inputs, dynamic_dims, training=False if mode == "inference" else None, unroll=True)
    capture_s = time.perf_counter() - t0

    def plan_on(shape: Any) -> Plan:
        try:
            return plan_graph(graph, shape, hardware, mode, memory_budget, time_limit_s, capture_s=capture_s,
                              pin=pin, optimizer=optimizer, recompute=recompute)
        except MemoryBudgetError as err:
            if graph.dynamic or dynamic_dims is not False:
                raise
            # the least is the static graph's: a dynamic trace (parallelize's default) may hold other ops
            raise MemoryBudgetError(
                f"{err}. This least is for the model traced with static sizes (autotp.plan's default, "
                f"dynamic_dims=False); autotp.parallelize traces the batch and sequence dims as dynamic by "
                f"default and its plan may need more: for its least, plan with dynamic_dims=None, or call "
                f"parallelize with dynamic_dims=False", err.minimum_bytes) from None

    if devices is not None:
        return search_meshes(devices, profile.devices_per_node, plan_on)
    return plan_on(mesh)


def _plan_layout(model: torch.nn.Module, devices: int, example_inputs: Any, profile: HardwareProfile, hardware: Any,
                 memory_budget: Any, time_limit_s: float, pin: Optional[Mapping[str, str]], optimizer: Any,
                 only: Optional[Mapping[str, Any]] = None) -> Plan:
    """``autotp.plan(..., pipeline=True)``: the model captured at each micro-batch size the search
    needs, planned on each tensor axis (and, for a Mixture-of-Experts model, each expert axis) once,
    every layout priced (autotp/planning/search/pipeline_search.py). A stack of layers of a few kinds
    (autotp/planning/search/layer_kinds.py) is priced from one layer of each kind."""
    import contextlib  # noqa: PLC0415
    import dataclasses  # noqa: PLC0415

    from autotp.planning.search.layer_kinds import (  # noqa: PLC0415
        KindStack,
        expand_units,
        find_kind_stack,
        representatives_only,
    )
    from autotp.planning.search.pipeline_search import search_layouts, units_of_plan  # noqa: PLC0415
    from autotp.tracing.repeats import find_stacks  # noqa: PLC0415

    t0 = time.perf_counter()
    batch = _batch_size(example_inputs)
    budget = parse_bytes(memory_budget) or float(profile.device.memory_bytes)
    stacks = find_stacks(model)
    stack = max(stacks, key=lambda s: s.count) if stacks else find_kind_stack(model)
    if stack is None:
        raise ValueError(f"pipeline=True: {type(model).__name__} has no stack of alike layers to cut into stages "
                         f"(a ModuleList or Sequential of at least 4 alike layers); plan a device count without it")
    # a Mixture-of-Experts model is priced from one layer of each kind (its search plans an ILP per
    # expert axis and micro-batch too); its chosen layout planned on the whole graph afterwards
    one_each = stack if isinstance(stack, KindStack) else KindStack(stack.path, ((0, stack.count),))
    with representatives_only(model, one_each):  # a step reads the loss alone of the outputs
        first = for_a_step(capture(model, _first_rows(example_inputs, batch, 1), False, training=None, unroll=True))
    experts = routed_expert_count(first) if batch > 1 else 0
    kinds = one_each.runs if experts or isinstance(stack, KindStack) else None
    graphs: dict[int, OpGraph] = {1: first} if kinds else {}
    plans: dict[tuple[int, int, int, int, bool], tuple[Plan, Any]] = {}
    paths: list[str] = [stack.layer(i) for i in range(stack.count)]

    def graph_of(rows: int) -> OpGraph:
        if rows not in graphs:
            with representatives_only(model, one_each) if kinds else contextlib.nullcontext():
                graphs[rows] = for_a_step(capture(model, _first_rows(example_inputs, batch, rows), False,
                                                  training=None, unroll=True))
        return graphs[rows]

    def plan_for(tp: int, b: int, ep: int = 1, cp: int = 1, whole_outputs: bool = False) -> tuple[Plan, Any]:
        whole_outputs = whole_outputs and bool(graph_of(b * ep).unread_outputs)  # else the same plan
        if (tp, b, ep, cp, whole_outputs) not in plans:
            graph = graph_of(b * ep)
            if whole_outputs:  # every output returned whole, as a module's forward returns it
                graph = dataclasses.replace(graph, unread_outputs=())
            mesh, pins = (tp,), dict(pin or {})
            if ep > 1 or cp > 1:  # the planned axes of the layout (autotp.layout.Layout.planned_axes)
                axes = Layout(tp=tp, ep=ep, cp=cp)
                mesh = MeshSpec(axes.planned_shape, axes.planned_axes)
            if ep > 1:  # the expert axis: the routed experts split by expert there, the ILP places the rest
                pins.update({fqn: "S(0)" for fqn in routed_expert_weights(graph)})
            # the context axis: the sequence split, the weights whole (autotp/planning/search/context_axis.py)
            p = plan_graph(graph, mesh, hardware, "train", 1e18, time_limit_s, pin=pins or None, optimizer=optimizer,
                           recompute=False, explainable=False, context=AXIS_NAMES[CONTEXT] if cp > 1 else None)
            units = units_of_plan(p, graph, paths)
            if kinds:
                units = dataclasses.replace(units, **dict(zip(("units", "parameters"),
                                                              expand_units(units.units, units.parameters, one_each))))
            plans[tp, b, ep, cp, whole_outputs] = (p, units)
        return plans[tp, b, ep, cp, whole_outputs]

    if kinds:
        paths = one_each.layers()
    sequence = context_sequence(first) if not experts else 0  # a context axis: dense models with attention
    choice = search_layouts(devices, profile, budget, stack.path, stack.count, batch,
                            lambda tp, b, ep=1, cp=1, whole_outputs=False: plan_for(tp, b, ep, cp, whole_outputs)[1],
                            only=only, experts=experts,
                            sequence=sequence)
    best = choice.chosen
    if kinds and not isinstance(stack, KindStack):  # the chosen layout's plan of the whole model
        kinds, paths = None, [stack.layer(i) for i in range(stack.count)]
        graphs.clear()
        plans.clear()
    # a plain layout (no stages, replicas, expert or context axis) runs as one parallel module, whose
    # step is its forward: it returns every output whole, so its plan gathers them and prices so
    stage_plan, _ = plan_for(best.tp, best.micro_batch_size, best.ep, best.cp, whole_outputs=best.layout.plain)
    choice = dataclasses.replace(choice, search_s=time.perf_counter() - t0,
                                 kinds=tuple(one_each.runs) if isinstance(stack, KindStack) else ())
    return dataclasses.replace(stage_plan, pipeline=choice,
                               memory=dataclasses.replace(stage_plan.memory, budget_bytes=budget),
                               hardware_source=hardware_origin(hardware))


def _batch_size(example_inputs: Any) -> int:
    """The batch: the first dim of the first tensor among the example inputs."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor) and t.ndim]
    if not leaves:
        raise ValueError("pipeline=True: the example inputs hold no tensor with a batch dim to split into micro-batches")
    return int(leaves[0].shape[0])


def _first_rows(example_inputs: Any, batch: int, rows: int) -> Any:
    """The example inputs cut to their first ``rows`` along the batch dim (tensors whose first dim is
    the batch); the rest as given."""
    return torch.utils._pytree.tree_map(
        lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == batch else t, example_inputs)
