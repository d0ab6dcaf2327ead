"""Hardware profiles: the figures the cost model prices with, read from and written to JSON.

A profile is a file a person can read and edit. Its outline (schema ``"autotp.hardware/1"``):

.. code-block:: json

    {"schema": "autotp.hardware/1", "name": "h100-sxm", "source": "where each figure comes from",
     "device": {"peak_flops": {"float32": 6.7e13, "bfloat16": 9.89e14},
                "memory_bandwidth_bytes_per_s": 3.35e12, "memory_bytes": 8.0e10,
                "kernel_overhead_s": 5e-6},
     "devices_per_node": 8,
     "links": {"intra_node": {"all_reduce": {"latency_s": 1.5e-5,
                                             "bus_bandwidth_bytes_per_s": 3.6e11},
                              "all_gather": {...}, "reduce_scatter": {...},
                              "all_to_all": {...}, "broadcast": {...}},
               "inter_node": {...}},
     "measurements": {...}}

A collective of S bytes (the full buffer, as nccl-tests counts it) over n ranks takes
``latency_s + S * factor(kind, n) / bus_bandwidth_bytes_per_s`` (``communication.py``).
Where one line does not fit every size (NCCL switches protocol and algorithm by size;
gloo on CPU page-faults a freshly allocated output buffer from 32 MiB on), a collective
may carry an optional ``segments`` array of further size ranges. Each holds from its
``from_bytes`` (an integer >= 1) up to the next one's, with its own two figures; the
object's own ``latency_s`` and ``bus_bandwidth_bytes_per_s`` hold below the first
``from_bytes``. Without ``segments`` (every built-in profile) it is one line for all sizes:

.. code-block:: json

    "all_gather": {"latency_s": 1.2e-4, "bus_bandwidth_bytes_per_s": 2.1e9,
                   "segments": [{"from_bytes": 33554432, "latency_s": 0.0,
                                 "bus_bandwidth_bytes_per_s": 7.1e8}]}

``from_bytes`` must rise strictly from one segment to the next.

``measurements`` is optional, free-form raw data kept verbatim (the profiler writes its
timings, ``backend``, ``world_size``, ``mesh``, ``date`` there). Every other field (but
``segments``) is required, and all are checked; an error names the field by its dotted
path, shows the bad value and says what was expected::

    links.intra_node.all_gather.bus_bandwidth_bytes_per_s: expected a number > 0, got 0
    links.inter_node.all_gather.segments[1].from_bytes: expected more than segments[0].from_bytes ...

Built-in profiles live in ``cost_models/profiles/NAME.json``.

>>> p = load_profile("h100-sxm")
>>> p.link_name_for_axis((2, 8), 0), p.link_name_for_axis((2, 8), 1)
('inter_node', 'intra_node')
>>> HardwareProfile.from_json(p.to_json()) == p
True
>>> slow = p.scaled_links(1e-4)
>>> slow.links["intra_node"].cost("all_reduce").bus_bandwidth_bytes_per_s
36000000.0
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cost_models.communication import COLLECTIVE_KINDS, LINK_NAMES, axis_link_name

SCHEMA = "autotp.hardware/1"
_DEVICE_FIELDS = ("peak_flops", "memory_bandwidth_bytes_per_s", "memory_bytes", "kernel_overhead_s")
_DEVICE_CURVES = ("matmul_curve", "memory_curve")  # optional: achieved rates by kernel size
_DEVICE_OPTIONAL = (*_DEVICE_CURVES, "memory_overlap")
_PROFILE_FIELDS = ("schema", "name", "source", "device", "devices_per_node", "links")


class ProfileError(ValueError):
    """A profile field is missing or wrong; ``field`` is its dotted path ("" for the whole)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}" if self.field else self.problem

    def within(self, prefix: str) -> ProfileError:
        """The same error seen from the enclosing object: the path gains ``prefix.``."""
        return ProfileError(f"{prefix}.{self.field}" if self.field else prefix, self.problem)


class _FrozenMap(Mapping):
    """A read-only, hashable mapping that compares equal to a dict with the same items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


@contextmanager
def _within(prefix: str) -> Iterator[None]:
    try:
        yield
    except ProfileError as e:
        raise e.within(prefix) from None


def _number(value: Any, field: str, *, positive: bool) -> float:
    want = "a number > 0" if positive else "a number >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ProfileError(field, f"expected {want}, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ProfileError(field, f"expected {want}, got {value!r}")
    return out


def _object(value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping:
    """Check that ``value`` is a JSON object with exactly the ``required`` (+ optional) keys."""
    if not isinstance(value, Mapping):
        fields = ", ".join(required)
        raise ProfileError("", f"expected a JSON object with fields {fields}, got {value!r}")
    for key in required:
        if key not in value:
            raise ProfileError(str(key), f"missing; expected fields {', '.join(required)}")
    for key in value:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional)
            raise ProfileError(str(key), f"unknown field; expected one of {allowed}")
    return value


def _freeze_json(value: Any, field: str) -> Any:
    """Deep copy of JSON-like data as immutable values: objects -> _FrozenMap, arrays -> tuple."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProfileError(field, f"expected a finite number (or null), got {value!r}")
        return value
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ProfileError(field, f"expected string keys, got {key!r}")
        return _FrozenMap({k: _freeze_json(v, f"{field}.{k}") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze_json(v, f"{field}[{i}]") for i, v in enumerate(value))
    want = "JSON data (object, array, string, number, bool, null)"
    raise ProfileError(field, f"expected {want}, got {value!r}")


def _thaw_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw_json(v) for v in value]
    return value


_COST_FIELDS = ("latency_s", "bus_bandwidth_bytes_per_s")


def _alpha_beta(obj: Any) -> None:
    """Validate (and turn into floats) ``obj.latency_s`` >= 0 and ``obj.bus_bandwidth_bytes_per_s`` > 0."""
    object.__setattr__(obj, "latency_s", _number(obj.latency_s, "latency_s", positive=False))
    bw = _number(obj.bus_bandwidth_bytes_per_s, "bus_bandwidth_bytes_per_s", positive=True)
    object.__setattr__(obj, "bus_bandwidth_bytes_per_s", bw)


@dataclass(frozen=True)
class CostSegment:
    """Alpha-beta figures that hold from ``from_bytes`` (full buffer) up to the next segment's."""

    from_bytes: int
    latency_s: float
    bus_bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        fb = self.from_bytes
        if isinstance(fb, bool) or not isinstance(fb, numbers.Integral) or fb < 1:
            raise ProfileError("from_bytes", f"expected an integer number of bytes >= 1, got {fb!r}")
        object.__setattr__(self, "from_bytes", int(fb))
        _alpha_beta(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostSegment:
        d = _object(d, ("from_bytes", *_COST_FIELDS))
        return cls(d["from_bytes"], d["latency_s"], d["bus_bandwidth_bytes_per_s"])

    def to_dict(self) -> dict[str, float]:
        return {
            "from_bytes": self.from_bytes,
            "latency_s": self.latency_s,
            "bus_bandwidth_bytes_per_s": self.bus_bandwidth_bytes_per_s,
        }


@dataclass(frozen=True)
class CollectiveCost:
    """Alpha-beta figures of one collective kind on one link (busbw as nccl-tests prints it).

    ``latency_s`` and ``bus_bandwidth_bytes_per_s`` hold below the first of ``segments``
    (for every size when there are none); each segment's figures hold from its
    ``from_bytes`` up to the next one's. ``figures_for(size_bytes)`` picks the range.

    >>> c = CollectiveCost(1e-5, 1e9, (CostSegment(1 << 25, 0.0, 5e8),))
    >>> c.figures_for((1 << 25) - 1), c.figures_for(1 << 25)
    ((1e-05, 1000000000.0), (0.0, 500000000.0))
    """

    latency_s: float
    bus_bandwidth_bytes_per_s: float
    segments: tuple[CostSegment, ...] = ()

    def __post_init__(self) -> None:
        _alpha_beta(self)
        if not isinstance(self.segments, (list, tuple)):
            want = "a list of segments (from_bytes, latency_s, bus_bandwidth_bytes_per_s)"
            raise ProfileError("segments", f"expected {want}, got {self.segments!r}")
        for i, seg in enumerate(self.segments):
            if not isinstance(seg, CostSegment):
                raise ProfileError(f"segments[{i}]", f"expected a CostSegment, got {seg!r}")
            if i and seg.from_bytes <= self.segments[i - 1].from_bytes:
                prev = self.segments[i - 1].from_bytes
                why = f"expected more than segments[{i - 1}].from_bytes ({prev}): ranges go in ascending order"
                raise ProfileError(f"segments[{i}].from_bytes", f"{why}, got {seg.from_bytes}")
        object.__setattr__(self, "segments", tuple(self.segments))

    def figures_for(self, size_bytes: float) -> tuple[float, float]:
        """``(latency_s, bus_bandwidth_bytes_per_s)`` of the size range holding ``size_bytes``."""
        figures = (self.latency_s, self.bus_bandwidth_bytes_per_s)
        for seg in self.segments:
            if size_bytes < seg.from_bytes:
                break
            figures = (seg.latency_s, seg.bus_bandwidth_bytes_per_s)
        return figures

    def scaled(self, factor: float) -> CollectiveCost:
        """A copy with every range's bus bandwidth multiplied by ``factor`` (latencies kept)."""
        return CollectiveCost(
            self.latency_s,
            self.bus_bandwidth_bytes_per_s * factor,
            tuple(dataclasses.replace(s, bus_bandwidth_bytes_per_s=s.bus_bandwidth_bytes_per_s * factor)
                  for s in self.segments),
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectiveCost:
        d = _object(d, _COST_FIELDS, ("segments",))
        raw = d.get("segments", [])
        if not isinstance(raw, (list, tuple)):
            want = "a JSON array of {from_bytes, latency_s, bus_bandwidth_bytes_per_s}"
            raise ProfileError("segments", f"expected {want}, got {raw!r}")
        segments = []
        for i, item in enumerate(raw):
            with _within(f"segments[{i}]"):
                segments.append(CostSegment.from_dict(item))
        return cls(d["latency_s"], d["bus_bandwidth_bytes_per_s"], tuple(segments))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"latency_s": self.latency_s, "bus_bandwidth_bytes_per_s": self.bus_bandwidth_bytes_per_s}
        if self.segments:
            out["segments"] = [s.to_dict() for s in self.segments]
        return out


@dataclass(frozen=True)
class LinkSpec:
    """What one kind of link (intra-node, inter-node) costs, for every collective kind."""

    costs: Mapping[str, CollectiveCost]

    def __post_init__(self) -> None:
        if not isinstance(self.costs, Mapping):
            raise ProfileError("", f"expected a mapping of collective kind to cost, got {self.costs!r}")
        for kind in self.costs:
            if kind not in COLLECTIVE_KINDS:
                kinds = ", ".join(COLLECTIVE_KINDS)
                raise ProfileError(str(kind), f"unknown collective; expected {kinds}")
        for kind in COLLECTIVE_KINDS:
            if kind not in self.costs:
                raise ProfileError(kind, f"missing; every link needs {', '.join(COLLECTIVE_KINDS)}")
            if not isinstance(self.costs[kind], CollectiveCost):
                raise ProfileError(kind, f"expected a CollectiveCost, got {self.costs[kind]!r}")
        object.__setattr__(self, "costs", _FrozenMap({k: self.costs[k] for k in COLLECTIVE_KINDS}))

    def cost(self, kind: str) -> CollectiveCost:
        if kind not in self.costs:
            kinds = ", ".join(COLLECTIVE_KINDS)
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {kinds}")
        return self.costs[kind]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkSpec:
        d = _object(d, COLLECTIVE_KINDS)
        costs = {}
        for kind in COLLECTIVE_KINDS:
            with _within(kind):
                costs[kind] = CollectiveCost.from_dict(d[kind])
        return cls(costs)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {kind: self.costs[kind].to_dict() for kind in COLLECTIVE_KINDS}


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

    >>> d = DeviceSpec({"float32": 1e12}, 1e11, 8e10, 0.0, memory_curve=((1e6, 2e10), (1e8, 4e10)))
    >>> d.bandwidth_for(1e7), d.bandwidth_for(1e9), d.flops_per_s_for("bfloat16", 1e9)
    (30000000000.0, 40000000000.0, 1000000000000.0)
    """

    peak_flops: Mapping[str, float]  # dtype name as torch prints it, without "torch."
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    kernel_overhead_s: float
    matmul_curve: Mapping[str, tuple[tuple[float, float], ...]] | None = None  # dtype -> (flops, FLOP/s)
    memory_curve: tuple[tuple[float, float], ...] | None = None  # (bytes moved, bytes/s)
    memory_overlap: float = 1.0  # share of the memory time hidden under the compute time

    def __post_init__(self) -> None:
        if not isinstance(self.peak_flops, Mapping):
            want = "a mapping of dtype name to FLOP/s"
            raise ProfileError("peak_flops", f"expected {want}, got {self.peak_flops!r}")
        flops = {}
        for dtype, value in self.peak_flops.items():
            _dtype_name(dtype, f"peak_flops.{dtype}")
            flops[dtype] = _number(value, f"peak_flops.{dtype}", positive=True)
        if "float32" not in flops:
            why = "missing; the float32 figure is required (it is the fallback)"
            raise ProfileError("peak_flops.float32", why)
        object.__setattr__(self, "peak_flops", _FrozenMap(flops))
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

    def _dtype_key(self, dtype: str) -> str:
        name = str(dtype).removeprefix("torch.")
        return name if name in self.peak_flops else "float32"

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` ("bfloat16" or torch.bfloat16); the float32 figure if unlisted."""
        return self.peak_flops[self._dtype_key(dtype)]

    def flops_per_s_for(self, dtype: str, flops: float) -> float:
        """FLOP/s one matmul-like kernel of ``flops`` achieves: ``matmul_curve``, else the peak."""
        key = self._dtype_key(dtype)
        if self.matmul_curve is not None and key in self.matmul_curve:
            return interpolate_rate(self.matmul_curve[key], flops)
        return self.peak_flops[key]

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
        return out


def _dtype_name(dtype: Any, field: str) -> None:
    if not isinstance(dtype, str) or not dtype or dtype.startswith("torch."):
        raise ProfileError(field, "expected a dtype name as torch prints it, without 'torch.' (e.g. 'bfloat16')")


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


@dataclass(frozen=True)
class HardwareProfile:
    """A device, how many share a node, and the two links: the whole input of the cost model."""

    name: str
    source: str
    device: DeviceSpec
    devices_per_node: int
    links: Mapping[str, LinkSpec]  # "intra_node" and "inter_node"
    measurements: Mapping[str, Any] | None = None  # raw profiler data, kept verbatim

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError("name", f"expected a non-empty string, got {self.name!r}")
        if not isinstance(self.source, str):
            want = "a string saying where the figures come from"
            raise ProfileError("source", f"expected {want}, got {self.source!r}")
        if not isinstance(self.device, DeviceSpec):
            raise ProfileError("device", f"expected a DeviceSpec, got {self.device!r}")
        dpn = self.devices_per_node
        if isinstance(dpn, bool) or not isinstance(dpn, numbers.Integral) or dpn < 1:
            raise ProfileError("devices_per_node", f"expected an integer >= 1, got {dpn!r}")
        object.__setattr__(self, "devices_per_node", int(dpn))
        if not isinstance(self.links, Mapping):
            names = ", ".join(LINK_NAMES)
            raise ProfileError("links", f"expected a mapping with {names}, got {self.links!r}")
        for name in self.links:
            if name not in LINK_NAMES:
                raise ProfileError(f"links.{name}", f"unknown link; expected {', '.join(LINK_NAMES)}")
        for name in LINK_NAMES:
            if name not in self.links:
                raise ProfileError(f"links.{name}", f"missing; expected links {', '.join(LINK_NAMES)}")
            if not isinstance(self.links[name], LinkSpec):
                raise ProfileError(f"links.{name}", f"expected a LinkSpec, got {self.links[name]!r}")
        object.__setattr__(self, "links", _FrozenMap({n: self.links[n] for n in LINK_NAMES}))
        if self.measurements is not None:
            if not isinstance(self.measurements, Mapping):
                got = self.measurements
                raise ProfileError("measurements", f"expected a JSON object or null, got {got!r}")
            object.__setattr__(self, "measurements", _freeze_json(self.measurements, "measurements"))

    # --- mesh axes -------------------------------------------------------------------

    def link_name_for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> str:
        """``"intra_node"`` or ``"inter_node"``: see ``communication.axis_link_name``."""
        return axis_link_name(tuple(mesh_shape), axis, self.devices_per_node)

    def link_for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> LinkSpec:
        return self.links[self.link_name_for_axis(mesh_shape, axis)]

    def scaled_links(self, factor: float, name: str | None = None) -> HardwareProfile:
        """A copy whose every link bus bandwidth is multiplied by ``factor`` (latencies kept)."""
        factor = _number(factor, "factor", positive=True)
        links = {
            link_name: LinkSpec({kind: c.scaled(factor) for kind, c in link.costs.items()})
            for link_name, link in self.links.items()
        }
        note = f"Links scaled: every bus bandwidth multiplied by {factor:g}, latencies unchanged."
        return dataclasses.replace(
            self,
            name=name if name is not None else f"{self.name}-links-x{factor:g}",
            source=f"{self.source}\n{note}" if self.source else note,
            links=links,
        )

    # --- JSON ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareProfile:
        if not isinstance(d, Mapping):
            raise ProfileError("", f"expected a JSON object (a hardware profile), got {d!r}")
        if "schema" not in d:
            raise ProfileError("schema", f"missing; expected {SCHEMA!r}")
        if d["schema"] != SCHEMA:
            raise ProfileError("schema", f"expected {SCHEMA!r}, got {d['schema']!r}")
        d = _object(d, _PROFILE_FIELDS, ("measurements",))
        with _within("device"):
            device = DeviceSpec.from_dict(d["device"])
        with _within("links"):
            links_d = _object(d["links"], LINK_NAMES)
            links = {}
            for name in LINK_NAMES:
                with _within(name):
                    links[name] = LinkSpec.from_dict(links_d[name])
        return cls(
            name=d["name"],
            source=d["source"],
            device=device,
            devices_per_node=d["devices_per_node"],
            links=links,
            measurements=d.get("measurements"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "name": self.name,
            "source": self.source,
            "device": self.device.to_dict(),
            "devices_per_node": self.devices_per_node,
            "links": {name: self.links[name].to_dict() for name in LINK_NAMES},
        }
        if self.measurements is not None:
            out["measurements"] = _thaw_json(self.measurements)
        return out

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError("", f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"


def builtin_profile_names() -> tuple[str, ...]:
    """Names of the profiles shipped in ``cost_models/profiles/``, sorted."""
    folder = resources.files("cost_models").joinpath("profiles")
    return tuple(sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json")))


def load_profile(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A built-in profile by name, a profile JSON file by path, or a HardwareProfile as is."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a profile name, a path or a HardwareProfile, got {name_or_path!r}")
    names = builtin_profile_names()
    if isinstance(name_or_path, str) and name_or_path in names:
        where = f"built-in profile {name_or_path!r}"
        folder = resources.files("cost_models").joinpath("profiles")
        text = folder.joinpath(f"{name_or_path}.json").read_text("utf-8")
    else:
        path = Path(name_or_path)
        if not path.is_file():
            known = ", ".join(names)
            raise ProfileError("", f"{str(name_or_path)!r} is neither a built-in profile ({known}) nor a JSON file")
        where = str(path)
        text = path.read_text("utf-8")
    try:
        return HardwareProfile.from_json(text)
    except ProfileError as e:
        raise ProfileError(e.field, f"{e.problem} (in {where})") from None
