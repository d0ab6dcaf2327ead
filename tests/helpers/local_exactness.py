"""Local execution is exact: every strategy of an op, run on each rank's pieces alone and put back
together, gives what the op gives on the full inputs (the check of tests/planning/test_strategies.py).

The reference is the op itself on full tensors. Each rank's pieces run through the op's local
executions (its family's ``LOCAL``), with :class:`autotp.local.site.EagerEmitter` making each call at
once, as the rewrite would emit it.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp.local.site import EagerEmitter, LocalSite, run_locally
from autotp.placement import R, Strategy
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.rules import local_executions
from autotp.planning.rules.inner import inner_collectives


def capture_graph(model: nn.Module, inputs: tuple) -> autotp.OpGraph:
    return autotp.capture(model, inputs)


def nodes_of(graph: autotp.OpGraph, target: str) -> list:
    found = [n for n in graph.ops() if n.target == target]
    assert found, f"no {target} in {[n.target for n in graph.ops()]}"
    return found


def strategy_texts(graph, node, mesh) -> list[str]:
    return [str(s) for s in node_strategies(graph, node, mesh)]


def strategy_tensors(node, strategy: Strategy):
    """(placements, TensorInfo) of every input and of the output of one strategy."""
    return list(zip(strategy.inputs, node.input_infos)) + [(strategy.output, o) for o in node.outputs]


def full_values(graph: autotp.OpGraph, inputs: tuple) -> dict[str, object]:
    """The value of every node of the exported graph on real inputs (a reference run)."""
    ep = graph.exported
    user = iter(inputs)
    flat = []
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER"):
            flat.append(ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target])
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            flat.append(ep.constants[spec.target])
        else:
            flat.append(next(user))
    interp = torch.fx.Interpreter(ep.graph_module, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*flat)
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {n.name: torch.utils._pytree.tree_map(detach, v) for n, v in interp.env.items()}


def _summands(t: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n random tensors that add up to ``t`` (a partial-sum placement)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-5, 5, t.shape, generator=gen).to(t.dtype) for _ in range(n - 1)]
    return parts + [t - sum(parts)]


def _local(full: torch.Tensor, placements, coord, mesh, seed: int) -> torch.Tensor:
    """Rank ``coord``'s piece of ``full``: axes applied in order (as DTensor does)."""
    out = full
    for a, (p, c, n) in enumerate(zip(placements, coord, mesh)):
        if p.is_blocked:
            out = out.unflatten(p.dim, (p.blocks, -1)).chunk(n, dim=p.dim + 1)[c].flatten(p.dim, p.dim + 1)
        elif p.is_shard:
            out = out.chunk(n, dim=p.dim)[c]
        elif p.is_partial:
            gen = torch.Generator().manual_seed(seed * 31 + a)
            out = _summands(out, n, gen)[c]
    return out.contiguous()


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype.is_floating_point or a.dtype.is_complex:
        scale = 1.0 + float(b.abs().max()) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), what


def _assemble(pieces: dict[tuple, torch.Tensor], placements, mesh, what: str) -> torch.Tensor:
    """Put rank outputs back together, innermost axis first (the inverse of ``_local``)."""
    current = dict(pieces)
    for a in reversed(range(len(mesh))):
        merged: dict[tuple, torch.Tensor] = {}
        rest = sorted({k[:a] + k[a + 1:] for k in current})
        for key in rest:
            group = [current[key[:a] + (c,) + key[a:]] for c in range(mesh[a])]
            p = placements[a]
            if p.is_blocked:  # each rank holds its piece of every block: put each block together
                blocks = [g.unflatten(p.dim, (p.blocks, -1)) for g in group]
                merged[key] = torch.cat(blocks, dim=p.dim + 1).flatten(p.dim, p.dim + 1)
            elif p.is_shard:
                merged[key] = torch.cat(group, dim=p.dim)
            elif p.is_partial:
                merged[key] = sum(group[1:], group[0])
            else:
                for c, g in enumerate(group[1:], 1):
                    _close(g, group[0], f"{what}: replicated output differs on axis {a} between coordinate 0 and {c}")
                merged[key] = group[0]
        current = merged
    (result,) = current.values()
    return result


def _run_local(graph, fx_node: torch.fx.Node, op, strategy: Strategy, values: dict, mesh, coord, seed: int):
    """Run the op on this rank's pieces, through its local executions as the rewrite runs them."""
    position = iter(range(len(op.inputs)))  # OpNode.inputs: one entry per tensor argument, in argument order
    alias = graph.alias_placeholders  # a tied parameter's second placeholder reads the first

    def mapped(a):
        if isinstance(a, torch.fx.Node):
            name = alias.get(a.name, a.name)
            if name not in graph:  # not a tensor (a symbolic size): passed as it is
                return values[a.name]
            k = next(position)
            assert op.inputs[k] == name, (op.name, k, op.inputs, a.name)
            q = strategy.inputs[k]
            full = values[a.name]
            return full if q is None else _local(full, q, coord, mesh, seed * 7 + k)
        return a

    args = tuple(torch.fx.node.map_aggregate(fx_node.args, mapped))
    kwargs = dict(torch.fx.node.map_aggregate(fx_node.kwargs, mapped))
    # as the rewrite runs it: the op's local executions (its family's), each call made at once
    reads = tuple(q if q is not None else (R,) * len(mesh) for q in strategy.inputs)
    site = LocalSite(node=op, strategy=strategy, reads=reads, mesh_shape=tuple(mesh), coordinate=tuple(coord),
                     groups=(None,) * len(mesh), axis_names=tuple(f"axis{a}" for a in range(len(mesh))),
                     target=fx_node.target, args=args, kwargs=kwargs, seed=seed,
                     emitter=EagerEmitter(tuple(mesh), tuple(coord)))
    with torch.no_grad():
        return run_locally(site, local_executions(op.target))


def check_strategy(graph, fx_node, op, strategy: Strategy, values: dict, mesh: tuple, seed: int = 0) -> None:
    what = f"{op.name} ({op.target}) {strategy} on mesh {mesh}"
    expected = values[op.name]
    coords = list(itertools.product(*(range(n) for n in mesh)))
    outs = {c: _run_local(graph, fx_node, op, strategy, values, mesh, c, seed) for c in coords}
    if isinstance(expected, torch.Tensor):
        _close(_assemble(outs, strategy.output, mesh, what), expected, what)
    else:  # several outputs (split / chunk): each one carries the output placement
        for i, e in enumerate(expected):
            _close(_assemble({c: o[i] for c, o in outs.items()}, strategy.output, mesh, f"{what}[{i}]"), e,
                   f"{what}[{i}]")


def partial_bool(op, strategy: Strategy) -> bool:
    return any(pl is not None and info.dtype == "bool" and any(p.is_partial for p in pl)
               for pl, info in strategy_tensors(op, strategy))


def check_every_strategy(graph, values: dict, mesh: tuple, targets=None) -> int:
    """Check every strategy of every op node (or of the ops in ``targets``); returns how many."""
    fx_nodes = {n.name: n for n in graph.exported.graph.nodes}
    checked = 0
    for op in graph.ops():
        if op.target == "getitem" or (targets is not None and op.target not in targets):
            continue
        if op.name not in values or not isinstance(values[op.name], (torch.Tensor, list, tuple)):
            continue
        for k, strategy in enumerate(node_strategies(graph, op, mesh)):
            if partial_bool(op, strategy):
                continue  # a partial sum of booleans has no meaning; see test_no_partial_bool
            if inner_collectives(op, strategy, mesh):
                continue  # the op communicates inside itself: checked on ranks (tests/runtime/test_batch_norm.py)
            check_strategy(graph, fx_nodes[op.name], op, strategy, values, mesh, seed=k)
            checked += 1
    return checked


class Ops(nn.Module):
    """embedding, add, layer_norm, linear, view, transpose, sdpa, reshape, sum, mean, softmax, matmul, bmm, cat."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.ln = nn.LayerNorm(64)
        self.lin = nn.Linear(64, 128)
        self.out = nn.Linear(128, 64, bias=False)

    def forward(self, ids, x):  # ids (4, 8) int64, x (4, 8, 64)
        e = self.emb(ids) + x  # (4, 8, 64)
        h = self.lin(self.ln(e))  # (4, 8, 128)
        q = h.view(4, 8, 4, 32).transpose(1, 2)  # (4, 4, 8, 32)
        k = (h * 0.5).view(4, 8, 4, 32).transpose(1, 2)
        v = torch.tanh(h).view(4, 8, 4, 32).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (4, 4, 8, 32)
        y = y.transpose(1, 2).reshape(4, 8, 128)  # (4, 8, 128)
        z = self.out(y)  # (4, 8, 64)
        a = torch.softmax(z @ z.transpose(1, 2), dim=-1)  # (4, 8, 8)
        b = torch.cat([torch.bmm(a, z), z], dim=-1)  # (4, 8, 128)
        return z.sum(-1), z.mean(dim=(0, 1)), z.sum(), a.sum(dim=1, keepdim=True), b


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x):  # (2, 4, 8, 32)
        h = self.proj(x)
        return F.scaled_dot_product_attention(h, h, h)  # q = k = v
