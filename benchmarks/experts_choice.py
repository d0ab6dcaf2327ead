"""Does the planner put whole experts on ranks where that prices cheaper?

Two Mixture-of-Experts shapes on ``h100-sxm``, training, a batch of 8 x 4096 tokens, each on the
meshes (8,) and (64,) (one node; eight nodes on one axis):

- a Qwen3-30B-A3B-like model: hidden 2048, 128 experts, top 8, moe_intermediate 768, 2 layers;
- a DeepSeek-V3-like model (transformers' ``DeepseekV3Config``): hidden 7168, 256 routed experts
  and 1 shared, top 8 of 4 groups of the 8 (``n_group``/``topk_group``), moe_intermediate 2048,
  latent attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128,
  128 heads), 3 layers, the first dense (``first_k_dense_replace=1``).

The vocabularies are cut to 32768 to keep the trace small. For each shape and mesh: the placement
the planner picks unpinned and the predicted step of the best plan with the experts pinned each
way (split by features; whole on ranks, every token on every rank; whole on ranks, the tokens
sent by all-to-all), side by side (``plan.expert_choices()``: the ILP solved again with each
pinned), and the chosen step over the feature split's.

    python -m benchmarks.experts_choice [--shapes qwen3-30b-a3b deepseek-v3] [--meshes 8 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import autotp

SHAPES = ("qwen3-30b-a3b", "deepseek-v3")
MESHES = (8, 64)
_COLUMNS = ("features", "whole", "routed")


def build(shape: str, tiny: bool = False) -> tuple[Any, dict]:
    """The model of ``shape`` on the meta device and its inputs (8 x 4096 tokens); ``tiny``: the
    same structure at widths a test plans in seconds (8 experts, 2 x 16 tokens; DeepSeek-V3's
    dense layer and one MoE layer)."""
    import transformers

    if shape == "qwen3-30b-a3b":
        width = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128) if tiny else dict(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=32768)
        config = transformers.Qwen3MoeConfig(num_experts_per_tok=8 if not tiny else 2, num_hidden_layers=2,
                                             tie_word_embeddings=False, **width)
        cls = transformers.Qwen3MoeForCausalLM
    elif shape == "deepseek-v3":
        width = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=128) if tiny else dict(
            hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
            num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=128,
            num_key_value_heads=128, vocab_size=32768)
        config = transformers.DeepseekV3Config(n_shared_experts=1, num_hidden_layers=2 if tiny else 3,
                                               first_k_dense_replace=1,
                                               tie_word_embeddings=False, **width)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"shape {shape!r}: expected one of {', '.join(SHAPES)}")
    with torch.device("meta"):
        model = cls(config)
    ids = torch.zeros(*((2, 16) if tiny else (8, 4096)), dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def row(shape: str, devices: int, tiny: bool = False) -> dict:
    """One shape on ``(devices,)``: the plan chosen unpinned and its experts' placements priced."""
    model, inputs = build(shape, tiny)
    t0 = time.perf_counter()
    plan = autotp.plan(model, (devices,), inputs, hardware="h100-sxm", mode="train")
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (choice,) = plan.expert_choices()  # each shape has one kind of MoE layer
    priced_s = time.perf_counter() - t0
    steps = {p.placement: p.step_s for p in choice.prices}
    return {"shape": shape, "mesh": (devices,), "chosen": choice.chosen.words, "placement": choice.chosen.placement,
            "steps_s": steps, "plan": plan, "choice": choice, "plan_s": plan_s, "priced_s": priced_s}


def _ms(s: Any) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--meshes", nargs="+", type=int, default=list(MESHES))
    args = parser.parse_args()
    print("| shape | mesh | chosen | by features | whole, every token | whole, all-to-all | chosen / by features |")
    print("|---|---|---|---|---|---|---|")
    rows = [row(shape, devices) for shape in args.shapes for devices in args.meshes]
    for r in rows:
        steps = r["steps_s"]
        ratio = steps[r["placement"]] / steps["features"] if steps.get("features") else float("nan")
        print(f"| {r['shape']} | {r['mesh']} | {r['chosen']} | " + " | ".join(_ms(steps.get(c)) for c in _COLUMNS)
              + f" | {ratio:.2f} |")
    for r in rows:
        print(f"\n{r['shape']} on {r['mesh']} (planned in {r['plan_s']:.1f} s, the other placements in "
              f"{r['priced_s']:.1f} s):")
        print("\n".join(r["choice"].lines()))


if __name__ == "__main__":
    main()
