"""Give autotp a rule for an op it does not know, check it, and run the model split on 2 ranks.

A model calls a custom op (here ``demo::expert_mm``, one matmul per expert, as MoE code calls a
grouped matmul). autotp has no rule for it, so by default it runs replicated, with a warning
naming it. ``autotp.register_rule`` says how it may be split on one mesh axis; ``autotp.check_rule``
runs every resulting strategy on random pieces and compares with the op on whole tensors, so a
wrong rule fails here and not as wrong numbers later.

Some ops cannot run on their pieces as they are. ``demo::expert_sum`` sends each token through the
experts a router picked for it, by expert id: with the experts split, a rank holds experts
``[start, stop)`` and must shift the ids by ``start`` (an id outside its experts then adds
nothing). ``register_rule(op, rule, local=...)`` says so in the same registration: ``local(site)``
returns what a rank runs in place of the op, from the strategy chosen and the rank's piece of each
split dim; each rank sums its own experts and the output is a partial sum.

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


@torch.library.custom_op("demo::expert_sum", mutates_args=())
def expert_sum(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Each token through the experts it is routed to, weighted and summed: x (T, D), w (E, D, F),
    experts (T, K) expert ids, gates (T, K) -> (T, F). An id outside ``[0, E)`` adds nothing."""
    valid = (experts >= 0) & (experts < w.shape[0])
    picked = w[experts.clamp(0, w.shape[0] - 1)]  # (T, K, D, F)
    return torch.einsum("td,tkdf,tk->tf", x, picked, gates * valid)


@expert_sum.register_fake
def _(x, w, experts, gates):
    return x.new_empty(x.shape[0], w.shape[2])


def _expert_sum_backward(ctx, grad):  # grad (T, F)
    x, w, experts, gates = ctx.saved_tensors
    valid = (experts >= 0) & (experts < w.shape[0])
    ids = experts.clamp(0, w.shape[0] - 1)
    picked, g = w[ids], gates * valid  # (T, K, D, F), (T, K)
    dw = torch.zeros_like(w).index_add_(0, ids.reshape(-1),
                                        torch.einsum("td,tf,tk->tkdf", x, grad, g).reshape(-1, *w.shape[1:]))
    return (torch.einsum("tf,tkdf,tk->td", grad, picked, g), dw, None,
            torch.einsum("td,tkdf,tf->tk", x, picked, grad) * valid)


expert_sum.register_autograd(_expert_sum_backward,
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))

# x whole, the experts split, ids and gates whole: each rank's sum over its experts is a partial sum;
# or the tokens split, each rank routing its own
EXPERT_SUM_RULE = [((R, S(0), R, R), P), ((S(0), R, S(0), S(0)), S(0))]


def expert_sum_local(site):
    """What a rank runs in place of ``expert_sum``: with the experts (dim 0 of the weights, input 1)
    split, the op on ids shifted to this rank's experts; else the op as it is (None)."""
    start, stop = site.piece(1, 0)
    if (start, stop) == (0, site.node.input_infos[1].shape[0]):
        return None

    def own_experts(x, w, experts, gates):
        return expert_sum(x, w, experts - start, gates)

    return own_experts


class Routed(nn.Module):
    """A mixture of experts: each token to its top 2 of 4 experts, weighted by the router."""

    def __init__(self, experts: int = 4, dim: int = 32, top: int = 2) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(dim, experts, generator=gen) / dim**0.5)
        self.w = nn.Parameter(torch.randn(experts, dim, dim, generator=gen) / dim**0.5)
        self.top = top

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        gates, experts = (flat @ self.router).softmax(-1).topk(self.top, dim=-1)  # (B*T, top) each
        return expert_sum(flat, self.w, experts, gates).reshape(b, t, d) + x


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


def _largest_difference(model, graph, plan, x) -> float:
    outs = run_threads(_rank, 2, graph, plan, model, x)
    return max((o - model(x)).abs().max().item() for o in outs)


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
    diff = _largest_difference(model, graph, plan, x)
    print(f"largest difference from one process on 2 ranks: {diff:.2e}")
    assert diff < 1e-5

    # an op that runs its own code on a rank's pieces: the rule and its local execution, one registration
    autotp.register_rule(torch.ops.demo.expert_sum.default, EXPERT_SUM_RULE, local=expert_sum_local)
    example = (torch.randn(6, 8), torch.randn(4, 8, 5), torch.randint(0, 4, (6, 2)), torch.rand(6, 2))
    checked = autotp.check_rule(torch.ops.demo.expert_sum.default, example)
    print("expert_sum exact on local pieces:", ", ".join(map(str, checked)))
    model, x = Routed(), torch.randn(2, 8, 32)
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "inference", pin={"w": "S(0)"})  # the experts split
    print("expert_sum split as", next(plan.strategy(n.name) for n in graph.ops() if n.target == "demo.expert_sum.default"))
    diff = _largest_difference(model, graph, plan, x)
    print(f"expert_sum: largest difference from one process on 2 ranks: {diff:.2e}")
    assert diff < 1e-5


if __name__ == "__main__":
    main()
