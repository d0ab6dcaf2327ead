"""``autotp.parallelize``: plan (or take a plan), check it fits, and build the parallel module.

Everything is checked before anything is built, and the user's model is only read: a bad input
raises with the model exactly as it was.

One plan for all ranks: every rank captures the model (it needs the graph to build its module),
but only the mesh's first rank solves (:mod:`autotp.runtime.agreement`); every rank checks the
plan against its own graph and builds from it.

The hardware a mesh is priced with follows its device type when none is given: ``cpu-gloo`` for
a CPU mesh; on CUDA, the built-in profile of the device (``default_hardware``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn

from autotp.mesh import MeshSpec
from autotp.planning.costs.costing import MODES
from autotp.planning.costs.recompute import check_recompute
from autotp.planning.errors import PlanError
from autotp.planning.result.plan import Plan
from autotp.runtime.agreement import agreed_plan, dropout_seed
from autotp.runtime.devices import check_rank_devices
from autotp.runtime.guard import DEFAULT_INPUT_CHECKS
from autotp.runtime.interface import Parallelized
from autotp.runtime.module import ModeSwitch, build_parallel_module, meta_copy
from autotp.tracing.export import capture
from autotp.tracing.loss import WithLoss
from autotp.weights.meta import unfillable_state
from autotp.words import with_article
from cost_models import optimizer_spec, resolve_hardware
from cost_models.devices import profile_for_device

__all__ = ["parallelize", "default_hardware"]

def default_hardware(device_type: str, device_name: Optional[str] = None) -> str:
    """The built-in profile for a mesh on ``device_type`` (``cpu``, or ``cuda`` with its name): the
    table of ``cost_models.devices`` (a new GPU is a profile file and a row there).

    >>> default_hardware("cpu"), default_hardware("cuda", "NVIDIA A100-SXM4-80GB"), default_hardware("cuda", "NVIDIA H200")
    ('cpu-gloo', 'a100-sxm', 'h200')
    >>> default_hardware("cuda", "NVIDIA GH200 480GB")
    Traceback (most recent call last):
    ...
    ValueError: no built-in hardware profile for the CUDA device 'NVIDIA GH200 480GB' (built-in GPU profiles: a100-pcie, a100-sxm, b200, h100-nvl, h100-pcie, h100-sxm, h200); measure this machine with `autotp profile -o my.json` and pass hardware="my.json"
    """
    return profile_for_device(device_type, device_name)


def _device_type(model: nn.Module) -> Optional[str]:
    types = {p.device.type for p in model.parameters()}
    return types.pop() if len(types) == 1 else None


def parallelize(model: nn.Module, mesh: Any, example_inputs: Any, plan: Optional[Plan] = None, hardware: Any = None,
                mode: Optional[str] = None, memory_budget: Any = None, dynamic_dims: Any = None,
                optimizer: Any = "adamw", recompute: Optional[bool] = None,
                check_inputs: Any = DEFAULT_INPUT_CHECKS, loss_fn: Any = None) -> Parallelized:
    """Return a module that computes what ``model`` computes, sharded over ``mesh`` as planned: a
    :class:`autotp.runtime.interface.Parallelized`, a ``ParallelModule`` for a plan on a plain mesh,
    a ``PipelineModule`` for a plan whose layout has pipeline stages, a data axis, an expert or a context axis.

    ``mesh`` must be a ``DeviceMesh`` over a live process group (every rank calls this with the same
    model and inputs). On a CUDA mesh each process must be set to a GPU of its own
    (``torch.cuda.set_device(local_rank)`` before CUDA is touched): ranks of one host on one GPU are
    refused (:mod:`autotp.runtime.devices`), and the inputs must be on the process's GPU. The model may have its parameters on the meta device (``autotp.meta_init``):
    each rank then allocates only its shards, uninitialized, for ``autotp.load_weights`` to fill. ``plan`` defaults to the plan the mesh's first rank makes with ``hardware``
    (default: the profile of the mesh's device, :func:`default_hardware`), ``mode``,
    ``memory_budget``, ``optimizer`` and ``recompute`` (see :func:`autotp.plan`), which every rank
    receives. The result's parameters are DTensor shards under the model's own names; ``result.plan``
    is the plan used. Layers the plan recomputes run under ``torch.utils.checkpoint``.

    ``mode``: ``"train"`` traces the model in the mode it is in, ``"inference"`` in eval mode; the
    result starts in that mode, and its ``train()`` / ``eval()`` switch what the model's would
    (dropout, batch norm; the first switch to the other mode traces it, collectively:
    :mod:`autotp.runtime.module`). Default: the given plan's mode, else ``"train"``. The result owns its
    tensors: training it never changes ``model`` (``del model`` frees the model's memory).

    ``loss_fn``: a function of the model's output and the targets, planned and run with the model
    (:class:`autotp.tracing.loss.WithLoss`): the example inputs end with the targets (or hold
    ``targets=``), and the result returns the loss. Cross-entropy on logits split by vocabulary runs
    on the split logits (:mod:`autotp.planning.rules.losses`).

    Every rank must be given the same inputs (each reads its share of them itself):
    ``check_inputs`` compares a checksum of each input over the ranks on the first calls (an int:
    that many calls of each mode, default 8; True: every call; False: never) and raises on every
    rank, naming the input and the ranks that differ (:mod:`autotp.runtime.guard`).

    The result runs at other sizes of the inputs' dynamic dims without planning again:
    ``dynamic_dims=None`` (default) makes the batch and sequence dims dynamic where the model allows
    (integer inputs: every dim; float inputs: all but the last), ``False`` none, and a dict such as
    ``{"input_ids": (0, 1)}`` exactly those (:mod:`autotp.tracing.dynamic`). The plan is priced at the
    example's sizes; ``result.plan.report()`` lists the dynamic dims and what the plan needs of them.
    With a ``plan`` given and ``dynamic_dims`` left at None, the model is traced as the plan was:
    dynamic if it was made with dynamic dims (``autotp.plan(..., dynamic_dims=None)``, ``autotp plan
    --dynamic``), else static.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize needs a DeviceMesh over a live process group, got {type(mesh).__name__}; "
                        "to plan without processes call autotp.plan(model, (8,), example_inputs)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model is {with_article(type(model).__name__)}; expected a torch.nn.Module")
    if loss_fn is not None:
        model = WithLoss(model, loss_fn)
    if mesh.get_coordinate() is None:
        import torch.distributed as dist

        raise ValueError(f"this process (global rank {dist.get_rank()} of {dist.get_world_size()}) is not in the mesh "
                         f"{mesh.mesh.tolist()}; every rank that calls autotp.parallelize must be in it: build the "
                         f"mesh over all the processes (init_device_mesh with the world size, e.g. torchrun "
                         f"--nproc-per-node {mesh.mesh.numel()}), or call parallelize on the mesh's ranks only")
    check_rank_devices(mesh)  # ranks of one host on one GPU: refused before anything is traced or communicated
    if mode is None:
        mode = plan.mode if isinstance(plan, Plan) else "train"
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    if isinstance(plan, Plan) and plan.mode != mode:
        raise PlanError(f"the plan is {with_article(plan.mode)} plan (made with mode={plan.mode!r}), and parallelize was asked "
                        f"for mode={mode!r}; leave mode out to use the plan as it is, or plan again with "
                        f"mode={mode!r}")
    if isinstance(plan, Plan) and plan.pipeline is not None and not plan.pipeline.layout.plain:
        return _parallelize_pipeline(model, mesh, example_inputs, plan)
    check_inputs = _input_checks(check_inputs)
    spec = MeshSpec.of(mesh)
    device = _device_type(model)
    if device is not None and device not in ("meta", mesh.device_type):
        raise ValueError(f"the model is on {device!r} but the mesh is on {mesh.device_type!r}; "
                         f"move the model to {mesh.device_type!r} or build the mesh on {device!r}")
    optimizer_spec(optimizer)  # bad arguments are refused on every rank, before the capture
    check_recompute(recompute)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan is {with_article(type(plan).__name__)}; expected an autotp Plan (autotp.plan or autotp.load_plan)")
    source = None
    if plan is None:
        if hardware is None:
            name = torch.cuda.get_device_name() if mesh.device_type == "cuda" else None
            hardware = default_hardware(mesh.device_type, name)
            source = (f"built-in profile, the default of autotp.parallelize for {with_article(mesh.device_type)} mesh"
                      + (f" ({name})" if name else "") + " (no hardware given; measure this machine with "
                      "`autotp profile` for figures that describe it)")
        resolve_hardware(hardware)  # a bad profile is refused on every rank, before the capture
    if plan is not None and dynamic_dims is None:
        # trace as the plan was traced: a plan made with static sizes fits the static graph (a symbolic
        # trace may keep ops, such as full-range slices, that a static one drops)
        dynamic_dims = None if plan.dynamic_dims else False
    # the mode the module starts in: eval for inference, else the model's own, each module's flag as the
    # user left it (a frozen backbone in eval mode inside a model in train mode reads its statistics)
    training = False if mode == "inference" else bool(model.training)
    traced = False if mode == "inference" else None
    # the mode traced now: the plan's, where a plan says another (it was made for that graph)
    if plan is not None and plan.training is not None and plan.training != training:
        traced = plan.training
    t0 = time.perf_counter()
    graph = capture(model, example_inputs, dynamic_dims, training=traced,  # a CaptureError says what failed
                    device=getattr(mesh, "device_type", None))
    unfillable = unfillable_state(model, graph.exported.constants)
    if unfillable:
        raise ValueError(f"the model is on the meta device, and nothing could give these their values: "
                         f"{', '.join(unfillable)}; build the model under autotp.meta_init() (parameters on meta, "
                         f"buffers made for real)")
    if plan is None:
        plan = agreed_plan(graph, spec, mesh, hardware, mode, memory_budget, time.perf_counter() - t0, optimizer,
                            recompute, hardware_source=source)
    plan.check_matches(graph, spec)
    seed = dropout_seed(mesh, graph)
    switch = ModeSwitch(meta_copy(model), example_inputs, dynamic_dims, mesh, memory_budget, recompute)
    module = build_parallel_module(graph, plan, mesh, model, seed, switch, check_inputs)
    return module if traced is None else module.train(training)


def _parallelize_pipeline(model: nn.Module, mesh: Any, example_inputs: Any, plan: Plan) -> Parallelized:
    """This rank's stages of a layout with stages, replicas, an expert or a context axis
    (:mod:`autotp.runtime.pipeline.module`): the model captured at the plan's micro-batch (the example
    inputs' first rows), as the plan was."""
    from autotp.planning.planner import _batch_size, _first_rows
    from autotp.runtime.pipeline.module import build_pipeline_module

    c = plan.pipeline.chosen
    if plan.pipeline.kinds:
        raise PlanError(f"the plan's stack {plan.pipeline.stack} has layers of {len(plan.pipeline.kinds)} kinds "
                        f"(runs {list(plan.pipeline.kinds)} as (first layer, layers)) and was priced from the first "
                        f"layer of each kind: it prices the layouts, and its graph is not the model's; "
                        f"autotp.parallelize runs a pipeline plan of a stack of alike layers only")
    problem = plan.pipeline.layout.mesh_problem(mesh, c.describe())
    if problem:
        raise PlanError(problem)
    batch = _batch_size(example_inputs)
    if batch != plan.pipeline.global_batch:
        raise ValueError(f"the plan was made for a batch of {plan.pipeline.global_batch} ({c.micro_batches} "
                         f"micro-batches of {c.micro_batch_rows} rows); the example inputs' batch is {batch}")
    # one micro-batch as the plan was made on it: on an expert axis, every rank of it given all of its
    # ranks' rows, which the plan splits
    micro = _first_rows(example_inputs, batch, c.micro_batch_rows)
    # in train mode, each module's own flag kept (a frozen submodule in eval mode stays so)
    graph = capture(model, micro, False, training=None if model.training else True,
                    device=getattr(mesh, "device_type", None))
    plan.check_matches(graph, plan.mesh)
    args, kwargs = (micro, {}) if not isinstance(micro, dict) else ((), micro)
    args = args if isinstance(args, tuple) else (args,)
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return build_pipeline_module(graph, plan, mesh, model, flat, dropout_seed(mesh, graph))


def _input_checks(value: Any) -> Optional[int]:
    """``check_inputs`` as the number of calls to check (None: every call)."""
    if value is True:
        return None
    if value is False:
        return 0
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(f"check_inputs={value!r}: expected True (every call), False (never) or a number of first calls")
