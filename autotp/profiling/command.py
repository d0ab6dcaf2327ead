"""``autotp profile``: measure the interconnect and the device, write a hardware profile.

    autotp profile [--nproc N] [--backend gloo|nccl] [--mesh 2x4] [-b 1K] [-e 256M] [-f 2]
                   [-n 20] [-w 5] [--min-time-s 0.5] [--rounds 5] [--no-held-out] [--no-refine] [--check]
                   [--dtypes float32,bfloat16] [--device-budget-s 8] [--timeout-s 120] [-o profile.json]

Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank of the group
torchrun made. Otherwise the command starts ``--nproc`` ranks on this host itself
(``launch.py``) and watches them; by default one per GPU of this host, else 2 on its CPU.
Either way every rank runs ``worker.run_rank``.

One rank (``--nproc 1``, or the default on a host with one GPU) measures the device alone: no
collectives to time, so the profile's links are those of the device's built-in profile
(``hardware.py``), and ``source`` says so.

Timing (``sweep.py``): blocks of ``-n`` runs after ``-w`` warm-up runs, each block's mean
taken on the slowest rank; each size is timed for ``--min-time-s`` over ``--rounds``
rounds and its figure is the mean block, trimmed of its fastest and slowest 10%.
``--min-time-s 0 --rounds 1`` is exactly one block: nccl-tests' measurement.

Held-out sizes (on unless ``--no-held-out``): the sweep also times the geometric midpoint
between each two consecutive sizes, interleaved with them in the same rounds; the fit never
sees them, and the summary gives the fit's prediction error on those of at least 1 MiB
("X of Y held-out sizes within 25%, worst Z%"; rows marked ``*`` in the tables), next to
the stricter leave-one-out figure.

Refinement sizes (on unless ``--no-refine``, and only with ``--rounds`` of 2 or more): after
the first round the sweep fits what it has and adds two fit sizes inside each gap where a new
size range starts, and in both gaps next to the bandwidth-bound size it misses most (by over
10%), so the fit sees where the times bend (rows marked ``+``).

The device (``device.py``): matmul FLOP/s per dtype, memory bandwidth and curves. ``--dtypes``
names the matmul dtypes (float32 always among them); by default the dtypes the device runs
natively, found by timing a small matmul in each next to float32 (``dtypes.py``), and bfloat16
always: where it is emulated (under a quarter of float32's rate, as on a CPU without AVX-512-BF16)
it is measured at small sizes and marked ``emulated_dtypes`` in the profile. Each dtype gets
``--device-budget-s`` seconds (default 8 on CPU, 20 on a GPU): sizes grow from a small ``n``
only while the next one fits in what is left, and the sizes reached are recorded.

``--timeout-s``: the longest the run may go without any rank making progress; then
every rank is stopped and the error names the rank that hung or died. Under torchrun
there is no watchdog and it is the process group's timeout instead.

Exit codes: 0 success; 1 ``--check`` found wrong results; 2 bad arguments, or a rank
failed or hung (the message names it).

    autotp profile --nproc 2 -b 1K -e 64M --check -o cpu.json          # two local gloo ranks
    torchrun --nproc-per-node 8 -m autotp.cli profile --mesh 2x4 -o h100.json
"""

from __future__ import annotations

import argparse
import os
import sys

from autotp.profiling.config import ProfileConfig, parse_mesh, parse_size, size_sweep
from autotp.profiling.dtypes import parse_dtypes
from autotp.profiling.launch import LAUNCHED_ENV, LaunchError, launch_local


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mesh(text: str) -> tuple[int, ...]:
    try:
        return parse_mesh(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtypes(text: str) -> tuple[str, ...]:
    try:
        return parse_dtypes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _seconds(allow_zero: bool):
    """An argparse type for a duration in seconds: > 0, or >= 0 when ``allow_zero``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
        if not (value >= 0 if allow_zero else value > 0):
            raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0 seconds, got {text}")
        return value

    return parse


def default_backend(local_ranks: int) -> str:
    """nccl when this host has a GPU for each of its ``local_ranks`` ranks, else gloo (CPU)."""
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autotp profile`` (sizes accept K/M/G suffixes, as nccl-tests does)."""
    parser.add_argument("--nproc", type=_int_at_least(1), default=None,
                        help="ranks to start on this host (default: the mesh's size, else one per GPU of this host, "
                             "else 2); 1 measures the device alone (its links are taken from the device's built-in "
                             "profile); ignored under torchrun")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="process-group backend (default: nccl if there is a GPU for each local rank, else gloo)")
    parser.add_argument("--mesh", type=_mesh, default=None,
                        help="mesh shape such as 2x4, row-major like DeviceMesh (default: one axis of all ranks)")
    parser.add_argument("-b", "--min-bytes", type=_size, default=parse_size("1K"), metavar="SIZE",
                        help="smallest message, full buffer (default 1K)")
    parser.add_argument("-e", "--max-bytes", type=_size, default=parse_size("256M"), metavar="SIZE",
                        help="largest message (default 256M)")
    parser.add_argument("-f", "--step-factor", type=_int_at_least(2), default=2, metavar="F",
                        help="multiply the size by F at each step (default 2)")
    parser.add_argument("-n", "--iters", type=_int_at_least(1), default=20, help="timed runs per block (default 20)")
    parser.add_argument("-w", "--warmup-iters", type=_int_at_least(0), default=5,
                        help="untimed runs of each size before timing it (default 5)")
    parser.add_argument("--min-time-s", type=_seconds(allow_zero=True), default=0.5, metavar="S",
                        help="repeat blocks of -n runs until S seconds are timed per size "
                             "(default 0.5: on a shared host a block's time is noisy, and more blocks "
                             "steady the point; 0 with --rounds 1 times one block of -n runs, as nccl-tests)")
    parser.add_argument("--rounds", type=_int_at_least(1), default=5, metavar="R",
                        help="spread each size's timing over R rounds through all sizes, the point is the mean block "
                             "trimmed of its fastest and slowest 10%% (default 5: on a shared host the time "
                             "drifts over seconds, and 5 rounds follow it better than 3)")
    parser.add_argument("--no-held-out", dest="held_out", action="store_false",
                        help="do not time the held-out sizes (the midpoints between the sizes, never fitted, "
                             "that test the fit): a quicker sweep, with only the leave-one-out error")
    parser.add_argument("--no-refine", dest="refine", action="store_false",
                        help="do not add sizes where the times bend (by default, with --rounds 2 or more, two "
                             "sizes inside each gap where the first round's fit starts a new size range, or next to "
                             "the size it misses most, join the fit, marked +)")
    parser.add_argument("--check", action="store_true",
                        help="verify every result on rank-dependent inputs; wrong elements make the exit code 1")
    parser.add_argument("--dtypes", type=_dtypes, default=None, metavar="LIST",
                        help="matmul dtypes to measure, e.g. float32,bfloat16 (float32 always; default: the dtypes "
                             "this device runs natively, found by timing a small matmul in each, and bfloat16 always, "
                             "marked emulated in the profile where it is)")
    parser.add_argument("--device-budget-s", type=_seconds(allow_zero=False), default=None, metavar="S",
                        help="seconds per dtype for its matmuls: sizes grow from small ones only while the next "
                             "fits in what is left (default 8 on CPU, 20 on a GPU)")
    parser.add_argument("--timeout-s", type=_seconds(allow_zero=False), default=120.0,
                        help="stop the run if no rank makes progress for this long (default 120)")
    parser.add_argument("-o", "--output", default="profile.json",
                        help="hardware profile JSON to write (default profile.json)")


def config_from_args(args: argparse.Namespace, local_ranks: int) -> ProfileConfig:
    """The run's :class:`ProfileConfig`; ``ValueError`` for options that disagree."""
    size_sweep(args.min_bytes, args.max_bytes, args.step_factor)  # raises if min > max
    return ProfileConfig(
        backend=args.backend or default_backend(local_ranks),
        mesh=args.mesh,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        step_factor=args.step_factor,
        iters=args.iters,
        warmup_iters=args.warmup_iters,
        check=args.check,
        timeout_s=args.timeout_s,
        output=args.output,
        min_time_s=args.min_time_s,
        rounds=args.rounds,
        held_out=args.held_out,
        refine=args.refine,
        dtypes=args.dtypes,
        device_budget_s=args.device_budget_s,
    )


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get(LAUNCHED_ENV) != "1"


def default_nproc() -> int:
    """One rank per GPU of this host (one GPU: the device alone, on nccl), else 2 ranks on its CPU."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else 2


def _nproc(args: argparse.Namespace) -> int:
    if args.mesh is None:
        return args.nproc or default_nproc()
    size = 1
    for s in args.mesh:
        size *= s
    if args.nproc is not None and args.nproc != size:
        raise ValueError(f"--mesh {'x'.join(map(str, args.mesh))} has {size} ranks but --nproc is {args.nproc}")
    return size


def _error(message: str) -> int:
    print(f"autotp profile: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the profile (see module doc); returns the exit code."""
    try:
        if _under_torchrun():
            from autotp.profiling.worker import run_rank

            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            return run_rank(config_from_args(args, local_ranks), launched=False)
        nproc = _nproc(args)
        config = config_from_args(args, nproc)
        config.mesh_for(nproc)
    except ValueError as exc:
        return _error(str(exc))
    try:
        return launch_local(nproc, config.to_json(), config.timeout_s)
    except LaunchError as exc:
        return _error(str(exc))
