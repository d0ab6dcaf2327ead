"""Seconds of one collective: the alpha-beta model with nccl-tests' bus factors.

A collective of ``size_bytes`` over ``n_ranks`` takes

    latency_s + size_bytes * collective_factor(kind, n_ranks) / bus_bandwidth_bytes_per_s

where ``bus_bandwidth_bytes_per_s`` is nccl-tests' *busbw* (the figure its tables print),
so one fitted bandwidth serves every group size. ``size_bytes`` is always the FULL
(unsharded) tensor, as nccl-tests counts it. ``latency_s`` and the bandwidth are those of
the size range of the link's figures that holds ``size_bytes`` (``CollectiveCost.segments``;
one range for all sizes unless the profile says otherwise):

=============== ===================================== =================
kind            size_bytes                            factor
=============== ===================================== =================
all_reduce      the tensor reduced                    2 (n - 1) / n
all_gather      the gathered output                   (n - 1) / n
reduce_scatter  the unreduced input                   (n - 1) / n
all_to_all      the per-rank buffer (input of a rank) (n - 1) / n
broadcast       the tensor                            1
=============== ===================================== =================

A group of one rank communicates nothing: the time is exactly 0.0, latency included.

Which link a mesh axis uses: global ranks are laid out row-major over the mesh shape, so
the ranks of one group along ``axis`` are ``stride = prod(mesh_shape[axis+1:])`` apart
and span ``stride * mesh_shape[axis]`` consecutive ranks; the axis is ``"intra_node"``
when every such group lies inside one node of ``devices_per_node`` ranks.

>>> from cost_models.hardware import CollectiveCost, LinkSpec
>>> from cost_models.communication import COLLECTIVE_KINDS
>>> link = LinkSpec({k: CollectiveCost(1e-5, 1e11) for k in COLLECTIVE_KINDS})
>>> collective_time_s(link, "all_reduce", 2**30, 8) == 1e-5 + 2**30 * 2 * 7 / 8 / 1e11
True
>>> from cost_models.hardware import CostSegment
>>> big = CollectiveCost(1e-5, 1e11, (CostSegment(2**25, 0.0, 5e10),))  # slower from 32 MiB
>>> link = LinkSpec({k: big for k in COLLECTIVE_KINDS})
>>> collective_time_s(link, "all_gather", 2**25, 2) == 2**25 * 1 / 2 / 5e10
True
>>> collective_factor("all_gather", 4)
0.75
>>> axis_link_name((2, 8), 0, devices_per_node=8), axis_link_name((2, 8), 1, 8)
('inter_node', 'intra_node')
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # runtime import would be circular: hardware validates kinds from here
    from cost_models.hardware import HardwareProfile, LinkSpec

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LINK_NAMES = ("intra_node", "inter_node")


def collective_factor(kind: str, n_ranks: int) -> float:
    """nccl-tests' bus factor: busbw = algbw * factor, so time = size * factor / busbw."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; expected one of {', '.join(COLLECTIVE_KINDS)}"
        )
    n = _check_ranks(n_ranks)
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def collective_time_s(link: LinkSpec, kind: str, size_bytes: float, n_ranks: int) -> float:
    """Seconds for one collective of ``size_bytes`` (full tensor) over ``n_ranks`` on ``link``."""
    factor = collective_factor(kind, n_ranks)  # validates kind and n_ranks
    if not isinstance(size_bytes, numbers.Real) or isinstance(size_bytes, bool):
        raise TypeError(f"size_bytes must be a number of bytes, got {size_bytes!r}")
    if not math.isfinite(size_bytes) or size_bytes < 0:
        raise ValueError(f"size_bytes must be finite and >= 0, got {size_bytes!r}")
    if factor == 0.0 or size_bytes == 0:
        return 0.0
    latency_s, bus_bandwidth_bytes_per_s = link.cost(kind).figures_for(size_bytes)
    return latency_s + size_bytes * factor / bus_bandwidth_bytes_per_s


def send_time_s(link: LinkSpec, size_bytes: float) -> float:
    """Seconds for one rank to send ``size_bytes`` to one other rank on ``link`` (a pipeline stage's
    activation, or its gradient back): one copy over the link, priced as a two-rank broadcast."""
    return collective_time_s(link, "broadcast", size_bytes, 2)


def axis_link_name(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int) -> str:
    """``"intra_node"`` if every group along ``axis`` fits in one node, else ``"inter_node"``.

    Ranks are numbered row-major over ``mesh_shape``; a group along ``axis`` is
    ``{base + i * stride for i in range(mesh_shape[axis])}`` with
    ``stride = prod(mesh_shape[axis+1:])``. Whenever ``stride * mesh_shape[axis]`` divides
    ``devices_per_node`` (always the case for powers of two) this is the rule
    ``stride * mesh_shape[axis] <= devices_per_node``; otherwise each group is checked, and
    one group straddling two nodes makes the axis ``"inter_node"`` (the slowest group sets
    the time of the collective).
    """
    shape = tuple(_as_int(s, "mesh_shape entries", 1) for s in mesh_shape)
    if not shape:
        raise ValueError(f"mesh_shape must be a non-empty tuple of ints >= 1, got {mesh_shape!r}")
    axis = _as_int(axis, "axis", 0)
    if axis >= len(shape):
        raise ValueError(f"axis must be in [0, {len(shape)}) for mesh {shape}, got {axis}")
    devices_per_node = _as_int(devices_per_node, "devices_per_node", 1)
    stride = math.prod(shape[axis + 1 :])
    block = stride * shape[axis]  # consecutive ranks holding whole groups along axis
    world = math.prod(shape)
    if world <= devices_per_node or devices_per_node % block == 0:
        return "intra_node"
    if block > devices_per_node:
        return "inter_node"
    span = stride * (shape[axis] - 1)  # first to last rank of a group
    for first in range(0, world, block):
        for base in range(first, first + stride):
            if base // devices_per_node != (base + span) // devices_per_node:
                return "inter_node"
    return "intra_node"


def axis_collective_time_s(
    profile: HardwareProfile,
    mesh_shape: tuple[int, ...],
    axis: int,
    kind: str,
    size_bytes: float,
) -> float:
    """Seconds for one collective along ``axis`` of a mesh, on the link that axis uses."""
    link = profile.link_for_axis(mesh_shape, axis)
    return collective_time_s(link, kind, size_bytes, tuple(mesh_shape)[axis])


def _check_ranks(n_ranks: int) -> int:
    return _as_int(n_ranks, "n_ranks", 1)


def _as_int(value: object, what: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy and torch ints accepted, bools and floats not)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return out
