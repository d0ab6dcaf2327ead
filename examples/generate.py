"""Greedy generation with a parallel Hugging Face model: one plan, every prompt length.

    python -m examples.generate               # 2 gloo processes on this machine
    torchrun --nproc-per-node 2 -m examples.generate

A small random ``LlamaForCausalLM`` (built from a config, no download) is parallelized once for
inference, with a 12-token prompt as the example input; a memory budget under the whole model
makes the planner shard its weights. Then, under ``torch.inference_mode()``, every rank generates
16 tokens greedily: each step runs the whole sequence so far (no KV cache: every step recomputes
the prefix; autotp does not parallelize a cache yet), so the module sees lengths 12 to 27 without
planning again. Rank 0 prints the tokens, and the process checks that they equal what the model
generates in one process.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autotp
from examples.models import hf_llama

PROMPT_TOKENS = 12
NEW_TOKENS = 16


def greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """``steps`` tokens, each the argmax of the logits of the whole sequence so far."""
    ids = prompt
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def build():
    return hf_llama(n_layer=2, hidden=128, ffn=256, heads=8, kv_heads=4, vocab=512, seq=PROMPT_TOKENS)


def run(rank: int, world: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, (prompt,) = build()  # seeded: the same weights and prompt on every rank
    prompt = prompt[:1]
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pmodel = autotp.parallelize(model, mesh, (prompt,), mode="inference", memory_budget=0.8 * full_bytes)
    tokens = greedy(pmodel, prompt, NEW_TOKENS)
    if rank == 0:
        print(sorted(set(pmodel.plan.module_styles().values())))
        report = pmodel.plan.report().split("\n\n")
        print("\n".join(part for part in report if part.startswith("Dynamic dims")))
        print(f"generated: {tokens}")
    return tokens


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        run(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
        return
    from examples.ranks import run_ranks

    results = run_ranks(run, 2)
    model, (prompt,) = build()
    expected = greedy(model.eval(), prompt[:1], NEW_TOKENS)
    assert all(r == expected for r in results), f"ranks generated {results}, one process {expected}"
    print(f"one process generated the same {NEW_TOKENS} tokens")


if __name__ == "__main__":
    main()
