"""Pipeline stages at run time: the rank's stages of a three-dimensional plan, and their schedule.

In: a plan made with ``autotp.plan(model, devices, inputs, pipeline=True)`` (its tensor-parallel
plan of one micro-batch, and ``plan.pipeline``: the stages as runs of the stack's layers, the
schedule and the micro-batches), the graph of one micro-batch, and a mesh with a ``pp`` axis and a
``tp`` axis. Out: a :class:`PipelineModule` holding this rank's stages (its layers rewritten for
its tensor-parallel sub-mesh, as :mod:`autotp.runtime.rewrite` writes any graph) under the
schedule of ``torch.distributed.pipelining``, with :meth:`PipelineModule.step` (a training step:
the loss on the last stage, the gradients on every stage's shards) and a forward for inference.

How a graph becomes stages: the whole graph is rewritten once for the tensor-parallel sub-mesh;
each node of the result goes with the unit it was emitted for (before the stack, a layer, after
it: :func:`autotp.planning.stages.unit_of_nodes`), a parameter's read with every stage that reads
it, and the units with the stage that runs them. A stage's graph receives what crosses the cut in front of
it and returns what crosses the cut after it: every value made at or before the stage and read
after it (the residual stream; a mask or rotary table made before the stack, passed on by the
stages between). Those are local tensors (each rank's piece, as the plan places them), sent point
to point to the same tensor-parallel rank of the next stage: what the plan prices at each cut
(``StageChoice.send_bytes`` a micro-batch). The model's inputs are not sent: every rank is given
them, and each stage reads those it uses (the last stage the labels of a loss computed in the
graph).

A data axis: each replica runs its rows of the batch; its gradients are averaged over the axis
(ZeRO 0), or each stage runs under FSDP2 over the tensor-parallel shards (ZeRO 1 and 3), each
layer of the stack one unit (moved into a submodule with the state only it reads). The
layout's recompute runs each layer of a stage under ``torch.utils.checkpoint``
(:mod:`autotp.runtime.recompute`). A rank allocates its stages' shards only (the others' stay on meta)
and runs nothing to build: the shapes each stage sends and receives are the plan's. What it leaves
out is in docs/limits.md; a weight read by two stages (an embedding tied to the head) is held by
both and its gradients summed over the pipeline axis after the step (an all-reduce the search
prices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx
from torch import nn

from autotp.planning.pipeline_search import layout_mesh
from autotp.runtime.state import put

__all__ = ["PipelineModule", "build_pipeline_module", "mesh_problem", "split_stages", "stage_of_units", "SCHEDULES"]

# the plan's schedule names -> torch.distributed.pipelining's classes (looked up when built)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "none": "Schedule1F1B"}  # one stage: the micro-batches accumulated, each backward after its forward


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph: the names of the values it receives (positional, in order) and returns (in
    order); every stage also takes the model's inputs by keyword (``keywords``), reading those it uses."""

    index: int
    module: torch.fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    keywords: tuple[str, ...]
    shared: Mapping[str, tuple[int, ...]]  # a parameter this stage holds with others -> the stages holding it


def stage_of_units(stages: Sequence[Any], n_layers: int) -> list[int]:
    """The stage of each unit (0 before the stack, ``1 + i`` layer ``i``, ``n_layers + 1`` after),
    from the plan's :class:`autotp.planning.pipeline_search.StageChoice` list."""
    of = [-1] * (n_layers + 2)
    for s in stages:
        for i in range(s.first_layer, s.end_layer):
            of[1 + i] = s.index
        if s.before:
            of[0] = s.index
        if s.after:
            of[n_layers + 1] = s.index
    if -1 in of:
        raise ValueError(f"the plan's stages do not cover every unit: {[(s.first_layer, s.end_layer) for s in stages]}")
    return of


def _node_stages(gm: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                 unit_stage: Sequence[int]) -> dict[torch.fx.Node, int]:
    """Each fx node's stage: that of the graph op it was emitted for; a node emitted for none (a
    parameter's read, a size, the outputs' redistribution) with its first reader, or where nothing
    reads it, with its last input."""
    nodes = list(gm.graph.nodes)
    stage: dict[torch.fx.Node, int] = {}
    last = max(unit_stage)
    for n in nodes:
        if n.op == "placeholder":
            stage[n] = 0  # the model's inputs: every stage is given them (by keyword), none sends them
        elif n.name in origin and origin[n.name] in unit:
            stage[n] = unit_stage[unit[origin[n.name]]]
    for n in reversed(nodes):  # by readers, from the end
        if n in stage or n.op == "placeholder":
            continue
        readers = [stage[u] for u in n.users if u in stage]
        if n.op == "output":
            stage[n] = last
        elif readers:
            stage[n] = min(readers)
    for n in nodes:  # nothing reads it: with its inputs
        if n not in stage:
            inputs = [stage[a] for a in n.all_input_nodes if a in stage]
            stage[n] = max(inputs) if inputs else 0
    return stage


def split_stages(gm: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                 unit_stage: Sequence[int]) -> list[StageGraph]:
    """The rewritten graph ``gm`` cut into one graph per stage (module docstring). ``origin``: fx node
    name -> graph op (:attr:`autotp.runtime.rewrite.GraphRewrite.origin`); ``unit``: graph op ->
    unit; ``unit_stage``: unit -> stage."""
    stage = _node_stages(gm, origin, unit, unit_stage)
    n_stages = max(unit_stage) + 1
    nodes = [n for n in gm.graph.nodes]
    # a read of a parameter or buffer (and its local shard) goes into every stage that uses it: a
    # weight two stages read (an embedding tied to the head) is held by both, never sent
    needed: dict[torch.fx.Node, set[int]] = {}
    for n in reversed(nodes):
        if _reads_state(n):
            needed[n] = set().union(*(needed[u] if u in needed else {stage[u]} for u in n.users)) or {stage[n]}
    for n in nodes:
        for a in n.all_input_nodes:
            if stage[a] > stage[n] and a.op != "placeholder" and a not in needed:
                raise NotImplementedError(f"{n.name} (stage {stage[n]}) reads {a.name}, made in the later stage "
                                          f"{stage[a]}: the graph cannot be cut into stages in this order")
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]  # crossing[k]: made <= k, read > k
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in nodes:
        if n.op in ("output", "placeholder") or n in needed:
            continue
        later = [stage[u] for u in n.users if stage[u] > stage[n]]
        for k in range(stage[n], max(later, default=stage[n])):
            crossing[k].append(n)
    shared = {n.target: tuple(sorted(needed[n])) for n in needed
              if n.op == "get_attr" and len(needed[n]) > 1 and isinstance(_attribute(gm, n.target), nn.Parameter)}
    out = []
    for k in range(n_stages):
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs = [] if k == 0 else crossing[k - 1]
        for n in inputs + placeholders:
            env[n] = g.placeholder(n.name)
        for n in nodes:
            here = k in needed[n] if n in needed else stage[n] == k
            if not here or n.op in ("placeholder", "output") or n in env:
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
        if k == n_stages - 1:
            (result,) = [n for n in nodes if n.op == "output"]
            g.output(torch.fx.node.map_arg(result.args[0], lambda a: env[a]))
            outputs: tuple[str, ...] = ()
        else:
            g.output(tuple(env[n] for n in crossing[k]))
            outputs = tuple(n.name for n in crossing[k])
        out.append(StageGraph(k, torch.fx.GraphModule(gm, g, class_name=f"AutotpStage{k}"),
                              tuple(n.name for n in inputs), outputs, tuple(n.name for n in placeholders),
                              {t: where for t, where in shared.items() if k in where}))
    return out


def _own_parameters(unit: nn.Module):
    """The parameters an FSDP unit manages: its module's, less those of the units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and hasattr(m, "unshard") for p in m.parameters()}
    return (p for p in unit.parameters() if id(p) not in inner)


def group_stage_layers(sg: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                       layer_paths: Sequence[str], recompute: bool, with_state: bool) -> None:
    """Each layer of the stack in the stage's graph ``sg`` moved into a submodule its graph calls
    (``origin``, ``unit``: as for :func:`split_stages`): a ``Recompute`` where the layout recomputes,
    else a ``Layer``. ``with_state``: the parameters and buffers only that layer reads move with it
    (FSDP2 then shards each layer as a unit); they are named ``autotp_pipeline_..._i.body.<name in the
    model>`` (:func:`_model_name` reads the model's name back)."""
    from autotp.runtime.recompute import Layer, Recompute, group_layers

    layer_of = {}
    for n in sg.graph.nodes:
        u = unit.get(origin.get(n.name, ""), 0)
        if 1 <= u <= len(layer_paths) and n.op in ("call_function", "call_module") and not _reads_state(n):
            layer_of[n] = layer_paths[u - 1]
    if with_state:
        layer_of.update(_state_of_one_layer(sg, layer_of))
    group_layers(sg, layer_of, "autotp_pipeline_recompute_" if recompute else "autotp_pipeline_layer_",
                 Recompute if recompute else Layer)


def _model_name(name: str) -> str:
    """A stage's parameter or buffer under its name in the model: without the layer's submodule
    (``autotp_pipeline_layer_3.body.``) that holds it when the stage runs its layers as units."""
    head, _, rest = name.partition(".")
    if head.startswith(("autotp_pipeline_layer_", "autotp_pipeline_recompute_")) and rest.startswith("body."):
        return rest[len("body."):]
    return name


def _state_of_one_layer(gm: torch.fx.GraphModule, layer_of: Mapping[torch.fx.Node, str]) -> dict[torch.fx.Node, str]:
    """The reads of parameters and buffers (and their local shards) that only one layer's nodes use,
    with that layer."""
    mine: dict[torch.fx.Node, str] = {}
    for n in reversed(list(gm.graph.nodes)):
        if _reads_state(n) and n.users:
            layers = {layer_of.get(u) or mine.get(u) for u in n.users}
            if len(layers) == 1 and None not in layers:
                mine[n] = layers.pop()
    return mine


def _reads_state(n: torch.fx.Node) -> bool:
    """A parameter's or buffer's read, or the local shard of one (nothing computed, nothing sent)."""
    from autotp.runtime.collectives import to_local

    return n.op == "get_attr" or (n.op == "call_function" and n.target is to_local
                                  and len(n.all_input_nodes) == 1 and n.all_input_nodes[0].op == "get_attr")


def _attribute(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _sharded_over_replicas(stage: nn.Module, graph_module: nn.Module, mesh: Any, zero: int) -> nn.Module:
    """The stage under PyTorch's FSDP2 over the data axis (``mesh``), over its tensor-parallel
    shards, as the schedule is to run it: each of its layers one unit (``build_pipeline_module``
    made each a submodule holding the state only it reads), the rest of the stage another.

    - ZeRO 1: the parameters gathered at the step's first forward and kept to its last backward, the
      gradients kept whole over the micro-batches and reduce-scattered once: the schedule is
      given the FSDP module itself, so ``torch.distributed.pipelining`` turns FSDP's gradient sync
      and resharding off until the last backward.
    - ZeRO 3: gathered for each micro-batch's forward and again for its backward, the gradients
      reduce-scattered after each backward (held sharded): FSDP's own hooks run every micro-batch,
      since the schedule is given a plain module around it.
    """
    from torch.distributed.fsdp import fully_shard

    from autotp.runtime.recompute import Layer, Recompute

    layers = [m for m in graph_module.modules() if isinstance(m, (Layer, Recompute))]
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=zero >= 3)
    if zero >= 3:
        fully_shard(graph_module, mesh=mesh, reshard_after_forward=True)
        return stage if stage is not graph_module else _Around(stage)
    return fully_shard(stage, mesh=mesh, reshard_after_forward=False)


class _Around(nn.Module):
    """A stage's module seen through a plain module: the schedule drives it as it drives any other."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


class _LastStage(nn.Module):
    """The last stage's graph returning the tensors among the model's outputs, flat (what a schedule
    passes to the loss); :meth:`rebuild` puts them back in the model's output structure."""

    def __init__(self, graph_module: torch.fx.GraphModule, out_spec: Any) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.out_spec = out_spec
        self.kept: list[int] = []
        self.leaves: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.graph_module(*args, **kwargs)
        flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in flat]
        self.kept = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        kept = tuple(flat[i] for i in self.kept)
        return kept[0] if len(kept) == 1 else kept

    def rebuild(self, tensors: Any) -> Any:
        tensors = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        flat = list(self.leaves)
        for i, t in zip(self.kept, tensors):
            flat[i] = t
        if self.out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return torch.utils._pytree.tree_unflatten(flat, self.out_spec)


def _default_loss(output: Any) -> torch.Tensor:
    """The loss the model computes itself (``labels=`` given: ``output.loss``), or a scalar output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.ndim == 0:
        loss = output
    if loss is None:
        raise ValueError("the model's output holds no loss: give step() a loss_fn(output, target), or trace the model "
                         "with labels= so it computes its loss")
    return loss


class PipelineModule(nn.Module):
    """This rank's pipeline stages of a three-dimensional plan, and their schedule (module docstring).

    ``step(*inputs, target=None, loss_fn=None, **kw)`` runs one training step over the global batch
    cut into the plan's micro-batches, and returns the mean of the micro-batches' losses on the
    rank(s) of the last stage (None elsewhere); the gradients, averaged as one pass over the whole
    batch would, are left on this rank's stage parameters for the optimizer. ``forward`` runs the
    batch through the stages without gradients and returns the model's output on the last stage's
    ranks (None elsewhere)."""

    def __init__(self, stages: Sequence[StageGraph], mine: Sequence[int], pp_group: Any, device: torch.device,
                 plan: Any, out_spec: Any, in_spec: Any, examples: Mapping[str, torch.Tensor],
                 shared: Sequence[tuple[str, tuple[int, ...], torch.dtype]] = (),
                 persistent: frozenset[str] = frozenset(), dp_group: Any = None, dp_rank: int = 0,
                 tp_mesh: Any = None, aliases: Optional[Mapping[str, Sequence[str]]] = None,
                 fsdp_mesh: Any = None) -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage

        self.plan = plan
        self.n_stages = len(stages)
        self.stage_indices = tuple(mine)
        self.in_spec = in_spec
        self.keywords = stages[0].keywords
        self.pp_group = pp_group
        self.device = device
        last = self.n_stages - 1
        modules = []
        for k in mine:
            m = _LastStage(stages[k].module, out_spec) if k == last else stages[k].module
            if fsdp_mesh is not None:
                m = _sharded_over_replicas(m, stages[k].module, fsdp_mesh, plan.pipeline.chosen.zero)
            modules.append(m)
        # FSDP2's units on this rank that hold parameters (each gathers and reduce-scatters its own)
        self.fsdp_units = 0 if fsdp_mesh is None else sum(
            1 for st in modules for u in st.modules() if hasattr(u, "unshard")
            and any(True for _ in _own_parameters(u)))
        # the stages are not submodules: this module holds their parameters and buffers under the
        # model's own names (a stage's graph reads them under those names), so state_dict, the
        # optimizer and autotp.checkpoint see this rank's part of the model as the model names it
        self.stages = list(modules)
        for k in mine:
            for name, p in stages[k].module.named_parameters():
                put(self, _model_name(name), p, "parameter")
            for name, b in stages[k].module.named_buffers():
                put(self, _model_name(name), b, "buffer", persistent=_model_name(name) in persistent)
        # a parameter's other names in the model (a head tied to the embedding): the same parameter,
        # so the state dict has the model's keys, as a ParallelModule's does
        held = dict(self.named_parameters())
        for name, others in (aliases or {}).items():
            for other in others if name in held else ():
                put(self, other, held[name], "parameter")
        # what the other stages hold: a checkpoint's keys that this rank does not read (autotp.load_weights)
        self.autotp_other_stages_keys = frozenset(persistent) - set(self.state_dict())
        self._pipeline_stages = []
        for k, m in zip(mine, modules):
            # what each stage reads and returns, of one micro-batch: given, so no stage runs to find out
            ins = tuple(examples[n] for n in stages[k].inputs)
            outs = tuple(examples[n] for n in stages[k].outputs) if k != last else examples["<output>"]
            self._pipeline_stages.append(PipelineStage(m, k, self.n_stages, device, input_args=ins, output_args=outs,
                                                       group=pp_group))
        self._schedules: dict[tuple, Any] = {}
        self._shared = tuple(shared)  # weights several stages hold: their gradients summed over the stages
        self.dp_group, self.dp_rank = dp_group, dp_rank
        self.tp_mesh = tp_mesh
        self._zero = plan.pipeline.chosen.zero
        self._merge_spec = _merge_spec(examples["<output>"], plan.pipeline.chosen.micro_batch_size,
                                       plan.pipeline.chosen.micro_batches)

    @property
    def holds_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_indices

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    def _schedule(self, loss_fn: Optional[Callable], training: bool) -> Any:
        import torch.distributed.pipelining as pipelining

        chosen = self.plan.pipeline.chosen
        key = (id(loss_fn), training)
        if key not in self._schedules:
            multi = len(self._pipeline_stages) > 1  # stages going round the ranks (interleaved)
            # a forward alone: every micro-batch through the stages in order
            name = SCHEDULES[chosen.schedule] if training else "ScheduleLoopedBFS" if multi else "ScheduleGPipe"
            cls = getattr(pipelining, name)
            if multi != (name in ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS")):
                raise NotImplementedError(f"{len(self._pipeline_stages)} stages on this rank and the schedule "
                                          f"{chosen.schedule!r}: stages going round the ranks run interleaved only")
            stage = self._pipeline_stages if multi else self._pipeline_stages[0]
            # a forward for inference must leave the gradients of the last step as they are
            self._schedules[key] = cls(stage, n_microbatches=chosen.micro_batches, loss_fn=loss_fn,
                                       output_merge_spec=self._merge_spec, scale_grads=training)
        return self._schedules[key]

    def _inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's inputs by the names of the graph's placeholders (every stage is given them)."""
        from torch.fx._pytree import tree_flatten_spec

        try:
            flat = tuple(tree_flatten_spec((args, kwargs), self.in_spec)) if self.in_spec is not None else args
        except Exception as err:  # noqa: BLE001 - said in the model's terms
            raise TypeError(f"the pipeline was traced with inputs structured as {self.in_spec}; this call's do not "
                            f"match: {err}") from err
        if len(flat) != len(self.keywords):
            raise TypeError(f"the pipeline was traced with {len(self.keywords)} inputs ({', '.join(self.keywords)}); "
                            f"this call gives {len(flat)}")
        c, batch = self.plan.pipeline.chosen, self.plan.pipeline.global_batch
        if c.dp > 1:  # this replica's rows of the batch
            share = batch // c.dp
            flat = [x[self.dp_rank * share:(self.dp_rank + 1) * share]
                    if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch else x for x in flat]
        return dict(zip(self.keywords, flat))

    def step(self, *args: Any, target: Any = None, loss_fn: Optional[Callable] = None, **kwargs: Any) -> Any:
        """One training step (class docstring). Collective over every rank of the mesh: each calls it
        with the same global batch (the first stage reads the inputs, the last stage the target)."""
        inputs = self._inputs(args, kwargs)
        last = self.stages[-1] if self.holds_last_stage else None

        def loss(output: Any, tgt: Any) -> torch.Tensor:
            rebuilt = last.rebuild(output)
            return loss_fn(rebuilt, tgt) if loss_fn is not None else _default_loss(rebuilt)

        schedule = self._schedule(loss, True)
        losses: list = []
        if self.holds_last_stage:
            if target is None:  # the loss reads no target: one placeholder per micro-batch
                target = torch.zeros(self.plan.pipeline.chosen.micro_batches, 1)
            schedule.step(target=target, losses=losses, **inputs)
        else:
            schedule.step(**inputs)
        self._sum_shared_gradients()
        if self.dp_group is not None and self._zero == 0:
            self._average_over_replicas()
        if self.holds_last_stage:
            loss = torch.stack([torch.as_tensor(x).detach() for x in losses]).mean()
            if self.dp_group is not None:  # the mean over the replicas' shares: the batch's loss
                import torch.distributed as dist

                dist.all_reduce(loss, group=self.dp_group)
                loss /= self.plan.pipeline.chosen.dp
            return loss
        return None

    def _average_over_replicas(self) -> None:
        """ZeRO 0: each replica's gradients averaged over the data axis (an all-reduce per parameter)."""
        import torch.distributed as dist

        for _, p in sorted(self.named_parameters()):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=self.dp_group)
            local /= self.plan.pipeline.chosen.dp

    def _sum_shared_gradients(self) -> None:
        """A weight held by several stages (an embedding tied to the head) gets in each the sum of the
        stages' gradients, so every copy takes the same optimizer step: an all-reduce of its local
        shard over the pipeline axis (ranks that do not hold it add zeros)."""
        import torch.distributed as dist

        params = dict(self.named_parameters())
        for name, shape, dtype in self._shared:
            p = params.get(name)
            if p is not None and p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = None if p is None else p.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local is None and self.dp_group is not None and self._zero > 0:
                # the holders' gradient is FSDP2's piece of the tensor-parallel shard: dim 0 cut in
                # chunks of ceil(rows / dp) over the data axis (the last ones shorter, or empty)
                rows, dp = shape[0], dist.get_world_size(self.dp_group)
                per = -(-rows // dp)
                shape = (max(0, min(per, rows - self.dp_rank * per)), *shape[1:])
            buffer = local if local is not None else torch.zeros(shape, dtype=dtype, device=self.device)
            dist.all_reduce(buffer, group=self.pp_group)

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._inputs(args, kwargs)
        out = self._schedule(None, False).step(**inputs)
        if not self.holds_last_stage:
            return None
        if self.dp_group is not None:  # every replica's rows, in order: the batch's output
            import torch.distributed as dist

            c = self.plan.pipeline.chosen
            share = c.micro_batches * c.micro_batch_size

            def whole(t: Any) -> Any:
                if not isinstance(t, torch.Tensor) or not t.ndim or t.shape[0] != share:
                    return t
                parts = [torch.empty_like(t) for _ in range(c.dp)]
                dist.all_gather(parts, t.contiguous(), group=self.dp_group)
                return torch.cat(parts)

            out = torch.utils._pytree.tree_map(whole, out)
        return self.stages[-1].rebuild(out)


def build_pipeline_module(graph: Any, plan: Any, mesh: Any, model: nn.Module, example_flat: Sequence[Any],
                          seed: Optional[int] = None) -> PipelineModule:
    """This rank's :class:`PipelineModule` of ``plan`` (made with ``pipeline=True``) on ``mesh``, a
    device mesh with axes named ``pp`` and ``tp`` (``(pp, tp)``: the plan's stages by the tensor
    axis), from ``graph``, the model captured at the plan's micro-batch size, and ``example_flat``,
    one micro-batch of inputs, flat in the graph's order."""
    from autotp.planning.stages import unit_of_nodes
    from autotp.runtime.rewrite import GraphRewrite
    from autotp.runtime.state import register_state

    choice = plan.pipeline
    c = choice.chosen
    problem = mesh_problem(c, mesh)
    if problem:
        raise ValueError(problem)
    tp_mesh, pp_mesh = mesh["tp"], mesh["pp"]
    dp_mesh = mesh["dp"] if c.dp > 1 else None
    layer_paths = [f"{choice.stack}.{i}" if choice.stack else str(i) for i in range(choice.layers)]
    unit = unit_of_nodes(graph, layer_paths)
    unit_stage = stage_of_units(choice.stages, choice.layers)
    pp_rank = pp_mesh.get_local_rank()
    mine = [k for k in range(len(choice.stages)) if k % c.pp == pp_rank]
    # the parameters this rank's stages read; the others' shards stay on meta (no memory)
    held = {p.fqn for p in graph.parameters
            if any(unit_stage[unit[r]] in mine for r in graph.consumers(p.node) if r in unit)}
    for attempt in ("stages", "whole"):
        root = nn.Module()
        register_state(root, graph, plan, tp_mesh, model, keep=held.__contains__ if attempt == "stages" else None)
        rewrite = GraphRewrite(graph, plan, tp_mesh, root, seed, check_inputs=0)
        rewrite.emit()
        gm = torch.fx.GraphModule(root, rewrite.fx, class_name="AutotpPipelineGraph")
        stages = split_stages(gm, rewrite.origin, unit, unit_stage)
        examples = _planned_values(graph, plan, tp_mesh, rewrite, stages) if attempt == "stages" else None
        if examples is not None:
            break
    fsdp = dp_mesh is not None and c.zero > 0
    if c.recompute or fsdp:
        # each layer of a stage as a submodule: the layout's recompute runs its forward again in the
        # backward; FSDP2 (ZeRO 1 and 3) shards and gathers it as one unit, with the parameters and
        # buffers only it reads, as torchtitan wraps each block
        for k in mine:
            group_stage_layers(stages[k].module, rewrite.origin, unit, layer_paths, c.recompute, with_state=fsdp)
    unlifted = graph.exported.module()
    info = unlifted.graph._codegen.pytree_info if hasattr(unlifted.graph._codegen, "pytree_info") else None
    if examples is None:  # a value crossing a cut that the plan does not describe: one run to see it
        examples = _example_values(gm, stages, example_flat, info.out_spec if info is not None else None)
    device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    shared = []
    for name in sorted({t for st in stages for t in st.shared}):
        local = _attribute(gm, name)
        local = local.to_local() if hasattr(local, "to_local") else local
        shared.append((name, tuple(local.shape), local.dtype))
    module = PipelineModule(stages, mine, pp_mesh.get_group(), device, plan,
                            info.out_spec if info is not None else None, info.in_spec if info is not None else None,
                            examples, shared, frozenset(model.state_dict().keys()),
                            dp_mesh.get_group() if dp_mesh is not None else None,
                            dp_mesh.get_local_rank() if dp_mesh is not None else 0, tp_mesh,
                            {p.fqn: p.aliases for p in graph.parameters if p.aliases},
                            dp_mesh if c.zero > 0 else None)
    # whether the rank allocated its stages' shards only and ran nothing to build (else: every
    # stage's shards, and the whole graph run once to see a crossing value the plan does not describe)
    module.built_from_plan = attempt == "stages"
    return module


def _example_values(gm: torch.fx.GraphModule, stages: Sequence[StageGraph], example_flat: Sequence[Any],
                    out_spec: Any) -> dict[str, Any]:
    """Each value that crosses a cut, as one micro-batch makes it on this rank (its shape and dtype
    are what the stages exchange), and the model's output tensors under ``"<output>"``: the whole
    graph run once over this rank's tensor-parallel group (every rank of the
    mesh runs it, each with its group), with the random streams it drew from set back."""
    wanted = {n for s in stages for n in (*s.inputs, *s.outputs)}
    seen: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            if n.name in wanted:
                seen[n.name] = _detached(value)
            return value

    with torch.enable_grad():  # whether each value needs a gradient is part of what the stages exchange
        flat = Recorder(gm).run(*example_flat)
    for m in gm.modules():  # dropout and random streams count their calls: this run is not one
        if hasattr(m, "calls"):
            m.calls = 0
    bad = sorted(n for n in wanted if not isinstance(seen.get(n), torch.Tensor))
    if bad:
        raise NotImplementedError(f"values that are not tensors cross a cut between stages: {bad}; autotp's "
                                  f"pipeline runtime sends tensors only")
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    tensors = tuple(_detached(x) for x in flat if isinstance(x, torch.Tensor))
    seen["<output>"] = tensors[0] if len(tensors) == 1 else tensors
    return seen


def _planned_values(graph: Any, plan: Any, tp_mesh: Any, rewrite: Any, stages: Sequence[StageGraph]
                    ) -> Optional[dict[str, Any]]:
    """What :func:`_example_values` finds by a run, from the plan alone: each value crossing a cut is
    an op's local output (its shape this rank's piece of the op's output as the plan places it, its
    dtype the op's, a gradient where the op carries one), and the model's outputs are whole. None
    where a crossing value is something else (a redistribution made for a reader)."""
    from autotp.placement import local_shape

    of_node = {fx.name: op for op, fx in rewrite.local.items()}
    mesh_shape, coordinate = tuple(int(x) for x in tp_mesh.mesh.shape), tp_mesh.get_coordinate()
    device = torch.device(tp_mesh.device_type) if tp_mesh.device_type == "cpu" else torch.device(
        tp_mesh.device_type, torch.get_device_module(tp_mesh.device_type).current_device())

    def empty(info: Any, placements: Any, requires_grad: bool) -> torch.Tensor:
        shape = local_shape(info.shape, placements, mesh_shape, coordinate) if placements else info.shape
        t = torch.empty(shape, dtype=getattr(torch, info.dtype), device=device)
        return t.requires_grad_(requires_grad and t.is_floating_point())

    seen: dict[str, Any] = {}
    for s in stages:
        for name in (*s.inputs, *s.outputs):
            op = of_node.get(name)
            if op is None or op not in graph or len(graph[op].outputs) != 1:
                return None
            node = graph[op]
            seen[name] = empty(node.outputs[0], plan.strategy(op).output, bool(node.requires_grad) and plan.mode == "train")
    outs = [graph[o] for o in graph.outputs]
    if any(len(n.outputs) != 1 for n in outs):
        return None
    tensors = tuple(empty(n.outputs[0], None, bool(n.requires_grad)) for n in outs)
    seen["<output>"] = tensors[0] if len(tensors) == 1 else tensors
    return seen


def _detached(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def _merge_spec(output: Any, micro_batch_size: int, micro_batches: int) -> Any:
    """How the micro-batches' outputs make the batch's: a tensor with the batch first, joined along
    it; anything else (a loss, a scalar) the mean over the micro-batches."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer

    def spec(t: torch.Tensor) -> Any:
        if t.ndim and t.shape[0] == micro_batch_size:
            return TensorChunkSpec(0)
        return _CustomReducer(0.0, lambda acc, x: acc + x / micro_batches)

    return tuple(spec(t) for t in output) if isinstance(output, tuple) else spec(output)


def mesh_problem(c: Any, mesh: Any) -> str:
    """What is wrong with ``mesh`` for the layout ``c`` (a ``Layout``), or ``""``: axes named ``pp``,
    ``tp`` (``pp``, ``dp``, ``tp`` with a data axis) of the layout's sizes."""
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(int(x) for x in mesh.mesh.shape)
    want, want_names = layout_mesh(c)
    if names == want_names and shape == want:
        return ""
    return (f"the plan's layout is {c.describe()}: its stages run on a mesh of shape {want} with axes named "
            f"{want_names}, e.g. init_device_mesh(device, {want}, mesh_dim_names={want_names}); given shape "
            f"{shape} named {names}")
