"""Checkpoints: DCP save/load round-trips a parallel model; the gathered state dict is the model's."""

from __future__ import annotations

import copy

import pytest
import torch

from examples.ranks import run_ranks


def _save_load_gather(rank: int, world: int, path: str) -> dict:
    import autotp
    from examples import models
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, inp = models.tiny_llama(device="cpu", seed=0)
    plan = autotp.plan(model, (world,), inp, hardware="cpu-gloo", memory_budget="1.2MB")
    pm = autotp.parallelize(model, mesh, inp, plan=plan)
    autotp.checkpoint.save(pm, path)

    other, _ = models.tiny_llama(device="cpu", seed=1)  # different weights
    fresh = autotp.parallelize(other, mesh, inp, plan=plan)
    before = (fresh(*inp) - pm(*inp)).abs().max().item()
    autotp.checkpoint.load(fresh, path)
    after = (fresh(*inp) - pm(*inp)).abs().max().item()

    full = autotp.checkpoint.full_state_dict(pm)
    ref = model.state_dict()
    gathered_equal = rank != 0 or (set(full) == set(ref) and all(torch.equal(full[k], ref[k]) for k in ref))
    return {"before": before, "after": after, "gathered_equal": gathered_equal,
            "sharded": any(s in ("colwise", "rowwise") for s in plan.module_styles().values()),
            "rank0_only": rank == 0 or full == {}}


@pytest.mark.slow  # a spawned run of its own; tests/weights/test_loading.py covers DCP and full_state_dict by default
def test_checkpoint_round_trip_and_full_state_dict(tmp_path):
    results = run_ranks(_save_load_gather, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["sharded"], "the plan should shard under this budget, or the test checks nothing"
        assert r["before"] > 1e-3, "different weights must give different outputs before loading"
        assert r["after"] == 0.0
        assert r["gathered_equal"]
        assert r["rank0_only"]


def test_a_pipeline_module_under_fsdp_with_splits_dtensor_cannot_size_is_refused_not_gathered_wrong():
    """FSDP2 makes a stage's parameters anew, without autotp's placements: a split of whole heads the
    axis does not divide would be sized by elements. save, load and full_state_dict refuse it."""
    from types import SimpleNamespace

    from autotp.weights.checkpoint import _check_sizable

    def module(placements: dict, units: int) -> SimpleNamespace:
        chosen = SimpleNamespace(zero=3)
        return SimpleNamespace(fsdp_units=units, plan=SimpleNamespace(parameter_placements=placements,
                                                                       pipeline=SimpleNamespace(chosen=chosen)))

    with pytest.raises(NotImplementedError, match=r"q_proj.weight unevenly .*pipeline=\{'zero': 0\}"):
        _check_sizable(module({"q_proj.weight": "S(0)~64", "o_proj.weight": "S(1)"}, 4))
    _check_sizable(module({"q_proj.weight": "S(0)", "o_proj.weight": "S(1)"}, 4))  # even splits: fine
    _check_sizable(module({"q_proj.weight": "S(0)~64"}, 0))  # no FSDP2: autotp's placements are kept



def _full_state_dicts(rank, world, prepared, model):
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.module import build_parallel_module

    graph, plan = prepared
    pm = build_parallel_module(graph, plan, init_device_mesh("cpu", (world,)), copy.deepcopy(model))
    everywhere = autotp.checkpoint.full_state_dict(pm, rank=None)
    on_zero = autotp.checkpoint.full_state_dict(pm)
    own = {(v.to_local() if hasattr(v, "to_local") else v).untyped_storage().data_ptr()
           for v in pm.state_dict().values()}
    shared = [k for k, v in everywhere.items() if v.untyped_storage().data_ptr() in own]
    return everywhere, on_zero, shared


def test_the_full_state_dict_holds_one_whole_tensor_at_a_time(monkeypatch):
    """Each tensor is gathered whole, copied to the CPU and let go before the next is gathered (on a
    GPU the device never holds more than one whole tensor beyond its shards); the result is the
    model's state dict, on rank 0 alone or on every rank, sharing no storage with the module. 2
    threaded ranks, an MLP whose plan splits its weights."""
    import threading
    import weakref

    from autotp.weights import checkpoint
    from examples.ranks import run_threads
    from tests.helpers.plans import sharded_mlp

    model, graph, plan = sharded_mlp()
    real = checkpoint.full_tensor
    made: dict = {}  # each rank's whole tensors, as weak references
    alive: list = []  # whole tensors still held when the next was gathered

    def watched(value, placements=None):
        mine = made.setdefault(threading.get_ident(), [])
        alive.extend(i for i, ref in enumerate(mine) if ref() is not None)
        full = real(value, placements)
        mine.append(weakref.ref(full))
        return full

    monkeypatch.setattr(checkpoint, "full_tensor", watched)
    results = run_threads(_full_state_dicts, 2, (graph, plan), model)
    want = model.state_dict()
    assert [len(refs) for refs in made.values()] == [2 * len(want)] * 2  # two calls, each tensor once
    assert alive == []
    for rank, (everywhere, on_zero, shared) in enumerate(results):
        assert shared == []
        assert on_zero.keys() == (want.keys() if rank == 0 else set())
        for result in (everywhere, on_zero):
            for k, v in result.items():
                assert v.device.type == "cpu" and torch.equal(v, want[k]), k
