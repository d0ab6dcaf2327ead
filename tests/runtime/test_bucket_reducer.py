"""Gradients averaged over a data axis in DDP's buckets, during the backward (autotp/runtime/bucket_reducer.py).

The buckets are DDP's own assignment (``torch.distributed._compute_bucket_assignment_by_size`` over
the parameters in the order the backward makes them, as DDP rebuilds its buckets after its first
step). On 2 threaded ranks, a tiny Llama's gradients over two micro-batches each: one all-reduce per
bucket, each launched once a step, during the last micro-batch's backward, never the first's, and
the averages one process's gradients over the whole batch.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist

from autotp.planning.costs.buckets import assign_buckets, exposed_all_reduce_s
from autotp.runtime.bucket_reducer import BucketReducer
from examples.ranks import run_threads

BUCKET_BYTES = 16 * 1024  # small, so the tiny model's gradients make several buckets


def _ddp_buckets(sizes: list[int], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """DDP's assignment of parameters (registration order) given in the order their gradients are made."""
    ready = list(reversed(range(len(sizes))))
    tensors = [torch.empty(sizes[i], dtype=torch.uint8) for i in ready]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [bucket_bytes])
    return tuple(tuple(ready[j] for j in b) for b in buckets)


def test_buckets_are_ddp_s():
    g = torch.Generator().manual_seed(0)
    for cap in (1, 100, 1000, 10**9):
        for n in (1, 2, 7, 30):
            sizes = torch.randint(1, 400, (n,), generator=g).tolist()
            assert assign_buckets(sizes, cap) == _ddp_buckets(sizes, cap), (sizes, cap)
    # a bucket never holds two stages' (or dtypes') parameters
    assert assign_buckets([4, 4, 4, 4], 100, keys=[0, 0, 1, 1]) == ((3, 2), (1, 0))
    with pytest.raises(ValueError, match="positive number of bytes; given 0"):
        assign_buckets([4], 0)


def test_the_last_bucket_is_exposed_the_others_hide_behind_the_backward():
    """Three buckets of 10 bytes, 1 s each, over a backward of 3 s: each ready at 1, 2, 3 s; only the
    last one's second runs past the backward. A slow link: the all-reduces queue, 3 x 5 s from 1 s."""
    assert exposed_all_reduce_s([10, 10, 10], lambda b: b / 10, 3.0) == pytest.approx(1.0)
    assert exposed_all_reduce_s([10, 10, 10], lambda b: b / 2, 3.0) == pytest.approx(1 + 15 - 3)
    assert exposed_all_reduce_s([30], lambda b: b / 10, 3.0) == pytest.approx(3.0)  # one bucket: nothing hidden


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=32))
    ids = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))
    return model, ids


def _rank(rank, world, model, ids, calls):
    model = copy.deepcopy(model)
    micro = ids[rank * 4:(rank + 1) * 4].chunk(2)  # this replica's rows, two micro-batches
    params = list(model.parameters())
    reducer = BucketReducer([params], dist.group.WORLD, accumulations=len(micro), divide_by=world * len(micro),
                            bucket_bytes=BUCKET_BYTES)
    for _ in range(2):  # a second step: the hooks count afresh
        model.zero_grad(set_to_none=True)
        with reducer.step():
            for x in micro:
                model(input_ids=x, labels=x).loss.backward()
    mine = [c for c in calls if c[0] == threading.get_ident()]
    return {"calls": [(phase, numel, async_op) for _, phase, numel, async_op in mine],
            "buckets": reducer.buckets, "launched": reducer.launched_in_backward,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_buckets_are_launched_during_the_last_backward_and_average_as_one_process(monkeypatch):
    model, ids = _llama()
    calls: list = []
    phase: dict = {}
    real = dist.all_reduce

    def recorded(tensor, *a, **kw):  # which rank, in which phase of its step, how large, asynchronous
        me = threading.get_ident()
        calls.append((me, phase.get(me), tensor.numel(), kw.get("async_op", False)))
        return real(tensor, *a, **kw)

    monkeypatch.setattr(dist, "all_reduce", recorded)
    orig_backward = torch.Tensor.backward
    count: dict = {}

    def backward(self, *a, **kw):  # the phase: which micro-batch's backward of the step is running
        me = threading.get_ident()
        k = count[me] = count.get(me, -1) + 1
        phase[me] = f"backward {k % 2}"
        try:
            return orig_backward(self, *a, **kw)
        finally:
            phase[me] = "after" if k % 2 == 0 else "end of step"

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    results = run_threads(_rank, 2, model, ids, calls)

    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    want = _ddp_buckets(sizes, BUCKET_BYTES)
    total = sum(sizes)
    for r in results:
        buckets = r["buckets"]
        assert tuple(b.parameters for b in buckets) == want
        # 88.6 KiB in buckets closed once they reach 16 KiB (some hold more): 5, where ceil(total / 16 KiB) is 6
        assert len(buckets) == 5 and total > 5 * BUCKET_BYTES, (len(buckets), total)
        # per step one all-reduce per bucket (not one per parameter: 21), of its bytes, asynchronous,
        # all launched during the last micro-batch's backward
        step = [(f"backward 1", b.size_bytes // 4, True) for b in buckets]
        assert r["calls"] == step + step, r["calls"]
        assert r["launched"] == len(buckets)
    # the averages over both replicas' micro-batches: one process's gradients over the whole batch
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        for r in results:
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_parameter_without_gradient_is_reduced_at_the_end_as_zeros():
    """A bucket with a parameter the step gave no gradient never becomes ready: it (and every bucket
    after it, kept in order on every rank) is launched when the step ends, the missing gradient as
    zeros, the others averaged."""

    def rank(r, world):
        used, unused = torch.nn.Parameter(torch.full((4,), float(r + 1))), torch.nn.Parameter(torch.zeros(4))
        reducer = BucketReducer([[unused, used]], dist.group.WORLD, accumulations=1, divide_by=world, bucket_bytes=16)
        with reducer.step():
            (used * 2).sum().backward()
        return reducer.launched_in_backward, used.grad.tolist(), unused.grad.tolist()

    assert run_threads(rank, 2) == [(1, [2.0] * 4, [0.0] * 4)] * 2


def test_dtensor_parameters_have_their_local_shards_averaged():
    """Parameters that are DTensors on a tensor axis (as a pipeline stage's are): their gradients'
    local shards are reduced over the data axis, the gradients stay DTensors. Mesh dp 2 x tp 1, two
    micro-batches, rank r's gradient (r + 1) per micro-batch: the average over 2 ranks x 2
    micro-batches is 1.5."""

    def rank(r, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        w = torch.nn.Parameter(distribute_tensor(torch.zeros(3, 2), mesh["tp"], [Shard(0)]))
        b = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh["tp"], [Replicate()]))
        reducer = BucketReducer([[w, b]], mesh["dp"].get_group(), accumulations=2, divide_by=4, bucket_bytes=8)
        with reducer.step():
            for _ in range(2):
                ((w.to_local() + b.to_local()).sum() * (r + 1)).backward()
        grads = w.grad.to_local().tolist(), b.grad.to_local().tolist()
        return (reducer.launched_in_backward, type(w.grad).__name__, *grads)

    assert run_threads(rank, 2) == [(2, "DTensor", [[1.5] * 2] * 3, [4.5] * 2)] * 2


def test_more_accumulations_than_micro_batches_are_an_error_not_a_wrong_average():
    """A gradient accumulated after its bucket was launched would be lost: the step says so."""

    def rank(r, world):
        p = torch.nn.Parameter(torch.ones(4))
        reducer = BucketReducer([[p]], dist.group.WORLD, accumulations=1, divide_by=world)
        try:
            with reducer.step():
                for _ in range(2):
                    p.sum().backward()
        except RuntimeError as err:
            return str(err)

    message = run_threads(rank, 2)[0]
    assert "parameters of shapes [(4,)] were accumulated after their bucket's all-reduce was launched" in message
