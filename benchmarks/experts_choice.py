"""Does the planner put whole experts on ranks where that prices cheaper?

A Qwen3-30B-A3B-like model (hidden 2048, 128 experts, top 8, moe_intermediate 768, 2 layers, vocabulary
cut to 32768 to keep the trace small) on ``h100-sxm``, mesh (8,), a batch of 8 x 4096, training: the
plan autotp chooses, against the same model with the experts pinned to the feature split (gate|up
by output features, down by input features) and pinned whole on ranks (``S(0)``), both with the
tokens split and sent to their experts by all-to-all (the planner's pick among the two) and with
the routed region withheld, so that every rank holds every token (``Pd``). Prints each plan's
predicted step, how its grouped matmuls are split and its collectives at them.

    python -m benchmarks.experts_choice
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

import autotp
from autotp.planning.choices import strategies
from autotp.planning.planner import plan_graph


def build():
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def describe(graph, plan, label: str) -> str:
    grouped = [n for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    splits = sorted({str(plan.strategy(n.name)) for n in grouped})
    names = {n.name for n in grouped}
    at = Counter(f"{c.phase} {c.kind}" for c in plan.collectives() if c.at in names)
    t = plan.predicted_time()
    return (f"{label}: predicted step {t.total_s * 1e3:.1f} ms (compute {t.compute_s * 1e3:.1f} ms, "
            f"communication {t.communication_s * 1e3:.1f} ms); grouped matmuls {splits}; "
            f"collectives at them {dict(sorted(at.items()))}")


@contextmanager
def tokens_whole():
    """The routed region withheld (no all-to-all dispatch offered): experts placed whole see every token."""
    offered = strategies.routed_choices
    strategies.routed_choices = lambda node, n, graph: []
    try:
        yield
    finally:
        strategies.routed_choices = offered


def main() -> None:
    model, inputs = build()
    graph = autotp.capture(model, inputs)
    experts = [p.fqn for p in graph.parameters if p.info.ndim == 3]
    chosen = plan_graph(graph, (8,), "h100-sxm", "train")
    print(describe(graph, chosen, "autotp's choice"))
    features = {n: ("S(1)[2]" if n.endswith("gate_up_proj") else "S(2)") for n in experts}
    pinned = plan_graph(graph, (8,), "h100-sxm", "train", pin=features)
    print(describe(graph, pinned, "experts split by features (pinned)"))
    whole = plan_graph(graph, (8,), "h100-sxm", "train", pin={n: "S(0)" for n in experts})
    print(describe(graph, whole, "whole experts on ranks (pinned)"))
    with tokens_whole():
        every = plan_graph(graph, (8,), "h100-sxm", "train", pin={n: "S(0)" for n in experts})
    print(describe(graph, every, "whole experts on ranks, every token on every rank (pinned, no all-to-all)"))


if __name__ == "__main__":
    main()
