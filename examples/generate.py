"""Serve a Hugging Face model on 2 ranks: ``generate()`` with a KV cache split like the attention.

    torchrun --nproc-per-node 2 examples/generate.py
    python examples/generate.py              # the same, on 2 gloo processes started here

A small random ``LlamaForCausalLM`` (built from its config, ``use_cache`` left at its default) is
parallelized for inference under a memory budget that makes the planner split it. ``generate``
traces and plans, on its first call, the prompt's graph and the one-token graph, with a static
cache whose keys and values each rank holds for its own kv heads; every token after the prompt is
one call of the one-token graph. Rank 0 prints the plan of a decode step, the tokens, and a
sampled continuation; the run checks that the greedy tokens equal the model's own ``generate``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autotp

NEW_TOKENS = 16


def build():
    """A small random Llama and a batch of two 12-token prompts (seeded: the same on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, (prompt,)


def run(rank: int, world: int) -> list[list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, (prompt,) = build()
    budget = 0.6 * sum(p.numel() * p.element_size() for p in model.parameters())  # under the whole model
    pmodel = autotp.parallelize(model, mesh, (prompt,), mode="inference", memory_budget=budget)
    tokens = pmodel.generate(prompt, max_new_tokens=NEW_TOKENS)
    sampled = pmodel.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.9,
                              generator=torch.Generator().manual_seed(0))
    if rank == 0:
        (plans,) = pmodel.generation_plans.values()  # the prompt's and one token's, for this batch
        print(plans["token"].report())
        print(f"greedy: {tokens[:, prompt.shape[1]:].tolist()}")
        print(f"sampled (top_p 0.9): {sampled[:, prompt.shape[1]:].tolist()}")
    return tokens.tolist()


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        tokens = run(dist.get_rank(), dist.get_world_size())
        model, (prompt,) = build()
        expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        if dist.get_rank() == 0:
            print("the same tokens as the model's own generate" if tokens == expected else
                  f"differs from the model's own generate: {expected}")
        dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, nprocs=2, join=True)


def _spawned(rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    main()


if __name__ == "__main__":
    main()
