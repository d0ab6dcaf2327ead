"""Run a function on N local processes with the gloo backend and collect what each rank returns.

Used by the demo, the benchmarks and the multi-process tests:
``run_ranks(fn, 2, *args)`` calls ``fn(rank, world, *args)`` on 2 spawned processes, each in its
own gloo process group, and returns the ranks' results (a rank that raises fails the call with
its traceback). ``fn`` must be importable (a module-level function) for spawn to find it.
"""

from __future__ import annotations

import os
import pickle
import tempfile
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
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; returns every rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, fn, args, out_dir), nprocs=world, join=True,
                           start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
