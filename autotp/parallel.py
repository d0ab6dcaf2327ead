"""``autotp.parallelize``: plan (or take a plan), check it fits, and build the parallel module.

Everything is checked before anything is built, and the user's model is only read: a bad input
raises with the model exactly as it was.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn

from autotp.capture import CaptureError, capture
from autotp.mesh import MeshSpec
from autotp.plan import Plan, PlanError
from autotp.planner import plan_graph
from autotp.rewrite import build_parallel_module

__all__ = ["parallelize"]


def _device_type(model: nn.Module) -> Optional[str]:
    types = {p.device.type for p in model.parameters()}
    return types.pop() if len(types) == 1 else None


def parallelize(model: nn.Module, mesh: Any, example_inputs: Any, plan: Optional[Plan] = None, hardware: Any = None,
                mode: str = "train", memory_budget: Any = None) -> torch.fx.GraphModule:
    """Return a module that computes what ``model`` computes, sharded over ``mesh`` as planned.

    ``mesh`` must be a ``DeviceMesh`` over a live process group (every rank calls this with the same
    model and inputs). ``plan`` defaults to ``autotp.plan(model, mesh, example_inputs, hardware,
    mode, memory_budget)``. The result's parameters are DTensor shards under the model's own names;
    ``result.plan`` is the plan used.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize needs a DeviceMesh over a live process group, got {type(mesh).__name__}; "
                        "to plan without processes call autotp.plan(model, (8,), example_inputs)")
    spec = MeshSpec.of(mesh)
    device = _device_type(model)
    if device == "meta":
        raise ValueError("the model is on the meta device: parallelize needs real weights (plan with autotp.plan, "
                         "then parallelize a model with its weights loaded)")
    if device is not None and device != mesh.device_type:
        raise ValueError(f"the model is on {device!r} but the mesh is on {mesh.device_type!r}; "
                         f"move the model to {mesh.device_type!r} or build the mesh on {device!r}")
    t0 = time.perf_counter()
    try:
        graph = capture(model, example_inputs)
    except CaptureError as err:
        raise ValueError(f"the example inputs do not fit the model:\n{err}") from err
    if plan is None:
        plan = plan_graph(graph, spec, hardware, mode, memory_budget, capture_s=time.perf_counter() - t0)
    elif not isinstance(plan, Plan):
        raise TypeError(f"plan is a {type(plan).__name__}; expected an autotp Plan (autotp.plan or autotp.load_plan)")
    else:
        plan.check_matches(graph, spec)
    return build_parallel_module(graph, plan, mesh, model)
