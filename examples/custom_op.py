"""Give autotp a rule for an op it does not know, check it, and run the model split on 2 ranks.

A model calls a custom op (here ``demo::expert_mm``, one matmul per expert, as MoE code calls a
grouped matmul). autotp has no rule for it, so by default it runs replicated, with a warning
naming it. ``autotp.register_rule`` says how it may be split on one mesh axis; ``autotp.check_rule``
runs every resulting strategy on random pieces and compares with the op on whole tensors, so a
wrong rule fails here and not as wrong numbers later.

    python -m examples.custom_op
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.placement import P, R, S
from examples.ranks import run_threads


@torch.library.custom_op("demo::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(E, T, D) @ (E, D, F) -> (E, T, F)."""
    return torch.bmm(x, w)


@expert_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return expert_mm(grad, w.transpose(1, 2)), expert_mm(x.transpose(1, 2), grad)


expert_mm.register_autograd(_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class Experts(nn.Module):
    def __init__(self, experts: int = 4, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden, generator=gen) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim, generator=gen) / hidden**0.5)

    def forward(self, x):  # (B, T, D): every token through every expert, summed
        b, t, d = x.shape
        xe = x.reshape(1, b * t, d).expand(self.up.shape[0], b * t, d)
        return expert_mm(F.gelu(expert_mm(xe, self.up)), self.down).sum(0).reshape(b, t, d) + x


def _rank(rank, world, graph, plan, model, x):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    pm = build_parallel_module(graph, plan, init_device_mesh("cpu", (world,)), model)
    return pm(x).detach()


def main() -> None:
    # the op on each rank's pieces: split the experts, the output features, or the contraction (a sum)
    autotp.register_rule(torch.ops.demo.expert_mm.default,
                         [((S(0), S(0)), S(0)), ((R, S(2)), S(2)), ((S(2), S(1)), P)])
    checked = autotp.check_rule(torch.ops.demo.expert_mm.default, (torch.randn(4, 6, 8), torch.randn(4, 8, 10)))
    print("exact on local pieces:", ", ".join(map(str, checked)))

    model, x = Experts(), torch.randn(2, 8, 32)
    graph = autotp.capture(model, (x,))
    from autotp.planning.planner import plan_graph

    try:  # a budget under the whole model's bytes, so the plan splits the experts
        plan = plan_graph(graph, (2,), "cpu-gloo", "inference", 1.0)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (2,), "cpu-gloo", "inference", int(err.minimum_bytes * 1.02) + 1)
    print("weights:", dict(plan.parameter_placements))
    outs = run_threads(_rank, 2, graph, plan, model, x)
    diff = max((o - model(x)).abs().max().item() for o in outs)
    print(f"largest difference from one process on 2 ranks: {diff:.2e}")
    assert diff < 1e-5


if __name__ == "__main__":
    main()
