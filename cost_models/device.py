"""What one device does: peak FLOP/s per dtype, memory bandwidth and size, per-kernel overhead,
the share of the peak large matmuls reach, the FLOP/s of convolutions where they run on other
units than matmuls, and optional curves of the rates kernels of a given size achieve.

Part of a hardware profile (:mod:`cost_models.hardware`), which reads and writes it as JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cost_models.validation import ProfileError, _FrozenMap, _within, _number, _object

_DEVICE_FIELDS = ("peak_flops", "memory_bandwidth_bytes_per_s", "memory_bytes", "kernel_overhead_s")
_DEVICE_CURVES = ("matmul_curve", "memory_curve")  # optional: achieved rates by kernel size
_DEVICE_OPTIONAL = (*_DEVICE_CURVES, "memory_overlap", "emulated_dtypes", "achievable_fraction",
                    "convolution_peak_flops")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU rank): roofline figures, memory, and a per-kernel overhead.

    Two optional curves refine the roofline with what kernels of a given size achieve; each is
    a tuple of ``(size, rate)`` points, sizes rising, read by :func:`interpolate_rate`:

    * ``matmul_curve``: per dtype, ``(flops, flops_per_s)`` of one matmul-like kernel by its FLOPs
      (JSON ``{"float32": [{"flops": 1.1e9, "flops_per_s": 1.3e11}, ...]}``). A dtype without
      a curve prices at its ``peak_flops``.
    * ``memory_curve``: ``(bytes, bytes_per_s)`` of one memory-bound kernel by the bytes it
      reads plus writes, measured with an out-of-place pointwise op on operands no cache holds
      (JSON ``[{"bytes": 3.1e6, "bytes_per_s": 8.2e9}, ...]``). Without it,
      ``memory_bandwidth_bytes_per_s`` holds for every size.

    ``memory_overlap`` (optional, 0..1, default 1) is the share of a kernel's memory time that
    runs under its compute time: 1 is the roofline's ``max(compute, memory)`` (a GPU's warps
    hide one behind the other), 0 is ``compute + memory`` (one CPU thread stalls on its loads
    and page faults); the profiler measures it on a matmul whose two times are about equal.

    ``emulated_dtypes`` (optional, default none) lists dtypes of ``peak_flops`` that the device
    has no fast kernels for (bfloat16 on a CPU without AVX-512-BF16): their figures are real but
    were measured at small sizes only (JSON ``"emulated_dtypes": ["bfloat16"]``).

    ``achievable_fraction`` (optional, 0 < f <= 1, default 1) is the share of ``peak_flops`` (and
    of ``convolution_peak_flops``) that large matmuls reach: a datasheet peak is priced at
    ``peak * achievable_fraction`` (JSON ``"achievable_fraction": 0.7``). A dtype with a measured
    ``matmul_curve`` prices on its curve, which already holds what the device reached.

    ``convolution_peak_flops`` (optional, default none) gives per dtype the peak FLOP/s of
    convolutions where they run at another rate than matmuls: on NVIDIA GPUs since Ampere, PyTorch
    runs float32 convolutions on TF32 tensor cores by default (``torch.backends.cudnn.allow_tf32``
    is True) and float32 matmuls in full float32 (``torch.backends.cuda.matmul.allow_tf32`` is
    False), so a GPU profile lists its TF32 figure here for float32 (JSON
    ``"convolution_peak_flops": {"float32": 4.945e14}``). A dtype not listed prices a convolution
    as a matmul.

    >>> d = DeviceSpec({"float32": 1e12}, 1e11, 8e10, 0.0, memory_curve=((1e6, 2e10), (1e8, 4e10)))
    >>> d.bandwidth_for(1e7), d.bandwidth_for(1e9), d.flops_per_s_for("bfloat16", 1e9)
    (30000000000.0, 40000000000.0, 1000000000000.0)
    >>> gpu = DeviceSpec({"float32": 6e13, "bfloat16": 1e15}, 3e12, 8e10, 5e-6, achievable_fraction=0.7,
    ...                  convolution_peak_flops={"float32": 5e14})
    >>> gpu.flops_per_s_for("bfloat16", 1e12), gpu.flops_per_s_for("float32", 1e12, convolution=True)
    (700000000000000.0, 350000000000000.0)
    """

    peak_flops: Mapping[str, float]  # dtype name as torch prints it, without "torch."
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    kernel_overhead_s: float
    matmul_curve: Mapping[str, tuple[tuple[float, float], ...]] | None = None  # dtype -> (flops, FLOP/s)
    memory_curve: tuple[tuple[float, float], ...] | None = None  # (bytes moved, bytes/s)
    memory_overlap: float = 1.0  # share of the memory time hidden under the compute time
    emulated_dtypes: tuple[str, ...] = ()  # dtypes of peak_flops the device only emulates
    achievable_fraction: float = 1.0  # share of the peak large matmuls and convolutions reach
    convolution_peak_flops: Mapping[str, float] | None = None  # dtype -> FLOP/s of its convolutions

    def __post_init__(self) -> None:
        flops = _flops_by_dtype(self.peak_flops, "peak_flops")
        if "float32" not in flops:
            why = "missing; the float32 figure is required (it is the fallback)"
            raise ProfileError("peak_flops.float32", why)
        object.__setattr__(self, "peak_flops", flops)
        for name in _DEVICE_FIELDS[1:]:
            positive = name != "kernel_overhead_s"
            object.__setattr__(self, name, _number(getattr(self, name), name, positive=positive))
        if self.matmul_curve is not None:
            if not isinstance(self.matmul_curve, Mapping):
                want = "a mapping of dtype name to a curve"
                raise ProfileError("matmul_curve", f"expected {want}, got {self.matmul_curve!r}")
            curves = {}
            for dtype, points in self.matmul_curve.items():
                _dtype_name(dtype, f"matmul_curve.{dtype}")
                curves[dtype] = _curve(points, f"matmul_curve.{dtype}")
            object.__setattr__(self, "matmul_curve", _FrozenMap(curves))
        if self.memory_curve is not None:
            object.__setattr__(self, "memory_curve", _curve(self.memory_curve, "memory_curve"))
        overlap = _number(self.memory_overlap, "memory_overlap", positive=False)
        if overlap > 1:
            raise ProfileError("memory_overlap", f"expected a number from 0 to 1, got {self.memory_overlap!r}")
        object.__setattr__(self, "memory_overlap", overlap)
        object.__setattr__(self, "emulated_dtypes", _emulated(self.emulated_dtypes, flops))
        fraction = _number(self.achievable_fraction, "achievable_fraction", positive=True)
        if fraction > 1:
            raise ProfileError("achievable_fraction",
                               f"expected a share of the peak, above 0 and at most 1, got {self.achievable_fraction!r}")
        object.__setattr__(self, "achievable_fraction", fraction)
        if self.convolution_peak_flops is not None:
            object.__setattr__(self, "convolution_peak_flops",
                               _flops_by_dtype(self.convolution_peak_flops, "convolution_peak_flops"))

    def _dtype_key(self, dtype: str) -> str:
        name = str(dtype).removeprefix("torch.")
        return name if name in self.peak_flops else "float32"

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` ("bfloat16" or torch.bfloat16); the float32 figure if unlisted."""
        return self.peak_flops[self._dtype_key(dtype)]

    def flops_per_s_for(self, dtype: str, flops: float, convolution: bool = False) -> float:
        """FLOP/s one matmul-like kernel of ``flops`` achieves: a ``convolution`` at its
        ``convolution_peak_flops`` where the dtype has one, else ``matmul_curve``, else the peak;
        a peak times ``achievable_fraction``."""
        key = self._dtype_key(dtype)
        if convolution and self.convolution_peak_flops is not None and key in self.convolution_peak_flops:
            return self.convolution_peak_flops[key] * self.achievable_fraction
        if self.matmul_curve is not None and key in self.matmul_curve:
            return interpolate_rate(self.matmul_curve[key], flops)
        return self.peak_flops[key] * self.achievable_fraction

    def bandwidth_for(self, bytes_moved: float) -> float:
        """Bytes/s one memory-bound kernel moving ``bytes_moved`` achieves: ``memory_curve``, else
        ``memory_bandwidth_bytes_per_s``."""
        if self.memory_curve is not None:
            return interpolate_rate(self.memory_curve, bytes_moved)
        return self.memory_bandwidth_bytes_per_s

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        d = _object(d, _DEVICE_FIELDS, _DEVICE_OPTIONAL)
        kwargs = {name: d[name] for name in _DEVICE_FIELDS}
        if d.get("matmul_curve") is not None:
            curves = d["matmul_curve"]
            if not isinstance(curves, Mapping):
                want = "a JSON object of dtype name to a curve"
                raise ProfileError("matmul_curve", f"expected {want}, got {curves!r}")
            kwargs["matmul_curve"] = {
                dtype: _curve_from_json(points, f"matmul_curve.{dtype}", "flops", "flops_per_s")
                for dtype, points in curves.items()
            }
        if d.get("memory_curve") is not None:
            kwargs["memory_curve"] = _curve_from_json(d["memory_curve"], "memory_curve", "bytes", "bytes_per_s")
        if "memory_overlap" in d:
            kwargs["memory_overlap"] = d["memory_overlap"]
        for name in ("emulated_dtypes", "achievable_fraction", "convolution_peak_flops"):
            if name in d:
                kwargs[name] = d[name]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "memory_bytes": self.memory_bytes,
            "kernel_overhead_s": self.kernel_overhead_s,
        }
        if self.matmul_curve is not None:
            out["matmul_curve"] = {
                dtype: [{"flops": f, "flops_per_s": r} for f, r in points]
                for dtype, points in self.matmul_curve.items()
            }
        if self.memory_curve is not None:
            out["memory_curve"] = [{"bytes": b, "bytes_per_s": r} for b, r in self.memory_curve]
        if self.memory_overlap != 1.0:
            out["memory_overlap"] = self.memory_overlap
        if self.emulated_dtypes:
            out["emulated_dtypes"] = list(self.emulated_dtypes)
        if self.achievable_fraction != 1.0:
            out["achievable_fraction"] = self.achievable_fraction
        if self.convolution_peak_flops is not None:
            out["convolution_peak_flops"] = dict(self.convolution_peak_flops)
        return out


def _flops_by_dtype(value: Any, field: str) -> _FrozenMap:
    """``value`` checked: a mapping of dtype name to FLOP/s > 0."""
    if not isinstance(value, Mapping):
        raise ProfileError(field, f"expected a mapping of dtype name to FLOP/s, got {value!r}")
    flops = {}
    for dtype, rate in value.items():
        _dtype_name(dtype, f"{field}.{dtype}")
        flops[dtype] = _number(rate, f"{field}.{dtype}", positive=True)
    return _FrozenMap(flops)


def _dtype_name(dtype: Any, field: str) -> None:
    if not isinstance(dtype, str) or not dtype or dtype.startswith("torch."):
        raise ProfileError(field, "expected a dtype name as torch prints it, without 'torch.' (e.g. 'bfloat16')")


def _emulated(names: Any, peak_flops: Mapping[str, float]) -> tuple[str, ...]:
    """``names`` checked: a list of distinct dtype names, each with a ``peak_flops`` figure."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        raise ProfileError("emulated_dtypes", f"expected a list of dtype names, got {names!r}")
    for i, name in enumerate(names):
        _dtype_name(name, f"emulated_dtypes[{i}]")
        if name not in peak_flops:
            raise ProfileError(f"emulated_dtypes[{i}]", f"{name!r} has no peak_flops figure; expected one of "
                               f"{', '.join(peak_flops)}")
        if name in names[:i]:
            raise ProfileError(f"emulated_dtypes[{i}]", f"{name!r} is listed twice")
    return tuple(names)


def _curve(points: Any, field: str) -> tuple[tuple[float, float], ...]:
    """``points`` checked: a non-empty sequence of (size > 0, rate > 0) pairs, sizes rising strictly."""
    if isinstance(points, (str, bytes)) or not isinstance(points, (list, tuple)) or not points:
        raise ProfileError(field, f"expected a non-empty list of (size, rate) points, got {points!r}")
    out: list[tuple[float, float]] = []
    for i, point in enumerate(points):
        if isinstance(point, (str, bytes)) or not isinstance(point, (list, tuple)) or len(point) != 2:
            raise ProfileError(f"{field}[{i}]", f"expected a (size, rate) pair, got {point!r}")
        size = _number(point[0], f"{field}[{i}].size", positive=True)
        rate = _number(point[1], f"{field}[{i}].rate", positive=True)
        if out and size <= out[-1][0]:
            raise ProfileError(f"{field}[{i}]", f"expected a size above {field}[{i - 1}]'s {out[-1][0]:g}, got {size:g}")
        out.append((size, rate))
    return tuple(out)


def _curve_from_json(points: Any, field: str, size_key: str, rate_key: str) -> tuple[tuple[float, float], ...]:
    """A curve from its JSON form ``[{size_key: .., rate_key: ..}, ...]``; errors name the JSON keys."""
    if isinstance(points, (str, bytes)) or not isinstance(points, (list, tuple)) or not points:
        want = f"a non-empty list of {{{size_key!r}: .., {rate_key!r}: ..}} objects"
        raise ProfileError(field, f"expected {want}, got {points!r}")
    pairs = []
    for i, point in enumerate(points):
        with _within(f"{field}[{i}]"):
            point = _object(point, (size_key, rate_key))
            pairs.append((_number(point[size_key], size_key, positive=True),
                          _number(point[rate_key], rate_key, positive=True)))
        if i and pairs[-1][0] <= pairs[-2][0]:
            raise ProfileError(f"{field}[{i}].{size_key}",
                               f"expected more than {field}[{i - 1}].{size_key} ({pairs[-2][0]:g}), got {pairs[-1][0]:g}")
    return _curve(pairs, field)


def interpolate_rate(points: tuple[tuple[float, float], ...], size: float) -> float:
    """The rate at ``size`` on a curve of ``(size, rate)`` points: linear in log(size) between
    neighbouring points, the end point's rate beyond either end.

    >>> interpolate_rate(((1e6, 1.0), (1e8, 3.0)), 1e7), interpolate_rate(((1e6, 1.0), (1e8, 3.0)), 1e3)
    (2.0, 1.0)
    """
    if size <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return r0 + w * (r1 - r0)
    return points[-1][1]
