"""Time collectives over a range of message sizes, the way nccl-tests does.

For every mesh axis, every collective kind and every size: ``warmup_iters`` untimed runs,
a barrier over all ranks, ``iters`` timed runs back to back, and the mean per run. With
``min_time_s`` > 0, blocks of ``iters`` runs repeat until that much time has been timed
(as OSU's benchmarks run more iterations on small messages): on a noisy host (a VM whose
vCPUs are throttled in milliseconds-long slices) a mean over 10 runs of 1 ms swings by
half, a mean over 0.1 s does not. All groups of the axis run at the same time. The time of a point is the **maximum over all
ranks** of their means (the slowest rank decides when a collective is over). With
``check`` one more run follows on rank-dependent inputs, and the mismatching elements of
every rank are summed into ``wrong``.

All ranks must call :func:`sweep` with the same arguments; only the callbacks differ
(rank 0 prints, every rank reports progress to the launcher's watchdog).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autotp.profiling import collectives
from autotp.profiling.collectives import bus_factor
from autotp.profiling.mesh import MeshAxis


@dataclass(frozen=True)
class SweepPoint:
    """One row of the table: a collective of ``size_bytes`` (full buffer) on one axis."""

    axis: int
    kind: str
    group_size: int
    size_bytes: int
    count: int
    time_s: float
    wrong: int | None  # None when not checked
    runs: int = 0  # timed runs per rank: iters, or a multiple of it with a minimum time

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.size_bytes / self.time_s

    @property
    def busbw_bytes_per_s(self) -> float:
        return self.algbw_bytes_per_s * bus_factor(self.kind, self.group_size)

    def to_dict(self) -> dict:
        return {
            "size_bytes": self.size_bytes,
            "count": self.count,
            "time_s": self.time_s,
            "runs": self.runs,
            "wrong": self.wrong,
        }


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along one mesh axis: the handle to pass to collectives and its ranks."""

    axis: MeshAxis
    handle: object  # a ProcessGroup, or None for the default group
    ranks: tuple[int, ...]


def new_axis_groups(axes: Sequence[MeshAxis], rank: int, world_size: int) -> tuple[AxisGroup, ...]:
    """Create the sub-groups of every axis (all ranks call ``new_group`` for every group, in
    the same order, as torch requires) and keep the one holding ``rank``."""
    result = []
    for axis in axes:
        mine = axis.group_of(rank)
        handle = None
        if axis.size != world_size:
            for group in axis.groups:
                created = dist.new_group(list(group))
                if group == mine:
                    handle = created
        result.append(AxisGroup(axis=axis, handle=handle, ranks=mine))
    return tuple(result)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    # An all-reduce rather than dist.barrier(): same meaning on gloo and nccl, no device guess.
    dist.all_reduce(torch.zeros(1, device=device))
    _synchronize(device)


def time_call(
    call: collectives.CollectiveCall,
    iters: int,
    warmup_iters: int,
    device: torch.device,
    min_time_s: float = 0.0,
    max_blocks: int = 1000,
) -> tuple[float, int]:
    """This rank's mean seconds per run of ``call``, and the number of timed runs.

    Runs ``warmup_iters`` untimed, then timed blocks of ``iters`` runs (each after a
    barrier) until the slowest rank has timed ``min_time_s`` in all: one block when
    ``min_time_s`` is 0, as nccl-tests does. The ranks agree on stopping with one small
    all-reduce between blocks, outside the timed region.
    """
    for _ in range(warmup_iters):
        call.run()
    timed_s, runs, blocks = 0.0, 0, 0
    while True:
        _barrier(device)
        start = time.perf_counter()
        for _ in range(iters):
            call.run()
        _synchronize(device)
        timed_s += time.perf_counter() - start
        runs += iters
        blocks += 1
        if min_time_s <= 0 or blocks >= max_blocks:
            break
        slowest = torch.tensor([timed_s], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if slowest.item() >= min_time_s:
            break
    return timed_s / runs, runs


def measure_point(
    group: AxisGroup,
    kind: str,
    size_bytes: int,
    *,
    rank: int,
    device: torch.device,
    iters: int,
    warmup_iters: int,
    check: bool,
    reduce_scatter_native: bool,
    min_time_s: float = 0.0,
) -> SweepPoint:
    """Time (and optionally check) one collective of one size; the result is the same on all ranks."""
    call = collectives.prepare(
        kind, size_bytes, group.handle, group.ranks, rank, device, reduce_scatter_native=reduce_scatter_native
    )
    mean_s, runs = time_call(call, iters, warmup_iters, device, min_time_s)
    slowest = torch.tensor([mean_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wrong = None
    if check:
        collectives.fill_for_check(call)
        call.run()
        _synchronize(device)
        total = torch.tensor([collectives.count_wrong(call)], dtype=torch.int64, device=device)
        dist.all_reduce(total)
        wrong = int(total.item())
    return SweepPoint(
        axis=group.axis.index,
        kind=kind,
        group_size=len(group.ranks),
        size_bytes=call.size_bytes,
        count=call.count,
        time_s=float(slowest.item()),
        wrong=wrong,
        runs=runs,
    )


def sweep(
    groups: Sequence[AxisGroup],
    kinds: Sequence[str],
    sizes_bytes: Sequence[int],
    *,
    rank: int,
    device: torch.device,
    iters: int,
    warmup_iters: int,
    check: bool,
    reduce_scatter_native: bool,
    min_time_s: float = 0.0,
    on_point: Callable[[int, AxisGroup, str, int], None] = lambda step, group, kind, size: None,
    on_kind_done: Callable[[AxisGroup, str, list[SweepPoint]], None] = lambda group, kind, points: None,
) -> tuple[SweepPoint, ...]:
    """Every axis x kind x size; ``on_point(step, group, kind, size)`` is called before each
    point (step counts from 1), ``on_kind_done`` after the last size of a kind."""
    results: list[SweepPoint] = []
    step = 0
    for group in groups:
        for kind in kinds:
            points = []
            for size in sizes_bytes:
                step += 1
                on_point(step, group, kind, size)
                points.append(
                    measure_point(
                        group,
                        kind,
                        size,
                        rank=rank,
                        device=device,
                        iters=iters,
                        warmup_iters=warmup_iters,
                        check=check,
                        reduce_scatter_native=reduce_scatter_native,
                        min_time_s=min_time_s,
                    )
                )
            on_kind_done(group, kind, points)
            results.extend(points)
    return tuple(results)
