"""The communication program of a plan: what each node reads, and the collectives that follow.

For every input ``k`` of every node the program names the producer, the placement the node needs
(``q``) and the mesh axes whose backward gradient must be summed (``grad_axes``: the node reads the
tensor replicated on that axis while working on shards there, or while its own output's gradient
is partial, ``Rg``). Reads of one producer with the same
``q`` share one redistribution, and reads that also share ``grad_axes`` share one gradient
reduction; where the read gathers on a gradient axis, the gather's backward reduce-scatters the
partial gradient instead (:func:`autotp.planning.costs.redistribute.fused_axes`); where the producer's output is
``Rg``, no reduction runs there: the producer passes the partial gradient on to its own inputs. The runtime executes exactly this
program: :func:`collectives` lists its collectives and :func:`local_copies` the copy kernels around
them, so the plan's collectives are the ones that run and its predicted time prices both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional

from autotp.mesh import MeshSpec
from autotp.placement import Placement, R, Strategy, shard_divisor
from autotp.planning.costs.redistribute import (
    all_reduce_copies,
    conversion,
    fused_axes,
    reduced_axes,
    reorder_copies,
    step_bytes,
    step_copies,
)
from autotp.planning.rules.inner import inner_collectives
from autotp.tracing.aliasing import read_versions
from autotp.tracing.graph import OpGraph, OpNode
from autotp.units import format_bytes

__all__ = ["Read", "Collective", "LocalCopy", "read_key", "reads", "collectives", "local_copies", "program", "OUTPUT"]

OUTPUT = "<output>"


def read_key(node: OpNode, k: int, versions: Mapping[tuple[str, int], int]) -> str:
    """What reads of input ``k`` of ``node`` share a redistribution with: the producer, or for a getitem
    the item it picks; after in-place writes into the producer's storage, also their count
    (:func:`autotp.tracing.aliasing.read_versions`): a read after a write sees another value."""
    key = node.name if node.target == "getitem" else node.inputs[k]
    version = versions.get((node.name, k))
    return f"{key}@{version}" if version else key


@dataclass(frozen=True)
class Read:
    """Node ``consumer`` reads ``producer`` (its input ``index``) with ``placements``."""

    consumer: str
    index: int
    producer: str
    placements: Optional[tuple[Placement, ...]]
    grad_axes: tuple[int, ...]
    key: str = ""  # what reads share (read_key): the producer, or for a getitem the item it picks

    @property
    def value(self) -> str:
        return self.key or self.producer


@dataclass(frozen=True)
class Collective:
    """One collective of one step: kind, phase ("forward", "backward", or "recompute": a forward
    collective of a recomputed layer, run again during the backward), mesh axis name, bytes, node.

    ``bytes`` is the size the profile prices the kind at (nccl-tests' size): the tensor an
    all_reduce or reduce_scatter reads and an all_gather writes, and for an all_to_all one rank's
    buffer. ``rank_sent_bytes``, for an all_to_all: the bytes one rank sends in it, as planned (the
    sum of its send sizes). A redistribution's rank sends its even piece, ``bytes``. A routed
    all-to-all's (:mod:`autotp.planning.rules.routed`) are the busiest rank's rows
    (:func:`autotp.planning.rules.experts.busiest_rows`), the rows it is priced at: a price, not a
    cap (dropless routing sends every row, and a rank sent more runs slower than priced). None
    for the other kinds."""

    kind: str
    phase: str
    mesh_axis: str
    bytes: float
    at: str
    rank_sent_bytes: Optional[float] = None

    def __str__(self) -> str:
        sent = "" if self.rank_sent_bytes is None else f" ({format_bytes(self.rank_sent_bytes)} sent a rank)"
        return f"{self.phase} {self.kind} over {self.mesh_axis}: {format_bytes(self.bytes)}{sent} at {self.at}"


@dataclass(frozen=True)
class LocalCopy:
    """One copy kernel on each rank around a redistribution over ``mesh_axis`` of node ``at``:
    ``bytes`` read plus written (:func:`autotp.planning.costs.redistribute.step_copies`, and for a gradient reduction
    :func:`autotp.planning.costs.redistribute.all_reduce_copies`)."""

    phase: str
    mesh_axis: str
    bytes: float
    dtype: str
    at: str


def reads(graph: OpGraph, chosen: Mapping[str, Strategy], mesh: MeshSpec, train: bool) -> list[Read]:
    """Every read of the graph under the chosen strategies, the graph outputs last (as ``OUTPUT``)."""
    out: list[Read] = []
    versions = read_versions(graph, OUTPUT)
    for node in graph.nodes:
        strat = chosen[node.name]
        for k, src in enumerate(node.inputs):
            q = strat.inputs[k]
            grad_axes: tuple[int, ...] = ()
            if train and q is not None and graph[src].requires_grad:
                grad_axes = tuple(a for a in range(mesh.ndim) if q[a].is_replicate and strat.partial_grads_on(a))
            out.append(Read(node.name, k, src, q, grad_axes, read_key(node, k, versions)))
    for i, name in enumerate(graph.outputs):
        version = versions.get((OUTPUT, i))
        whole = None if name in graph.unread_outputs else (R,) * mesh.ndim  # an unread output stays as held
        out.append(Read(OUTPUT, i, name, whole, (), f"{name}@{version}" if version else ""))
    return out


def collectives(graph: OpGraph, chosen: Mapping[str, Strategy], mesh: MeshSpec, train: bool) -> list[Collective]:
    """The collectives of one step (forward, and backward when ``train``), in program order."""
    return program(graph, chosen, mesh, train)[0]


def local_copies(graph: OpGraph, chosen: Mapping[str, Strategy], mesh: MeshSpec, train: bool) -> list[LocalCopy]:
    """The copy kernels the redistributions and gradient reductions run on each rank
    (:func:`autotp.planning.costs.redistribute.step_copies`), forward then backward, in program order."""
    return program(graph, chosen, mesh, train)[1]


def program(graph: OpGraph, chosen: Mapping[str, Strategy], mesh: MeshSpec, train: bool,
            recomputed: Collection[str] = ()) -> tuple[list[Collective], list[LocalCopy]]:
    """Both lists of one step at once: :func:`collectives` and :func:`local_copies`.

    ``recomputed``: the nodes of layers that recompute (:mod:`autotp.planning.costs.recompute`); a redistribution
    first read by one of them runs again in the backward, its forward collectives and copies listed
    once more with phase ``"recompute"``."""
    rec: list[Collective] = []
    rec_copies: list[LocalCopy] = []
    fwd: list[Collective] = []
    bwd: list[Collective] = []
    fwd_copies: list[LocalCopy] = []
    bwd_copies: list[LocalCopy] = []
    done_redistribute: set[tuple] = set()
    done_reduce: set[tuple] = set()
    last = None

    def inner(name: Optional[str]) -> None:
        """The collectives op ``name`` runs inside itself (a loss on split classes, batch norm on a
        split batch), after its reads."""
        if name is None or name == OUTPUT:
            return
        node = graph[name]
        for kind, phase, a, size in inner_collectives(node, chosen[name], mesh.shape, train and node.requires_grad):
            sent = size if kind == "all_to_all" else None  # an op's own all-to-all is priced at a rank's buffer
            if phase == "backward":
                bwd.append(Collective(kind, phase, mesh.axis_names[a], size, name, sent))
                continue
            fwd.append(Collective(kind, phase, mesh.axis_names[a], size, name, sent))
            if name in recomputed:
                rec.append(Collective(kind, "recompute", mesh.axis_names[a], size, name, sent))

    for r in reads(graph, chosen, mesh, train):
        if r.consumer != last:
            inner(last)
            last = r.consumer
        if r.placements is None:
            continue
        src = graph[r.producer]
        # what is read: the producer's output, or for a getitem the item (a cut's pieces may differ)
        info = graph[r.consumer].input_infos[r.index] if r.consumer != OUTPUT else src.outputs[0]
        p = chosen[r.producer].output
        fused = fused_axes(p, r.placements, r.grad_axes)
        if (r.value, r.placements, fused) not in done_redistribute:
            done_redistribute.add((r.value, r.placements, fused))
            steps = conversion(info.shape, p, r.placements, mesh.shape, fused)
            for step in steps.steps:
                size = step_bytes(step, steps.shape, info.nbytes, mesh.shape)
                axis = mesh.axis_names[step.axis]
                backward = train and src.requires_grad
                again = r.consumer in recomputed

                def step_collective(kind: str, phase: str) -> Collective:
                    sent = size if kind == "all_to_all" else None  # a rank's even piece, as step_bytes sizes it
                    return Collective(kind, phase, axis, size, r.producer, sent)

                if step.forward:
                    fwd.append(step_collective(step.forward, "forward"))
                    if again:
                        rec.append(step_collective(step.forward, "recompute"))
                if step.backward and backward:
                    bwd.append(step_collective(step.backward, "backward"))
                copies_fwd, copies_bwd = step_copies(step, steps.shape, mesh.shape[step.axis], info.nbytes)
                fwd_copies += [LocalCopy("forward", axis, b, info.dtype, r.producer) for b in copies_fwd]
                if again:
                    rec_copies += [LocalCopy("recompute", axis, b, info.dtype, r.producer) for b in copies_fwd]
                if backward:
                    bwd_copies += [LocalCopy("backward", axis, b, info.dtype, r.producer) for b in copies_bwd]
            for a, b in reorder_copies(steps, info.nbytes):  # unequal blocks put in the ranks' order or back
                axis = mesh.axis_names[a]
                fwd_copies.append(LocalCopy("forward", axis, b, info.dtype, r.producer))
                if r.consumer in recomputed:
                    rec_copies.append(LocalCopy("recompute", axis, b, info.dtype, r.producer))
                if train and src.requires_grad:
                    bwd_copies.append(LocalCopy("backward", axis, b, info.dtype, r.producer))
        reduce_axes = reduced_axes(p, r.placements, r.grad_axes)
        key = (r.value, r.placements, r.grad_axes)
        if reduce_axes and key not in done_reduce:
            done_reduce.add(key)
            for a in reduce_axes:
                # the largest piece the other axes leave (autotp.planning.costs.costing.CostModel.grad_reduce_s)
                size = info.nbytes / shard_divisor(info.shape, [pl for b, pl in enumerate(r.placements) if b != a],
                                                   [n for b, n in enumerate(mesh.shape) if b != a])
                bwd.append(Collective("all_reduce", "backward", mesh.axis_names[a], size, r.producer))
                bwd_copies += [LocalCopy("backward", mesh.axis_names[a], b, info.dtype, r.producer)
                               for b in all_reduce_copies(size)]
    inner(last)
    return fwd + bwd + rec, fwd_copies + bwd_copies + rec_copies
