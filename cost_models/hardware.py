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

Built-in profiles live in ``cost_models/profiles/NAME.json``. The parts of a profile have their own
modules: :mod:`cost_models.device` (``DeviceSpec``), :mod:`cost_models.links` (``LinkSpec``,
``CollectiveCost``, ``CostSegment``) and :mod:`cost_models.validation` (``ProfileError``); this one
holds the whole profile and re-exports them.

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
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cost_models.communication import LINK_NAMES, axis_link_name
from cost_models.device import DeviceSpec, interpolate_rate
from cost_models.links import CollectiveCost, CostSegment, LinkSpec
from cost_models.validation import ProfileError, _freeze_json, _FrozenMap, _number, _object, _thaw_json, _within

__all__ = ["SCHEMA", "CollectiveCost", "CostSegment", "DeviceSpec", "HardwareProfile", "LinkSpec",
           "ProfileError", "DEFAULT_HARDWARE", "builtin_profile_names", "hardware_origin", "interpolate_rate",
           "load_profile", "resolve_hardware"]

SCHEMA = "autotp.hardware/1"
_PROFILE_FIELDS = ("schema", "name", "source", "device", "devices_per_node", "links")


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


# the profile autotp.plan and the CLI use when none is named
DEFAULT_HARDWARE = "h100-sxm"


def resolve_hardware(hardware: Any) -> HardwareProfile:
    """A built-in profile name, a path to a profile JSON, a HardwareProfile, or None (the default)."""
    return load_profile(DEFAULT_HARDWARE if hardware is None else hardware)


def hardware_origin(hardware: Any) -> str:
    """Where a profile came from, for the report: the default, a built-in profile or a file."""
    if hardware is None:
        return ("the default of autotp.plan and the CLI (no hardware given: --hardware or hardware= names another "
                "profile or a profile file)")
    if isinstance(hardware, HardwareProfile):
        return "given as a HardwareProfile"
    if isinstance(hardware, str) and hardware in builtin_profile_names():
        return "built-in profile, given"
    return f"profile file {str(hardware)!r}, given"
