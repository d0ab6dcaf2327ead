"""Rank-side progress reports for the launcher's watchdog, and the fault-injection hook.

Every rank reports its progress before each sweep point: a step number and where it is.
Under ``autotp profile``'s own launcher the reports are small JSON files in a directory
the launcher names (``AUTOTP_PROFILE_STATUS_DIR``), one per rank, replaced atomically; the
launcher reads them to tell a rank that hangs (its step stays behind the others') from
the ranks that wait for it. A rank also records how it ended: ``done`` with its exit code,
or ``error`` with the exception, so that a rank that vanishes without either is known to
have died.

Fault injection, for tests of those paths (never set it otherwise)::

    AUTOTP_PROFILE_FAULT=hang:1     rank 1 sleeps forever when it reaches step 1
    AUTOTP_PROFILE_FAULT=die:1      rank 1 exits at once (code 17) at step 1
    AUTOTP_PROFILE_FAULT=die:1:4    ... at step 4 instead
    AUTOTP_PROFILE_FAULT=corrupt:1  rank 1 feeds one wrong input element to every --check run

Step 0 is "started, before the process group"; step k >= 1 is the k-th sweep point. Each
kind's steps start after the room reserved for its refinement sizes (``sweep.steps_per_kind``),
so the numbers can skip where fewer sizes were added. After the sweep each size the device
measurement times is a step too (``worker.DEVICE_STEPS`` of them are kept for it).

>>> Fault.parse("hang:1")
Fault(action='hang', rank=1, step=1)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

STATUS_DIR_ENV = "AUTOTP_PROFILE_STATUS_DIR"
FAULT_ENV = "AUTOTP_PROFILE_FAULT"
DIE_EXIT_CODE = 17


@dataclass(frozen=True)
class Fault:
    """An injected failure: ``action`` ("hang", "die", "corrupt") on ``rank`` at ``step``."""

    action: str
    rank: int
    step: int = 1

    @classmethod
    def parse(cls, text: str) -> "Fault":
        parts = text.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("hang", "die", "corrupt"):
            raise ValueError(
                f"invalid {FAULT_ENV}={text!r}: expected hang:RANK[:STEP], die:RANK[:STEP] or corrupt:RANK"
            )
        try:
            numbers = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"invalid {FAULT_ENV}={text!r}: RANK and STEP must be integers") from None
        return cls(parts[0], *numbers)

    def corrupts(self, rank: int) -> bool:
        """Whether this rank must spoil its --check inputs."""
        return self.action == "corrupt" and rank == self.rank

    @classmethod
    def from_env(cls) -> "Fault | None":
        text = os.environ.get(FAULT_ENV, "")
        return cls.parse(text) if text else None

    def trigger(self, rank: int, step: int) -> None:
        """Hang or die here if this is the rank and step the fault names."""
        if self.action == "corrupt" or rank != self.rank or step != self.step:
            return
        if self.action == "die":
            os._exit(DIE_EXIT_CODE)
        while True:  # hang: the watchdog (or the process-group timeout) must end this
            time.sleep(3600)


@dataclass(frozen=True)
class RankStatus:
    """A rank's last report: its step, where it was, and how it ended if it did."""

    rank: int
    step: int
    where: str
    time_s: float  # time.time() of the report
    state: str = "running"  # running | done | error
    exit_code: int | None = None
    error: str | None = None

    def describe(self) -> str:
        return f"step {self.step} ({self.where})"


def status_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def read_status(directory: str, rank: int) -> RankStatus | None:
    """The rank's last report, or None if it never wrote one (or the file is unreadable)."""
    try:
        with open(status_path(directory, rank)) as f:
            return RankStatus(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


class Heartbeat:
    """Writes this rank's :class:`RankStatus` (nothing if no status directory is set) and
    applies the fault hook at each step."""

    def __init__(self, rank: int, directory: str | None = None, fault: Fault | None = None) -> None:
        self.rank = rank
        self.directory = directory if directory is not None else os.environ.get(STATUS_DIR_ENV)
        self.fault = fault
        self.step = 0
        self.where = "starting"

    def _write(self, status: RankStatus) -> None:
        if not self.directory:
            return
        path = status_path(self.directory, self.rank)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(status.__dict__, f)
        os.replace(tmp, path)

    def beat(self, step: int, where: str) -> None:
        self.step, self.where = step, where
        if self.fault is not None:
            self.fault.trigger(self.rank, step)
        self._write(RankStatus(self.rank, step, where, time.time()))

    def done(self, exit_code: int) -> None:
        self._write(RankStatus(self.rank, self.step, self.where, time.time(), "done", exit_code))

    def failed(self, error: str) -> None:
        self._write(RankStatus(self.rank, self.step, self.where, time.time(), "error", None, error))
