"""What a link costs: per collective kind, latency and bus bandwidth, optionally by size range.

Part of a hardware profile (:mod:`cost_models.hardware`), which reads and writes it as JSON."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cost_models.communication import COLLECTIVE_KINDS
from cost_models.validation import ProfileError, _FrozenMap, _within, _number, _object


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
