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

    return out.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}


def assert_step_matches_one_process(graph, plan, model, x, world: int = 2) -> None:
    """Output and every gradient of ``sum(model(x)**2)`` on ``world`` ranks equal one process's."""
    ref = model(x)
    ref.pow(2).sum().backward()
    for out, grads in run_threads(_step, world, graph, plan, model, x):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())
