"""Printing: nccl-tests style tables of sweep points, the fit summary, a progress line.

A table, one per mesh axis and collective kind (sizes and bandwidths as nccl-tests prints
them: bytes, elements, microseconds, GB/s = 1e9 bytes per second)::

    # all_reduce on axis0 (size 2: [0, 1]), 20 iterations after 5 warm-up
    #       size         count      type     time   algbw   busbw #wrong
    #        (B)    (elements)               (us)  (GB/s)  (GB/s)
            1024           256     float    35.17    0.03    0.03      0
            1408           352     float    36.02    0.04    0.04      0 *
    # Avg bus bandwidth    : 0.0291
    # * held-out size: timed in the same rounds, never used by the fit

A trailing ``*`` marks a held-out size (``sizes.held_out_sizes``) and a trailing ``+`` a
refinement size (``sizes.refinement_sizes``); other rows are exactly nccl-tests' columns.
"""

from __future__ import annotations

import sys
from typing import Sequence, TextIO

from autotp.profiling.collectives import DTYPE_NAME
from autotp.profiling.fit import BREAKPOINT_PENALTY, AlphaBetaFit
from autotp.profiling.sweep import SweepPoint

HELD_OUT_TOLERANCE = 0.25  # what the profile aims for on sizes >= 1 MiB

_HEADER = (
    "#       size         count      type     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)               (us)  (GB/s)  (GB/s)       "
)


def _time_us(time_s: float) -> str:
    us = time_s * 1e6
    return f"{us:8.2f}" if us < 1e5 else f"{us:8.0f}"


def format_row(point: SweepPoint) -> str:
    wrong = "N/A" if point.wrong is None else str(point.wrong)
    return (
        f"{point.size_bytes:12d}  {point.count:12d}  {DTYPE_NAME:>8}  {_time_us(point.time_s)}"
        f"  {point.algbw_bytes_per_s / 1e9:6.2f}  {point.busbw_bytes_per_s / 1e9:6.2f}  {wrong:>5}"
        + (" *" if point.held_out else " +" if point.refined else "")
    )


def average_busbw_bytes_per_s(points: Sequence[SweepPoint]) -> float:
    """Mean busbw over the points, as nccl-tests' "Avg bus bandwidth" line."""
    return sum(p.busbw_bytes_per_s for p in points) / len(points)


def format_table(title: str, points: Sequence[SweepPoint]) -> str:
    """The header, one row per point and the average bus bandwidth line."""
    lines = [f"# {title}", _HEADER.rstrip()]
    lines += [format_row(p) for p in points]
    lines.append(f"# Avg bus bandwidth    : {average_busbw_bytes_per_s(points) / 1e9:.4g}")
    if any(p.held_out for p in points):
        lines.append("# * held-out size: timed in the same rounds, never used by the fit")
    if any(p.refined for p in points):
        lines.append("# + refinement size: added after the first round where the times bend, fitted")
    return "\n".join(lines)


def _summary(errors: Sequence[float]) -> tuple[int, int, float]:
    """``(within tolerance, total, worst)`` of relative errors."""
    worst = max(abs(e) for e in errors)
    return sum(abs(e) <= HELD_OUT_TOLERANCE for e in errors), len(errors), worst


def held_out_summary(fits: Sequence[AlphaBetaFit]) -> tuple[int, int, float] | None:
    """``(within 25%, held-out sizes, worst |error|)`` over all fits, or None without held-out sizes."""
    errors = [e.relative_error for fit in fits for e in fit.held_out]
    return _summary(errors) if errors else None


def leave_one_out_summary(fits: Sequence[AlphaBetaFit]) -> tuple[int, int, float] | None:
    """The same as :func:`held_out_summary` for the leave-one-out predictions."""
    errors = [e.relative_error for fit in fits for e in fit.leave_one_out]
    return _summary(errors) if errors else None


def format_fits(fits: Sequence[tuple[str, AlphaBetaFit]]) -> str:
    """The fitted figures, one line per (axis, kind); every held-out size's error; the
    held-out summary (the headline) and the leave-one-out summary."""
    tol = f"{100 * HELD_OUT_TOLERANCE:.0f}%"
    lines = [
        "# Fit: time = latency_s + size * bus_factor / busbw (relative least squares on the fit sizes), "
        f"a new size range only where it removes >= {BREAKPOINT_PENALTY:g} of squared relative error"
    ]
    lines += [f"# {axis_name:<6} {line}" for axis_name, fit in fits for line in str(fit).splitlines()]
    held = [(name, fit, e) for name, fit in fits for e in fit.held_out]
    if held:
        lines.append("# Held-out sizes (timed in the same rounds, never fitted) >= 1 MiB: the fit's prediction error")
        lines.append("#   axis   kind                 size(B)  measured(us)  predicted(us)   error")
        for name, fit, e in held:
            lines.append(
                f"#   {name:<6} {fit.kind:<14} {e.size_bytes:>13d}  {e.measured_s * 1e6:12.1f}"
                f"  {e.predicted_s * 1e6:13.1f}  {100 * e.relative_error:+6.1f}%"
            )
        within, total, worst = held_out_summary([fit for _, fit in fits])
        lines.append(f"# Held-out summary: {within} of {total} held-out sizes within {tol}, worst {100 * worst:.1f}%")
    loo = leave_one_out_summary([fit for _, fit in fits])
    if loo is not None:
        within, total, worst = loo
        lines.append(
            f"# Leave-one-out (stricter: each fit size >= 1 MiB left out and the whole fit redone; "
            f"an extrapolation at the ends of a range): {within} of {total} within {tol}, worst {100 * worst:.1f}%"
        )
    for name, fit in fits:
        worst = fit.max_held_out_error
        if worst is not None and worst > HELD_OUT_TOLERANCE:
            lines.append(
                f"# note: {fit.kind} on {name}: held-out sizes off by up to {100 * worst:.0f}%; its times do not "
                f"follow {sum(1 for seg in fit.segments if seg.points)} straight line(s) in size closely (noise, or a step "
                f"between sizes)"
            )
    return "\n".join(lines)


class Progress:
    """A one-line progress display on ``stream`` (stderr): rewritten in place on a terminal,
    one line per new collective kind otherwise (so logs stay short)."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_label = ""
        self._shown = False

    def update(self, step: int, label: str, detail: str) -> None:
        if not self.enabled:
            return
        if self._tty:
            text = f"[{step}/{self.total_steps}] {label} {detail}"
            self.stream.write("\r" + text.ljust(79)[:79])
            self._shown = True
        elif label != self._last_label:
            self.stream.write(f"[{step}/{self.total_steps}] {label}\n")
        self._last_label = label
        self.stream.flush()

    def clear(self) -> None:
        """Erase the in-place line before something else is printed."""
        if self.enabled and self._tty and self._shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self._shown = False
