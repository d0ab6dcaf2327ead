"""The working memory of attention under a described mask (autotp/planning/rules/attention_working.py):
each strategy's figure against a hand count of its largest chunk, the plan's backward priced with
it, and the kernel's own call measured storage by storage (benchmarks/memory.py's meter)."""

from __future__ import annotations

import functools

import torch

import autotp
from autotp.masks import CHUNK_ROWS, MaskSpec, masked_attention
from autotp.mesh import MeshSpec
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.costs.costing import CostModel
from autotp.planning.planner import plan_graph
from cost_models import load_profile

SEQ = 2048  # two chunks of CHUNK_ROWS query rows


@functools.lru_cache(maxsize=None)  # one capture of each for every test
def _llama(padded: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=SEQ))
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids, **({"attention_mask": torch.ones_like(ids)} if padded else {})}
    return model, autotp.capture(model, inputs)


def _attention(graph):
    (node,) = [n for n in graph.ops() if "attention" in n.target]
    return node


def test_each_strategy_holds_its_largest_chunk_s_masks():
    """Causal Llama, 1 x 2048 tokens, 4 heads (2 kv heads, repeated to 4) of 8, float32, on 2 ranks. A
    mask chunk holds a boolean and a float32 a pair (5 bytes); the ring's block 4 float32 scores per
    head and two booleans a pair, the balanced ring's block a quarter of it (chunks of 512 of 2048),
    each beside its key and value chunks in flight (the 2 kv heads, as before the repeat)."""
    assert CHUNK_ROWS == 1024
    cost = CostModel(MeshSpec.of((2,)), load_profile("cpu-gloo"), "train")
    _, graph = _llama(padded=False)
    attention = _attention(graph)
    held = {(str(s.inputs[0][0]), s.variant): cost.working_bytes(attention, s)
            for s in node_strategies(graph, attention, (2,))}
    in_flight = 2 * (2 * 1024 * 2 * 8 * 4) * 2  # (k, v) held and arriving, and their gradients
    assert held == {
        ("R", ""): 0.0, ("S(1)", ""): 0.0,  # is_causal on whole rows: the kernel's own mask
        ("S(2)", ""): 1024 * 2048 * 5,  # rank 1's rows 1024..2048 read every key
        ("S(2)", "balanced"): 512 * 2048 * 5,  # rank 0's chunk 3 (rows 1536..2048) reads every key
        # rank 1's block of its rows and one key chunk, beside the key and value chunk it holds and the
        # one arriving, with their float32 gradients (1024 keys x 2 kv heads x 8, float32, each)
        ("S(2)", "ring/kv2"): 1024 * 1024 * (4 * 4 * 4 + 2) + in_flight,
        ("S(2)", "ring_balanced/kv2"): 512 * 512 * (4 * 4 * 4 + 2) + in_flight,  # 512 rows against 512 keys
    }
    # the padding vector given: every strategy builds masks, the heads' too (rows 1024..2048, every key)
    _, graph = _llama(padded=True)
    attention = _attention(graph)
    held = {(str(s.inputs[0][0]), s.variant): cost.working_bytes(attention, s)
            for s in node_strategies(graph, attention, (2,))}
    assert held[("S(1)", "")] == held[("R", "")] == held[("S(2)", "")] == 1024 * 2048 * 5
    inference = CostModel(MeshSpec.of((2,)), load_profile("cpu-gloo"), "inference")
    assert all(inference.working_bytes(attention, s) == 0 for s in node_strategies(graph, attention, (2,)))


def test_the_backward_s_start_prices_the_masks_of_a_chunk():
    """Padded, weights whole: the planner splits the heads, and the backward's first peak is the
    masks of the largest chunk (10.5 MB), above the loss's gradients (3 x the 0.5 MB logits), which
    were the figure before the masks were priced."""
    model, graph = _llama(padded=True)
    plan = plan_graph(graph, (2,), "cpu-gloo", pin={n: "R" for n, _ in model.named_parameters()})
    assert plan.memory.transient_bytes == 1024 * 2048 * 5
    state = plan.memory.parameters_bytes + plan.memory.optimizer_bytes + plan.memory.buffers_bytes
    assert plan.memory_timeline()["backward start"] == state + plan.memory.activations_bytes + 1024 * 2048 * 5


def test_a_masked_call_holds_what_is_priced():
    """The kernel itself: balanced rows' last chunk (rows 1536..2048 of 2048, every key), forward and
    backward, measured storage by storage; beside its inputs, output and their gradients it holds
    the figure priced for it, within 5%."""
    from benchmarks.memory import LiveBytes

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 512, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 4, SEQ, 8, generator=g, requires_grad=True) for _ in range(2))
    meter = LiveBytes()
    for t in (q, k, v):
        meter.track(t, "inputs")
    with meter:
        out = masked_attention(q, k, v, None, MaskSpec(), row_offset=1536)
        out.backward(torch.ones_like(out))
    own = sum(t.nbytes for t in (q, k, v)) * 2 + out.nbytes * 2  # inputs, their gradients, output, its gradient
    _, graph = _llama(padded=False)
    attention = _attention(graph)
    balanced = next(s for s in node_strategies(graph, attention, (2,)) if s.variant == "balanced")
    priced = CostModel(MeshSpec.of((2,)), load_profile("cpu-gloo"), "train").working_bytes(attention, balanced)
    assert 0.95 <= (meter.peak - own) / priced <= 1.05, (meter.peak - own, priced)
    print(f"held {(meter.peak - own) / 1e6:.3f} MB, priced {priced / 1e6:.3f} MB")
