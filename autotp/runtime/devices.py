"""Which device each rank computes on: the mesh's device type, at the index its process is set to.

A ``DeviceMesh`` names a device type (``"cuda"``), not an index: each process computes on the device
it is set to (``torch.cuda.set_device(local_rank)``, or the one ``init_device_mesh`` sets from
``LOCAL_RANK`` where CUDA was not touched before). Everything the runtime makes is made on
:func:`mesh_device`, and a graph traced for the mesh's device type runs on it (:func:`on_mesh_device`).

Two checks, each before any collective:

- an input on another device than the mesh's (a prompt left on the CPU for a CUDA mesh would reach
  NCCL, which has no CPU backend) is an error naming the input and both devices
  (:func:`wrong_device`, raised by the input check and by ``generate``);
- ranks of one host that compute on one device (a process that touched CUDA before its device was
  set: every rank's shards on ``cuda:0``) are refused by ``autotp.parallelize``
  (:func:`check_rank_devices`): each rank's (host, device index) is exchanged through the process
  group's rendezvous store, not the mesh's backend (NCCL refuses a communicator whose ranks share a
  GPU, with its own error), and :func:`shared_devices` finds the ranks that share one.

>>> shared_devices([("a", 0), ("a", 0), ("b", 0), ("a", 1)], [0, 1, 2, 3])
[('a', 0, [0, 1])]
>>> on_mesh_device(torch.device("meta"), torch.device("cpu")), on_mesh_device(torch.device("cuda", 0), torch.device("cpu"))
(device(type='cpu'), device(type='cuda', index=0))
"""

from __future__ import annotations

import hashlib
import socket
import threading
from typing import Any, Optional, Sequence

import torch

__all__ = ["mesh_device", "on_mesh_device", "wrong_device", "shared_devices", "rank_devices_error",
           "gather_strings", "check_rank_devices"]


def mesh_device(mesh: Any) -> torch.device:
    """This rank's device of ``mesh``: the CPU, or the accelerator of the mesh's type at the index the
    process is set to (``torch.device("cuda", torch.cuda.current_device())``)."""
    if mesh.device_type in ("cpu", "meta"):
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def on_mesh_device(device: Any, here: torch.device) -> Any:
    """A device a traced graph names, as the rank's graph must name it: ``here`` (the rank's
    :func:`mesh_device`) for the meta device (a model traced on meta) and for any index of ``here``'s
    type (a fake device of a trace says ``cuda:0`` on every rank); anything else as it is."""
    if isinstance(device, torch.device) and (device.type == "meta" or device.type == here.type):
        return here
    return device


def wrong_device(name: str, given: torch.device, expected: torch.device) -> Optional[str]:
    """The error for input ``name`` on ``given`` where the module computes on ``expected``, or None
    where they agree (an index left out of ``expected`` takes any)."""
    if given.type == expected.type and (expected.index is None or given.index == expected.index):
        return None
    return (f"input {name!r} is on {given}, but this parallel module computes on {expected} (the mesh's device on "
            f"this rank); move the input there first (e.g. tensor.to({str(expected)!r})): the plan's collectives "
            f"run on the mesh's device, and nothing was run")


def shared_devices(places: Sequence[tuple[str, int]], ranks: Sequence[int]) -> list[tuple[str, int, list[int]]]:
    """(host, device index, ranks) of each device that more than one rank computes on; ``places[k]``
    is the (host, device index) of ``ranks[k]``."""
    by_place: dict[tuple[str, int], list[int]] = {}
    for rank, place in zip(ranks, places):
        by_place.setdefault(tuple(place), []).append(rank)
    return [(host, index, sorted(on)) for (host, index), on in sorted(by_place.items()) if len(on) > 1]


def rank_devices_error(places: Sequence[tuple[str, int]], ranks: Sequence[int], device_type: str) -> Optional[str]:
    """The error for ranks that share a device (:func:`shared_devices`), or None where each has its own."""
    shared = shared_devices(places, ranks)
    if not shared:
        return None
    what = "; ".join(f"ranks {', '.join(map(str, on))} of host {host} all compute on {device_type}:{index}"
                     for host, index, on in shared[:4]) + (f"; and {len(shared) - 4} more" if len(shared) > 4 else "")
    return (f"{what}: each rank must compute on a device of its own, or their shards and caches would share "
            f"one device's memory. Call torch.{device_type}.set_device(local_rank) at the start of each process, "
            f"before anything touches {device_type.upper()} (local_rank = int(os.environ['LOCAL_RANK']) under "
            f"torchrun), then build the mesh; nothing was run")


_CHECKS: dict[tuple[str, int], int] = {}  # per (set of ranks, rank): the exchanges this process made
_CHECKS_LOCK = threading.Lock()


def gather_strings(mesh: Any, value: str) -> list[str]:
    """Every rank's ``value``, in the order of the mesh's ranks, through the default process group's
    rendezvous store (a key per rank and exchange): no collective of the mesh's backend runs."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    group = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    me = dist.get_rank()
    with _CHECKS_LOCK:  # ranks as threads of one process count their own exchanges
        n = _CHECKS[(group, me)] = _CHECKS.get((group, me), 0) + 1
    prefix = f"autotp/devices/{group}/{n}/"
    store = _get_default_store()
    store.set(prefix + str(me), value)
    return [store.get(prefix + str(r)).decode() for r in ranks]


def check_rank_devices(mesh: Any) -> None:
    """Raise (on every rank) where ranks of ``mesh`` on one host compute on one device of an
    accelerator mesh (module docstring); a CPU mesh, or one over the fake process group, is not checked."""
    import torch.distributed as dist

    if mesh.device_type in ("cpu", "meta") or dist.get_backend() == "fake":
        return
    index = torch.get_device_module(mesh.device_type).current_device()
    ranks = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    places = [text.rsplit("|", 1) for text in gather_strings(mesh, f"{socket.gethostname()}|{index}")]
    error = rank_devices_error([(host, int(i)) for host, i in places], ranks, mesh.device_type)
    if error:
        raise RuntimeError(error)
