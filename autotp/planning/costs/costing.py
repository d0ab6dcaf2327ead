"""Costing: seconds and bytes of each strategy, edge and gradient reduction on one mesh and profile.

* A node's strategy costs the roofline time of its local shard (``cost_models.compute_time_s`` on
  the FLOPs and bytes one rank handles; a convolution at the profile's convolution rate where it
  has one, as cuDNN runs float32 convolutions in TF32). In ``train`` mode a node that carries a
  gradient adds its backward, priced by what the backward kernels do:

  - an op with FLOPs (a matmul, attention): ``BACKWARD_FLOP_RATIO`` (2) kernels like the forward,
    the gradients of the input and of the weight, each as many FLOPs as the forward;
  - an op without (elementwise, norm, softmax, gather; ``flop_counter`` counts none): memory-bound,
    priced on the bytes its backward moves: the output's gradient read, each floating-point input
    read again (what the forward saved) and its gradient written, each integer input read once.

  A tensor read by several nodes that carry gradients (a residual stream, a norm's output read by
  q, k and v, a weight tied to two layers) gets one gradient from each, and autograd adds them up:
  each addition is priced as a memory-bound kernel on the producer's local shard. (Where readers
  share a redistribution, the runtime adds their gradients at the placement they read, before the
  redistribution's backward: a gathered tensor's at full size, priced at the shard's. Pricing that
  exactly needs the additions keyed by redistribution, as the collectives are.)
* An edge costs the collectives of :mod:`autotp.planning.costs.redistribute` between the producer's output
  placement and the placement the consumer needs, forward and (in train mode, for tensors that
  carry gradients) backward, and the local copies the runtime makes around them
  (:func:`autotp.planning.costs.redistribute.step_copies`: a step on a dim other than the first rearranges the
  tensor on each rank), each priced as a memory-bound kernel.
* A **gradient reduction** is the backward ``all_reduce`` of a tensor that is replicated on an
  axis where a consumer works on shards: each rank then holds only a partial gradient. One
  reduction serves every such consumer of the tensor (q, k and v share one).
* Memory per device: parameters, gradients and the optimizer's state of the local shards
  (``cost_models.model_state_bytes``, for the optimizer the user names: AdamW by default) and, in train mode, the activations kept for backward.

>>> from autotp.mesh import MeshSpec
>>> from autotp.placement import R, S
>>> from autotp.tracing.graph import TensorInfo
>>> from cost_models import load_profile
>>> cm = CostModel(MeshSpec.of((8,)), load_profile("h100-sxm"), "inference")
>>> cm.edge_s(TensorInfo((1024, 1024), "float32"), (S(0),), (R,), False) > 0
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional, Sequence, Union

from autotp.mesh import MeshSpec
from autotp.ops import CONVOLUTIONS
from autotp.placement import Placement, R, Strategy, axis_divisor, plain, shard_divisor
from autotp.planning.costs.redistribute import (
    all_reduce_copies,
    conversion,
    is_convertible,
    reorder_copies,
    step_bytes,
    step_copies,
)
from autotp.planning.costs.saved import forward_liveness, kept_storages
from autotp.planning.rules.attention import attention_work_divisor, overlapped_collectives, ring_transient_bytes
from autotp.planning.rules.attention_working import working_bytes
from autotp.planning.rules.experts import expert_work_divisor
from autotp.planning.rules.inner import inner_collectives
from autotp.planning.rules.routed import routed_kept_bytes, routed_work_divisor
from autotp.tracing.graph import BUFFER, PARAMETER, OpGraph, OpNode, TensorInfo, dtype_bytes
from cost_models import (
    HardwareProfile,
    OptimizerSpec,
    collective_time_s,
    compute_time_s,
    model_state_bytes,
    optimizer_spec,
)

__all__ = ["CostModel", "MemoryParts", "BACKWARD_FLOP_RATIO", "MODES"]

BACKWARD_FLOP_RATIO = 2.0  # backward ≈ 2× forward: gradients of inputs and of weights
MODES = ("train", "inference")
INFEASIBLE_S = float("inf")


@dataclass(frozen=True)
class MemoryParts:
    parameters_bytes: float = 0.0
    gradients_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buffers_bytes: float = 0.0  # held for the model's lifetime: caches, running statistics, masks
    transient_bytes: float = 0.0  # the gradients the backward starts from (of the model's outputs)
    step_temporary_bytes: float = 0.0  # what the optimizer's step allocates while it runs

    @property
    def backward_start_bytes(self) -> float:
        """At the start of the backward (the peak of most steps): everything the forward kept, the
        state, and the first gradients; no parameter's gradient exists yet."""
        return (self.parameters_bytes + self.optimizer_bytes + self.activations_bytes + self.buffers_bytes
                + self.transient_bytes)

    @property
    def optimizer_step_bytes(self) -> float:
        """At the optimizer's step: the state, every gradient, and the step's temporaries; the
        activations are gone."""
        return (self.parameters_bytes + self.optimizer_bytes + self.gradients_bytes + self.buffers_bytes
                + self.step_temporary_bytes)


class CostModel:
    """Prices strategies on one mesh with one hardware profile, in ``train`` or ``inference`` mode."""

    def __init__(self, mesh: MeshSpec, profile: HardwareProfile, mode: str,
                 optimizer: Union[str, OptimizerSpec, None] = "adamw", graph: Optional[OpGraph] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        self.optimizer = optimizer_spec(optimizer)
        self.mesh = mesh
        self.profile = profile
        self.mode = mode
        self.train = mode == "train"
        self._links = tuple(profile.link_for_axis(mesh.shape, a) for a in range(mesh.ndim))
        self._collective_cached = lru_cache(maxsize=None)(self._collective_uncached)
        self._edge_cached = lru_cache(maxsize=None)(self._edge_uncached)
        self._event_cached = lru_cache(maxsize=None)(self._backward_event_uncached)
        self._grad_reduce_cached = lru_cache(maxsize=None)(self._grad_reduce_uncached)
        # one conversion per (shape, src, dst, partial-gradient axes), shared by the time and memory figures
        self._conversion = lru_cache(maxsize=None)(
            lambda shape, src, dst, axes: conversion(shape, src, dst, self.mesh.shape, axes))
        # what the backward of the graph keeps (autotp.planning.costs.saved); without a graph, every output
        # that needs a gradient is priced as kept (an upper bound)
        self.kept = kept_storages(graph) if graph is not None and self.train else None
        self._returned = frozenset(graph.outputs) - frozenset(graph.unread_outputs) if graph is not None else frozenset()

    # -- communication -------------------------------------------------------------------------

    def _collective_uncached(self, kind: str, axis: int, size_bytes: float) -> float:
        return collective_time_s(self._links[axis], kind, size_bytes, self.mesh.shape[axis])

    def collective_s(self, kind: str, axis: int, size_bytes: float) -> float:
        """Seconds of one collective over ``axis``; ``size_bytes`` is the full tensor along that axis."""
        return self._collective_cached(kind, axis, float(size_bytes))

    def edge_s(self, info: TensorInfo, src: Sequence[Placement], dst: Optional[Sequence[Placement]],
               requires_grad: bool, grad_axes: Sequence[int] = ()) -> float:
        """Forward (and, when training a tensor that carries a gradient, backward) redistribution time.

        ``grad_axes``: axes on which the reader returns a partial gradient; where the edge gathers
        on such an axis, its backward reduce-scatters (the separate gradient all_reduce is priced by
        :meth:`grad_reduce_s` only where no gather absorbs it).

        From ``Rg`` (a gradient left partial) only a reader of ``R`` that returns a partial gradient
        there may read: any other would add a whole gradient to partial ones (infeasible).
        """
        if dst is None:
            return 0.0
        if any(p.grad_partial for p in src):
            if self.train and requires_grad and any(p.grad_partial and not (d == R and a in grad_axes)
                                                    for a, (p, d) in enumerate(zip(src, dst))):
                return INFEASIBLE_S
            src = plain(src)
        if tuple(src) == tuple(dst):
            return 0.0
        if not is_convertible(tuple(src), tuple(dst)):
            return INFEASIBLE_S
        forward_s, backward_s = self._edge_cached(info, tuple(src), tuple(dst), tuple(grad_axes))
        return forward_s + (backward_s if self.train and requires_grad else 0.0)

    def _edge_uncached(self, info: TensorInfo, src: tuple, dst: tuple, grad_axes: tuple) -> tuple[float, float]:
        """Seconds of the redistribution's forward (collectives and copies) and of its backward."""
        forward_s = backward_s = 0.0
        steps = self._conversion(tuple(info.shape), src, dst, grad_axes if self.train else ())
        for step in steps.steps:
            size = step_bytes(step, steps.shape, info.nbytes, self.mesh.shape)
            copies_fwd, copies_bwd = step_copies(step, steps.shape, self.mesh.shape[step.axis], info.nbytes)
            forward_s += (self.collective_s(step.forward, step.axis, size) if step.forward else 0.0) + sum(
                self.copy_s(b, info.dtype) for b in copies_fwd)
            backward_s += (self.collective_s(step.backward, step.axis, size) if step.backward else 0.0) + sum(
                self.copy_s(b, info.dtype) for b in copies_bwd)
        for _, b in reorder_copies(steps, info.nbytes):
            forward_s += self.copy_s(b, info.dtype)
            backward_s += self.copy_s(b, info.dtype)
        return forward_s, backward_s

    def edge_forward_s(self, info: TensorInfo, src: Sequence[Placement], dst: Optional[Sequence[Placement]],
                       grad_axes: Sequence[int] = ()) -> float:
        """The forward part of :meth:`edge_s`: its collectives and copies (what a recomputed read runs again)."""
        src = plain(src)
        if dst is None or tuple(src) == tuple(dst) or not is_convertible(tuple(src), tuple(dst)):
            return 0.0
        return self._edge_cached(info, tuple(src), tuple(dst), tuple(grad_axes))[0]

    def copy_s(self, bytes_moved: float, dtype: str) -> float:
        """Seconds of one local copy kernel moving ``bytes_moved`` (read plus written)."""
        return compute_time_s(self.profile.device, 0.0, bytes_moved, dtype)

    def grad_reduce_s(self, info: TensorInfo, placements: Sequence[Placement], axis: int) -> float:
        """Backward all_reduce over ``axis`` of the gradient of a tensor held with ``placements``, and
        the clone of the gradient it reduces into (:func:`autotp.planning.costs.redistribute.all_reduce_copies`)."""
        if not self.train:
            return 0.0
        return self._grad_reduce_cached(info, tuple(placements), axis)

    def _grad_reduce_uncached(self, info: TensorInfo, placements: tuple, axis: int) -> float:
        divisor = shard_divisor(info.shape, [p for b, p in enumerate(placements) if b != axis],
                                [n for b, n in enumerate(self.mesh.shape) if b != axis])
        size = info.nbytes / divisor
        return (self.collective_s("all_reduce", axis, size)
                + sum(self.copy_s(b, info.dtype) for b in all_reduce_copies(size)))

    # -- compute -------------------------------------------------------------------------------

    def local_bytes(self, info: TensorInfo, placements: Optional[Sequence[Placement]]) -> float:
        if placements is None:
            return 0.0
        return info.nbytes / shard_divisor(info.shape, placements, self.mesh.shape)

    def node_compute_s(self, node: OpNode, strategy: Strategy, gradient_reads: int = 1) -> float:
        """Roofline seconds of the node's local work (forward, plus backward when training), and, when
        training, the sums of the ``gradient_reads`` gradients its output gets back
        (:meth:`autotp.tracing.graph.OpGraph.gradient_reads`): ``gradient_reads - 1`` additions of its local
        output, a memory-bound kernel each (read two, write one). The collectives the op runs inside
        itself add to its work, those that run while it computes (a ring's shifts:
        :func:`autotp.planning.rules.attention.overlapped_collectives`) the longer of them and the work."""
        seconds = self.gradient_sums_s(node, strategy, gradient_reads)
        if node.is_placeholder or node.is_view:
            return seconds
        exposed_s, hidden_s = self._inner_parts_s(node, strategy, backward=True)
        return seconds + max(self._work_s(node, strategy), hidden_s) + exposed_s

    def inner_collectives_s(self, node: OpNode, strategy: Strategy, backward: bool = True) -> float:
        """Seconds of the collectives an op runs inside itself (a loss on split classes, batch norm
        on a split batch: :func:`autotp.planning.rules.inner.inner_collectives`): the forward's, and
        when training and ``backward``, the backward's."""
        return sum(self.collective_s(kind, axis, size)
                   for kind, _, axis, size in inner_collectives(node, strategy, self.mesh.shape,
                                                                 self.train and backward and node.requires_grad))

    def _inner_parts_s(self, node: OpNode, strategy: Strategy, backward: bool) -> tuple[float, float]:
        """:meth:`inner_collectives_s` in two: the seconds of the collectives that add to the op's
        work, and of those that run under it."""
        train = self.train and backward and node.requires_grad
        exposed = inner_collectives(node, strategy, self.mesh.shape, train)
        hidden = overlapped_collectives(node, strategy, self.mesh.shape, train)
        for c in hidden:
            exposed.remove(c)
        return tuple(sum(self.collective_s(kind, axis, size) for kind, _, axis, size in part)
                     for part in (exposed, hidden))

    def gradient_sums_s(self, node: OpNode, strategy: Strategy, gradient_reads: int) -> float:
        """Seconds of adding up the ``gradient_reads`` gradients of the node's output (training only)."""
        if not self.train or not node.requires_grad or gradient_reads < 2:
            return 0.0
        local = self.local_bytes(node.outputs[0], strategy.output)
        return (gradient_reads - 1) * compute_time_s(self.profile.device, 0.0, 3 * local, node.outputs[0].dtype)

    def node_forward_s(self, node: OpNode, strategy: Strategy) -> float:
        """Roofline seconds of the node's forward alone (what recomputing it costs)."""
        if node.is_placeholder or node.is_view:
            return 0.0
        exposed_s, hidden_s = self._inner_parts_s(node, strategy, backward=False)
        return max(self._forward(node, strategy)[0], hidden_s) + exposed_s

    def _forward(self, node: OpNode, strategy: Strategy) -> tuple[float, float, list, float, str]:
        # the work splits over an axis only where some tensor is cut in pieces on it: an op on
        # partials (P) does the whole work on every rank
        work_divisor = 1.0
        for a, n in enumerate(self.mesh.shape):
            if strategy.split_on(a):
                work_divisor *= _work_divisor(node, strategy, a, n)
        flops = node.flops / work_divisor
        in_bytes = [(self.local_bytes(i, p), i.is_float) for i, p in zip(node.input_infos, strategy.inputs)]
        out_bytes = sum(self.local_bytes(o, strategy.output) for o in node.outputs)
        moved = sum(b for b, _ in in_bytes) + out_bytes
        dtype = node.outputs[0].dtype if node.outputs[0].is_float else next(
            (i.dtype for i in node.input_infos if i.is_float), "float32")
        seconds = compute_time_s(self.profile.device, flops, moved, dtype, convolution=node.target in CONVOLUTIONS)
        return seconds, flops, in_bytes, out_bytes, dtype

    def _work_s(self, node: OpNode, strategy: Strategy) -> float:
        seconds, flops, in_bytes, out_bytes, dtype = self._forward(node, strategy)
        device = self.profile.device
        if self.train and node.requires_grad:
            if flops > 0:
                seconds *= 1.0 + BACKWARD_FLOP_RATIO
            else:
                backward_bytes = out_bytes + sum(2 * b if is_float else b for b, is_float in in_bytes)
                seconds += compute_time_s(device, 0.0, backward_bytes, dtype)
        return seconds

    # -- memory --------------------------------------------------------------------------------

    def node_memory(self, node: OpNode, strategy: Strategy) -> MemoryParts:
        """Bytes per device that choosing ``strategy`` for ``node`` commits."""
        if node.role == PARAMETER:
            info = node.output
            fraction = 1.0 / shard_divisor(info.shape, strategy.output, self.mesh.shape)
            state = model_state_bytes(info.numel, dtype_bytes(info.dtype), fraction,
                                      mode=self.mode if node.requires_grad else "inference", optimizer=self.optimizer)
            return MemoryParts(state.parameters_bytes, state.gradients_bytes, state.optimizer_bytes, 0.0,
                               step_temporary_bytes=state.step_temporary_bytes)
        if node.role == BUFFER:
            return MemoryParts(buffers_bytes=self.local_bytes(node.output, strategy.output))
        if not self.train or not node.requires_grad or node.is_placeholder:
            return MemoryParts()
        routed = routed_kept_bytes(node, strategy, self.mesh.shape)  # the dispatched rows, kept for the backward
        if self.kept is None:
            if node.is_view:
                return MemoryParts()
            return MemoryParts(activations_bytes=routed + sum(self.local_bytes(o, strategy.output) for o in node.outputs))
        local = self.local_bytes(node.outputs[0], strategy.output)
        kept = local if node.name in self.kept.kept else 0.0
        extra = self.kept.extra_per_element.get(node.name, 0.0)
        if extra:
            extra *= node.outputs[0].numel / shard_divisor(node.outputs[0].shape, strategy.output, self.mesh.shape)
        # a returned tensor's gradient arrives, and the first op of the backward makes one of its size
        transient = 2 * local if node.name in self.kept.returned else 0.0
        if node.name in self.kept.held:  # returned beside the loss (logits): whole, alive through the backward
            transient += sum(o.nbytes for o in node.outputs)
        per_input = self.kept.extra_per_input_element.get(node.name, 0.0)
        first = self.local_bytes(node.input_infos[0], strategy.inputs[0]) if node.inputs else 0.0
        transient += self.kept.transient_per_input_element.get(node.name, 0.0) * first
        return MemoryParts(activations_bytes=kept + extra + per_input * first + (routed if kept else 0.0),
                           transient_bytes=transient)

    def memory_key(self, node: OpNode) -> tuple:
        """What :meth:`node_memory` reads of the node beyond its shapes and role: nodes of one shape
        with equal keys commit equal bytes under one strategy."""
        if self.kept is None:
            return ()
        k, name = self.kept, node.name
        return (name in k.kept, k.extra_per_element.get(name, 0.0), name in k.returned, name in k.held,
                k.extra_per_input_element.get(name, 0.0), k.transient_per_input_element.get(name, 0.0))

    def alive_bytes(self, node: OpNode, strategy: Strategy) -> float:
        """Bytes a rank holds of the node's outputs while they live in a forward: their local
        pieces; a graph output, which the module returns whole, at least whole."""
        local = sum(self.local_bytes(o, strategy.output) for o in node.outputs)
        return max(local, sum(o.nbytes for o in node.outputs)) if node.name in self._returned else local

    def forward_peak_bytes(self, graph: OpGraph, chosen: Mapping[str, Strategy]) -> float:
        """The most bytes of op outputs alive at once in a forward without autograd, under the
        strategies ``chosen`` (:func:`autotp.planning.costs.saved.forward_liveness`)."""
        return forward_liveness(graph).peak(lambda r: self.alive_bytes(graph[r], chosen[r]))

    def copy_bytes(self, info: TensorInfo, produced: Sequence[Placement], read: Optional[Sequence[Placement]]) -> float:
        """Bytes a reader that keeps its input for the backward keeps beyond its producer's output,
        when it reads ``info`` made at ``produced`` as ``read``: a gathered copy, larger than the
        piece it came from (a reduced partial sum or a slice takes no more than its source)."""
        if not self.train or read is None:
            return 0.0
        return max(0.0, self.local_bytes(info, read) - self.local_bytes(info, produced))

    def backward_event_bytes(self, info: TensorInfo, produced: Sequence[Placement],
                             read: Optional[Sequence[Placement]], grad_axes: Sequence[int] = ()) -> float:
        """Bytes alive at once, beside the activations still kept, while the backward turns the
        gradient of a read at ``read`` into its producer's placement ``produced`` (the gradient of
        a gather is reduce-scattered; of a reduce-scatter, gathered): the gradient as read and as
        produced, and where the collective moves a dim other than the first, a contiguous copy of
        each. Zero where the backward moves nothing."""
        if not self.train or read is None:
            return 0.0
        return self._event_cached(info, tuple(produced), tuple(read), tuple(grad_axes))

    def _backward_event_uncached(self, info: TensorInfo, produced: tuple, read: tuple, grad_axes: tuple) -> float:
        src = plain(produced)
        if tuple(src) == tuple(read) or not is_convertible(tuple(src), tuple(read)):
            return 0.0
        steps = self._conversion(tuple(info.shape), tuple(src), read, grad_axes).steps
        moving = [s for s in steps if s.backward]
        if not moving:
            return 0.0
        both = self.local_bytes(info, read) + self.local_bytes(info, src)
        inner = any(p.is_shard and p.dim != 0 for s in moving for p in (s.src, s.dst))
        return 2 * both if inner else both

    def working_bytes(self, node: OpNode, strategy: Strategy) -> float:
        """Bytes an op's kernel holds at once beyond its inputs, outputs and what is kept, in the
        backward (training): an attention's masks of its largest chunk, built again where the
        backward runs each chunk again, or the ring's scores of a block
        (:func:`autotp.planning.rules.attention_working.working_bytes`), with the ring's key and value
        chunks in flight and their gradients (:func:`autotp.planning.rules.attention.ring_transient_bytes`).
        An event of the backward, as a conversion of a gradient is: beside every activation still kept,
        not beside another (one layer's attention runs its backward at a time)."""
        if not self.train or not node.requires_grad:
            return 0.0
        return working_bytes(node, strategy, self.mesh.shape) + ring_transient_bytes(node, strategy, self.mesh.shape)

    def backward_events_bytes(self, graph: OpGraph, chosen: Mapping[str, Strategy]) -> float:
        """The largest :meth:`backward_event_bytes` of any read, or :meth:`working_bytes` of any op,
        under the strategies ``chosen``."""
        if not self.train:
            return 0.0
        most = max((self.working_bytes(v, chosen[v.name]) for v in graph.ops()), default=0.0)
        for v in graph.nodes:
            for k, u in enumerate(v.inputs):
                if graph[u].requires_grad:
                    most = max(most, self.backward_event_bytes(v.input_infos[k], chosen[u].output,
                                                               chosen[v.name].inputs[k]))
        return most

    def copies_bytes(self, graph: OpGraph, chosen: Mapping[str, Strategy]) -> float:
        """What the readers that keep their inputs keep beyond their producers' outputs
        (:meth:`copy_bytes`) under the strategies ``chosen``; readers that read one value at one
        placement share one copy."""
        if self.kept is None:
            return 0.0
        seen: dict[tuple, float] = {}
        for v, k in self.kept.saved_reads:
            node = graph[v]
            u = node.inputs[k]
            read = chosen[v].inputs[k]
            seen[(u, read)] = self.copy_bytes(node.input_infos[k], chosen[u].output, read)
        return sum(seen.values())


def _work_divisor(node: OpNode, strategy: Strategy, axis: int, n: int) -> float:
    """How many times less work the slowest rank does on ``axis``: ``n``, or for an uneven split the
    full size over its largest piece (every tensor a choice splits unevenly is cut in the same units),
    or for experts split whole over the ranks, the rows over the busiest rank's
    (:func:`autotp.planning.rules.experts.expert_work_divisor`), or on routed rows, the busiest
    rank's received rows (:func:`autotp.planning.rules.routed.routed_work_divisor`), or for a causal or
    described attention split by query rows, the mask's pairs over the busiest rank's
    (:func:`autotp.planning.rules.attention.attention_work_divisor`)."""
    attention = attention_work_divisor(node, strategy, axis, n)
    if attention is not None:
        return attention
    routed = routed_work_divisor(node, strategy, axis, n)
    if routed is not None:
        return routed
    experts = expert_work_divisor(node, strategy, axis, n)
    if experts is not None:
        return experts
    tensors = zip((*strategy.inputs, strategy.output), (*node.input_infos, node.outputs[0]))
    for placements, info in tensors:
        if placements is not None and placements[axis].is_uneven:
            p = placements[axis]
            return axis_divisor(info.shape[p.dim], p, n)
    return float(n)
