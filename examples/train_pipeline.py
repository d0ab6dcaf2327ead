"""Train a Hugging Face model in pipeline stages on 2 ranks: the layout chosen by ``autotp.plan``, run by ``autotp.parallelize``.

    torchrun --nproc-per-node 2 examples/train_pipeline.py
    python examples/train_pipeline.py              # the same, on 2 gloo processes started here

A small random Qwen2 (6 layers, built from its config) is planned for 2 devices with ``pipeline=``
kept to two stages (``{"pp": 2}``): the search cuts the layers, picks the schedule and the number of
micro-batches. Every rank builds its stages and steps its own parameters with AdamW; rank 0 prints
the layout, the last stage's rank the losses, checked against the same model trained in one process.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import autotp

STEPS = 3


def build():
    """A small random Qwen2 and a batch of 8 sequences of 32 tokens (seeded: the same on every rank)."""
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.logging.set_verbosity_error()
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def run(rank: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    model, batch = build()
    plan = autotp.plan(model, dist.get_world_size(), batch, hardware="cpu-gloo", pipeline={"pp": 2})
    c = plan.pipeline.chosen
    if rank == 0:
        print(f"layout: {c.describe()}; stages (layers): "
              f"{[(s.first_layer, s.end_layer) for s in plan.pipeline.stages]}")
    mesh = init_device_mesh("cpu", (c.pp, c.tp), mesh_dim_names=("pp", "tp"))
    pmodel = autotp.parallelize(model, mesh, batch, plan=plan)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)  # this rank's stages
    losses = []
    for step in range(STEPS):
        loss = pmodel.step(**batch)  # the batch's loss on the last stage's ranks, None elsewhere
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
            print(f"step {step}: loss {loss.item():.6f}")
    return losses


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        losses = run(dist.get_rank())
        model, batch = build()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        expected = []
        for _ in range(STEPS):
            loss = reference(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(loss.item())
        ok = not losses or all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, expected))
        if losses:
            print("the same losses as one process" if ok else f"differs from one process: {expected}")
        dist.destroy_process_group()
        if not ok:
            raise SystemExit(1)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, nprocs=2, join=True)


def _spawned(rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    main()


if __name__ == "__main__":
    main()
