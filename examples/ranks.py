"""Run a function on N ranks and collect what each rank returns.

``run_ranks(fn, 2, *args)`` calls ``fn(rank, world, *args)`` on 2 new processes (:func:`start_method`),
each in its own gloo process group, and returns the ranks' results (a rank that raises fails the call with
its traceback). ``fn`` must be importable (a module-level function) for the new processes to find it. Used by
the demo, the benchmarks and the multi-process tests.

``run_threads(fn, 2, *args)`` is the same contract in this process: one thread per rank, joined
by PyTorch's in-process "threaded" test backend. The ranks' collectives are real (every rank's
tensors are summed, gathered, exchanged), but no process starts and nothing is imported twice,
so a check costs seconds instead of tens of seconds. What ``fn`` does must be safe to run on
several threads at once. The factories of ``examples/models.py`` are (they take turns). torch.export
is not: it must not trace while another thread runs torch ops, so capture and plan in the calling
thread and give the ranks the graph and the plan (as ``tests/runtime/test_runtime.py`` does). The global
random generator is shared by the threads: seed through the factories' ``seed`` or a
``torch.Generator``. Used by the tests.

>>> def total(rank, world):
...     import torch, torch.distributed as dist
...     t = torch.tensor([float(rank + 1)])
...     dist.all_reduce(t)
...     return t.item()
>>> run_threads(total, 3)
[6.0, 6.0, 6.0]
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import threading
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, fn: Callable, args: tuple, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    # rendezvous through a file in the run's own folder: no port to pick, so no race with another
    # process taking a "free" port between the parent choosing it and rank 0 binding it
    store = "file://" + os.path.join(out_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    if payload[0] == "error":  # the others may wait for this rank in a collective: the parent ends them
        os._exit(1)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def start_method() -> str:
    """How :func:`run_ranks` starts its processes: ``forkserver`` where the platform has it (a server
    process imports what :func:`preload` names once, and every rank is forked from it with those
    modules already imported: a run pays for ``import torch`` once, not once per rank and run),
    else ``spawn``. Both start each rank without the caller's threads or state."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def preload(modules: list[str]) -> None:
    """Name the modules the ranks' server process imports before forking them (``forkserver`` only;
    call before the first :func:`run_ranks`). A module that fails to import there is skipped."""
    if start_method() == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(modules)


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; returns every rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world, fn, args, out_dir), nprocs=world, join=True,
                               start_method=start_method())
            exited = None
        except mp.ProcessExitedException as err:  # a rank failed; the others were ended
            exited = err
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):  # ended while it waited for the failed rank
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        if exited is not None:
            raise exited
        return results


def run_threads(fn: Callable, world: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` threads of this process (module docstring)."""
    import torch
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg)

    if dist.is_initialized():
        raise RuntimeError("run_threads needs this process to have no default process group; "
                           "it has one already (call it outside any distributed run)")
    results: list[tuple[str, Any]] = [("error", "the rank did not finish")] * world

    def worker(rank: int, store: dist.Store) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = ("ok", fn(rank, world, *args))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            results[rank] = ("error", traceback.format_exc())
            ProcessLocalGroup.exception_handle(exc)  # wake the other ranks out of their collectives
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        store = dist.HashStore()
        threads = [threading.Thread(target=worker, args=(rank, store), name=f"rank{rank}") for rank in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        hung = [rank for rank, t in enumerate(threads) if t.is_alive()]
        ProcessLocalGroup.reset()
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s:.0f} s")
    # a rank that failed first ends the others' collectives: report the first cause, not the echo
    failed = [(rank, value) for rank, (status, value) in enumerate(results) if status != "ok"]
    causes = [f for f in failed if "termination event" not in f[1]] or failed
    if causes:
        rank, value = causes[0]
        raise AssertionError(f"rank {rank} failed:\n{value}")
    return [value for _, value in results]
