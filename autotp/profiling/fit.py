"""Alpha-beta fit of measured collective times: ``time = latency_s + size * factor / busbw``.

``size`` is the full (unsharded) buffer in bytes and ``factor`` nccl-tests' bus factor of
the collective (``collectives.bus_factor``), so the fitted bandwidth is a busbw that the
cost model uses directly with any group size.

How the fit is made (and why):

* Least squares on the *relative* error, i.e. minimise ``sum(((a + b*x_i) / t_i - 1)^2)``
  with ``x_i = size_i * factor`` and ``b = 1 / busbw``. Plain least squares on seconds
  would let the largest message decide everything and leave the latency meaningless; the
  relative form weights a 10 us and a 10 ms point alike, which is also how the predictions
  are judged (percent error).
* Constraints: ``latency_s >= 0`` (if the free fit goes negative, the bandwidth is refit
  with zero latency) and ``busbw > 0`` (if the free fit finds time not growing with size,
  the bandwidth is taken as the best one observed, ``max(x_i / t_i)``, and the latency is
  refit with it).
* The profile uses the fit on **all** points. Its errors are reported two ways:
  ``residuals`` are in-sample (fit on all, compared with each point), and ``held_out``
  are leave-one-out: for each point of at least ``held_out_min_bytes`` (1 MiB), the fit
  is redone without that point and its prediction compared with the measurement. The
  largest size's held-out error is a genuine extrapolation. Held-out errors are the
  honest measure of how well the model predicts a size it has not seen.

>>> pts = [TimedPoint(s, 2e-5 + s / 3e9) for s in (1024, 65536, 1 << 20, 1 << 24)]
>>> f = fit_collective("broadcast", 2, pts)
>>> round(f.latency_s * 1e6, 3), round(f.bus_bandwidth_bytes_per_s / 1e9, 3)
(20.0, 3.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotp.profiling.collectives import bus_factor

HELD_OUT_MIN_BYTES = 1 << 20


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
class AlphaBetaFit:
    """Fitted latency and bus bandwidth of one collective kind on one group size."""

    kind: str
    group_size: int
    latency_s: float
    bus_bandwidth_bytes_per_s: float
    residuals: tuple[PointError, ...]
    held_out: tuple[PointError, ...]

    def predict_s(self, size_bytes: float) -> float:
        factor = bus_factor(self.kind, self.group_size)
        return self.latency_s + size_bytes * factor / self.bus_bandwidth_bytes_per_s

    @property
    def max_held_out_error(self) -> float | None:
        """Largest |relative error| among held-out points, or None if there are none."""
        return max((abs(e.relative_error) for e in self.held_out), default=None)

    def __str__(self) -> str:
        worst = self.max_held_out_error
        held = "n/a" if worst is None else f"{100 * worst:.1f}%"
        return (
            f"{self.kind:<14} n={self.group_size:<3} latency {self.latency_s * 1e6:9.2f} us  "
            f"busbw {self.bus_bandwidth_bytes_per_s / 1e9:8.3f} GB/s  held-out max |err| {held}"
        )


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


def fit_collective(
    kind: str,
    group_size: int,
    points: Sequence[TimedPoint],
    held_out_min_bytes: int = HELD_OUT_MIN_BYTES,
) -> AlphaBetaFit:
    """Fit ``kind`` on ``points`` and report in-sample and leave-one-out errors (see module doc)."""
    factor = bus_factor(kind, group_size)
    xs = [p.size_bytes * factor for p in points]
    ts = [p.time_s for p in points]
    a, b = fit_alpha_beta(xs, ts)
    residuals = tuple(PointError(p.size_bytes, p.time_s, a + x * b) for p, x in zip(points, xs))
    held_out = []
    if len(points) >= 3:
        for i, p in enumerate(points):
            if p.size_bytes < held_out_min_bytes:
                continue
            a_i, b_i = fit_alpha_beta(xs[:i] + xs[i + 1 :], ts[:i] + ts[i + 1 :])
            held_out.append(PointError(p.size_bytes, p.time_s, a_i + xs[i] * b_i))
    return AlphaBetaFit(
        kind=kind,
        group_size=group_size,
        latency_s=a,
        bus_bandwidth_bytes_per_s=1.0 / b,
        residuals=residuals,
        held_out=tuple(held_out),
    )
