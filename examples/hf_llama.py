"""Parallelize a Hugging Face ``LlamaForCausalLM`` built from a config (no download).

    torchrun --nproc-per-node 2 -m examples.hf_llama

Prints the plan on rank 0 and checks the logits against the unparallelized model.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autotp
from examples.models import hf_llama


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" not in os.environ:  # run as a plain script: say how to start the ranks
        sys.exit("start the ranks with torchrun: torchrun --nproc-per-node 2 -m examples.hf_llama")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))

    model, inputs = hf_llama(n_layer=2, hidden=256, ffn=512, heads=8, kv_heads=4, vocab=1024, seq=64, batch=2,
                             device=device)
    reference = model(*inputs).logits  # (B, T, vocab)
    # a budget below the replicated footprint makes autotp shard even this small model
    replicated = autotp.plan(model, (world,), inputs, hardware="cpu-gloo").memory_per_device().total_bytes
    pmodel = autotp.parallelize(model, mesh, inputs, hardware="cpu-gloo", memory_budget=0.7 * replicated)
    logits = pmodel(*inputs).logits
    if dist.get_rank() == 0:
        print(pmodel.plan.report())
        err = (logits - reference).abs().max().item()
        print(f"\nmax |logits - single-device logits| = {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
