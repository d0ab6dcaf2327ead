"""Three-dimensional layouts on paper: autotp's choice against published hand configurations.

For the Llama 3 shapes (bf16 weights, AdamW, sequences of 8192 tokens, 2048 of them per step: the
16M-token batch of the Llama 3 paper) on the built-in ``h100-sxm`` profile, each row runs
``autotp.plan(model, devices, inputs, pipeline=True)`` (the model on the meta device) and prices,
with the same units and cost model, the hand configuration a team would write
(``autotp.planning.search.pipeline_search.price_layout``). It prints both layouts, their predicted steps,
the ratio autotp / hand (goal <= 1.0: never worse than a configuration the search could have
chosen) and the search's wall time on this machine (goal <= 60 s per row).

Hand configurations, as published:

- 8B on 8: torchtitan's Llama 3 8B recipe, FSDP over the 8 GPUs (ZeRO 3), layers recomputed;
- 8B on 64: the same, FSDP over 64;
- 70B on 64 and on 256: torchtitan's 2D, FSDP over nodes times TP 8 inside each, layers recomputed;
- 405B on 512: the Llama 3 paper's TP 8 x PP 16 with interleaved 1F1B, the data axis what is left
  (4), micro-batches of one sequence, optimizer state split over the data axis (ZeRO 1).

A hand configuration that does not fit the budget as published is priced with every layer
recomputing, then with ZeRO 3 as well; the row says which.

Mixture-of-Experts rows (bf16, AdamW, sequences of 4096 tokens, 7.5 of them per device per step:
DeepSeek-V3's 15360 sequences on 2048 GPUs, scaled to the device count), the models built from
transformers' configs on the meta device, the search with its expert axis
(``autotp.planning.search.pipeline_search``), the hand layout priced by the same search kept to it
(``pipeline={...}``), so both are priced alike:

- DeepSeek-V3 671B (61 layers, the first 3 dense; MLA; 256 routed experts + 1 shared, top 8) on
  256: DeepSeek-V3's report (PP 16, EP 64 across 8 nodes, ZeRO-1 data parallelism, no TP, on 2048
  H800) scaled to 256: PP 16 x EP 16, no TP, no data axis left;
- the same on 512: torchtitan's DeepSeek-V3 671B configuration (train_configs/deepseek_v3_671b.toml:
  tensor_parallel_degree 8, data_parallel_shard_degree -1 (FSDP over the rest), expert and pipeline
  degree 1, activation checkpointing full): FSDP 64 x TP 8, layers recomputed;
- Qwen3-235B-A22B (94 layers, 128 experts top 8) on 64: torchtitan's configuration as above:
  FSDP 8 x TP 8, layers recomputed.

    .venv/bin/python -m benchmarks.plan_3d
    .venv/bin/python -m benchmarks.plan_3d --only 8b-8
    .venv/bin/python -m benchmarks.plan_3d --only ds-256 --only ds-512 --only qwen3-235b-64
"""

from __future__ import annotations

import argparse
import time

SEQ = 8192
BATCH = 2048
SHAPES = {  # examples.models.hf_llama kwargs
    "8b": dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "70b": dict(n_layer=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    "405b": dict(n_layer=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256),
}
# row: (shape, devices, hand layout as Candidate fields, where it comes from)
ROWS = {
    "8b-8": ("8b", 8, dict(pp=1, dp=8, tp=1, schedule="none", stages_per_rank=1, micro_batch_size=1, zero=3,
                           recompute=True), "torchtitan 8B: FSDP 8"),
    "8b-64": ("8b", 64, dict(pp=1, dp=64, tp=1, schedule="none", stages_per_rank=1, micro_batch_size=1, zero=3,
                             recompute=True), "torchtitan 8B: FSDP 64"),
    "70b-64": ("70b", 64, dict(pp=1, dp=8, tp=8, schedule="none", stages_per_rank=1, micro_batch_size=1, zero=3,
                               recompute=True), "torchtitan 70B: FSDP 8 x TP 8"),
    "70b-256": ("70b", 256, dict(pp=1, dp=32, tp=8, schedule="none", stages_per_rank=1, micro_batch_size=1, zero=3,
                                 recompute=True), "torchtitan 70B: FSDP 32 x TP 8"),
    "405b-512": ("405b", 512, dict(pp=16, dp=4, tp=8, schedule="interleaved_1f1b", stages_per_rank=2,
                                   micro_batch_size=1, zero=1, recompute=False), "Llama 3: TP 8 x PP 16 x DP 4"),
}
HARDWARE = "h100-sxm"
# a hand layout as published; where that does not fit the budget, with every layer recomputing, then
# with ZeRO 3 too (the fields changed, and what the row says of it)
AS_PUBLISHED_OR_FITTED = (({}, ""), ({"recompute": True}, " +recompute"), ({"recompute": True, "zero": 3},
                                                                          " +recompute, zero 3"))
MOE_SEQ = 4096
SEQUENCES_PER_DEVICE = 7.5  # DeepSeek-V3: 15360 sequences on 2048 GPUs
MOE_SHAPES = {  # transformers config classes and their kwargs
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)),
    "qwen3-235b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        tie_word_embeddings=False)),
}
MOE_ROWS = {  # row: (shape, devices, hand layout as pipeline={...} fields, where it comes from)
    "ds-256": ("deepseek-v3", 256, dict(pp=16, dp=1, ep=16, tp=1, zero=0),
               "DeepSeek-V3 report scaled: PP 16 x EP 16"),
    "ds-512": ("deepseek-v3", 512, dict(pp=1, dp=64, ep=1, tp=8, zero=3, recompute=True),
               "torchtitan 671B: FSDP 64 x TP 8"),
    "qwen3-235b-64": ("qwen3-235b", 64, dict(pp=1, dp=8, ep=1, tp=8, zero=3, recompute=True),
                      "torchtitan: FSDP 8 x TP 8"),
}


def moe_model(shape: str, layers: int | None = None, **overrides):
    """The shape's model on the meta device in bf16, train mode (``layers`` and ``overrides``: a
    shrunk one)."""
    import torch
    import transformers

    config_cls, model_cls, kwargs = MOE_SHAPES[shape]
    kwargs = {**kwargs, **overrides, **({"num_hidden_layers": layers} if layers else {})}
    config = getattr(transformers, config_cls)(**kwargs)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    return model.to(torch.bfloat16).train()


def moe_row(name: str, layers: int | None = None, seq: int = MOE_SEQ, devices: int | None = None,
            **overrides) -> dict:
    """The search's choice and the hand layout on the row's devices, priced alike. ``layers``,
    ``seq``, ``devices`` and ``overrides`` (config fields) shrink the row; on other ``devices`` the
    hand layout's data axis is what is left (its source's "FSDP over the rest")."""
    import torch

    import autotp
    from autotp import MemoryBudgetError

    shape, row_devices, hand, source = MOE_ROWS[name]
    if devices is not None and devices != row_devices:
        hand = {**hand, "dp": devices // (hand["pp"] * hand["ep"] * hand["tp"])}
    devices = devices or row_devices
    model = moe_model(shape, layers, **overrides)
    ids = torch.zeros(int(SEQUENCES_PER_DEVICE * devices), seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    t0 = time.perf_counter()
    plan = autotp.plan(model, devices, inputs, hardware=HARDWARE, pipeline=True)
    search_s = time.perf_counter() - t0
    priced, note = None, ""
    for changed, note in AS_PUBLISHED_OR_FITTED:
        try:
            kept = autotp.plan(model, devices, inputs, hardware=HARDWARE, pipeline={**hand, **changed})
        except (MemoryBudgetError, ValueError):
            continue
        priced = kept.pipeline.chosen
        break
    return dict(name=name, devices=devices, chosen=plan.pipeline.chosen, hand=priced, source=source + note,
                search_s=search_s, priced=plan.pipeline.priced)


def row(name: str) -> dict:
    import torch

    import autotp
    from autotp.planning.search.pipeline_search import Candidate, price_layout
    from examples import models as M

    shape, devices, hand, source = ROWS[name]
    model, (ids,) = M.hf_llama(**SHAPES[shape], seq=SEQ, batch=BATCH, device="meta", dtype=torch.bfloat16)
    model.train()
    units_seen = {}
    t0 = time.perf_counter()
    plan = autotp.plan(model, devices, {"input_ids": ids, "labels": ids}, hardware=HARDWARE, pipeline=True)
    search_s = time.perf_counter() - t0
    choice = plan.pipeline
    per_replica = BATCH // hand["dp"]
    units = _units(model, ids, plan, hand["tp"], hand["micro_batch_size"], units_seen)
    # as published; where that does not fit the budget, with every layer recomputing, then with ZeRO 3 too
    for changed, note in AS_PUBLISHED_OR_FITTED:
        layout = Candidate(**{**hand, **changed}, micro_batches=per_replica // hand["micro_batch_size"])
        priced, _ = price_layout(layout, units, plan.hardware, plan.memory.budget_bytes)
        if priced.step_s is not None:
            break
    return dict(name=name, devices=devices, chosen=choice.chosen, hand=priced, source=source + note,
                search_s=search_s, priced=choice.priced)


def _units(model, ids, plan, tp, b, seen):
    """The units of a plan on (tp,) at micro-batch b, made as the search makes them."""
    import autotp
    from autotp.planning.planner import plan_graph
    from autotp.planning.search.pipeline_search import units_of_plan
    from autotp.tracing.repeats import find_stacks

    stack = max(find_stacks(model), key=lambda s: s.count)
    graph = autotp.capture(model, {"input_ids": ids[:b], "labels": ids[:b]}, unroll=True)
    p = plan_graph(graph, (tp,), plan.hardware, "train", 1e18, recompute=False, explainable=False)
    return units_of_plan(p, graph, [stack.layer(i) for i in range(stack.count)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(ROWS) + sorted(MOE_ROWS), action="append")
    args = ap.parse_args()
    print(f"HF LlamaForCausalLM on meta, bf16, AdamW, {BATCH} sequences of {SEQ} per step, hardware {HARDWARE}; "
          f"MoE rows: {SEQUENCES_PER_DEVICE} sequences of {MOE_SEQ} per device")
    head = f"{'row':<9} {'autotp':<80} {'step s':>8} {'hand':<44} {'step s':>8} {'ratio':>6} {'search s':>8}"
    print(head)
    print("-" * len(head))
    for name in args.only or list(ROWS) + list(MOE_ROWS):
        r = moe_row(name) if name in MOE_ROWS else row(name)
        c, h = r["chosen"], r["hand"]
        hand_s = h.step_s if h is not None and h.step_s is not None else float("nan")
        hand = r["source"] if h is not None and h.step_s is not None else r["source"] + " (no fit)"
        print(f"{name:<9} {c.describe():<80} {c.step_s:>8.2f} {hand:<44} {hand_s:>8.2f} "
              f"{c.step_s / hand_s:>6.2f} {r['search_s']:>8.1f}", flush=True)
        for who, x in (("autotp", c), ("hand", h)):  # the busiest rank's terms, as the search priced them
            if x is not None and x.step_s is not None:
                print(f"{'':<9}   {who}: compute {x.compute_s:.2f} s, communication {x.communication_s:.2f} s, "
                      f"bubble {x.bubble_s:.2f} s, peak {x.peak_bytes / 2**30:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
