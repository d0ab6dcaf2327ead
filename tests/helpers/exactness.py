"""One training step of a parallel module on threaded ranks, compared with the model in one process."""

from __future__ import annotations

import torch

from examples.ranks import run_threads


def _step(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    out = pm(x)
    out.pow(2).sum().backward()
    from autotp.weights.checkpoint import full_tensor
    from autotp.runtime.shards import placements_of

    local = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for n, p in pm.named_parameters()}
    return out.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}, local


def assert_step_matches_one_process(graph, plan, model, x, world: int = 2) -> list[dict[str, tuple[int, ...]]]:
    """Output and every gradient of ``sum(model(x)**2)`` on ``world`` ranks equal one process's.
    Returns each rank's local shape of every parameter (the model's gradients are left as one
    process's backward made them)."""
    ref = model(x)
    ref.pow(2).sum().backward()
    shapes = []
    for out, grads, local in run_threads(_step, world, graph, plan, model, x):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=name)
        shapes.append(local)
    return shapes
