"""Which device each rank computes on (``autotp/runtime/devices.py``), and the checks that refuse
what would fail on a GPU: an input on another device than the mesh's, ranks of one host on one GPU.

References: hand-written (host, device index) lists of ranks; an input guard of one input, given a
tensor on the meta device where the rank computes on the CPU; the strings every rank of 2 threaded
ranks put in the rendezvous store. None of it needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

from autotp.runtime.devices import on_mesh_device, rank_devices_error, shared_devices
from autotp.runtime.guard import InputGuard, InputSpec
from examples.ranks import run_threads


def test_ranks_of_one_host_on_one_gpu_are_named_with_the_call_that_sets_each_its_own():
    # the common failure: CUDA touched before the device was set, so every rank stayed on cuda:0
    places = [("node-a", 0), ("node-a", 0), ("node-b", 0), ("node-b", 1)]
    assert shared_devices(places, [0, 1, 2, 3]) == [("node-a", 0, [0, 1])]
    error = rank_devices_error(places, [0, 1, 2, 3], "cuda")
    assert "ranks 0, 1 of host node-a all compute on cuda:0" in error
    assert "torch.cuda.set_device(local_rank)" in error and "LOCAL_RANK" in error
    assert "node-b" not in error  # its ranks have a GPU each


def test_each_rank_on_its_own_device_is_accepted_also_at_one_index_on_other_hosts():
    assert rank_devices_error([("a", 0), ("a", 1), ("b", 0), ("b", 1)], [0, 1, 2, 3], "cuda") is None
    # ranks numbered as a mesh lists them, not 0..n-1
    assert shared_devices([("a", 3), ("b", 3), ("a", 3)], [4, 5, 6]) == [("a", 3, [4, 6])]


def _exchange(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.devices import gather_strings

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    first = gather_strings(mesh, f"host|{rank}")
    second = gather_strings(mesh, f"again|{10 + rank}")  # a later exchange reads the later values
    return first, second


def test_every_rank_reads_every_rank_s_place_through_the_store():
    results = run_threads(_exchange, 2)
    expected = (["host|0", "host|1"], ["again|10", "again|11"])
    assert results == [expected, expected]


def test_a_traced_device_becomes_this_rank_s_device():
    here = torch.device("cuda", 1)
    assert on_mesh_device(torch.device("cuda", 0), here) == here  # a fake device says cuda:0 on every rank
    assert on_mesh_device(torch.device("meta"), here) == here
    assert on_mesh_device(torch.device("cpu"), here) == torch.device("cpu")  # the model's own move to the CPU
    assert on_mesh_device("cuda:0", here) == "cuda:0"  # not a device: as it is


def test_an_input_on_another_device_than_the_rank_s_is_refused_naming_both():
    guard = InputGuard((InputSpec("input_ids", (2, 8), "int64"),), device=torch.device("cpu"))
    guard(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError) as err:
        guard(torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    assert "input 'input_ids' is on meta, but this parallel module computes on cpu" in str(err.value)


def _check_as_cuda(rank, world):
    """``check_rank_devices`` on 2 threaded ranks of one host, their mesh said to be CUDA's (the device
    index each is set to comes from the patched ``torch.cuda.current_device``)."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.devices import check_rank_devices

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    try:
        check_rank_devices(SimpleNamespace(device_type="cuda", mesh=mesh.mesh))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("set_device", [False, True])
def test_parallelize_s_check_refuses_two_ranks_on_one_gpu_on_every_rank(monkeypatch, set_device):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "current_device", (lambda: dist.get_rank()) if set_device else (lambda: 0))
    results = run_threads(_check_as_cuda, 2)
    if set_device:
        assert results == [None, None]
    else:
        assert results[0] == results[1] and "ranks 0, 1 of host" in results[0] and "cuda:0" in results[0]
