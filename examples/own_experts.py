"""Mixture-of-Experts layers written by hand, the ways research code writes them, and their experts on ranks.

Each layer routes every token to its top ``k`` of ``E`` experts (a softmax router, the top-k weights
renormalized) and sums the experts' outputs weighted by the router:

- :class:`ListExperts`: the experts an ``nn.ModuleList`` of small MLPs, every expert run on every
  token, the outputs weighted by a dense ``(tokens, E)`` gate the top-k weights are scattered into;
- :class:`DenseExperts`: one batched parameter per projection, ``w1 (E, d, f)``, ``w2 (E, f, d)``, run
  with ``torch.einsum`` on every token and weighted by the same dense gate;
- :class:`CapacityExperts`: the same parameters, the tokens dispatched into ``C`` slots per expert by
  one-hot masks (GShard, Switch), ``torch.bmm`` per expert, combined back by the masks;
- :class:`GroupedExperts`: the same parameters (in bfloat16: ``torch._grouped_mm`` traces in no other
  dtype), the routed rows sorted by expert and run by ``torch._grouped_mm`` with the experts' offsets,
  as Hugging Face's ``grouped_mm`` experts do, optionally with a bias per expert;
- :class:`LoopExperts`: a loop over the experts, each on the tokens routed to it (``nonzero``): sizes
  that depend on the routing, which autotp refuses at capture naming the op.

``moe_lm(layer)`` wraps one in a small language model (embedding, norm, the layer as a residual
branch, the head); ``own_moe(form)`` builds a seeded tiny one with its example input.

The three forms with a batched parameter place whole experts on ranks: pin the parameters ``S(0)``
(or let the planner, where it prices that cheaper); each rank computes its own experts and one
all-reduce sums them. The list of modules has no expert dim to split: each expert is split as any
MLP (by features) or kept whole (docs/training.md, "Experts of your own").

    python -m examples.own_experts
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Router", "ListExperts", "DenseExperts", "CapacityExperts", "GroupedExperts", "LoopExperts",
           "MoELM", "FORMS", "own_moe", "batched_expert_weights"]


class Router(nn.Module):
    """Each token's top ``k`` experts and their weights (softmax, renormalized over the ``k``)."""

    def __init__(self, dim: int, experts: int, k: int):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.k = k

    def forward(self, x):  # (N, dim) -> (N, k) weights, (N, k) expert ids
        weights, ids = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids


def dense_gate(weights, ids, experts: int):
    """The routing as a ``(N, E)`` gate: each token's top-k weights at its experts, zero elsewhere."""
    return torch.zeros(ids.shape[0], experts, dtype=weights.dtype, device=weights.device).scatter(1, ids, weights)


class ExpertMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class ListExperts(nn.Module):
    """(a) ``nn.ModuleList`` of MLPs, every expert on every token, weighted by the dense gate."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int):
        super().__init__()
        self.router = Router(dim, experts, k)
        self.experts = nn.ModuleList(ExpertMLP(dim, hidden) for _ in range(experts))

    def forward(self, x):  # (N, dim)
        gate = dense_gate(*self.router(x), len(self.experts))
        out = torch.stack([expert(x) for expert in self.experts], dim=1)  # (N, E, dim)
        return (gate.unsqueeze(-1) * out).sum(1)


class Batched(nn.Module):
    """A router and one batched parameter per projection: ``w1 (E, dim, hidden)``, ``w2 (E, hidden, dim)``."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.router = Router(dim, experts, k)
        self.k = k
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden, dtype=dtype) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim, dtype=dtype) / hidden ** 0.5)


class DenseExperts(Batched):
    """(b) Every token through every expert with ``einsum``, weighted by the dense gate."""

    def forward(self, x):  # (N, dim)
        gate = dense_gate(*self.router(x), self.w1.shape[0])
        h = F.silu(torch.einsum("nd,edf->enf", x, self.w1))
        y = torch.einsum("enf,efd->end", h, self.w2)
        return torch.einsum("ne,end->nd", gate, y)


class CapacityExperts(Batched):
    """(b) GShard / Switch dispatch: each expert takes at most ``capacity`` routed rows (default
    ``N * k / E``; rows past it are dropped), put in its slots by one-hot masks, run with ``bmm``."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int, capacity: int | None = None):
        super().__init__(dim, hidden, experts, k)
        self.capacity = capacity

    def forward(self, x):  # (N, dim)
        n, experts = x.shape[0], self.w1.shape[0]
        slots = self.capacity or n * self.k // experts
        weights, ids = self.router(x)
        mask = F.one_hot(ids, experts).to(x.dtype)  # (N, k, E)
        position = (mask.reshape(n * self.k, experts).cumsum(0).reshape(n, self.k, experts) - 1) * mask
        kept = mask * (position < slots).to(x.dtype)
        place = F.one_hot(position.long().clamp(max=slots - 1), slots).to(x.dtype) * kept.unsqueeze(-1)
        dispatch = place.sum(1)  # (N, E, C)
        combine = (place * weights[..., None, None]).sum(1)
        h = F.silu(torch.bmm(torch.einsum("nec,nd->ecd", dispatch, x), self.w1))
        return torch.einsum("nec,ecd->nd", combine, torch.bmm(h, self.w2))


class GroupedExperts(Batched):
    """(c) The routed rows sorted by expert, ``torch._grouped_mm`` over the experts' offsets; the
    weights (and the optional per-expert bias ``b1 (E, hidden)``) in bfloat16, the rows cast to it.
    ``combine``: how the weighted rows go back to their tokens, ``"index_add"`` (added at each row's
    token) or ``"sum"`` (as Hugging Face: put back in token order, viewed ``(N, k, dim)``, summed
    over ``k``)."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int, bias: bool = False, combine: str = "index_add"):
        super().__init__(dim, hidden, experts, k, dtype=torch.bfloat16)
        if combine not in ("index_add", "sum"):
            raise ValueError(f"GroupedExperts: combine {combine!r} is not 'index_add' or 'sum'")
        self.combine = combine
        self.b1 = nn.Parameter(0.2 * torch.randn(experts, hidden, dtype=torch.bfloat16)) if bias else None

    def forward(self, x):  # (N, dim)
        experts = self.w1.shape[0]
        weights, ids = self.router(x)
        expert_ids, order = ids.flatten().sort()
        counts = torch.histc(expert_ids.float(), bins=experts, min=0, max=experts - 1)
        offsets = counts.cumsum(0).to(torch.int32)
        token = order // self.k
        h = torch._grouped_mm(x[token].to(self.w1.dtype), self.w1, offs=offsets)
        if self.b1 is not None:
            h = h + self.b1[expert_ids]
        y = torch._grouped_mm(F.silu(h), self.w2, offs=offsets).to(x.dtype) * weights.flatten()[order, None]
        if self.combine == "index_add":
            return torch.zeros_like(x).index_add(0, token, y)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        return y[inverse].view(x.shape[0], self.k, x.shape[1]).sum(1)


class LoopExperts(ListExperts):
    """(d) Each expert on the tokens routed to it, found with ``nonzero``: sizes that depend on the routing."""

    def forward(self, x):  # (N, dim)
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class MoELM(nn.Module):
    """Embedding, layer norm, the MoE layer as a residual branch, the head: ``(B, T)`` ids -> logits."""

    def __init__(self, moe: nn.Module, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.moe = moe
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        x = self.norm(h)
        return self.head(h + self.moe(x.reshape(-1, x.shape[-1])).reshape(x.shape))


FORMS = {"list": ListExperts, "dense": DenseExperts, "capacity": CapacityExperts, "grouped": GroupedExperts,
         "loop": LoopExperts}


def own_moe(form: str, *, vocab: int = 64, dim: int = 32, hidden: int = 32, experts: int = 4, k: int = 2,
            batch: int = 2, seq: int = 12, device="cpu", seed: int = 0, **options):
    """``(model, (ids,))``: a seeded :class:`MoELM` around the layer ``FORMS[form]``; on ``"meta"``,
    weights with no memory (for planning at real widths)."""
    if form not in FORMS:
        raise ValueError(f"own_moe: form {form!r} is not one of {sorted(FORMS)}")
    with torch.device(device):
        torch.manual_seed(seed)
        model = MoELM(FORMS[form](dim, hidden, experts, k, **options), vocab, dim)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return model, (ids,)


def batched_expert_weights(model: nn.Module) -> list[str]:
    """The parameters with an expert dim: 3-d (experts x features x features), and the per-expert
    tables (experts x features) of the modules that hold them."""
    holders = [m for m in model.modules() if any(p.ndim == 3 for p in m.parameters(recurse=False))]
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for m in holders for p in m.parameters(recurse=False) if p.ndim >= 2]


def _compare(rank, world, graph, plan, model, ids):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return build_parallel_module(graph, plan, mesh, model)(ids).detach()


def main() -> None:
    import autotp
    from autotp.planning.planner import plan_graph
    from examples.ranks import run_threads

    for form in ("dense", "capacity", "grouped"):
        model, (ids,) = own_moe(form)
        graph = autotp.capture(model, (ids,))
        pin = {name: "S(0)" for name in batched_expert_weights(model)}
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)
        reference = model(ids).detach()
        outputs = run_threads(_compare, 2, graph, plan, model, ids)
        worst = max((out - reference).abs().max().item() for out in outputs)
        print(f"{form}: experts {pin} on 2 ranks, {len(plan.collectives())} collectives a step; "
              f"largest difference from one process {worst:.2e}")
    try:
        autotp.capture(*own_moe("loop"))
    except autotp.CaptureError as err:
        print(f"loop: refused at capture: {str(err).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
