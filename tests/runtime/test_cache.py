"""A model's own KV cache (buffers written in place) is split like the attention that reads it.

``examples/models.py``'s :class:`CachedLlama` keeps its keys and values in non-persistent buffers,
written with ``index_copy_`` at the positions given, and decodes one token a call
(``greedy_with_cache``). Planned under a budget that makes it shard, the plan stores each cache by
kv heads where its attention is split by heads; the parallel module holds only its piece, decodes
the same tokens as one process, and the one-token calls (a size ``torch.export`` specializes) run on
a graph traced and planned for them on first use, with every weight and cache left where it is.

References: the model in one process (tokens), the plan (placements, collectives, bytes), the
buffers' own sizes. One run of 2 threaded ranks (``tests/helpers/turns.py``: each rank parallelizes,
and traces its decode graph, itself, the traces taken in turns); the model is built once here and
each rank parallelizes its own copy.
"""

from __future__ import annotations

import copy

import torch

import autotp
from autotp.placement import local_shape, parse_placements
from examples.models import cached_llama, greedy_with_cache
from tests.helpers.observed import CollectiveLog, planned
from tests.helpers.turns import run_threads_tracing_in_turns

NEW_TOKENS = 6


def _model():
    # two layers (each its own cache), two kv heads (one per rank); the planner solves this size in
    # a third of the time of dim 128 with 4 kv heads, and nothing checked depends on the widths
    return cached_llama(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab=128, max_len=64)


def _budget(model) -> float:
    return 0.7 * sum(p.numel() * p.element_size() for p in model.parameters())  # forces shards


def _rank(rank, world, built):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, (ids, pos) = copy.deepcopy(built)  # (cached_llama seeds the global generator: built once, outside the threads)
    pm = autotp.parallelize(model, mesh, (ids, pos), mode="inference", hardware="cpu-gloo",
                            memory_budget=_budget(model))
    tokens = greedy_with_cache(pm, ids, NEW_TOKENS)
    (decode_plan,) = pm.variant_plans.values()
    with CollectiveLog(mesh) as log:  # one more decode step, observed
        pm(torch.tensor([[1]] * ids.shape[0]), torch.tensor([ids.shape[1] + NEW_TOKENS]))
    held = {n: tuple(b.shape) for n, b in pm.named_buffers()}
    return {"tokens": tokens, "held": held, "plan": pm.plan.to_json(), "decode_plan": decode_plan.to_json(),
            "observed": log.counts(), "report": pm.plan.report(), "bytes": [s.bytes for s in log.seen]}


def test_a_model_s_own_cache_is_split_like_its_attention_and_decodes_as_one_process():
    fresh = _model()  # for the ranks: the reference below writes its own model's caches
    model, (ids, pos) = _model()
    expected = greedy_with_cache(model, ids, NEW_TOKENS)
    assert len({t for row in expected for t in row}) > 2, "a degenerate reference would prove little"
    caches = {n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("_cache")}
    results = run_threads_tracing_in_turns(_rank, 2, fresh)
    for rank, r in enumerate(results):
        assert r["tokens"] == expected, f"rank {rank}"
        plan, decode = autotp.Plan.from_json(r["plan"]), autotp.Plan.from_json(r["decode_plan"])
        split = plan.buffer_placements
        assert split and set(split) <= set(caches), split  # a cache is split, and only caches are
        for name, shape in caches.items():  # each rank holds its piece, never the whole of a split cache
            placements = parse_placements(split.get(name, "R"))
            assert r["held"][name] == local_shape(shape, placements, (2,), (rank,)), name
        # split by kv heads (dim 1), as the attention that reads it
        assert {text for text in split.values()} == {"S(1)"}, split
        # the decode graph keeps every weight and cache where it is stored
        assert decode.parameter_placements == plan.parameter_placements
        assert decode.buffer_placements == plan.buffer_placements
        # what a decode step communicates is what its plan lists, and never a cache
        assert r["observed"] == planned(decode, "forward"), (r["observed"], decode.collective_list)
        cache_bytes = min(4 * torch.Size(s).numel() // 2 for s in caches.values())
        assert all(b < cache_bytes for b in r["bytes"]), r["bytes"]
        # the memory counts the caches, at the size each rank holds
        held_bytes = sum(b.element_size() * torch.Size(r["held"][n]).numel() for n, b in model.named_buffers())
        assert plan.memory.buffers_bytes == held_bytes
        assert "Buffers stored split" in r["report"] and "buffers " in r["report"]


def test_only_buffers_outside_the_state_dict_may_be_split():
    """A cache (non-persistent) may be stored split; running statistics (in the state dict, saved
    and loaded whole) stay whole."""
    from autotp.planning.choices.strategies import all_strategies

    norm = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).eval()
    graph = autotp.capture(norm, (torch.randn(4, 8),), training=False)
    stats = [n for n in graph.nodes if n.role == "buffer"]
    assert stats and all(n.persistent for n in stats)
    options = all_strategies(graph, (2,), stats)
    assert all({str(s) for s in options[n.name]} == {"() -> R"} for n in stats)
    model, (ids, pos) = _model()
    graph = autotp.capture(model, (ids, pos), training=False)
    caches = [n for n in graph.nodes if n.role == "buffer" and n.param_fqn.endswith("_cache")]
    assert caches and not any(n.persistent for n in caches)
    options = all_strategies(graph, (2,), caches)
    assert all("() -> S(1)" in {str(s) for s in options[n.name]} for n in caches)
