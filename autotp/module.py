"""The parallel module: a ``GraphModule`` on local shards that switches graphs with ``train()``/``eval()``.

A traced graph holds one mode of the model: dropout that drops or not, batch norm that updates its
running statistics or reads them, and whatever else ``forward()`` decides from ``self.training``.
So :class:`ParallelModule` keeps one graph per mode, over the same parameters and buffers, and
``train(mode)`` / ``eval()`` runs the graph of that mode, as the model's own ``train()`` /
``eval()`` would switch it.

The graph of the mode the module was built in comes from ``autotp.parallelize``. The other one is
made the first time the module switches to it (:class:`ModeSwitch`): a copy of the model with its
tensors on the meta device, taken at ``parallelize`` (the user's own model is not kept, nor read
again), is traced in that mode. Where the graph is the same op for op (no dropout, no batch norm),
the same plan runs it; else the mesh's first rank plans the new graph (in the first plan's mode, train
or inference) with every parameter pinned where it already is (no weight moves) and every rank gets
that plan, so the first switch to a mode
is collective: every rank calls ``train()`` / ``eval()``, as every rank calls ``forward``. The
switches after it swap the graph only.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Optional

import torch
import torch.fx
from torch import nn

__all__ = ["ParallelModule", "ModeSwitch", "meta_copy", "op_signature"]


def meta_copy(model: nn.Module) -> Optional[nn.Module]:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory), to trace
    again later; None where the model cannot be copied (then a later switch of mode says so)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and id(b) not in memo:
                memo[id(b)] = b.detach().to("meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model that cannot be copied is traced in one mode only
        return None


class ModeSwitch:
    """What the parallel module needs to make the graph of another mode: the meta copy of the model,
    the example inputs (on meta), how they were traced, the mesh, and how the first plan was made."""

    def __init__(self, skeleton: Optional[nn.Module], example_inputs: Any, dynamic_dims: Any, mesh: Any,
                 memory_budget: Any, recompute: Optional[bool]) -> None:
        self.skeleton = skeleton
        self.example_inputs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                                 example_inputs)
        self.dynamic_dims = dynamic_dims
        self.mesh = mesh
        self.memory_budget = memory_budget
        self.recompute = recompute

    def graph_for(self, module: "ParallelModule", training: bool) -> tuple[torch.fx.Graph, Any, tuple]:
        """The graph (on ``module``'s state), the plan and the ops (:func:`op_signature`) of ``module``'s
        model in mode ``training``."""
        from autotp.capture import capture
        from autotp.mesh import MeshSpec
        from autotp.parallel import _agreed_plan, _from_first_rank
        from autotp.rewrite import build_graph, has_active_dropout

        if self.skeleton is None:
            raise RuntimeError(f"this parallel module runs the model in {_mode(module.graph_training)} mode only: "
                               f"autotp could not copy the model to trace it in {_mode(training)} mode; put the "
                               f"model in {_mode(training)} mode before autotp.parallelize")
        first = module.plan
        graph = capture(self.skeleton, self.example_inputs, self.dynamic_dims, training=training)
        spec = MeshSpec.of(self.mesh)
        if op_signature(graph) == module.autotp_ops:
            plan = first
        else:
            pins = dict(first.parameter_placements)
            # the first plan's mode, not the new one's: a train plan's graph in eval mode may still run a
            # backward (fine-tuning with dropout off), and only a train plan reduces its gradients
            plan = _agreed_plan(graph, spec, self.mesh, first.hardware, first.mode, self.memory_budget, 0.0,
                                first.optimizer, self.recompute, keep=pins, hardware_source=first.hardware_source)
        plan.check_matches(graph, spec)
        seed = _from_first_rank(self.mesh, [torch.initial_seed()])[0] if has_active_dropout(graph) else None
        fx_graph = build_graph(graph, plan, self.mesh, module, seed, prefix=_mode(training) + "_")
        return fx_graph, plan, op_signature(graph)


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def op_signature(graph: Any) -> tuple:
    """What two captures of one model must share to be one graph: every node the same op on the same
    arguments (a dropout's train flag and a batch norm's ``training`` are arguments). Kept instead of
    the capture, which holds the model's tensors."""
    if graph.exported is None:
        return ()
    # a model traced on meta (the copy) names the meta device where the real one names its own
    return tuple((x.name, x.op, str(x.target), _DEVICE.sub("device", str(x.args)), _DEVICE.sub("device", str(x.kwargs)))
                 for x in graph.exported.graph.nodes)


_DEVICE = re.compile(r"device\(type='[^']*'(, index=\d+)?\)")


class ParallelModule(torch.fx.GraphModule):
    """What ``autotp.parallelize`` returns (module docstring). Besides the ``GraphModule``, it has
    ``plan`` (the plan of the graph that runs now), ``plans`` (per mode, ``True`` for train, the plans
    made so far) and ``autotp_placements``."""

    def _autotp_init(self, graph: Any, plan: Any, switch: Optional[ModeSwitch], check_inputs: Optional[int]) -> None:
        """Called once by the rewrite: the graph just built is the one of the traced mode."""
        self.autotp_check_inputs = check_inputs
        self.graph_training = bool(graph.training)
        self.autotp_ops = op_signature(graph)
        self._autotp_modes = {self.graph_training: (self.graph, plan, self.autotp_ops)}
        self._autotp_switch = switch
        self.plan = plan
        nn.Module.train(self, self.graph_training)

    @property
    def plans(self) -> dict[bool, Any]:
        return {mode: entry[1] for mode, entry in self._autotp_modes.items()}

    def train(self, mode: bool = True) -> "ParallelModule":
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        modes = getattr(self, "_autotp_modes", None)
        if modes is not None and mode != self.graph_training:
            if mode not in modes:
                if self._autotp_switch is None:
                    raise RuntimeError(f"this parallel module was built from a plan and graph alone and runs the "
                                       f"model in {_mode(self.graph_training)} mode only; build it with "
                                       f"autotp.parallelize to switch it to {_mode(mode)} mode")
                modes[mode] = self._autotp_switch.graph_for(self, mode)
            graph, plan, ops = modes[mode]
            self.graph = graph  # recompiles forward
            self.plan, self.autotp_ops, self.graph_training = plan, ops, mode
        return nn.Module.train(self, mode)
