"""Serve an encoder-decoder (BART) on 2 ranks: ``generate()`` with self- and cross-attention caches split by heads.

    torchrun --nproc-per-node 2 examples/translate.py
    python examples/translate.py              # the same, on 2 gloo processes started here

A small random ``BartForConditionalGeneration`` (built from its config) is parallelized for
inference under a memory budget that makes the planner split it. ``generate`` traces and plans, on
its first call, the encoder's graph (it runs once per call), the decoder's first step (it fills the
cross-attention cache from the encoder's states) and a later step's (it reads that cache); each rank
holds the keys and values of its own heads. The generation config's own rules apply as in the
model's ``generate`` (BART forces its end token last). Rank 0 prints what a decoded token runs and
the tokens; the run checks them against the model's own ``generate``. A T5 or Marian model, which
makes no decoder inputs of its own, is parallelized with ``{"input_ids": ..., "decoder_input_ids": ...}``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autotp

NEW_TOKENS = 12


def build():
    """A small random BART and a batch of two source texts of 10 and 7 tokens, the second
    right-padded, with their attention mask (seeded: the same on every rank)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
                        decoder_attention_heads=8, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=512,
                        max_position_embeddings=64, init_std=0.3)
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config).eval()
    source = torch.randint(3, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(source)
    source[1, 7:], mask[1, 7:] = config.pad_token_id, 0
    return model, source, mask


def run(rank: int) -> list[list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, source, mask = build()
    budget = 0.6 * sum(p.numel() * p.element_size() for p in model.parameters())  # under the whole model
    pmodel = autotp.parallelize(model, mesh, (source,), mode="inference", memory_budget=budget)
    tokens = pmodel.generate(source, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    if rank == 0:
        (plans,) = pmodel.generation_plans.values()  # the encoder's, the first step's, a later step's
        print(plans["token"].report())
        print(f"tokens: {tokens.tolist()}")
    return tokens.tolist()


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        tokens = run(dist.get_rank())
        model, source, mask = build()
        expected = model.generate(source, attention_mask=mask, max_new_tokens=NEW_TOKENS).tolist()
        if dist.get_rank() == 0:
            print("the same tokens as the model's own generate" if tokens == expected else
                  f"differs from the model's own generate: {expected}")
        dist.destroy_process_group()
        if tokens != expected:
            raise SystemExit(1)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, nprocs=2, join=True)


def _spawned(rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    main()


if __name__ == "__main__":
    main()
