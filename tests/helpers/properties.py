"""Random small models (stacks of MLP and attention blocks) as cases, and the check that a case's
parallel module is exact against one process (tests/test_properties.py draws the cases).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.planning.planner import plan_graph
from autotp.runtime.module import build_parallel_module
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog, assert_as_planned


@dataclass(frozen=True)
class Case:
    blocks: tuple[str, ...]  # "mlp", "attention", "layer_norm", "rms_norm"
    dim: int
    heads: int
    head_dim: int
    batch: int
    seq: int
    mesh: tuple[int, ...]
    mode: str
    slack: float  # the budget is the least any plan needs times (1 + slack)
    seed: int


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, heads * head_dim)
        self.v_proj = nn.Linear(dim, heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x):  # (B, T, dim)
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, 4 * dim)
        self.down_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(x)))


def build(case: Case) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(case.seed)
    make = {"mlp": lambda: MLP(case.dim), "attention": lambda: Attention(case.dim, case.heads, case.head_dim),
            "layer_norm": lambda: nn.LayerNorm(case.dim), "rms_norm": lambda: nn.RMSNorm(case.dim)}
    model = nn.Sequential(*(make[kind]() for kind in case.blocks))
    for p in model.parameters():  # norms start at 1 and 0: give every parameter a gradient worth checking
        nn.init.normal_(p, std=0.3)
    x = torch.randn(case.batch, case.seq, case.dim)  # (B, T, dim)
    return model, (x,)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _rank(rank, world, case, graph, plan, models):
    model, (x,) = models[rank]
    ref, _ = models[world]  # the single-process reference, shared read-only
    mesh = _mesh(case.mesh)
    pm = build_parallel_module(graph, plan, mesh, model)
    train = case.mode == "train"
    with torch.set_grad_enabled(train), CollectiveLog(mesh) as fwd:
        out = pm(x)
    assert_as_planned(fwd, plan, "forward")
    with torch.set_grad_enabled(train):
        want = ref(x)
    scale = max(want.abs().max().item(), 1e-6)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5 * scale)
    if not train:
        return {}
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(case.seed))
    with CollectiveLog(mesh) as bwd:
        (out - target).pow(2).mean().backward()
    assert_as_planned(bwd, plan, "backward")
    from autotp.weights.checkpoint import full_tensor
    from autotp.runtime.shards import placements_of

    # autotp's gather: DTensor's full_tensor() sizes an uneven split of whole heads by elements
    return {name: full_tensor(p.grad, placements_of(p)).detach() for name, p in pm.named_parameters()}


def _gradients(model: nn.Module, inputs: tuple, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``(model(x) - target).pow(2).mean()``, in the model's dtype."""
    out = model(*inputs)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    (out - target).pow(2).mean().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check(case: Case, plan: Any = None) -> str:
    """Plan ``case``'s model on its mesh near its memory floor, run it on threads, compare; says
    whether the plan shards (for Hypothesis' statistics).

    In train mode a float32 gradient off by more than float32's rounding allows is checked again in
    float64 (:func:`_exact_in_float64`): an ill-conditioned draw (gradients in the hundreds from a
    random init) can lift the rounding of sums in another order past any fixed share of one
    process's own error, where a wrong plan is off in float64 too. ``plan``: the plan of ``case``
    made already (planning near the floor is most of a check's time)."""
    try:
        return _check(case, plan)
    except _Float32Mismatch as mismatch:
        _exact_in_float64(case, mismatch)
        return "parameters sharded: float32 rounding past the tolerance, exact in float64"


class _Float32Mismatch(AssertionError):
    """A float32 gradient of the parallel module outside the tolerance of one process's, under ``plan``."""

    def __init__(self, message: str, plan: Any) -> None:
        super().__init__(message)
        self.plan = plan


def _exact_in_float64(case: Case, mismatch: "_Float32Mismatch") -> None:
    """The same model in float64, its weights stored where the float32 plan put them: every rank's
    gradients equal one process's in float64 to 1e-9 of the largest, or the float32 mismatch stands."""
    model, inputs = build(case)
    model, inputs = model.double(), tuple(x.double() for x in inputs)
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, case.mesh, "cpu-gloo", case.mode, keep=dict(mismatch.plan.parameter_placements))
    world = 1
    for n in case.mesh:
        world *= n
    models = [copy.deepcopy((model, inputs)) for _ in range(world)] + [(model, inputs)]
    grads = run_threads(_rank, world, case, graph, plan, models)
    one = _gradients(model, inputs, case.seed)
    gmax = max(g.abs().max().item() for g in one.values())
    for name, want in one.items():
        for rank, g in enumerate(grads):
            if not torch.allclose(g[name], want, rtol=1e-9, atol=1e-9 * gmax):
                raise AssertionError(f"{mismatch}\nand in float64, rank {rank}'s gradient of {name} is off by "
                                     f"{(g[name] - want).abs().max().item():.3e} (largest gradient {gmax:.3e})")


def plan_near_the_floor(case: Case, graph: Any) -> Any:
    """The plan of ``case``'s graph under the least budget any plan needs times ``1 + case.slack``."""
    try:
        plan_graph(graph, case.mesh, "cpu-gloo", case.mode, memory_budget=1)
        raise AssertionError("a budget of one byte was met")
    except autotp.MemoryBudgetError as err:
        budget = err.minimum_bytes * (1 + case.slack)
    return plan_graph(graph, case.mesh, "cpu-gloo", case.mode, memory_budget=budget)


def _check(case: Case, plan: Any = None) -> str:
    model, inputs = build(case)
    graph = autotp.capture(model, inputs)
    plan = plan if plan is not None else plan_near_the_floor(case, graph)
    sharded = any("S" in p for p in plan.parameter_placements.values())
    world = 1
    for n in case.mesh:
        world *= n
    models = [copy.deepcopy((model, inputs)) for _ in range(world)] + [(model, inputs)]
    grads = run_threads(_rank, world, case, graph, plan, models)
    if case.mode == "train":
        exact = _gradients(copy.deepcopy(model).double(), tuple(x.double() for x in inputs), case.seed)
        one = _gradients(model, inputs, case.seed)
        gmax = max(g.abs().max().item() for g in one.values())
        # float32 sums in another order differ by rounding, which cancellation between large terms can
        # lift well above 1e-5 of the largest gradient; allow what one process's float32 result itself
        # is off from float64 by, four times over (a wrong plan is off by far more)
        rounding = max((one[n].double() - exact[n]).abs().max().item() for n in one)
        for name, want in one.items():
            for rank, g in enumerate(grads):
                try:
                    torch.testing.assert_close(g[name], want, rtol=1e-4, atol=max(1e-5 * gmax, 4 * rounding),
                                               msg=lambda m, name=name, rank=rank: f"rank {rank}, gradient of {name}: {m}")
                except AssertionError as err:
                    raise _Float32Mismatch(str(err), plan) from None
    return f"parameters sharded: {sharded}; collectives: {'some' if plan.collectives() else 'none'}"
