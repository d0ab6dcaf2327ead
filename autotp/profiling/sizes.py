"""Which message sizes a sweep times besides its grid: held-out sizes and refinement sizes.

Held-out sizes (``held_out=True``, the default of ``autotp profile``): besides the fit
sizes, every axis also times :func:`held_out_sizes`, the geometric midpoint between each two
consecutive fit sizes, rounded so that every rank's shard is a whole number of 64-byte cache
lines (``SHARD_ALIGN_BYTES``; a whole number of elements where the gap between two small fit
sizes leaves no room for that). The shards a plan moves are cache-line aligned: torch
allocates on 64-byte boundaries and model widths are multiples of 16 floats. A shard
aligned to 4 bytes only is not what the planner prices, and gloo runs it slower: its
all_gather took 5-11% longer on 4, 8, 16, 32 and 64 MiB plus 64 bytes (each rank's shard
32 bytes off a cache line) than on the power of two itself, on this project's 2-vCPU VM,
and the fit's error on such held-out sizes averaged -8.6% over 66 of them in 11 profiles,
against -0.4% on its own sizes. They are interleaved with the fit sizes
(ascending 1 KiB, ~1.41 KiB, 2 KiB, ...; each round passes a held-out size right after or
before its neighbours), timed exactly like them, and marked ``held_out`` in their
:class:`autotp.profiling.sweep.SweepPoint`: the fit never sees them, they test its predictions (``fit.py``).

Refinement sizes (``refine=True``, the default of ``autotp profile``, with two rounds or
more): a piecewise fit can only start a new size range at a size it measured, so a bend
between two fit sizes is seen by neither line, and a held-out size inside that gap is
predicted by one of them extrapolated. After the first round, the sweep fits what it has
(:func:`refinement_sizes`) and adds two fit sizes, a quarter and three quarters of the way
across (log scale; the held-out midpoint stays out), in

* each gap where the fit starts a new range. On this project's VM gloo's all_gather slows
  from 0.6-0.7 to 1.1-1.3 ns/B between 16 and 32 MiB, its held-out size at 23.7 MiB already
  takes 0.7-0.9 ns/B, and without the added sizes the fit missed it by up to 30%;
* both gaps next to the bandwidth-bound size the fit misses most, if by over
  ``REFINE_MISS`` (10%): a bend too narrow for the grid's two or three sizes there to buy a
  range of their own. gloo's all_to_all runs 8-16 MiB faster per byte (0.32-0.39 ns/B) than
  the sizes on either side (0.45-0.51 from 16 MiB); one range spanned it, and its held-out
  size at 11.3 MiB came out 15-27% slow in 7 of 8 profiles.

The added sizes are prepared like the others and timed in the remaining rounds, interleaved
with the rest, for the same total time. Every rank makes the same choice: the times are the
slowest rank's, the same on all. The fit sizes themselves stay the ``-b``/``-e``/``-f`` grid
as nccl-tests has it; for a group size that is not a power of two its shards are then off
cache lines while the held-out and refinement shards are not.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from autotp.profiling import collectives, fit
from autotp.profiling.collectives import bus_factor

SHARD_ALIGN_BYTES = 64  # held-out shards are whole cache lines (see the module doc)
MAX_REFINED = 2 * (fit.MAX_SEGMENTS - 1 + 2)  # refinement sizes per kind and axis, at most: 2 per gap
REFINE_MISS = 0.1  # relative error past which the fit's worst bandwidth-bound size is refined


def _aligned_between(target: float, lo: int, hi: int, group_size: int) -> int | None:
    """The size nearest ``target`` strictly between ``lo`` and ``hi`` whose shards are whole cache
    lines (``SHARD_ALIGN_BYTES`` per rank), else whole elements; None if neither fits.

    >>> _aligned_between(184, 128, 257, 2), _aligned_between(184, 128, 250, 2)
    (256, 184)
    """
    for unit in (SHARD_ALIGN_BYTES * group_size, collectives.DTYPE_BYTES * group_size):
        below, above = math.floor(target / unit) * unit, math.ceil(target / unit) * unit
        inside = [s for s in (below, above) if lo < s < hi]
        if inside:
            return min(inside, key=lambda s: (abs(s - target), s))
    return None


def held_out_sizes(sizes_bytes: Sequence[int], group_size: int) -> tuple[int, ...]:
    """The held-out sizes between the fit sizes ``sizes_bytes`` on a group of ``group_size``.

    For each two consecutive sizes as measured (``collectives.element_count`` may round a
    fit size down), the geometric midpoint rounded to the nearest multiple of
    ``SHARD_ALIGN_BYTES * group_size`` (every rank's shard whole cache lines), or, where
    no such multiple lies strictly between the two, of ``DTYPE_BYTES * group_size`` (every
    shard whole elements); kept only when strictly between the two, so it is never a fit
    size.

    >>> held_out_sizes([1024, 2048, 4096], 2)
    (1408, 2944)
    >>> held_out_sizes([1 << 20, 1 << 21], 3)
    (1482816,)
    >>> held_out_sizes([16, 32], 2)  # no 128-byte multiple in between: whole elements
    (24,)
    """
    measured = sorted({collectives.element_count(s, group_size) * collectives.DTYPE_BYTES for s in sizes_bytes})
    mids = (_aligned_between(math.sqrt(lo * hi), lo, hi, group_size) for lo, hi in zip(measured, measured[1:]))
    return tuple(m for m in mids if m is not None)


def refinement_sizes(
    kind: str, group_size: int, sizes_bytes: Sequence[int], times_s: Sequence[float], avoid: Sequence[int] = ()
) -> tuple[int, ...]:
    """Fit sizes to add where the fit of ``times_s`` (at ``sizes_bytes``, ascending) bends or
    misses, two inside each such gap ``lo < hi`` between neighbouring fit sizes, at a quarter and
    three quarters of the way on a log scale (``lo * (hi / lo) ** 0.25`` and ``** 0.75``), aligned
    as held-out sizes are, never one of ``sizes_bytes`` or ``avoid`` (the held-out sizes: the
    midpoints stay out of the fit). The gaps:

    * each gap where the fit starts a new size range (at most ``fit.MAX_SEGMENTS - 1``);
    * both gaps next to the *worst bandwidth-bound size*: of the sizes that would take at least
      half their time at the best rate any size reached, the one the fit misses by the largest relative error,
      if that is over ``REFINE_MISS`` (a curve one line cannot follow, but whose few points
      fall short of buying a range of their own).

    At most ``MAX_REFINED`` sizes.

    >>> step = [2e-5 + s / (3e9 if s < 1 << 25 else 1e9) for s in fit.SIZES_1K_TO_64M]
    >>> refinement_sizes("broadcast", 2, fit.SIZES_1K_TO_64M, step)  # the step lies in 16-32 MiB
    (19951616, 28215808)
    """
    factor = bus_factor(kind, group_size)
    xs = [s * factor for s in sizes_bytes]
    ranges = fit.fit_segments(list(sizes_bytes), xs, list(times_s))
    gaps = [start for start, _, _ in ranges[1:]]  # gap i lies between sizes i - 1 and i
    worst = _worst_bandwidth_bound(ranges, xs, times_s)
    if worst is not None:
        gaps += [g for g in (worst, worst + 1) if 0 < g < len(sizes_bytes) and g not in gaps]
    taken = set(sizes_bytes) | set(avoid)
    added = []
    for gap in gaps:
        lo, hi = sizes_bytes[gap - 1], sizes_bytes[gap]
        for share in (0.25, 0.75):
            size = _aligned_between(lo * (hi / lo) ** share, lo, hi, group_size)
            if size is not None and size not in taken:
                taken.add(size)
                added.append(size)
    return tuple(sorted(added))


def _worst_bandwidth_bound(
    ranges: Sequence[tuple[int, float, float]], xs: Sequence[float], times_s: Sequence[float]
) -> int | None:
    """Index of the size, among the bandwidth-bound ones, with the largest relative error of the
    fit; None if there is none. A size is bandwidth-bound when moving its bytes at the best rate
    any size reached (``max(x / t)``) takes at least half its time: below that its time is mostly
    latency, and its scatter mostly the host's jitter (which a fitted range's own line, bent to
    that jitter, would not tell). Only an error over ``REFINE_MISS`` counts."""
    starts = [start for start, _, _ in ranges]
    best_rate = max(x / t for x, t in zip(xs, times_s))
    worst, worst_error = None, REFINE_MISS
    for i, (x, t) in enumerate(zip(xs, times_s)):
        _, a, b = ranges[bisect.bisect_right(starts, i) - 1]
        error = abs((a + b * x) / t - 1.0)
        if x / best_rate >= t / 2 and error > worst_error:
            worst, worst_error = i, error
    return worst


def planned_sizes(sizes_bytes: Sequence[int], group_size: int, held_out: bool) -> tuple[tuple[int, bool], ...]:
    """``(size, is_held_out)`` in the order the sweep takes them: fit and held-out sizes interleaved."""
    planned = [(s, False) for s in sizes_bytes]
    if held_out:
        planned += [(s, True) for s in held_out_sizes(sizes_bytes, group_size)]
    return tuple(sorted(planned))
