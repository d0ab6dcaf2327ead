"""Local execution is exact: every strategy of an op, run on each rank's pieces alone and put back
together, gives what the op gives on the full inputs (the check of tests/planning/test_strategies.py).

The reference is the op itself on full tensors; nothing of autotp's runtime runs the pieces.
"""

from __future__ import annotations

import itertools
import math
import sys

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp import ops
from autotp.placement import Strategy, local_shape
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.rules.convolutions import GROUPED, local_groups
from autotp.planning.rules.inner import inner_collectives

aten = torch.ops.aten


_SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


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
    """Run the op on this rank's pieces; shape arguments rewritten to local shapes."""
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

    args = list(torch.fx.node.map_aggregate(fx_node.args, mapped))
    kwargs = dict(torch.fx.node.map_aggregate(fx_node.kwargs, mapped))
    target = fx_node.target
    q0 = strategy.inputs[0] if strategy.inputs else None
    blocked = [(mesh[a], p) for a, p in enumerate(q0 or ()) if p.is_blocked]
    ndim = op.input_infos[0].ndim if op.input_infos else 0
    if blocked and target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        (n, p), = blocked  # a cut of a fused output into its blocks: local sizes are 1/n of each block
        if (args[2] if len(args) > 2 else 0) % ndim == p.dim and target is not aten.chunk.default:
            args[1] = args[1] // n if target is aten.split.Tensor else [x // n for x in args[1]]
    elif blocked and target is aten.slice.Tensor and args[1] % ndim == blocked[0][1].dim:
        (n, p), = blocked
        size = op.input_infos[0].shape[p.dim]
        args = [args[0], p.dim, (args[2] or 0) // n, min(args[3], size) // n, 1]
    elif target in _SHAPE_ARG_OPS:
        args[1] = list(local_shape(op.output.shape, strategy.output, mesh))
    elif target is aten.repeat.default:  # a dim split from a whole input: this rank's copies
        lead = len(args[1]) - op.input_infos[0].ndim
        q = strategy.inputs[0]
        args[1] = [r if d >= lead and any(p.is_shard and p.dim == d - lead for p in q)
                   else r // math.prod(n for p, n in zip(strategy.output, mesh) if p.is_shard and p.dim == d)
                   for d, r in enumerate(args[1])]
    elif target is aten.unflatten.int:  # the new dims' sizes: this rank's piece of each
        d, k = args[1] % op.input_infos[0].ndim, len(args[2])
        args[2] = list(local_shape(op.output.shape, strategy.output, mesh))[d:d + k]
    elif str(target) in ops.UNIFORM_FACTORY:  # each rank makes its piece
        args[ops.UNIFORM_FACTORY[str(target)]] = list(local_shape(op.output.shape, strategy.output, mesh))
    elif target is aten.slice.Tensor:
        dim = args[1] if len(args) > 1 else 0
        dim = dim + op.input_infos[0].ndim if dim < 0 else dim
        q = strategy.inputs[0]
        if any(p.is_shard and p.dim == dim for p in q):  # a full-range or x[r::step] slice may keep the dim split
            step = args[4] if len(args) > 4 else 1
            start = (args[2] or 0) if step != 1 and len(args) > 2 else 0
            args = [args[0], dim, start, sys.maxsize, step]
    elif str(target) in GROUPED and local_groups(op, strategy.inputs[0], mesh) is not None:
        name = "groups" if "groups" in op.args else "num_groups"  # whole groups per rank: its share of them
        at = [a.name for a in target._schema.arguments].index(name)
        if at < len(args):
            args[at] = local_groups(op, strategy.inputs[0], mesh)
        else:
            kwargs[name] = local_groups(op, strategy.inputs[0], mesh)
    elif target is aten.embedding.default:
        w = strategy.inputs[0]
        row_axes = [a for a, p in enumerate(w) if p.is_shard and p.dim == 0]
        if row_axes:  # row-split table: look up own rows, zeros for the others (a partial sum)
            (a,) = row_axes
            rows = op.input_infos[0].shape[0] // mesh[a]
            weight, idx = args[0], args[1]
            local = idx - coord[a] * rows
            outside = (local < 0) | (local >= rows)
            out = aten.embedding.default(weight, local.masked_fill(outside, 0), *args[2:])
            return out.masked_fill(outside.unsqueeze(-1), 0)
    with torch.no_grad():
        out = target(*args, **kwargs)
    if str(target) in ("aten.mean.dim", "aten.mean.default") and any(p.is_partial for p in strategy.output):
        x = op.input_infos[0]
        dims = set(op.args.ints("dim", x.ndim) or range(x.ndim)) if "dim" in op.args else set(range(x.ndim))
        q = strategy.inputs[0]
        out = out / math.prod(n for p, n in zip(q, mesh) if p.is_shard and p.dim in dims)  # local means sum to it
    return out


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
