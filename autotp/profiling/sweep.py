"""Time collectives over a range of message sizes, the way nccl-tests does (and a bit more).

For every mesh axis and every collective kind, all groups of the axis running at once:

1. every size is prepared: buffers, ``warmup_iters`` untimed runs, and with ``check``
   one run on rank-dependent inputs whose mismatching elements, summed over all ranks,
   become the point's ``wrong``;
2. ``rounds`` rounds over the sizes (ascending, then descending, ...); in each, a size
   gets timed blocks of ``iters`` runs, each block after a barrier, until
   ``min_time_s / rounds`` has been timed (a single block when ``min_time_s`` is 0, which
   is exactly nccl-tests' ``-n``).

A block's time is the mean over its ``iters`` runs, taken on the slowest rank (the
**maximum over ranks**: the slowest rank decides when a collective is over), which is
nccl-tests' figure. A point's time is the **trimmed mean over its blocks**: the mean after
dropping the fastest and the slowest ``TRIM`` (10%) of them (none when there are fewer than
10 blocks). With a single block it is exactly nccl-tests' figure; with many, a rare block
that a long stall of the host hit does not move it, and the point is still what a run of
that collective costs on average, which is what a training step pays.

Why blocks and rounds: on a shared host (a VM whose vCPUs the host, or other programs, take
away in slices of milliseconds, for seconds at a time) a mean over 10 runs of 1 ms swings by
half from one moment to the next. Spreading a size's blocks over rounds, in alternating order,
exposes every size to the same slow drifts, so the sizes stay comparable with each other,
which is what the fit needs. On a quiet machine they change only the run time. How many
rounds: on this project's 2-vCPU VM (gloo, 1-16 MiB, 6 rounds recorded twice) a size's level
moves by 30-50% between rounds, and 3 rounds put the fit's error on held-out sizes up to 44%,
so ``autotp profile`` uses 5 rounds by default (the large sizes, one block per round, cost
most of the extra time). How many blocks: scoring those profiles again on every other block
alone raised the worst held-out error from 20/18/23% to 21-26/21-25/24-32%, so the default
``--min-time-s`` is 0.5 s per size (four runs: worst 23%, 18%, 22% and 28%, the last one at the
all_gather step between 16 and 32 MiB; the whole 1 KiB-64 MiB sweep of five kinds with held-out
sizes then takes 3 minutes on 2 gloo ranks, from 2).

Why a trimmed mean, not the median: on that VM a 1-2 MiB gloo all_reduce's blocks of 10 runs
take anywhere from 0.7 to 4 ms, in two clusters (the two ranks running at once, or one waiting
for a core). The median of 10-20 such blocks jumps between the clusters as their mix shifts;
the mean moves smoothly with it. Three profiles whose every block was recorded, scored on the
held-out sizes from 1 MiB (fit on the fit sizes' figures, compared with the held-out sizes'):
worst errors 27%, 30% and 29% with the median of blocks, 20%, 18% and 23% with the trimmed
mean (19%, 18% and 24% with the plain mean).

Held-out and refinement sizes (``held_out=True`` and ``refine=True``, the defaults of
``autotp profile``): which sizes besides the grid are timed, and why, :mod:`autotp.profiling.sizes` says; they
are timed exactly like the grid's, interleaved with them in the same rounds.

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
from autotp.profiling.sizes import MAX_REFINED, planned_sizes, refinement_sizes


TRIM = 0.1  # share of blocks dropped at each end before a point's mean (see the module doc)


@dataclass(frozen=True)
class SweepPoint:
    """One row of the table: a collective of ``size_bytes`` (full buffer) on one axis."""

    axis: int
    kind: str
    group_size: int
    size_bytes: int
    count: int
    time_s: float  # trimmed mean over blocks of the block's mean on the slowest rank
    wrong: int | None  # None when not checked
    runs: int = 0  # timed runs: iters times the number of blocks
    held_out: bool = False  # a held-out size: measured to test the fit, never fitted
    refined: bool = False  # a fit size the sweep added inside a gap where the sizes' times bend

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
        } | ({"refined": True} if self.refined else {})


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


def barrier(device: torch.device) -> None:
    """Wait for all ranks of the default group (an all-reduce: the same on gloo and nccl)."""
    dist.all_reduce(torch.zeros(1, device=device))
    _synchronize(device)


@dataclass(frozen=True)
class Timing:
    """How each point is timed (see module doc)."""

    iters: int = 20
    warmup_iters: int = 5
    min_time_s: float = 0.0  # per point, over all rounds
    rounds: int = 1


def time_blocks(
    call: collectives.CollectiveCall,
    iters: int,
    device: torch.device,
    min_time_s: float = 0.0,
    max_blocks: int = 100_000,
) -> list[float]:
    """This rank's mean seconds per run in each timed block of ``iters`` runs of ``call``.

    Each block starts after a barrier. Blocks repeat until the slowest rank has timed
    ``min_time_s`` in all (one block when it is 0, as nccl-tests does). The ranks agree
    on stopping with one small all-reduce between blocks, outside the timed region, so
    every rank times the same number of blocks.
    """
    block_means: list[float] = []
    timed_s = 0.0
    while True:
        barrier(device)
        start = time.perf_counter()
        for _ in range(iters):
            call.run()
        _synchronize(device)
        elapsed = time.perf_counter() - start
        block_means.append(elapsed / iters)
        timed_s += elapsed
        if min_time_s <= 0 or len(block_means) >= max_blocks:
            return block_means
        slowest = torch.tensor([timed_s], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if slowest.item() >= min_time_s:
            return block_means


def check_call(call: collectives.CollectiveCall, device: torch.device, corrupt: bool = False) -> int:
    """Run ``call`` once on check inputs; mismatching elements summed over all ranks.

    ``corrupt`` (a test hook) spoils one input element first, so the check must fail.
    """
    collectives.fill_for_check(call)
    if corrupt:
        call.input.view(-1)[0] += 1000.0
    call.run()
    _synchronize(device)
    total = torch.tensor([collectives.count_wrong(call)], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    collectives.reset(call)
    return int(total.item())


OnPoint = Callable[[int, AxisGroup, str, int, str], None]


def sweep_kind(
    group: AxisGroup,
    kind: str,
    sizes_bytes: Sequence[int],
    timing: Timing,
    *,
    rank: int,
    device: torch.device,
    check: bool,
    reduce_scatter_native: bool,
    on_point: OnPoint,
    first_step: int = 1,
    corrupt_check: bool = False,
    held_out: Sequence[bool] = (),
    refine: bool = False,
) -> list[SweepPoint]:
    """All sizes of one kind on one axis: prepare (warm up, check) each, then ``rounds``
    rounds over the sizes, alternating ascending and descending order. ``held_out[i]``
    marks ``sizes_bytes[i]`` as a held-out size (default: none is).

    ``refine`` (with at least two rounds): after the first round, the fit sizes' times so far
    are fitted and :func:`refinement_sizes` are added where a new size range starts and around
    the worst-fitted bandwidth-bound size. They are
    prepared like the others and timed in the remaining rounds, interleaved with the rest,
    ``min_time_s / (rounds - 1)`` per round, so that they get the same time in all (with
    ``min_time_s`` 0, one block per round: one block fewer than the others).

    The buffers of all sizes live at once (about 4x the largest message per rank, for
    all_to_all; refinement sizes in the top gap add up to 1.5x more), so that a round can come
    back to a size without allocating again.
    """
    step = first_step

    def prepare(size: int) -> tuple[collectives.CollectiveCall, int | None]:
        nonlocal step
        on_point(step, group, kind, size, "warm-up" + (" and check" if check else ""))
        step += 1
        call = collectives.prepare(
            kind, size, group.handle, group.ranks, rank, device, reduce_scatter_native=reduce_scatter_native
        )
        for _ in range(timing.warmup_iters):
            call.run()
        return call, (check_call(call, device, corrupt_check) if check else None)

    calls, wrong = [], []
    for size in sizes_bytes:
        call, w = prepare(size)
        calls.append(call)
        wrong.append(w)
    marks = list(held_out) + [False] * (len(calls) - len(held_out))
    refined = [False] * len(calls)
    blocks: list[list[float]] = [[] for _ in calls]
    budget_s = [timing.min_time_s / timing.rounds] * len(calls)  # per round
    for round_index in range(timing.rounds):
        if refine and round_index == 1:
            fit_calls = [c for c, h in zip(calls, marks) if not h]
            times_s = [trimmed_mean(_slowest_rank(b, device)) for b, h in zip(blocks, marks) if not h]
            avoid = [c.size_bytes for c, h in zip(calls, marks) if h]
            for size in refinement_sizes(kind, len(group.ranks), [c.size_bytes for c in fit_calls], times_s, avoid):
                call, w = prepare(size)
                at = sum(1 for c in calls if c.size_bytes < call.size_bytes)
                calls.insert(at, call)
                wrong.insert(at, w)
                marks.insert(at, False)
                refined.insert(at, True)
                blocks.insert(at, [])
                budget_s.insert(at, timing.min_time_s / (timing.rounds - 1))
        order = range(len(calls)) if round_index % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            on_point(step, group, kind, calls[i].size_bytes, f"round {round_index + 1}/{timing.rounds}")
            step += 1
            blocks[i] += time_blocks(calls[i], timing.iters, device, budget_s[i])
    times_s = [trimmed_mean(_slowest_rank(b, device)) for b in blocks]
    return [
        SweepPoint(
            axis=group.axis.index,
            kind=kind,
            group_size=len(group.ranks),
            size_bytes=call.size_bytes,
            count=call.count,
            time_s=time_s,
            wrong=w,
            runs=len(b) * timing.iters,
            held_out=h,
            refined=r,
        )
        for call, time_s, w, b, h, r in zip(calls, times_s, wrong, blocks, marks, refined)
    ]


def _slowest_rank(block_means: list[float], device: torch.device) -> list[float]:
    """Per block, the largest mean over all ranks (every rank has the same blocks)."""
    t = torch.tensor(block_means, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``values`` without the lowest and the highest ``trim`` share (default ``TRIM``),
    rounded down to whole values: nothing is dropped from fewer than ``1 / trim`` values.

    >>> trimmed_mean([1.0, 2.0, 3.0]), trimmed_mean([100.0] + [1.0] * 8 + [0.0])
    (2.0, 1.0)
    """
    if not values:
        raise ValueError("trimmed_mean of no values")
    ordered = sorted(values)
    k = int(len(ordered) * trim)
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


def steps_per_kind(n_sizes: int, timing: Timing, refine: bool = False) -> int:
    """Steps of :func:`sweep_kind`: a preparation and ``rounds`` timings per size, and room for
    ``MAX_REFINED`` refinement sizes (a preparation and ``rounds - 1`` timings each)."""
    refined = MAX_REFINED * timing.rounds if refine and timing.rounds >= 2 else 0
    return n_sizes * (1 + timing.rounds) + refined


def total_steps(
    groups: Sequence[AxisGroup],
    n_kinds: int,
    sizes_bytes: Sequence[int],
    timing: Timing,
    held_out: bool,
    refine: bool = False,
) -> int:
    """Steps of a whole :func:`sweep` (for the progress line)."""
    return sum(
        n_kinds * steps_per_kind(len(planned_sizes(sizes_bytes, len(g.ranks), held_out)), timing, refine)
        for g in groups
    )


def sweep(
    groups: Sequence[AxisGroup],
    kinds: Sequence[str],
    sizes_bytes: Sequence[int],
    timing: Timing,
    *,
    rank: int,
    device: torch.device,
    check: bool,
    reduce_scatter_native: bool,
    on_point: OnPoint = lambda step, group, kind, size, phase: None,
    on_kind_done: Callable[[AxisGroup, str, list[SweepPoint]], None] = lambda group, kind, points: None,
    corrupt_check: bool = False,
    held_out: bool = False,
    refine: bool = False,
) -> tuple[SweepPoint, ...]:
    """Every axis x kind x size. ``on_point(step, group, kind, size, phase)`` is called
    before each step (counting from 1), ``on_kind_done`` after the last round of a kind.
    ``held_out``: also time each axis's :func:`held_out_sizes`, interleaved (module doc).
    ``refine``: add fit sizes where the times bend (:func:`sweep_kind`, module doc)."""
    results: list[SweepPoint] = []
    step = 1
    for group in groups:
        planned = planned_sizes(sizes_bytes, len(group.ranks), held_out)
        for kind in kinds:
            points = sweep_kind(
                group,
                kind,
                [size for size, _ in planned],
                timing,
                rank=rank,
                device=device,
                check=check,
                reduce_scatter_native=reduce_scatter_native,
                on_point=on_point,
                first_step=step,
                corrupt_check=corrupt_check,
                held_out=[h for _, h in planned],
                refine=refine,
            )
            step += steps_per_kind(len(planned), timing, refine)
            on_kind_done(group, kind, points)
            results.extend(points)
    return tuple(results)
