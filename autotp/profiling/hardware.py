"""From measurements to a ``cost_models.HardwareProfile`` ("autotp.hardware/1") on disk.

Which mesh axis feeds which link of the profile:

* all ranks on one host (the usual local run): there is no inter-node link to measure.
  Both ``intra_node`` and ``inter_node`` get the figures of the axis with the most ranks
  (the first such axis on a tie), and ``source`` says so;
* several hosts: an axis whose groups each stay on one host is intra-node, any other is
  inter-node; each link takes the figures of its largest axis. A link no axis measured
  gets the other link's figures, and ``source`` says that too.

``measurements`` keeps what the figures came from: backend, world size, mesh, date,
torch version, hosts, the raw sweep per axis and kind (``sweep``: the fit sizes;
``held_out_sweep``: the held-out sizes, never fitted), each fit with its size ranges,
in-sample ``residuals``, ``held_out`` errors (the fit's prediction on each held-out size
>= 1 MiB) and ``leave_one_out`` errors, and ``held_out_summary`` (within 25%, of, worst).
A fit of several size ranges becomes a ``CollectiveCost`` with ``segments``.

One rank (world size 1) times no collective: its profile is the device as measured and the links
of the device's built-in profile (``cpu-gloo`` on a CPU, the GPU's own where it has one, else
``h100-sxm``), named in ``source`` and in ``measurements.links_from``.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from autotp.profiling import collectives
from autotp.profiling.config import ProfileConfig, format_size
from autotp.profiling.device import DeviceMeasurement
from autotp.profiling.dtypes import EMULATED_BELOW
from autotp.profiling.sizes import REFINE_MISS
from autotp.profiling.fit import (
    BREAKPOINT_PENALTY,
    HELD_OUT_MIN_BYTES,
    MAX_SEGMENTS,
    AlphaBetaFit,
    TimedPoint,
    fit_collective,
)
from autotp.profiling.sweep import AxisGroup, SweepPoint
from autotp.profiling.table import HELD_OUT_TOLERANCE, format_fits, held_out_summary, leave_one_out_summary

if TYPE_CHECKING:
    from cost_models import DeviceSpec

LINKS = ("intra_node", "inter_node")


@dataclass(frozen=True)
class RunInfo:
    """Facts about the run that the profile records."""

    backend: str
    world_size: int
    local_world_size: int
    mesh: tuple[int, ...]
    hostnames: tuple[str, ...]
    reduce_scatter: str  # "native" | "emulated"


def fit_sweep(points: Sequence[SweepPoint]) -> dict[tuple[int, str], AlphaBetaFit]:
    """One alpha-beta fit per (axis, kind) of the sweep: on the fit sizes only; the held-out
    sizes are the fit's test points."""
    by_key: dict[tuple[int, str], list[SweepPoint]] = {}
    for p in points:
        by_key.setdefault((p.axis, p.kind), []).append(p)
    return {
        key: fit_collective(
            key[1],
            pts[0].group_size,
            [TimedPoint(p.size_bytes, p.time_s) for p in pts if not p.held_out],
            test_points=[TimedPoint(p.size_bytes, p.time_s) for p in pts if p.held_out],
        )
        for key, pts in by_key.items()
    }


def axis_links(groups: Sequence[AxisGroup], hostnames: Sequence[str]) -> tuple[dict[str, int], str]:
    """``{link: axis index}`` and a sentence for ``source`` saying how it was chosen."""

    def largest(candidates: list[AxisGroup]) -> AxisGroup:
        return max(candidates, key=lambda g: (g.axis.size, -g.axis.index))

    if len(set(hostnames)) <= 1:
        chosen = largest(list(groups))
        note = (
            f"all {len(hostnames)} ranks on one host ({hostnames[0]}): no inter-node link was measured; "
            f"intra_node and inter_node both hold the figures of {chosen.axis.name} ({chosen.axis.size} ranks)"
        )
        return {"intra_node": chosen.axis.index, "inter_node": chosen.axis.index}, note
    intra = [g for g in groups if all(len({hostnames[r] for r in grp}) == 1 for grp in g.axis.groups)]
    inter = [g for g in groups if g not in intra]
    links: dict[str, int] = {}
    notes = []
    if intra:
        links["intra_node"] = largest(intra).axis.index
        notes.append(f"intra_node from axis{links['intra_node']} (its groups stay on one host)")
    if inter:
        links["inter_node"] = largest(inter).axis.index
        notes.append(f"inter_node from axis{links['inter_node']} (its groups span hosts)")
    for link, other in (("intra_node", "inter_node"), ("inter_node", "intra_node")):
        if link not in links:
            links[link] = links[other]
            notes.append(f"{link} not measured by any axis: copied from {other}")
    return links, "; ".join(notes)


def measurements_dict(
    config: ProfileConfig,
    info: RunInfo,
    groups: Sequence[AxisGroup],
    points: Sequence[SweepPoint],
    fits: dict[tuple[int, str], AlphaBetaFit],
    links: dict[str, int],
    device: DeviceMeasurement,
) -> dict:
    axes = {}
    for g in groups:
        name = g.axis.name
        axes[name] = {
            "size": g.axis.size,
            "groups": [list(grp) for grp in g.axis.groups],
            "links": [link for link, index in links.items() if index == g.axis.index],
            "sweep": {
                kind: [p.to_dict() for p in points if p.axis == g.axis.index and p.kind == kind and not p.held_out]
                for kind in collectives.KINDS
            },
            "held_out_sweep": {
                kind: [p.to_dict() for p in points if p.axis == g.axis.index and p.kind == kind and p.held_out]
                for kind in collectives.KINDS
            },
            "fit": {},
        }
        for kind in collectives.KINDS:
            fit = fits[(g.axis.index, kind)]
            axes[name]["fit"][kind] = {
                "latency_s": fit.latency_s,
                "bus_bandwidth_bytes_per_s": fit.bus_bandwidth_bytes_per_s,
                "segments": [seg.to_dict() for seg in fit.segments],
                "group_size": fit.group_size,
                "method": (
                    "least squares on relative error, the fit sizes (sweep) only, in up to "
                    f"{MAX_SEGMENTS} size ranges (penalty {BREAKPOINT_PENALTY:g} per breakpoint), joined across the "
                    "gaps between them (a segment of 0 points bridges a rise; after a drop the next range starts "
                    "right after the last size of the one before); "
                    "held_out = the fit's error on each held-out size (held_out_sweep, never fitted); "
                    "leave_one_out = each fit size left out of the whole fit, ranges included"
                ),
                "residuals": [e.to_dict() for e in fit.residuals],
                "held_out": [e.to_dict() for e in fit.held_out],
                "leave_one_out": [e.to_dict() for e in fit.leave_one_out],
            }
    ordered = list(fits.values())
    summaries = {}
    for name, summary in (("held_out_summary", held_out_summary(ordered)),
                          ("leave_one_out_summary", leave_one_out_summary(ordered))):
        if summary is not None:
            within, total, worst = summary
            summaries[name] = {"tolerance": HELD_OUT_TOLERANCE, "within": within, "of": total, "worst": worst}
    return {
        "tool": "autotp profile",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "backend": info.backend,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
        "mesh": list(info.mesh),
        "hostnames": sorted(set(info.hostnames)),
        "dtype": "float32",
        "reduce_scatter": info.reduce_scatter,
        "iters": config.iters,
        "warmup_iters": config.warmup_iters,
        "min_time_s": config.min_time_s,
        "rounds": config.rounds,
        "statistic": "mean over blocks (the fastest and slowest 10% dropped) of the block mean on the slowest rank",
        "held_out": (
            "geometric midpoints between consecutive fit sizes, rounded so that every rank's shard is whole "
            "64-byte cache lines (whole elements where the gap leaves no room), timed interleaved with the "
            f"fit sizes in the same rounds, never fitted; errors reported from {format_size(HELD_OUT_MIN_BYTES)}"
            if config.held_out
            else None
        ),
        "refine": (
            "after the first round, two fit sizes (a quarter and three quarters of the way, log scale) added "
            "inside each gap where the fit starts a new size range, and in both gaps next to the "
            f"bandwidth-bound size it misses most if by over {REFINE_MISS:.0%}, timed in the remaining rounds; "
            "marked refined in the sweep"
            if config.refine and config.rounds >= 2
            else None
        ),
        **summaries,
        "check": config.check,
        "wrong": sum(p.wrong or 0 for p in points) if config.check else None,
        "axes": axes,
        "device": device.to_dict(),
    }


def build_profile(
    config: ProfileConfig,
    info: RunInfo,
    groups: Sequence[AxisGroup],
    points: Sequence[SweepPoint],
    device: DeviceMeasurement,
    fits: dict[tuple[int, str], AlphaBetaFit] | None = None,
):
    """The ``cost_models.HardwareProfile`` of this run (imports cost_models when called)."""
    from cost_models import CollectiveCost, CostSegment, HardwareProfile, LinkSpec

    fits = fits if fits is not None else fit_sweep(points)
    links, link_note = axis_links(groups, info.hostnames)
    link_specs = {
        link: LinkSpec(
            costs={
                kind: CollectiveCost(
                    latency_s=fits[(axis, kind)].latency_s,
                    bus_bandwidth_bytes_per_s=fits[(axis, kind)].bus_bandwidth_bytes_per_s,
                    segments=tuple(
                        CostSegment(seg.from_bytes, seg.latency_s, seg.bus_bandwidth_bytes_per_s)
                        for seg in fits[(axis, kind)].segments[1:]
                    ),
                )
                for kind in collectives.KINDS
            }
        )
        for link, axis in links.items()
    }
    host = info.hostnames[0]
    sizes = config.sizes_bytes
    rs_note = (
        "reduce_scatter emulated (all_reduce + chunk copy)"
        if info.reduce_scatter == "emulated"
        else ("reduce_scatter as gloo runs it (an all_reduce plus a copy)" if info.backend == "gloo" else "")
    )
    source = (
        f"measured by `autotp profile` on {host}, torch {torch.__version__}, backend {info.backend}, "
        f"{info.world_size} ranks, mesh {'x'.join(map(str, info.mesh))}. Links: {link_note}. "
        f"Collectives: float32, {format_size(sizes[0])}..{format_size(sizes[-1])}; a point is the trimmed "
        f"mean (10% off each end) over blocks of {config.iters} runs (each block's mean taken on the "
        f"slowest rank), timed for {config.min_time_s:g} s over {config.rounds} round(s); alpha-beta fit on busbw (relative least "
        f"squares over the sweep's sizes, in up to {MAX_SEGMENTS} size ranges where one line does not fit"
        + (
            "; prediction errors on held-out sizes (midpoints between the sizes, never fitted) and "
            "leave-one-out errors in measurements)"
            if config.held_out
            else "; leave-one-out errors in measurements)"
        )
        + (f"; {rs_note}" if rs_note else "")
        + f". {_device_source(device)}"
    )
    return HardwareProfile(
        name=f"measured-{info.backend}-{info.world_size}x-{host}",
        source=source,
        device=device_spec(device),
        devices_per_node=info.local_world_size,
        links=link_specs,
        measurements=measurements_dict(config, info, groups, points, fits, links, device),
    )


def _device_source(device: DeviceMeasurement) -> str:
    """What ``source`` says of the device's figures."""
    return (
        f"Device: {device.device_name} with {device.threads} thread(s), torch.mm peak "
        + (f"per dtype up to n = {', '.join(f'{r.dtype} {r.matmul_n}' for r in device.reach)} (sizes grown "
           f"within {device.reach[0].budget_s:g} s per dtype)" if device.reach
           else f"over n in {sorted({m.n for m in device.matmuls})}")
        + ", copy bandwidth (read+write), tiny-op overhead"
        + (", matmul_curve (a linear layer's three training products, n tokens x n in x 4n out)"
           if device.matmul_curve else "")
        + (", memory_curve (a + b into a fresh output, operands from a ring no cache holds)"
           if device.memory_curve else "")
        + (", memory_overlap (a float32 matmul whose compute and memory times are about equal)"
           if device.memory_overlap is not None else "")
        + "; "
        f"memory_bytes = {'device memory' if device.device_type == 'cuda' else 'host RAM'}."
        + (f" Emulated dtypes ({', '.join(device.emulated_dtypes)}): a matmul under {EMULATED_BELOW:g}x float32's "
           "rate at a small size; measured at small sizes only." if device.emulated_dtypes else "")
    )


LINKS_FALLBACK = "h100-sxm"  # the links of a one-device profile of a GPU with no built-in profile


def borrowed_links(device: DeviceMeasurement) -> tuple[str, dict]:
    """A one-device profile's links, which one rank cannot time: the name of the built-in profile
    they are taken from and its links. The device's own profile (``cost_models.profile_for_device``:
    ``cpu-gloo`` on a CPU), else ``LINKS_FALLBACK`` for a GPU with none."""
    from cost_models import load_profile, profile_for_device

    try:
        name = profile_for_device(device.device_type, device.device_name)
    except ValueError:
        name = LINKS_FALLBACK
    return name, dict(load_profile(name).links)


def build_device_profile(info: RunInfo, device: DeviceMeasurement):
    """The profile of a one-rank run: the device as measured, the links borrowed (:func:`borrowed_links`)."""
    from cost_models import HardwareProfile

    borrowed, links = borrowed_links(device)
    host = info.hostnames[0]
    source = (
        f"measured by `autotp profile` on {host}, torch {torch.__version__}, one rank (backend {info.backend}): "
        f"the device alone. Links: not measured (one rank has no collective to time); intra_node and inter_node "
        f"are the built-in profile {borrowed}'s, so this profile prices a plan on one device as measured and a "
        f"plan on several with {borrowed}'s links. {_device_source(device)}"
    )
    measurements = {
        "tool": "autotp profile",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "backend": info.backend,
        "world_size": 1,
        "mesh": [1],
        "hostnames": [host],
        "links_from": borrowed,
        "device": device.to_dict(),
    }
    return HardwareProfile(name=f"measured-{info.backend}-1x-{host}", source=source, device=device_spec(device),
                           devices_per_node=1, links=links, measurements=measurements)


def device_spec(device: DeviceMeasurement) -> DeviceSpec:
    """The profile's ``device`` (a ``cost_models.DeviceSpec``) from a measurement."""
    from cost_models import DeviceSpec

    return DeviceSpec(
        peak_flops=dict(device.peak_flops),
        memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
        memory_bytes=device.memory_bytes,
        kernel_overhead_s=device.kernel_overhead_s,
        matmul_curve={dtype: points for dtype, points in device.matmul_curve.items() if points} or None,
        memory_curve=device.memory_curve or None,
        memory_overlap=1.0 if device.memory_overlap is None else device.memory_overlap,
        emulated_dtypes=tuple(device.emulated_dtypes),
    )


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def report_and_write(
    config: ProfileConfig,
    info: RunInfo,
    groups: Sequence[AxisGroup],
    points: Sequence[SweepPoint],
    device: DeviceMeasurement,
) -> None:
    """Rank 0: print the fits and the device figures, write the profile JSON."""
    fits = fit_sweep(points)
    print(format_fits([(f"axis{axis}", fit) for (axis, _), fit in sorted(fits.items(), key=_fit_order)]))
    _print_device(device)
    _write(config, build_profile(config, info, groups, points, device, fits))


def report_and_write_device(config: ProfileConfig, info: RunInfo, device: DeviceMeasurement) -> None:
    """A one-rank run: print the device figures, write its profile (:func:`build_device_profile`)."""
    _print_device(device)
    profile = build_device_profile(info, device)
    print(f"# Links: not measured with one rank; taken from the built-in profile {profile.measurements['links_from']}")
    _write(config, profile)


def _write(config: ProfileConfig, profile) -> None:
    if config.output:
        write_text_atomic(config.output, profile.to_json())
        print(f"# Wrote {config.output}")
    sys.stdout.flush()


def _print_device(device: DeviceMeasurement) -> None:
    flops = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in device.peak_flops.items())
    print(
        f"# Device: {device.device_name} ({device.threads} thread(s)): {flops}; memory bandwidth "
        f"{device.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s; kernel overhead "
        f"{device.kernel_overhead_s * 1e6:.3g} us; memory {format_size(device.memory_bytes)}"
        + (f"; emulated (small sizes only): {', '.join(device.emulated_dtypes)}" if device.emulated_dtypes else "")
    )
    if device.matmul_curve and device.memory_curve:
        matmul = "; ".join(f"{dtype} " + " ".join(f"{r / 1e12:.3g}" for _, r in points)
                           for dtype, points in device.matmul_curve.items())
        memory = " ".join(f"{r / 1e9:.3g}" for _, r in device.memory_curve)
        print(f"# Device curves: matmul TFLOP/s by size: {matmul}; memory GB/s by size: {memory}; "
              f"memory overlap {device.memory_overlap if device.memory_overlap is not None else 1.0:.2f}")


def _fit_order(item: tuple[tuple[int, str], AlphaBetaFit]) -> tuple[int, int]:
    (axis, kind), _ = item
    return axis, collectives.KINDS.index(kind)
