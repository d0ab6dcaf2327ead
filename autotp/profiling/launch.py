"""Start N local ranks as processes and watch them until all finish, one fails, or they stall.

Each rank is ``python -m autotp.profiling.worker`` with the environment torchrun would
give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
127.0.0.1, ``MASTER_PORT`` a free port) plus the run's :class:`ProfileConfig` as JSON.
Rank 0 writes to this terminal; the other ranks' output goes to log files whose tail is
shown if they fail.

The watchdog polls the processes and the ranks' heartbeat files (``heartbeat.py``):

* a rank that exits with a nonzero code, or with code 0 but without reporting "done",
  has failed: every other rank is killed and :class:`LaunchError` names the rank that
  ended first (a rank that died without a Python error before one that raised, since the
  others usually fail *because* a peer vanished);
* if no rank reports progress for ``timeout_s``, the run has stalled: every rank is
  killed and the error names the ranks whose step is behind the others' (the hung ones;
  the others are waiting for them in a collective). Until every rank has reported once
  (Python and torch still loading, which a busy host can stretch to many seconds) the
  limit is ``max(timeout_s, STARTUP_S)`` instead.

The ranks' process-group timeout is set above ``timeout_s`` so that the watchdog, which
knows more, speaks first. Nothing is left running: the children are killed by pid.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from autotp.profiling.heartbeat import STATUS_DIR_ENV, RankStatus, read_status

CONFIG_ENV = "AUTOTP_PROFILE_CONFIG"
STARTUP_S = 60.0
LAUNCHED_ENV = "AUTOTP_PROFILE_LAUNCHED"


class LaunchError(RuntimeError):
    """A rank failed or the run stalled; the message names the rank(s) and what they did."""


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int
    seen_at_s: float  # seconds since launch when the watchdog saw it


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _package_root() -> str:
    # .../<root>/autotp/profiling/launch.py -> <root>, so children import this same autotp
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank_env(rank: int, nproc: int, port: int, config_json: str, status_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env[CONFIG_ENV] = config_json
    env[STATUS_DIR_ENV] = status_dir
    env[LAUNCHED_ENV] = "1"
    return env


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class _Ranks:
    """The started processes, their logs and statuses, for the watch loop."""

    def __init__(self, procs: list[subprocess.Popen], logs: dict[int, str], status_dir: str) -> None:
        self.procs = procs
        self.logs = logs
        self.status_dir = status_dir

    def status(self, rank: int) -> RankStatus | None:
        return read_status(self.status_dir, rank)

    def finished(self, rank: int) -> bool:
        status = self.status(rank)
        return status is not None and status.state == "done"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, rank: int) -> str:
        text = _tail(self.logs[rank]) if rank in self.logs else ""
        return f"\n--- last lines of rank {rank}'s output ---\n{text.rstrip()}" if text.strip() else ""


def _describe_failure(ranks: _Ranks, failed: list[RankExit]) -> str:
    def died_silently(e: RankExit) -> bool:
        status = ranks.status(e.rank)
        return status is None or status.state == "running"

    # The culprit: first to end; among those seen together, one with no Python error first.
    failed = sorted(failed, key=lambda e: (e.seen_at_s, not died_silently(e), e.rank))
    first = failed[0]
    status = ranks.status(first.rank)
    where = status.describe() if status else "start-up (no report yet)"
    how = f"exited with code {first.returncode}" if first.returncode >= 0 else f"was killed by signal {-first.returncode}"
    if first.returncode == 0:
        how += " before finishing"
    lines = [f"rank {first.rank} {how} after {where}; stopped all ranks"]
    if status and status.error:
        lines.append(f"  rank {first.rank}: {status.error}")
    for other in failed[1:]:
        other_status = ranks.status(other.rank)
        reason = other_status.error if other_status and other_status.error else f"exit code {other.returncode}"
        lines.append(f"  then rank {other.rank} failed: {reason}")
    return "\n".join(lines) + ranks.log_tail(first.rank)


def _describe_stall(ranks: _Ranks, waited_s: float, running: list[int]) -> str:
    statuses = {r: ranks.status(r) for r in running}
    steps = {r: (s.step if s else -1) for r, s in statuses.items()}
    lowest = min(steps.values())
    behind = sorted(r for r, step in steps.items() if step == lowest)

    def where(r: int) -> str:
        s = statuses[r]
        return s.describe() if s else "start-up (no report yet)"

    if len(behind) == len(running) and len(running) > 1:
        head = f"ranks {', '.join(map(str, behind))} made no progress for {waited_s:g} s, all at {where(behind[0])}"
    else:
        names = ", ".join(f"rank {r}" for r in behind)
        head = f"{names} hung: no progress for {waited_s:g} s since {where(behind[0])}"
        waiting = [r for r in running if r not in behind]
        if waiting:
            head += "; " + ", ".join(f"rank {r} waits at {where(r)}" for r in waiting)
    return head + "; stopped all ranks" + (ranks.log_tail(behind[0]) if behind[0] != 0 else "")


def launch_local(nproc: int, config_json: str, timeout_s: float, poll_interval_s: float = 0.05) -> int:
    """Run ``nproc`` ranks of the profile; the largest of their exit codes, or LaunchError.

    ``timeout_s`` is the longest the run may go with no rank reporting progress.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autotp-profile-") as status_dir:
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs: dict[int, str] = {}
        ranks = _Ranks(procs, logs, status_dir)
        try:
            for rank in range(nproc):
                env = _rank_env(rank, nproc, port, config_json, status_dir)
                if rank == 0:
                    out = None  # rank 0 prints the tables on this terminal
                else:
                    logs[rank] = os.path.join(status_dir, f"rank{rank}.log")
                    out = open(logs[rank], "w")
                cmd = [sys.executable, "-m", "autotp.profiling.worker"]
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
                if out is not None:
                    out.close()
            return _watch(ranks, timeout_s, poll_interval_s, start)
        finally:
            ranks.kill_all()


def _watch(ranks: _Ranks, timeout_s: float, poll_interval_s: float, start: float) -> int:
    exits: dict[int, RankExit] = {}
    last_steps: dict[int, int] = {}
    last_progress = time.monotonic()
    while True:
        now = time.monotonic()
        for rank, proc in enumerate(ranks.procs):
            code = proc.poll()
            if code is not None and rank not in exits:
                exits[rank] = RankExit(rank, code, now - start)
        # A rank that ended without reporting "done" failed, whatever its exit code.
        failed = [e for e in exits.values() if not ranks.finished(e.rank)]
        if failed:
            ranks.kill_all()
            raise LaunchError(_describe_failure(ranks, failed))
        if len(exits) == len(ranks.procs):
            return max(e.returncode for e in exits.values())
        for rank in range(len(ranks.procs)):
            status = ranks.status(rank)
            step = status.step if status else -1
            if last_steps.get(rank) != step:
                last_steps[rank] = step
                last_progress = now
        started = all(step >= 0 for step in last_steps.values())
        limit_s = timeout_s if started else max(timeout_s, STARTUP_S)
        if now - last_progress > limit_s:
            running = [r for r in range(len(ranks.procs)) if r not in exits]
            message = _describe_stall(ranks, limit_s, running)
            ranks.kill_all()
            raise LaunchError(message)
        time.sleep(poll_interval_s)
