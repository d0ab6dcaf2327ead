"""The path a real-size model takes: built on meta, parallelized, loaded shard by shard.

    python -m examples.load_pretrained            # 2 gloo processes on this machine
    torchrun --nproc-per-node 2 -m examples.load_pretrained

A small random Hugging Face Llama is saved with ``save_pretrained`` (safetensors, several files and
an index), standing in for a downloaded checkpoint. Then every rank:

1. builds the model from its config under ``autotp.meta_init()``: parameters on the meta device
   (no memory), buffers such as the rotary ``inv_freq`` made for real;
2. ``autotp.parallelize``: the first rank plans, every rank receives the plan and allocates only
   its shards;
3. ``autotp.load_weights``: every rank reads the slices of the files it holds.

Rank 0 prints the plan's styles, the bytes it holds against the full model, and the largest
difference from ``from_pretrained`` in one process.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import autotp
from examples.models import hf_llama


def save_checkpoint(directory: str) -> None:
    model, _ = hf_llama(n_layer=2, hidden=256, ffn=512, heads=8, kv_heads=4, vocab=1024, seq=64)
    model.save_pretrained(directory, max_shard_size="1MB")


def run(rank: int, world: int, directory: str) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with autotp.meta_init():
        model = LlamaForCausalLM(AutoConfig.from_pretrained(directory)).eval()
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # a budget a little under the whole model per rank makes the planner shard even this small one
    pmodel = autotp.parallelize(model, mesh, (ids,), memory_budget=0.7 * 4 * full_bytes)
    autotp.load_weights(pmodel, directory)
    logits = pmodel(ids).logits
    reference = LlamaForCausalLM.from_pretrained(directory).eval()(ids).logits
    err = ((logits - reference).abs().max() / reference.abs().max()).item()
    if rank == 0:
        held = sum(p.to_local().numel() * p.element_size() for p in pmodel.parameters())
        print(sorted(set(pmodel.plan.module_styles().values())))
        print(f"rank 0 holds {held / 2**20:.2f} MiB of the model's {full_bytes / 2**20:.2f} MiB of parameters")
        print(f"largest |logits - from_pretrained| / |logits| = {err:.1e}")
    return err


def main() -> None:
    if "RANK" in os.environ:  # under torchrun: rank 0 writes the checkpoint, every rank reads it
        dist.init_process_group("gloo")
        directory = os.path.join(tempfile.gettempdir(), "autotp-load-example")
        if dist.get_rank() == 0:
            save_checkpoint(directory)
        dist.barrier()
        run(dist.get_rank(), dist.get_world_size(), directory)
        dist.destroy_process_group()
        return
    from examples.ranks import run_ranks

    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory)
        errors = run_ranks(run, 2, directory)
    assert max(errors) < 1e-5, errors


if __name__ == "__main__":
    main()
