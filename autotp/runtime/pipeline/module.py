"""Pipeline stages at run time: the rank's stages of a three-dimensional plan, and their schedule.

In: a plan made with ``autotp.plan(model, devices, inputs, pipeline=True)`` (its tensor-parallel
plan of one micro-batch, and ``plan.pipeline``: the stages as runs of the stack's layers, the
schedule and the micro-batches), the graph of one micro-batch, and the mesh of its layout
(:class:`autotp.layout.Layout`: a pipeline and a tensor axis, and between them a data axis with
replicas, an expert axis with experts split and a context axis with the sequence split); the
sub-meshes of each role are the layout's. Out: a :class:`PipelineModule` holding this rank's stages
(its layers rewritten for the plan's sub-mesh, :meth:`autotp.layout.Layout.planned_mesh`: the tensor
axis, or the expert or context axis with a tensor axis beside it, as
:mod:`autotp.runtime.rewrite` writes any graph) under the
schedule of ``torch.distributed.pipelining``, with :meth:`PipelineModule.step` (a training step:
the loss on the last stage, the gradients on every stage's shards) and a forward for inference.

How a graph becomes stages: the whole graph is rewritten once for the tensor-parallel sub-mesh;
each node of the result goes with the unit it was emitted for (before the stack, a layer, after
it: :func:`autotp.planning.search.stages.unit_of_nodes`), a parameter's read with every stage that reads
it, and the units with the stage that runs them. A stage's graph receives what crosses the cut in front of
it and returns what crosses the cut after it: every value made at or before the stage and read
after it (the residual stream; a mask or rotary table made before the stack, passed on by the
stages between). Those are local tensors (each rank's piece, as the plan places them), sent point
to point to the same tensor-parallel rank of the next stage: what the plan prices at each cut
(``StageChoice.send_bytes`` a micro-batch). The model's inputs are not sent: every rank is given
them, and each stage reads those it uses (the last stage the labels of a loss computed in the
graph).

An expert axis is planned as the tensor axis is: every rank of it is given the same micro-batch
(``Candidate.micro_batch_rows``: ``ep`` ranks' rows), which the plan splits and sends to the experts'
ranks by all-to-all, each of the plan's collectives once per micro-batch. A context axis too: every
rank of it is given the same micro-batch whole, whose sequence the plan splits (each rank keeps its
piece of the inputs), the weights whole on each and their gradients summed over it by the plan.

A data axis: each replica runs its rows of the batch, its stages one replica of the data axis's
runtime (:mod:`autotp.runtime.data_parallel`): the gradients averaged over the axis in DDP's
buckets during the last micro-batch's backward (ZeRO 0), or each stage under FSDP2 over the
tensor-parallel shards (ZeRO 1 and 3), each layer of the stack one unit (moved into a submodule
with the state only it reads). The
layout's recompute runs each layer of a stage under ``torch.utils.checkpoint``
(:mod:`autotp.runtime.recompute`). A rank allocates its stages' shards only (the others' stay on meta)
and runs nothing to build: the shapes each stage sends and receives are the plan's. What it leaves
out is in docs/pipelines.md#limits; a weight read by two stages (an embedding tied to the head) is held by
both and its gradients summed over the pipeline axis after the step (an all-reduce the search
prices).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.layout import DATA, PIPELINE
from autotp.runtime.data_parallel import DataParallel
from autotp.runtime.devices import mesh_device, wrong_device
from autotp.runtime.interface import Parallelized, default_loss
from autotp.runtime.pipeline.stage_graphs import (
    StageGraph,
    attribute,
    example_values,
    planned_values,
    split_stages,
    stage_of_units,
)
from autotp.runtime.pipeline.stage_units import group_stage_layers, model_name
from autotp.runtime.pipeline.token_counts import TokenMean, scale_factors, token_mean
from autotp.runtime.state import put

__all__ = ["PipelineModule", "build_pipeline_module", "SCHEDULES"]

# the plan's schedule names -> torch.distributed.pipelining's classes (looked up when built)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "none": "Schedule1F1B"}  # one stage: the micro-batches accumulated, each backward after its forward


class _LastStage(nn.Module):
    """The last stage's graph returning the tensors among the model's outputs, flat (what a schedule
    passes to the loss); :meth:`rebuild` puts them back in the model's output structure. The outputs
    a step does not read come out of the graph as the plan holds them (DTensors:
    :mod:`autotp.local.outputs`): dropped while ``loss_only`` (a step with the model's own loss),
    else gathered whole."""

    def __init__(self, graph_module: torch.fx.GraphModule, out_spec: Any) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.out_spec = out_spec
        self.kept: list[int] = []
        self.leaves: list[Any] = []
        self.loss_only = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.graph_module(*args, **kwargs)
        flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        flat = [(None if self.loss_only else x.full_tensor()) if isinstance(x, DTensor) else x for x in flat]
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


class PipelineModule(Parallelized):
    """This rank's pipeline stages of a three-dimensional plan, and their schedule (module docstring).

    ``step(*inputs, target=None, loss_fn=None, **kw)`` runs one training step over the global batch
    cut into the plan's micro-batches, and returns the mean of the micro-batches' losses on the
    rank(s) of the last stage (None elsewhere); the gradients, averaged as one pass over the whole
    batch would, are left on this rank's stage parameters for the optimizer. ``forward`` runs the
    batch through the stages without gradients and returns the model's output on the last stage's
    ranks (None elsewhere). ``save_pretrained`` (from :mod:`autotp.weights.export`) writes the whole
    model as Hugging Face does; the model's ``config`` and ``generation_config`` are kept where it has them."""

    def __init__(self, stages: Sequence[StageGraph], mine: Sequence[int], pp_group: Any, device: torch.device,
                 plan: Any, out_spec: Any, in_spec: Any, examples: Mapping[str, torch.Tensor],
                 shared: Sequence[tuple[str, tuple[int, ...], torch.dtype]] = (),
                 persistent: frozenset[str] = frozenset(), dp_mesh: Any = None,
                 tp_mesh: Any = None, aliases: Optional[Mapping[str, Sequence[str]]] = None,
                 token_mean: Optional[TokenMean] = None) -> None:
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
        modules = [_LastStage(stages[k].module, out_spec) if k == last else stages[k].module for k in mine]
        # the data axis: this rank's stages one replica (ZeRO 0: DDP's buckets, each launched during the
        # last micro-batch's backward; ZeRO 1 and 3: each stage under FSDP2)
        data = plan.pipeline.layout.data
        self.data_parallel = None if data is None else DataParallel(
            modules, data, dp_mesh, plan.pipeline.chosen.micro_batches, inner=[stages[k].module for k in mine])
        modules = list(modules) if self.data_parallel is None else list(self.data_parallel.modules)
        # FSDP2's units on this rank that hold parameters (each gathers and reduce-scatters its own)
        self.fsdp_units = 0 if self.data_parallel is None else self.data_parallel.fsdp_units
        # the stages are not submodules: this module holds their parameters and buffers under the
        # model's own names (a stage's graph reads them under those names), so state_dict, the
        # optimizer and autotp.checkpoint see this rank's part of the model as the model names it
        self.stages = list(modules)
        for k in mine:
            for name, p in stages[k].module.named_parameters():
                put(self, model_name(name), p, "parameter")
            for name, b in stages[k].module.named_buffers():
                put(self, model_name(name), b, "buffer", persistent=model_name(name) in persistent)
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
        # the random draws in the stages' graphs, traced in train mode (dropout): inference would make them
        from autotp.local.dropout import SeededAttention, ShardedDropout, SharedRandom

        self._draws = sorted({type(m).__name__ for st in modules for m in st.modules()
                              if isinstance(m, (SharedRandom, SeededAttention)) or (isinstance(m, ShardedDropout) and m.p > 0)})
        self._shared = tuple(shared)  # weights several stages hold: their gradients summed over the stages
        self.dp_group = None if dp_mesh is None else dp_mesh.get_group()
        self.dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
        self.tp_mesh = tp_mesh
        self._zero = plan.pipeline.chosen.zero
        # ZeRO 0's reducer (the schedule leaves the gradients unscaled: it divides by dp x micro-batches)
        self.gradient_reducer = None if self.data_parallel is None else self.data_parallel.gradient_reducer
        # the model's own loss, where it is a mean over valid targets: weighed by their counts
        self._token_mean = token_mean
        self._merge_spec = _merge_spec(examples["<output>"], plan.pipeline.chosen.micro_batch_rows,
                                       plan.pipeline.chosen.micro_batches,
                                       token_mean.output if token_mean is not None else None)

    def _apply(self, fn: Any, recurse: bool = True) -> "PipelineModule":
        """A cast of the stages' weights to another dtype is refused before anything changes
        (:func:`autotp.runtime.module.refuse_cast`)."""
        if getattr(self, "_pipeline_stages", None) is not None:
            from autotp.runtime.module import refuse_cast

            refuse_cast(self, fn)
        return super()._apply(fn, recurse)

    @property
    def holds_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_indices

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    def _schedule(self, loss_fn: Optional[Callable], training: bool) -> Any:
        import torch.distributed.pipelining as pipelining

        chosen = self.plan.pipeline.chosen
        key = (loss_fn is None, training)  # the step's loss reads the step's own loss_fn and weights
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
                                       output_merge_spec=self._merge_spec,
                                       scale_grads=training and self.gradient_reducer is None)
        return self._schedules[key]

    def _inputs(self, args: tuple, kwargs: dict, replica: bool = True) -> dict[str, Any]:
        """The call's inputs by the names of the graph's placeholders (every stage is given them): this
        replica's rows of the batch (``replica=False``: the whole batch)."""
        from torch.fx._pytree import tree_flatten_spec

        try:
            flat = tuple(tree_flatten_spec((args, kwargs), self.in_spec)) if self.in_spec is not None else args
        except Exception as err:  # noqa: BLE001 - said in the model's terms
            raise TypeError(f"the pipeline was traced with inputs structured as {self.in_spec}; this call's do not "
                            f"match: {err}") from err
        if len(flat) != len(self.keywords):
            raise TypeError(f"the pipeline was traced with {len(self.keywords)} inputs ({', '.join(self.keywords)}); "
                            f"this call gives {len(flat)}")
        for name, x in zip(self.keywords, flat):  # before any send: the stages exchange on the mesh's device
            error = wrong_device(name, x.device, self.device) if isinstance(x, torch.Tensor) else None
            if error:
                raise ValueError(error)
        c, batch = self.plan.pipeline.chosen, self.plan.pipeline.global_batch
        if c.dp > 1 and replica:  # this replica's rows of the batch
            share = batch // c.dp
            flat = [x[self.dp_rank * share:(self.dp_rank + 1) * share]
                    if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch else x for x in flat]
        return dict(zip(self.keywords, flat))

    def _loss_factors(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """What this replica's micro-batches' mean losses are multiplied by so that their sum over the
        micro-batches and replicas is one process's loss (:mod:`autotp.runtime.pipeline.token_counts`), or None
        where the model's loss is no mean over valid targets. Every rank counts the whole batch it is
        given (no collective); a loss that cannot be so weighed is refused on every rank alike where
        its micro-batches hold unequal counts."""
        tm = self._token_mean
        if tm is None or (tm.exact and not self.holds_last_stage):  # only the last stage weighs its losses
            return None
        c = self.plan.pipeline.chosen
        every = tm.counts(self._inputs(args, kwargs, replica=False), c.dp * c.micro_batches)
        if not tm.exact:
            if int(every.min()) != int(every.max()):  # a host read, only for such a loss
                raise ValueError(
                    f"the model's loss adds a mean over valid targets (a cross-entropy with ignore_index="
                    f"{tm.ignore_index}) to other terms, and this batch's micro-batches hold unequal numbers of "
                    f"valid targets ({every.tolist()}): a pipeline's mean of the micro-batches' losses would not "
                    f"be the batch's loss. Give step() a loss_fn(output, target) that weighs them, or batches "
                    f"whose micro-batches hold as many valid targets each")
            return None
        mine = every[self.dp_rank * c.micro_batches:(self.dp_rank + 1) * c.micro_batches]
        return scale_factors(mine, every.sum(), c.micro_batches, c.dp).to(self.device)

    def step(self, *args: Any, target: Any = None, loss_fn: Optional[Callable] = None, **kwargs: Any) -> Any:
        """One training step (class docstring). Collective over every rank of the mesh: each calls it
        with the same global batch (the first stage reads the inputs, the last stage the target).
        The model's own loss (``labels=``), where it is a mean over valid targets (ignored labels,
        padding), is weighed by each micro-batch's count of them, so loss and gradients are one
        process's; a ``loss_fn`` is the user's, and its micro-batches' losses are averaged."""
        inputs = self._inputs(args, kwargs)
        factors = self._loss_factors(args, kwargs) if loss_fn is None else None
        self._step_loss = (loss_fn, factors is not None)
        schedule = self._schedule(self._loss_of_micro_batch, True)
        losses: list = []
        if self.holds_last_stage and target is None:  # the loss reads no target: a placeholder (or weight) each
            target = (factors.view(-1, 1) if factors is not None
                      else torch.zeros(self.plan.pipeline.chosen.micro_batches, 1, device=self.device))
        given = dict(target=target, losses=losses) if self.holds_last_stage else {}
        last = next((m for m in self.stages if isinstance(m, _LastStage)), None)
        if last is not None:  # the model's own loss reads none of the outputs the plan leaves unread
            last.loss_only = loss_fn is None
        try:
            with self.data_parallel.step() if self.data_parallel is not None else contextlib.nullcontext():
                # the step returns the loss only: no micro-batch's output (the logits) is kept to the step's end
                schedule.step(**given, **inputs, return_outputs=False)
        finally:
            if last is not None:
                last.loss_only = False
        self._sum_shared_gradients()
        if self.holds_last_stage:
            loss = torch.stack([torch.as_tensor(x).detach() for x in losses]).mean()
            if self.dp_group is not None:  # the mean over the replicas' shares: the batch's loss
                import torch.distributed as dist

                dist.all_reduce(loss, group=self.dp_group)
                loss /= self.plan.pipeline.chosen.dp
            return loss
        return None

    def _loss_of_micro_batch(self, output: Any, target: Any) -> torch.Tensor:
        """The loss the schedule back-propagates for one micro-batch: the step's ``loss_fn``, or the
        model's own loss, weighed by the micro-batch's valid targets where ``target`` carries them."""
        loss_fn, weighed = self._step_loss
        rebuilt = self.stages[-1].rebuild(output)
        if loss_fn is not None:
            return loss_fn(rebuilt, target)
        value = default_loss(rebuilt)
        if not weighed:
            return value
        factor = target.reshape(()).to(value.dtype)
        # a micro-batch with no valid target has a mean of nan and weighs nothing
        return torch.where(factor > 0, value * factor, torch.zeros_like(value))

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
        if self._draws:  # refused rather than run with the training graph's dropout, whatever eval() says
            raise NotImplementedError(
                f"this pipeline module's stages were planned in train mode and draw random masks "
                f"({', '.join(self._draws)}: dropout); its forward would apply them to inference. Run inference on "
                f"a module from autotp.parallelize(model, mesh, inputs, mode='inference') (no pipeline stages), or "
                f"plan the model with its dropout probabilities at 0 "
                f"(docs/pipelines.md#what-the-runtime-does-not-do)")
        inputs = self._inputs(args, kwargs)
        factors = self._loss_factors(args, kwargs)
        out = self._schedule(None, False).step(**inputs)
        if not self.holds_last_stage:
            return None
        c = self.plan.pipeline.chosen
        if self._token_mean is not None:  # the micro-batches' mean losses, weighed by their valid targets
            flat = list(out) if isinstance(out, tuple) else [out]
            means = torch.stack([torch.as_tensor(x) for x in flat[self._token_mean.output]])
            if factors is not None:
                means = torch.where(factors > 0, means * factors.to(means.dtype), torch.zeros_like(means))
            flat[self._token_mean.output] = means.sum() / c.micro_batches
            out = tuple(flat) if isinstance(out, tuple) else flat[0]
        if self.dp_group is not None:  # every replica's rows, in order: the batch's output
            import torch.distributed as dist

            share = c.micro_batches * c.micro_batch_rows

            def whole(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and not t.ndim and t.is_floating_point():
                    t = t.clone()  # a loss: the mean over the replicas' shares
                    dist.all_reduce(t, group=self.dp_group)
                    return t / c.dp
                if not isinstance(t, torch.Tensor) or not t.ndim or t.shape[0] != share:
                    return t
                parts = [torch.empty_like(t) for _ in range(c.dp)]
                dist.all_gather(parts, t.contiguous(), group=self.dp_group)
                return torch.cat(parts)

            out = torch.utils._pytree.tree_map(whole, out)
        return self.stages[-1].rebuild(out)


def build_pipeline_module(graph: Any, plan: Any, mesh: Any, model: nn.Module, example_flat: Sequence[Any],
                          seed: Optional[int] = None) -> PipelineModule:
    """This rank's :class:`PipelineModule` of ``plan`` (made with ``pipeline=True``) on ``mesh``, the
    device mesh of the plan's layout (``plan.pipeline.layout``: its shape and axis names), from
    ``graph``, the model captured at the plan's micro-batch size, and ``example_flat``, one
    micro-batch of inputs, flat in the graph's order."""
    from autotp.planning.search.stages import unit_of_nodes
    from autotp.runtime.rewrite import GraphRewrite
    from autotp.runtime.state import register_state

    choice = plan.pipeline
    c, layout = choice.chosen, choice.layout
    problem = layout.mesh_problem(mesh, c.describe())
    if problem:
        raise ValueError(problem)
    # the plan's mesh: the tensor axis, or the expert axis (and a tensor axis of more than one rank)
    tp_mesh = layout.planned_mesh(mesh)
    pp_mesh, dp_mesh = (layout.sub_mesh(mesh, role) for role in (PIPELINE, DATA))
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
        examples = planned_values(graph, plan, tp_mesh, rewrite, stages) if attempt == "stages" else None
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
        examples = example_values(gm, stages, example_flat, info.out_spec if info is not None else None)
    device = mesh_device(mesh)
    shared = []
    for name in sorted({t for st in stages for t in st.shared}):
        local = attribute(gm, name)
        local = local.to_local() if hasattr(local, "to_local") else local
        shared.append((name, tuple(local.shape), local.dtype))
    module = PipelineModule(stages, mine, pp_mesh.get_group(), device, plan,
                            info.out_spec if info is not None else None, info.in_spec if info is not None else None,
                            examples, shared, frozenset(model.state_dict().keys()), dp_mesh, tp_mesh,
                            {p.fqn: p.aliases for p in graph.parameters if p.aliases},
                            _token_mean(graph.exported, info.out_spec if info is not None else None))
    # whether the rank allocated its stages' shards only and ran nothing to build (else: every
    # stage's shards, and the whole graph run once to see a crossing value the plan does not describe)
    module.built_from_plan = attempt == "stages"
    for name in ("config", "generation_config"):  # what users read from a Hugging Face model, save_pretrained too
        if getattr(model, name, None) is not None:
            setattr(module, name, copy.deepcopy(getattr(model, name)))
    module.autotp_model_class = type(model).__name__
    module.autotp_state_keys = tuple(model.state_dict().keys())
    return module


def _token_mean(exported: Any, out_spec: Any) -> Optional[TokenMean]:
    """How to weigh the model's own loss (the output :func:`autotp.runtime.interface.default_loss` reads), or None."""
    n = len(list(next(n for n in exported.graph.nodes if n.op == "output").args[0]))
    try:
        indexed = torch.utils._pytree.tree_unflatten(list(range(n)), out_spec) if out_spec is not None else 0
        at = default_loss(indexed) if not isinstance(indexed, int) else indexed
    except Exception:  # noqa: BLE001 - an output with no loss: nothing to weigh
        return None
    return token_mean(exported, at) if isinstance(at, int) else None


def _merge_spec(output: Any, micro_batch_size: int, micro_batches: int, collected: Optional[int] = None) -> Any:
    """How the micro-batches' outputs make the batch's: a tensor with the batch first, joined along
    it; anything else (a loss, a scalar) the mean over the micro-batches; the output at flat index
    ``collected`` (a loss weighed by its valid targets) kept per micro-batch, as a tuple."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer

    def spec(k: int, t: torch.Tensor) -> Any:
        if k == collected:
            return _CustomReducer((), lambda acc, x: acc + (x,))
        if t.ndim and t.shape[0] == micro_batch_size:
            return TensorChunkSpec(0)
        return _CustomReducer(0.0, lambda acc, x: acc + x / micro_batches)

    return tuple(spec(k, t) for k, t in enumerate(output)) if isinstance(output, tuple) else spec(0, output)
