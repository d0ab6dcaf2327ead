"""One rank of ``autotp profile``: join the group, sweep, measure the device, write the profile.

Runs the same way under torchrun and under the command's own launcher (``launch.py``):
the rank reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
joins the default group with ``init_process_group`` (env://). Rank 0 prints the tables
(stdout) and a progress line (stderr), fits the alpha-beta model and writes the JSON.

    python -m autotp.profiling.worker      # as launched; the config comes in $AUTOTP_PROFILE_CONFIG

Exit code: 0, or 1 when ``--check`` found wrong elements (rank 0 only).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp.profiling import collectives
from autotp.profiling.config import ProfileConfig, format_size
from autotp.profiling.device import (DeviceMeasurement, DtypeReach, agree_probes, measure_device, probe_dtypes,
                                     slowest_rank)
from autotp.profiling.dtypes import candidate_dtypes, choose_dtypes
from autotp.profiling.heartbeat import Fault, Heartbeat
from autotp.profiling.launch import CONFIG_ENV, LAUNCHED_ENV
from autotp.profiling.mesh import mesh_axes
from autotp.profiling.sweep import AxisGroup, SweepPoint, Timing, barrier, new_axis_groups, sweep, total_steps
from autotp.profiling.table import Progress, format_table

# What ProcessGroupGloo does for reduce_scatter_tensor in torch 2.13 (read from its source,
# ProcessGroupGloo::reduce_scatter_tensor_coalesced, and visible in the timings: it is not
# faster than all_reduce): a clone of the input, an all_reduce of the whole buffer, a copy.
GLOO_REDUCE_SCATTER_NOTE = (
    "warning: gloo runs reduce_scatter as an all_reduce of the whole buffer plus a copy of the "
    "rank's chunk (inside torch's ProcessGroupGloo); its times and busbw reflect that, not a "
    "ring reduce-scatter"
)


DEVICE_STEPS = 1000  # heartbeat steps kept for the device measurement (one per measured size)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set (run under torchrun or `autotp profile`)")
        return default
    return int(value)


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA, but torch.cuda.is_available() is False; use --backend gloo")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_rank(config: ProfileConfig, launched: bool) -> int:
    """This rank's whole part; returns its exit code (see module doc)."""
    rank = _env_int("RANK")
    heartbeat = Heartbeat(rank, fault=Fault.from_env())
    heartbeat.beat(0, "starting")
    try:
        code = _run(config, launched, rank, heartbeat)
    except BaseException as exc:
        heartbeat.failed(f"{type(exc).__name__}: {exc}")
        raise
    heartbeat.done(code)
    return code


def _run(config: ProfileConfig, launched: bool, rank: int, heartbeat: Heartbeat) -> int:
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    shape = config.mesh_for(world_size)
    device = _device(config.backend, local_rank)
    if launched and device.type == "cpu":
        # N ranks share this host's cores: each gets its share (the device figures are per rank).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    # Launched: the watchdog must speak before gloo's own timeout; under torchrun this is the limit.
    pg_timeout_s = config.timeout_s + 30 if launched else config.timeout_s
    dist.init_process_group(config.backend, timeout=timedelta(seconds=pg_timeout_s))
    try:
        return _profile(config, rank, world_size, local_world_size, shape, device, heartbeat)
    finally:
        dist.destroy_process_group()


def _profile(
    config: ProfileConfig,
    rank: int,
    world_size: int,
    local_world_size: int,
    shape: tuple[int, ...],
    device: torch.device,
    heartbeat: Heartbeat,
) -> int:
    lead = rank == 0
    if world_size == 1:
        return _profile_device_alone(config, device, heartbeat)
    axes = mesh_axes(shape)
    skipped = [a for a in axes if a.size < 2]
    groups = new_axis_groups([a for a in axes if a.size >= 2], rank, world_size)
    hostnames: list = [None] * world_size
    dist.all_gather_object(hostnames, socket.gethostname())
    rs_native = collectives.probe_reduce_scatter(device)
    if lead:
        for a in skipped:
            print(f"note: {a.name} has size 1, nothing to time on it", file=sys.stderr)
        if not rs_native:
            print(
                "warning: this backend has no tensor reduce_scatter; it is emulated here as "
                "all_reduce + taking the rank's chunk",
                file=sys.stderr,
            )
        elif config.backend == "gloo":
            print(GLOO_REDUCE_SCATTER_NOTE, file=sys.stderr)
        sys.stderr.flush()

    sizes = config.sizes_bytes
    timing = Timing(config.iters, config.warmup_iters, config.min_time_s, config.rounds)
    steps = total_steps(groups, len(collectives.KINDS), sizes, timing, config.held_out, config.refine)
    progress = Progress(steps, enabled=lead)

    def on_point(step: int, group: AxisGroup, kind: str, size: int, phase: str) -> None:
        heartbeat.beat(step, f"{group.axis.name} {kind} {format_size(size)} {phase}")
        progress.update(step, f"{group.axis.name} {kind}", f"{format_size(size)} {phase}")

    def on_kind_done(group: AxisGroup, kind: str, points: list[SweepPoint]) -> None:
        if lead:
            progress.clear()
            blocks = sorted({p.runs // config.iters for p in points})
            span = f"{blocks[0]}" if len(blocks) == 1 else f"{blocks[0]}..{blocks[-1]}"
            title = (
                f"{kind} on {group.axis}: trimmed mean of {span} blocks of {config.iters} runs per size "
                f"over {config.rounds} round(s), after {config.warmup_iters} warm-up runs"
            )
            print(format_table(title, points), flush=True)

    if lead:
        print(f"# autotp profile: backend {config.backend}, world size {world_size}, mesh {'x'.join(map(str, shape))}")
    points = sweep(
        groups,
        collectives.KINDS,
        sizes,
        timing,
        rank=rank,
        device=device,
        check=config.check,
        reduce_scatter_native=rs_native,
        on_point=on_point,
        on_kind_done=on_kind_done,
        corrupt_check=heartbeat.fault is not None and heartbeat.fault.corrupts(rank),
        held_out=config.held_out,
        refine=config.refine,
    )
    progress.clear()
    device_measurement = _measure_device(config, lead, world_size, device, heartbeat, steps + 1)
    barrier(device)
    heartbeat.beat(steps + DEVICE_STEPS + 2, "writing the profile")
    wrong = sum(p.wrong or 0 for p in points) if config.check else 0
    if lead:
        from autotp.profiling.hardware import RunInfo, report_and_write

        info = RunInfo(
            backend=config.backend,
            world_size=world_size,
            local_world_size=local_world_size,
            mesh=shape,
            hostnames=tuple(hostnames),
            reduce_scatter="native" if rs_native else "emulated",
        )
        report_and_write(config, info, groups, points, device_measurement)
        if config.check:
            verdict = "OK" if wrong == 0 else "FAILED"
            print(f"# Check: {wrong} wrong elements in total: {verdict}", flush=True)
    return 1 if wrong else 0


def _profile_device_alone(config: ProfileConfig, device: torch.device, heartbeat: Heartbeat) -> int:
    """One rank: the device measured, no collectives (there is no other rank to time them with)."""
    from autotp.profiling.hardware import RunInfo, report_and_write_device

    print(f"# autotp profile: backend {config.backend}, world size 1: the device alone, no collectives to time")
    measured = _measure_device(config, True, 1, device, heartbeat, first_step=1)
    heartbeat.beat(DEVICE_STEPS + 2, "writing the profile")
    info = RunInfo(backend=config.backend, world_size=1, local_world_size=1, mesh=(1,),
                   hostnames=(socket.gethostname(),), reduce_scatter="native")
    report_and_write_device(config, info, measured)
    return 0


def _measure_device(config: ProfileConfig, lead: bool, world_size: int, device: torch.device,
                    heartbeat: Heartbeat, first_step: int) -> DeviceMeasurement:
    """Every rank measures at once, as every rank computes at once in a training step (ranks that
    share a host share its cores and memory bandwidth); the slowest rank's figures are kept. Each
    measured size is a heartbeat step, so a slow device that makes progress is never stopped."""
    steps = itertools.count(first_step)

    def beat(what: str) -> None:
        heartbeat.beat(min(next(steps), first_step + DEVICE_STEPS - 1), f"measuring the device: {what}")

    def tell(reach: DtypeReach) -> None:
        if lead:
            print(reach.describe(), file=sys.stderr, flush=True)

    if lead:
        print("measuring the device (matmul FLOP/s per dtype, memory bandwidth, kernel overhead) ...",
              file=sys.stderr, flush=True)
    # the ranks agree on which dtypes are emulated, so that all measure the same ones
    probes = agree_probes(probe_dtypes(device, candidate_dtypes(config.dtypes), on_progress=beat), world_size)
    if lead:
        for line in choose_dtypes(config.dtypes, probes).notes(probes):
            print(line, file=sys.stderr, flush=True)
    mine = measure_device(device, dtypes=config.dtypes, budget_s=config.device_budget_s, probes=probes,
                          on_progress=beat, on_dtype=tell)
    # a fixed step for the wait: a rank still measuring (lower step) is the one a stall names
    heartbeat.beat(first_step + DEVICE_STEPS, "measured the device; waiting for the other ranks")
    return slowest_rank(mine, world_size)


def main() -> int:
    """Entry of a rank started by ``launch.py``: errors become one line (the launcher,
    which sees every rank, reports the run's failure)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    config = ProfileConfig.from_json(os.environ[CONFIG_ENV])
    try:
        return run_rank(config, launched=os.environ.get(LAUNCHED_ENV) == "1")
    except Exception as exc:  # noqa: BLE001 - reported, and the exit code says it failed
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(f"[rank {os.environ.get('RANK')}] {type(exc).__name__}: {first_line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
