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

    .venv/bin/python -m benchmarks.plan_3d
    .venv/bin/python -m benchmarks.plan_3d --only 8b-8
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
    for changed, note in (({}, ""), ({"recompute": True}, " +recompute"), ({"recompute": True, "zero": 3},
                                                                           " +recompute, zero 3")):
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
    ap.add_argument("--only", choices=sorted(ROWS), action="append")
    args = ap.parse_args()
    print(f"HF LlamaForCausalLM on meta, bf16, AdamW, {BATCH} sequences of {SEQ} per step, hardware {HARDWARE}")
    head = f"{'row':<9} {'autotp':<62} {'step s':>8} {'hand':<44} {'step s':>8} {'ratio':>6} {'search s':>8}"
    print(head)
    print("-" * len(head))
    for name in args.only or list(ROWS):
        r = row(name)
        c, h = r["chosen"], r["hand"]
        hand_s = h.step_s if h.step_s is not None else float("nan")
        hand = r["source"] if h.step_s is not None else r["source"] + " (no fit)"
        print(f"{name:<9} {c.describe():<62} {c.step_s:>8.2f} {hand:<44} {hand_s:>8.2f} "
              f"{c.step_s / hand_s:>6.2f} {r['search_s']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
