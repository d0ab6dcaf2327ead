"""Piecewise alpha-beta fit of measured collective times: ``time = latency_s + size * factor / busbw``.

``size`` is the full (unsharded) buffer in bytes and ``factor`` nccl-tests' bus factor of
the collective (``collectives.bus_factor``), so the fitted bandwidth is a busbw that the
cost model uses directly with any group size. The sizes may be split into up to
``MAX_SEGMENTS`` ranges, each with its own latency and busbw (a profile's
``CollectiveCost.segments``): NCCL switches protocol and algorithm by size, and gloo on a
CPU takes a step from 32 MiB, where the output buffer it allocates on every call starts to
be page-faulted afresh.

How the fit is made (and why):

* Each range is a least-squares fit on the *relative* error, i.e. it minimises
  ``sum(((a + b*x_i) / t_i - 1)^2)`` with ``x_i = size_i * factor`` and ``b = 1 / busbw``.
  Plain least squares on seconds would let the largest message decide everything and
  leave the latency meaningless; the relative form weights a 10 us and a 10 ms point
  alike, which is also how the predictions are judged (percent error).
* Constraints per range: ``latency_s >= 0`` (if the free fit goes negative, the bandwidth
  is refit with zero latency) and ``busbw > 0`` (if the free fit finds time not growing
  with size, the bandwidth is taken as the best one observed, ``max(x_i / t_i)``, and the
  latency is refit with it).
* Ranges: among all ways to cut the sorted sizes into at most ``MAX_SEGMENTS`` ranges, of
  at least ``MIN_POINTS`` sizes each (``MIN_POINTS_LAST`` for the largest range: a
  doubling sweep has two sizes in its last octave), the fit takes the one with the least
  ``sum of squared relative errors + BREAKPOINT_PENALTY * (ranges - 1)``. The penalty is
  0.25^2: a breakpoint must remove at least the squared error of one point 25% off, so
  noise of a few percent never buys one. Ties go to fewer ranges, then earlier cuts: the
  fit is deterministic.
* Gaps: a range starts at its smallest measured size, and between the last size of one
  range (``lo``) and the first of the next (``hi``) lies a gap no line was fitted on. The
  lower range's line, extrapolated across it, is the worst guess there: in a latency-bound
  range it climbs steeply. So the fit joins the two lines: where the times rise across the
  gap, a *bridge* (a segment with ``points == 0``) runs straight from the lower line's time
  at ``lo`` to the upper line's at ``hi``, if that line has a latency >= 0 (a steep step
  does not: the step then stays at ``hi``); where they drop, the upper range starts right
  after ``lo``, so that no size in the gap is predicted slower than ``hi``. Fitted
  afresh on 15 stored profiles of this project's VM (1 KiB-64/256 MiB, 2 gloo ranks), the
  held-out sizes from 1 MiB missed by over 25% 8 times in 480 instead of 11, worst 31%
  instead of 51% (leave-one-out: 41 of 641 instead of 49, worst 50% instead of 80%); the 8
  left are an all_to_all and an all_gather whose times bend between two grid sizes, at a
  place that moves from run to run.
* Why up to four ranges: on that VM the sizes below about 128 KiB scatter by 15-30% from
  one to the next, and two ranges go to them before a step at 16-32 MiB can have one;
  with three, gloo's all_to_all there kept one line from 78 KiB to 256 MiB and missed
  its held-out 11.3 MiB by 29%. On the 15 profiles four ranges lower the mean held-out
  error from 7.4% to 7.2% and the leave-one-out misses over 25% from 43 to 41 of 641.
* The profile uses the fit on all of its sizes (the *fit sizes*: ``-b`` to ``-e``, times
  ``-f`` each step). Its errors are reported three ways:

  - ``held_out``, the headline: a conventional train/test split. The sweep also measures
    *held-out sizes* (``sizes.held_out_sizes``: the geometric midpoint between each two
    consecutive fit sizes, e.g. about 1.41x each size of a doubling sweep), interleaved
    with the fit sizes in the same rounds, so slow drifts of the machine hit both alike.
    They never enter the fit (:func:`fit_collective` takes them as ``test_points``); each
    one of at least ``held_out_min_bytes`` (1 MiB) is compared with the fit's prediction.
  - ``leave_one_out``, a stricter test: for each fit size of at least ``held_out_min_bytes``,
    the whole fit (the choice of ranges included) is redone without it and its prediction
    compared with the measurement. At the ends of a range this is an extrapolation: the
    largest size, or 64 MiB when only 32 and 64 MiB lie above a step, is predicted from
    points that never saw its range.
  - ``residuals``: in-sample (fit on all fit sizes, compared with each of them).

>>> pts = [TimedPoint(s, 2e-5 + s / 3e9) for s in (1024, 65536, 1 << 20, 1 << 24)]
>>> f = fit_collective("broadcast", 2, pts)
>>> round(f.latency_s * 1e6, 3), round(f.bus_bandwidth_bytes_per_s / 1e9, 3), len(f.segments)
(20.0, 3.0, 1)
>>> step = [TimedPoint(s, 2e-5 + s / (3e9 if s < 1 << 25 else 1e9)) for s in SIZES_1K_TO_64M]
>>> [(s.from_bytes, round(s.bus_bandwidth_bytes_per_s / 1e9, 3)) for s in fit_collective("broadcast", 2, step).segments]
[(0, 3.0), (33554432, 1.0)]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from autotp.profiling.collectives import bus_factor
from autotp.profiling.config import format_size

HELD_OUT_MIN_BYTES = 1 << 20
MAX_SEGMENTS = 4  # see the module doc
MIN_POINTS = 3  # per range, but the largest
MIN_POINTS_LAST = 2  # the largest range
BREAKPOINT_PENALTY = 0.25**2  # squared relative error a breakpoint must remove
SIZES_1K_TO_64M = tuple(1 << k for k in range(10, 27))  # for examples and tests


@dataclass(frozen=True)
class TimedPoint:
    """One measurement: a collective of ``size_bytes`` (full buffer) took ``time_s``."""

    size_bytes: int
    time_s: float


@dataclass(frozen=True)
class PointError:
    """A prediction next to the measurement it should match."""

    size_bytes: int
    measured_s: float
    predicted_s: float

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured: +0.1 means the model says 10% slower."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    def to_dict(self) -> dict:
        return {
            "size_bytes": self.size_bytes,
            "measured_s": self.measured_s,
            "predicted_s": self.predicted_s,
            "relative_error": self.relative_error,
        }


@dataclass(frozen=True)
class FitSegment:
    """One size range of a fit: from ``from_bytes`` (0 for the first) to the next range's.
    ``points`` is 0 for a bridge across the gap between two fitted ranges (module doc)."""

    from_bytes: int
    latency_s: float
    bus_bandwidth_bytes_per_s: float
    points: int  # measurements the range was fit on

    def to_dict(self) -> dict:
        return {
            "from_bytes": self.from_bytes,
            "latency_s": self.latency_s,
            "bus_bandwidth_bytes_per_s": self.bus_bandwidth_bytes_per_s,
            "points": self.points,
        }


@dataclass(frozen=True)
class AlphaBetaFit:
    """Fitted size ranges (latency and bus bandwidth each) of one collective kind on one group size."""

    kind: str
    group_size: int
    segments: tuple[FitSegment, ...]  # ascending from_bytes, the first from 0
    residuals: tuple[PointError, ...]  # in-sample, on the fit sizes
    leave_one_out: tuple[PointError, ...]  # each fit size >= held_out_min_bytes, fit redone without it
    held_out: tuple[PointError, ...] = ()  # held-out sizes >= held_out_min_bytes, never in the fit

    @property
    def latency_s(self) -> float:
        """The first (smallest sizes') range's latency: the profile's base figure."""
        return self.segments[0].latency_s

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """The first (smallest sizes') range's bus bandwidth: the profile's base figure."""
        return self.segments[0].bus_bandwidth_bytes_per_s

    def segment_for(self, size_bytes: float) -> FitSegment:
        chosen = self.segments[0]
        for seg in self.segments[1:]:
            if size_bytes < seg.from_bytes:
                break
            chosen = seg
        return chosen

    def predict_s(self, size_bytes: float) -> float:
        seg = self.segment_for(size_bytes)
        return seg.latency_s + size_bytes * bus_factor(self.kind, self.group_size) / seg.bus_bandwidth_bytes_per_s

    @property
    def max_held_out_error(self) -> float | None:
        """Largest |relative error| on the held-out sizes, or None if there are none."""
        return max((abs(e.relative_error) for e in self.held_out), default=None)

    @property
    def max_leave_one_out_error(self) -> float | None:
        """Largest |relative error| of the leave-one-out predictions, or None if there are none."""
        return max((abs(e.relative_error) for e in self.leave_one_out), default=None)

    def __str__(self) -> str:
        """One line per size range; the first also gives the largest held-out-size and
        leave-one-out errors."""

        def percent(worst: float | None) -> str:
            return "n/a" if worst is None else f"{100 * worst:.1f}%"

        held = f"{percent(self.max_held_out_error)} (leave-one-out {percent(self.max_leave_one_out_error)})"
        lines = []
        for i, seg in enumerate(self.segments):
            if i == 0:
                head = f"{self.kind:<14} n={self.group_size:<3}"
            else:
                head = f"{('  bridge from ' if seg.points == 0 else '  from ') + format_size(seg.from_bytes):<20}"
            line = (
                f"{head} latency {seg.latency_s * 1e6:9.2f} us  "
                f"busbw {seg.bus_bandwidth_bytes_per_s / 1e9:8.3f} GB/s"
            )
            lines.append(line + (f"  held-out max |err| {held}" if i == 0 else ""))
        return "\n".join(lines)


def fit_alpha_beta(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` minimising ``sum(((a + b*x) / t - 1)^2)`` with ``a >= 0`` and ``b > 0``.

    ``xs`` are bytes times bus factor, ``ts`` seconds. Needs at least one point.
    """
    if not xs or len(xs) != len(ts):
        raise ValueError(f"need matching, non-empty points; got {len(xs)} sizes and {len(ts)} times")
    if any(t <= 0 for t in ts):
        raise ValueError(f"times must be positive, got {min(ts)}")
    us = [1.0 / t for t in ts]
    vs = [x / t for x, t in zip(xs, ts)]
    suu = sum(u * u for u in us)
    svv = sum(v * v for v in vs)
    suv = sum(u * v for u, v in zip(us, vs))
    su, sv = sum(us), sum(vs)
    det = suu * svv - suv * suv
    if len(xs) >= 2 and det > 1e-12 * suu * svv:
        a = (su * svv - sv * suv) / det
        b = (suu * sv - suv * su) / det
    else:  # one point, or all points at the same size: no way to split latency from bandwidth
        a, b = -1.0, 0.0
    if a < 0:
        a, b = 0.0, sv / svv
    if b <= 0:
        b = 1.0 / max(vs)  # the best bandwidth observed, as if there were no latency
        a = max(0.0, sum(u * (1.0 - b * v) for u, v in zip(us, vs)) / suu)
    return a, b


def fit_segments(
    sizes: Sequence[int],
    xs: Sequence[float],
    ts: Sequence[float],
    max_segments: int | None = None,
) -> list[tuple[int, float, float]]:
    """The ranges of the least penalised squared relative error (see module doc).

    ``sizes`` ascending, ``xs`` = size times bus factor, ``ts`` seconds. Returns
    ``(first point index, a, b)`` per range, ascending; the first index is 0.
    """
    max_segments = MAX_SEGMENTS if max_segments is None else max_segments
    n = len(xs)
    cache: dict[tuple[int, int], tuple[float, float, float]] = {}

    def segment(start: int, end: int) -> tuple[float, float, float]:
        if (start, end) not in cache:
            a, b = fit_alpha_beta(xs[start:end], ts[start:end])
            sse = sum(((a + b * x) / t - 1.0) ** 2 for x, t in zip(xs[start:end], ts[start:end]))
            cache[(start, end)] = (a, b, sse)
        return cache[(start, end)]

    cut_at = [c for c in range(1, n) if sizes[c - 1] < sizes[c]]  # a range starts at a new size
    best_score, best_starts = float("inf"), [0]
    for n_cuts in range(max(1, max_segments)):
        for cuts in itertools.combinations(cut_at, n_cuts):
            bounds = (0, *cuts, n)
            lengths = [e - s for s, e in zip(bounds, bounds[1:])]
            if any(k < MIN_POINTS for k in lengths[:-1]) or lengths[-1] < min(MIN_POINTS_LAST, n):
                continue
            score = BREAKPOINT_PENALTY * n_cuts + sum(segment(s, e)[2] for s, e in zip(bounds, bounds[1:]))
            if score < best_score:
                best_score, best_starts = score, list(bounds[:-1])
    ends = best_starts[1:] + [n]
    return [(s, *segment(s, e)[:2]) for s, e in zip(best_starts, ends)]


def _fit(kind: str, group_size: int, points: Sequence[TimedPoint]) -> tuple[FitSegment, ...]:
    """The ranges of ``points`` (sorted by size), joined across the gaps between them (module
    doc), no error reports."""
    factor = bus_factor(kind, group_size)
    sizes = [p.size_bytes for p in points]
    ranges = fit_segments(sizes, [s * factor for s in sizes], [p.time_s for p in points])
    ends = [start for start, _, _ in ranges[1:]] + [len(points)]
    segments = [FitSegment(0, ranges[0][1], 1.0 / ranges[0][2], ends[0])]
    for (start, a, b), end in zip(ranges[1:], ends[1:]):
        below, above = sizes[start - 1], sizes[start]  # the gap: the last size of one range, the first of the next
        low_s = segments[-1].latency_s + below * factor / segments[-1].bus_bandwidth_bytes_per_s
        high_s = a + b * above * factor
        begin = above
        if high_s <= low_s:  # the times drop across the gap: the next range's line holds inside it
            begin = below + 1
        elif above - below >= 2:  # room for a segment of its own
            slope = (high_s - low_s) / ((above - below) * factor)
            latency_s = low_s - slope * below * factor
            if latency_s >= 0:  # a bridge from one range's end to the next's start
                segments.append(FitSegment(below + 1, latency_s, 1.0 / slope, 0))
        segments.append(FitSegment(begin, a, 1.0 / b, end - start))
    return tuple(segments)


def fit_collective(
    kind: str,
    group_size: int,
    points: Sequence[TimedPoint],
    held_out_min_bytes: int = HELD_OUT_MIN_BYTES,
    test_points: Sequence[TimedPoint] = (),
) -> AlphaBetaFit:
    """Fit ``kind`` on ``points`` (the fit sizes) and report in-sample, leave-one-out and
    held-out-size errors (see module doc). ``test_points`` are the held-out sizes' measurements:
    they are only compared with the fit's predictions, never fitted."""
    points = sorted(points, key=lambda p: p.size_bytes)
    fit = AlphaBetaFit(kind, group_size, _fit(kind, group_size, points), (), ())
    residuals = tuple(PointError(p.size_bytes, p.time_s, fit.predict_s(p.size_bytes)) for p in points)
    leave_one_out = []
    if len(points) >= 3:
        for i, p in enumerate(points):
            if p.size_bytes < held_out_min_bytes:
                continue
            without = AlphaBetaFit(kind, group_size, _fit(kind, group_size, points[:i] + points[i + 1 :]), (), ())
            leave_one_out.append(PointError(p.size_bytes, p.time_s, without.predict_s(p.size_bytes)))
    held_out = tuple(
        PointError(p.size_bytes, p.time_s, fit.predict_s(p.size_bytes))
        for p in sorted(test_points, key=lambda p: p.size_bytes)
        if p.size_bytes >= held_out_min_bytes
    )
    return AlphaBetaFit(kind, group_size, fit.segments, residuals, tuple(leave_one_out), held_out)
