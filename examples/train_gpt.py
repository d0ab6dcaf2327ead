"""Train a small GPT with autotp: plan, parallelize, AdamW steps.

Under torchrun (gloo on CPU, NCCL on CUDA):

    torchrun --nproc-per-node 2 -m examples.train_gpt --steps 5

Every rank builds the same model from the same seed, autotp plans it for the mesh (or loads a
plan with ``--plan plan.json``), and each rank then holds only its shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from examples.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=2048, n_layer=4, n_head=8, dim=256, max_seq_len=128)
BATCH, SEQ = 8, 128


def build(device: str = "cpu", seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """The model, its example inputs and next-token targets, identical on every rank for a seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(CONFIG)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g).to(device)  # (B, T+1)
    if device == "meta":
        tokens = torch.zeros(BATCH, SEQ + 1, dtype=torch.long, device="meta")
    return model, (tokens[:, :-1],), tokens[:, 1:]


def model_and_inputs() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The model (on meta) and its example inputs, as ``autotp plan examples.train_gpt:model_and_inputs`` takes them."""
    model, inputs, _ = build("meta")
    return model, inputs


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # logits (B, T, V)


def train(model: torch.nn.Module, inputs: tuple, targets: torch.Tensor, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps; returns the losses and the step times in seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(*inputs), targets)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def train_parallel(mesh, steps: int, hardware: str = "cpu-gloo", plan=None, device: str = "cpu"):
    """Plan (unless given) and train the parallel model on this rank; returns (losses, times, plan)."""
    import autotp

    model, inputs, targets = build(device)
    pmodel = autotp.parallelize(model, mesh, inputs, plan=plan, hardware=hardware)
    losses, times = train(pmodel, inputs, targets, steps)
    return losses, times, pmodel.plan


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hardware", default="cpu-gloo", help="profile name or JSON path (e.g. from autotp profile)")
    parser.add_argument("--plan", default=None, help="a plan JSON saved by autotp plan --json")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" not in os.environ:  # run as a plain script: say how to start the ranks
        sys.exit("start the ranks with torchrun: torchrun --nproc-per-node 2 -m examples.train_gpt --steps 5")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan = autotp.load_plan(args.plan) if args.plan else None
    losses, times, plan = train_parallel(mesh, args.steps, args.hardware, plan, device)
    if dist.get_rank() == 0:
        print(plan.report())
        for i, (loss, t) in enumerate(zip(losses, times)):
            print(f"step {i}: loss {loss:.5f}  {t * 1e3:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
