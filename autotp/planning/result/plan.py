"""The Plan: the chosen placement of every node and parameter, and what follows from it.

A :class:`Plan` is plain data (it saves to JSON and loads back, never pickle): the mesh, mode and
hardware profile it was made for, one strategy per node, and what the cost model predicts for it:
the collectives of one step, the time split into compute and communication, the memory per
device. ``rewrite`` and ``report`` both read it; neither re-solves anything.

>>> import torch, autotp
>>> plan = autotp.plan(torch.nn.Linear(64, 64), (8,), (torch.randn(4, 64),), hardware="h100-sxm")
>>> plan.module_styles()
{'': 'replicate'}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from autotp import ops
from autotp.mesh import MeshSpec
from autotp.placement import Strategy, dim_divisor, format_placements
from autotp.planning.costs.program import Collective
from autotp.planning.errors import PlanError
from autotp.planning.result.expert_choice import ExpertChoice, expert_choices
from autotp.planning.result.explain import ExplainContext, explain
from autotp.planning.result.report import render
from autotp.planning.search.mesh_search import MeshCandidate
from autotp.planning.search.pipeline_search import PipelineChoice
from autotp.tracing.dynamic import Divisibility, DynamicDim
from autotp.tracing.graph import BUFFER, INPUT, PARAMETER, OpGraph
from autotp.words import with_article
from cost_models import HardwareProfile, OptimizerSpec

__all__ = ["Plan", "PlannedInput", "PredictedTime", "MemoryPerDevice", "SolveStats", "ModuleChoice", "load_plan"]

SCHEMA = "autotp.plan/1"
_TIMING_FIELDS = ("capture_s", "strategies_s", "solve_s")


@dataclass(frozen=True)
class PredictedTime:
    compute_s: float
    communication_s: float
    recompute_s: float = 0.0  # of the two above, what recomputing layers adds (forward compute and collectives)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s


@dataclass(frozen=True)
class MemoryPerDevice:
    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # kept for the backward, after recompute
    budget_bytes: Optional[float] = None
    recompute_saved_bytes: float = 0.0  # activations that recomputed layers do not keep
    buffers_bytes: float = 0.0  # the model's buffers: KV caches, running statistics, masks
    transient_bytes: float = 0.0  # the gradients the backward starts from (of the model's outputs)
    step_temporary_bytes: float = 0.0  # what the optimizer's step allocates while it runs
    mode: str = "train"

    def phases(self) -> dict[str, float]:
        """Bytes per device where a step's memory peaks: in training, at the backward's start (the
        state, every activation the backward keeps, its first gradients; no parameter's gradient
        yet) and at the optimizer's step (the state, every gradient, the step's temporaries; the
        activations freed); in inference, the state and buffers."""
        state = self.parameters_bytes + self.optimizer_bytes + self.buffers_bytes
        if self.mode != "train":
            return {"forward": state + self.activations_bytes}
        return {"backward start": state + self.activations_bytes + self.transient_bytes,
                "optimizer step": state + self.gradients_bytes + self.step_temporary_bytes}

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    @property
    def peak_bytes(self) -> float:
        return max(self.phases().values())

    @property
    def total_bytes(self) -> float:
        """The peak (:meth:`phases`): what must fit the device."""
        return self.peak_bytes


@dataclass(frozen=True)
class SolveStats:
    solver: str
    status: str
    optimal: bool
    variables: int
    constraints: int
    representatives: int
    nodes: int
    capture_s: Optional[float]  # None in a plan loaded from a file: timings are not saved
    strategies_s: Optional[float]
    solve_s: Optional[float]
    # the stacks traced at three layers and unrolled (autotp/tracing/repeats.py), as "path (n layers)";
    # not saved: a loaded plan says nothing of how its graph was traced
    unrolled: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModuleChoice:
    """The summary a person reads for one module: its style and the placements around it."""

    module: str
    style: str
    op: str
    weight: str
    input: str
    output: str


@dataclass(frozen=True)
class UnevenSplit:
    """A parameter split into units the ranks do not divide (``S(d)~g``, :mod:`autotp.planning.rules.uneven`)."""

    parameter: str
    shape: tuple[int, ...]
    placement: str  # the axis's placement, e.g. "S(0)~128"
    mesh_axis: str
    units: tuple[int, ...]  # units of the grain each rank holds, in rank order

    def describe(self) -> str:
        grain = self.placement.split("~")[1]
        total, n = sum(self.units), len(self.units)
        return (f"{self.parameter} {list(self.shape)} {self.placement} over {self.mesh_axis}: {total} units of {grain}, "
                f"{'/'.join(map(str, self.units))} per rank (the largest piece sets the time: "
                f"{max(self.units)} where an even split would hold {total / n:.3g})")


@dataclass(frozen=True)
class PlannedInput:
    """A user input of the example the plan was traced with: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class NodeChoice:
    name: str
    target: str
    module: str
    shape: tuple[int, ...]
    strategy: str


@dataclass(frozen=True, eq=False)
class Plan:
    model_type: str
    mesh: MeshSpec
    mode: str
    hardware: HardwareProfile
    nodes: tuple[NodeChoice, ...]
    parameter_placements: Mapping[str, str]
    collective_list: tuple[Collective, ...]
    time: PredictedTime
    memory: MemoryPerDevice
    stats: SolveStats
    modules: tuple[ModuleChoice, ...]
    # the inputs' dynamic dims and what the plan needs of them (autotp.tracing.dynamic); empty: all static
    dynamic_dims: tuple[DynamicDim, ...] = ()
    divisibility: tuple[Divisibility, ...] = ()
    # the layers that recompute their activations in the backward (module paths), and the optimizer priced
    recompute: tuple[str, ...] = ()
    optimizer: OptimizerSpec = OptimizerSpec()
    # parameters split unevenly (whole heads or rows the ranks do not divide), for the report
    uneven: tuple[UnevenSplit, ...] = ()
    # how the model was traced: its mode (True: train; None in a plan saved before this was kept) and
    # its example inputs; and where the hardware profile came from (given, or which default)
    training: Optional[bool] = None
    inputs: tuple[PlannedInput, ...] = ()
    hardware_source: str = "given"
    # buffers by name -> placements, for those the plan stores split (a KV cache by heads); others are whole
    buffer_placements: Mapping[str, str] = field(default_factory=dict)
    # given a device count, the mesh shapes the search planned, best first (autotp/planning/search/mesh_search.py)
    mesh_search: tuple[MeshCandidate, ...] = ()
    # pipeline=True: the layout chosen in three dimensions, its stages and the candidates priced
    # (autotp/planning/search/pipeline_search.py); this plan is then its stages' tensor-parallel plan
    pipeline: Optional[PipelineChoice] = None
    # the outputs no step reads whole (a pipeline's step returns the loss alone): the plan neither
    # gathers nor prices them (autotp/planning/search/step_reads.py); the runtime gathers them only
    # for a call that returns them (PipelineModule.forward, a step with a loss_fn of its own)
    unread_outputs: tuple[str, ...] = ()
    _strategies: Mapping[str, Strategy] = field(default=None, repr=False)  # type: ignore[assignment]
    # the captured graph and the planner's arguments, for explain() (a plan made in this process)
    _context: Optional["ExplainContext"] = field(default=None, repr=False, compare=False)
    # expert_choices() once computed (it solves again): kept with the plan in memory, never saved
    _expert_choices: Optional[tuple] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._strategies is None:
            parsed: dict[str, Strategy] = {}  # the layers' nodes share a few texts: each parsed once
            for n in self.nodes:
                if n.strategy not in parsed:
                    parsed[n.strategy] = Strategy.parse(n.strategy)
            object.__setattr__(self, "_strategies", {n.name: parsed[n.strategy] for n in self.nodes})

    # -- the public API (docs/design.md) ---------------------------------------------------------

    def module_styles(self) -> dict[str, str]:
        """``{"layers.0.self_attn.q_proj": "colwise", ...}`` for every module with a weight."""
        return {m.module: m.style for m in self.modules}

    def collectives(self) -> list[Collective]:
        return list(self.collective_list)

    def predicted_time(self) -> PredictedTime:
        return self.time

    def memory_per_device(self) -> MemoryPerDevice:
        return self.memory

    def memory_timeline(self) -> dict[str, float]:
        """Bytes per device at the points of a step where memory peaks, in step order
        (:meth:`MemoryPerDevice.phases`): in training the backward's start and the optimizer's step,
        in inference the forward's fullest step. The largest is the plan's memory."""
        return self.memory.phases()

    def strategy(self, node: str) -> Strategy:
        return self._strategies[node]

    @property
    def strategies(self) -> Mapping[str, Strategy]:
        return self._strategies

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """``{(phase, kind): count}`` over one step."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.collective_list:
            counts[(c.phase, c.kind)] = counts.get((c.phase, c.kind), 0) + 1
        return counts

    def report(self, fmt: str = "text", explain: bool = False) -> str:
        """The plan as text, "json" or "html"; ``explain``: the text ends with :meth:`explain` of the
        modules left replicated (repeated layers once), each placement they could have, priced."""
        return render(self, fmt, explain)

    def explain(self, module: str):
        """Why ``module`` is split as it is: each placement its largest weight could have, with the step
        time, collectives and memory of the best plan that stores it so (:mod:`autotp.planning.result.explain`)."""
        return explain(self, module)

    def expert_choices(self) -> tuple[ExpertChoice, ...]:
        """For each kind of routed MoE layer (found from its grouped matmuls), the placement of its
        experts the plan chose and the best plan with each other placement, priced in the terms that
        decide (:mod:`autotp.planning.result.expert_choice`); empty for a model without. Solved
        once, on the first call (the report calls it), and kept."""
        if self._expert_choices is None:
            object.__setattr__(self, "_expert_choices", expert_choices(self))
        return self._expert_choices

    def storage_pins(self, graph: OpGraph) -> dict[str, str]:
        """What a later plan of another graph of the model must store where this plan does (``keep``
        of :func:`autotp.planning.planner.plan_graph`): every parameter, and every buffer of ``graph``
        that may be stored split, as this plan stores it (whole where it does not split it)."""
        whole = "R" * self.mesh.ndim
        return {**self.parameter_placements,
                **{n.param_fqn: self.buffer_placements.get(n.param_fqn, whole) for n in graph.nodes
                   if n.role == BUFFER and not n.persistent}}

    # -- persistence ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model_type": self.model_type,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "mode": self.mode,
            "hardware": json.loads(self.hardware.to_json()),
            "nodes": [[n.name, n.target, n.module, list(n.shape), n.strategy] for n in self.nodes],
            "parameter_placements": dict(self.parameter_placements),
            "collectives": [asdict(c) for c in self.collective_list],
            "time": asdict(self.time),
            "memory": asdict(self.memory),
            # wall-clock timings stay out of the file: the same inputs give byte-identical JSON
            "stats": {k: v for k, v in asdict(self.stats).items() if k not in _TIMING_FIELDS + ("unrolled",)},
            "modules": [asdict(m) for m in self.modules],
            "dynamic_dims": [asdict(d) for d in self.dynamic_dims],
            "divisibility": [asdict(d) for d in self.divisibility],
            "recompute": list(self.recompute),
            "optimizer": asdict(self.optimizer),
            "uneven": [asdict(u) for u in self.uneven],
            "training": self.training,
            "inputs": [asdict(i) for i in self.inputs],
            "hardware_source": self.hardware_source,
            "buffer_placements": dict(self.buffer_placements),
            "mesh_search": [asdict(c) for c in self.mesh_search],
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            **({"unread_outputs": list(self.unread_outputs)} if self.unread_outputs else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if d.get("schema") != SCHEMA:
            raise PlanError(f"plan schema {d.get('schema')!r}: expected {SCHEMA!r}")
        try:
            return cls(
                model_type=d["model_type"],
                mesh=MeshSpec(tuple(d["mesh"]["shape"]), tuple(d["mesh"]["axis_names"])),
                mode=d["mode"],
                hardware=HardwareProfile.from_json(json.dumps(d["hardware"])),
                nodes=tuple(NodeChoice(n[0], n[1], n[2], tuple(n[3]), n[4]) for n in d["nodes"]),
                parameter_placements=dict(d["parameter_placements"]),
                collective_list=tuple(Collective(**c) for c in d["collectives"]),
                time=PredictedTime(**d["time"]),
                memory=MemoryPerDevice(**{"mode": d["mode"], **d["memory"]}),
                stats=SolveStats(**{**{k: None for k in _TIMING_FIELDS}, **d["stats"]}),
                modules=tuple(ModuleChoice(**m) for m in d["modules"]),
                dynamic_dims=tuple(DynamicDim(**x) for x in d.get("dynamic_dims", ())),
                divisibility=tuple(Divisibility(**x) for x in d.get("divisibility", ())),
                recompute=tuple(d.get("recompute", ())),
                optimizer=_optimizer(d.get("optimizer", {})),
                uneven=tuple(UnevenSplit(u["parameter"], tuple(u["shape"]), u["placement"], u["mesh_axis"],
                                         tuple(u["units"])) for u in d.get("uneven", ())),
                training=d.get("training"),
                inputs=tuple(PlannedInput(i["name"], tuple(i["shape"]), i["dtype"]) for i in d.get("inputs", ())),
                hardware_source=d.get("hardware_source", "given"),
                buffer_placements=dict(d.get("buffer_placements", {})),
                mesh_search=tuple(MeshCandidate.from_dict(c) for c in d.get("mesh_search", ())),
                pipeline=PipelineChoice.from_dict(d["pipeline"]) if d.get("pipeline") else None,
                unread_outputs=tuple(d.get("unread_outputs", ())),
            )
        except (KeyError, TypeError, IndexError) as err:
            raise PlanError(f"plan file is missing or has a malformed field: {err}") from err

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # -- checks --------------------------------------------------------------------------------

    def check_matches(self, graph: OpGraph, mesh: MeshSpec) -> None:
        """Raise :class:`PlanError` naming the first difference between this plan and a graph/mesh."""
        if tuple(mesh.shape) != tuple(self.mesh.shape):
            raise PlanError(f"the plan was made for mesh {self.mesh}, but the mesh given is {mesh}")
        for planned in self.nodes:  # a plan edited by hand may split dims the mesh does not divide
            self._check_even(planned.name, planned.target, self._strategies[planned.name].output,
                             planned.shape, mesh)
        differs = next((i for i, (planned, node) in enumerate(zip(self.nodes, graph.nodes))
                        if (planned.name, planned.target, tuple(planned.shape))
                        != (node.name, node.target, node.outputs[0].shape)), None)
        if differs is not None or len(graph.nodes) != len(self.nodes):
            raise PlanError(self._difference(graph, differs))
        for node in graph.nodes:
            strat = self._strategies[node.name]
            for placements, info in zip(strat.inputs, node.input_infos):
                self._check_even(node.name, node.target, placements, info.shape, mesh)
        if self.recompute:
            from autotp.planning.costs.recompute import layer_chains

            layers = {layer.path for chain in layer_chains(graph) for layer in chain}
            unknown = [path for path in self.recompute if path not in layers]
            if unknown:
                raise PlanError(f"the plan recomputes {', '.join(unknown)}, which the model does not have as layers "
                                f"of a stack of identical layers (those are: {', '.join(sorted(layers)) or 'none'})")

    def _difference(self, graph: OpGraph, i: Optional[int]) -> str:
        """Why ``graph`` is not the graph this plan was made for, in a user's words: the model's class,
        its mode, its example inputs, or the first module whose ops differ."""
        head = "the plan was made for another model"
        if self.model_type and graph.model_type and self.model_type != graph.model_type:
            return (f"{head}: the plan is for {with_article(self.model_type)}, the model is "
                    f"{with_article(graph.model_type)}; plan this model")
        if self.training is not None and self.training != graph.training:
            made, now = ("train", "eval") if self.training else ("eval", "train")
            return (f"the plan was traced with the model in {made} mode, and the model was traced in {now} mode "
                    f"(dropout and batch norm differ between the two); call model.{made}() before parallelize, or "
                    f"plan the model in {now} mode")
        given = {n.name: n.outputs[0] for n in graph.nodes if n.role == INPUT}
        for planned in self.inputs:
            info = given.get(planned.name)
            if info is None:
                return (f"{head}: the plan was traced with an input {planned.name!r}, which these example inputs "
                        f"do not have (they have {', '.join(given) or 'none'}); pass the inputs the plan was made with")
            if tuple(info.shape) != tuple(planned.shape) or info.dtype != planned.dtype:
                return (f"the plan was made for input {planned.name!r} of shape {list(planned.shape)} "
                        f"({planned.dtype}), but the example gives shape {list(info.shape)} ({info.dtype}); "
                        f"give parallelize example inputs of the plan's shapes, or plan again for these")
        if i is None:
            return (f"{head}: it has {len(self.nodes)} nodes, the model has {len(graph.nodes)} (the same first "
                    f"{min(len(self.nodes), len(graph.nodes))}); plan this model again")
        planned, node = self.nodes[i], graph.nodes[i]
        where = node.module_path or planned.module or "the model's top level"
        return (f"{head}: the first difference is in module {where!r} (node {i}): the plan has {planned.name} "
                f"({planned.target}, shape {list(planned.shape)}), the model has {node.name} ({node.target}, shape "
                f"{list(node.outputs[0].shape)}); plan this model again")

    @staticmethod
    def _check_even(name: str, target: str, placements, shape, mesh: MeshSpec) -> None:
        for d in {p.dim for p in (placements or ()) if p.is_shard}:
            ranks = dim_divisor(placements, mesh.shape, d)
            if d >= len(shape) or shape[d] % ranks:
                size = shape[d] if d < len(shape) else "missing"
                raise PlanError(
                    f"the plan splits dim {d} (size {size}) of node {name} ({target}) over {ranks} ranks of "
                    f"mesh {mesh}, which does not divide it evenly; plan again for this mesh")


def _optimizer(fields: Mapping[str, Any]) -> OptimizerSpec:
    try:
        return OptimizerSpec(**fields)
    except ValueError as err:
        raise PlanError(f"plan file: {err}") from err


def load_plan(path: str | os.PathLike) -> Plan:
    """Load a plan saved with :meth:`Plan.save`."""
    with open(path) as f:
        return Plan.from_json(f.read())


def module_choices(graph: OpGraph, chosen: Mapping[str, Strategy]) -> tuple[ModuleChoice, ...]:
    """One :class:`ModuleChoice` per module that owns a weight, in graph order."""
    out: dict[str, ModuleChoice] = {}
    for node in graph.ops():
        params = [k for k, src in enumerate(node.inputs) if graph[src].role == PARAMETER]
        if not params or node.module_path in out:
            continue
        # ``x @ w.T`` (Falcon's linear): the style is what the matmul does with the transposed weight
        weight = ops.WEIGHT_INPUT.get(node.target)
        weight = weight if weight in params else params[0]  # addmm's first parameter is its bias
        stored = chosen[node.inputs[weight]].output  # the weight as it is stored
        node, params = _through_transpose(graph, node, params)
        strat = chosen[node.name]
        k_w = ops.WEIGHT_INPUT.get(node.target)
        acts = [k for k in range(len(node.inputs)) if k not in params]
        act_in = strat.inputs[acts[0]] if acts else None
        if k_w is not None and k_w in params:
            w = strat.inputs[k_w]
            w_dims = {p.dim for p in (w or ()) if p.is_shard}
            # the dim of the weight that indexes output features: (out, in) for linear,
            # (in, out) for mm/addmm (HF Conv1D), (rows, features) for an embedding
            out_dim = 0 if node.target == "aten.linear.default" else 1
            if node.target in ops.CONVOLUTIONS:  # (out, in/groups, *kernel); transposed (in, out/groups, *kernel)
                out_dim = 1 if "transpose" in node.target or node.args.get("transposed", False) else 0
                if node.args.int("groups", default=1) > 1 and w_dims:
                    out_dim = -1  # split by whole groups
            in_dim = 1 - out_dim
            style = ("colwise" if out_dim in w_dims else "rowwise" if in_dim in w_dims else "grouped" if w_dims
                     else _activation_style(node, act_in, node.input_infos[acts[0]] if acts else None))
        else:
            k_w = params[0]
            w = strat.inputs[k_w]
            style = _activation_style(node, act_in, node.input_infos[acts[0]] if acts else None)
        out[node.module_path] = ModuleChoice(node.module_path, style, node.target.split(".")[1],
                                             format_placements(stored if k_w in params else w),
                                             format_placements(act_in),
                                             format_placements(strat.output))
    return tuple(out.values())




def _activation_style(node, act_in, info) -> str:
    """The style of a module whose weight stays whole, from how its input is split: ``batch`` (dim
    0: data parallel), ``channel`` / ``spatial`` for a channels-first op (a convolution, batch or
    group norm, dims 1 / 2 on), else ``sequence`` (a dim between the batch and the features)."""
    dims = {p.dim for p in (act_in or ()) if p.is_shard} if info is not None else set()
    if not dims:
        return "replicate"
    if 0 in dims and info.ndim > 1:
        return "batch"
    if node.target in ops.CHANNELS_FIRST:
        return "channel" if 1 in dims else "spatial"
    return "sequence" if any(0 < d < info.ndim - 1 for d in dims) else "replicate"


def _through_transpose(graph: OpGraph, node, params: list[int]):
    """A 2-D weight read through a transpose by a matmul: that matmul, reading it as its weight."""
    if node.target not in ops.TRANSPOSE or node.output.ndim != 2:
        return node, params
    for name in graph.consumers(node.name):
        consumer = graph[name]
        k_w = ops.WEIGHT_INPUT.get(consumer.target)
        if k_w is not None and k_w < len(consumer.inputs) and consumer.inputs[k_w] == node.name:
            return consumer, [k_w]
    return node, params
