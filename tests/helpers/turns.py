"""Ranks as threads that call ``autotp.parallelize`` (and ``generate``) themselves: traces taken in turns.

``examples.ranks.run_threads`` runs a rank per thread, and torch.export must not trace while another
thread runs torch ops, so the threaded tests usually capture and plan in the calling thread.
``run_threads_tracing_in_turns(fn, world, *args)`` lets the ranks capture themselves, as they do in
processes: every ``autotp.tracing.export.capture`` a rank makes waits until every rank has come to
its own (the ranks run the same code, so they capture at the same points: ``parallelize``, a switch of
mode, ``generate``'s cache graphs), then the ranks trace one after the other, rank 0 first, while
the others wait on a ``threading.Barrier`` (no torch op runs in a thread parked there), and go on
together once the last has traced. Each rank traces its own model, as a process would: nothing is
shared but the turns. A rank that fails breaks the barrier, so the others fail too instead of waiting.

Not for ``torch.compile``: Dynamo's state is process-wide (``tests/runtime/test_compile.py`` runs on
processes).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from examples.ranks import run_threads


def run_threads_tracing_in_turns(fn: Callable, world: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` threads (``run_threads``), each rank's traces in turn."""
    import torch.distributed as dist

    import autotp.tracing.export as export

    original = export.capture
    barrier = threading.Barrier(world, timeout=timeout_s)
    depth = threading.local()  # a capture inside a capture (another mode, an unrolled stack) is the rank's own

    def capture(*a: Any, **kw: Any) -> Any:
        if getattr(depth, "n", 0):
            return original(*a, **kw)
        rank = dist.get_rank()
        result, error = None, None
        barrier.wait()  # every rank is here: none runs torch ops but the one whose turn it is
        for turn in range(world):
            if turn == rank:
                depth.n = 1
                try:
                    result = original(*a, **kw)
                except BaseException as err:  # noqa: BLE001 - raised after the turns, as the rank's own
                    error = err
                finally:
                    depth.n = 0
            barrier.wait()
        if error is not None:
            raise error
        return result

    def rank_fn(rank: int, world_: int, *rank_args: Any) -> Any:
        try:
            return fn(rank, world_, *rank_args)
        except BaseException:
            barrier.abort()  # the others may wait for this rank's turn: they fail instead of waiting
            raise

    # every module that imported the function by name calls the one taken in turns (those imported
    # later take it from autotp.tracing.export, and are put back too)
    def autotp_modules() -> list:
        return [m for name, m in list(sys.modules.items()) if name == "autotp" or name.startswith("autotp.")]

    for module in autotp_modules():
        if getattr(module, "capture", None) is original:
            module.capture = capture
    try:
        return run_threads(rank_fn, world, *args, timeout_s=timeout_s)
    finally:
        for module in autotp_modules():
            if getattr(module, "capture", None) is capture:
                module.capture = original
