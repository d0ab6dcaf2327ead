"""Strategies: for every node of an OpGraph, the placements it can take on the mesh.

Rules are written for one mesh axis of size ``n`` (``axis_rules``) and combined over the axes of
the mesh (:func:`node_strategies`): a strategy on a 2-axis mesh is one single-axis choice per axis,
kept when every sharded dim splits evenly and no dim is split by two axes.

Every rule here is one whose local execution is exact: running the op on each rank's shards (with
shape arguments rewritten to local shapes, and the masked lookup for a row-split embedding) gives
each rank its shard of the true output. That is what lets the rewrite run local tensors with only
the plan's collectives.

Where to find an op's rules: autotp's own rules first, then DTensor's op-strategy registry
(:mod:`autotp.dtensor_rules`, the one module that reads DTensor internals, filtering the
registry's answer to what is exact on local shards); an op neither knows is run replicated,
with one warning per op kind. Own rules stay for the ops they cover because the registry's
versions of those do not fit a runtime that runs each aten op on local pieces, or miss options:
the row-split embedding is a ``_MaskPartial`` there; ``linear``, ``layer_norm``, ``softmax.int``,
``matmul`` and ``scaled_dot_product_attention`` exist there only as decompositions, slow to trace
(~0.1-0.5 s each) and, for causal attention, not traceable at all (its mask comes from a factory
op); views, ``expand`` and ``new_*`` factories carry shape arguments DTensor rewrites before
running them (autotp's rewrite does the same, from the rules here); a mean passes a pending sum
through here and not there. tests/test_dtensor_rules.py compares the two lists for the ops both
know and pins the difference; every strategy from either source is checked exact on local shards
(tests/test_strategies.py, tests/test_dtensor_rules.py).

>>> import torch, autotp
>>> from autotp.strategies import node_strategies
>>> g = autotp.capture(torch.nn.Linear(4, 8, bias=False), (torch.randn(2, 4),))
>>> [str(s) for s in node_strategies(g, g.ops()[0], (2,))]
['(R, R) -> R', '(R, S(0)) -> S(1)', '(S(1), S(1)) -> P', '(S(0), R) -> S(0)', '(P, R) -> P']
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Callable, Iterable, Mapping, Optional, Sequence

from autotp.graph import BUFFER, CONSTANT, INPUT, PARAMETER, OpGraph, OpNode, TensorInfo
from autotp.placement import P, Placement, R, S, Strategy

log = logging.getLogger(__name__)

# One single-axis choice: input placements (None = any) and the output placement.
AxisChoice = tuple[tuple[Optional[Placement], ...], Placement]

_FACTORY = {
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
    "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default",
    "aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default",
    "aten.rand.default", "aten.randn.default",
}
_UNARY_LINEAR = {  # f(sum of partials) = sum of f(partials)
    "aten.neg.default", "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default", "aten.detach.default",
    "aten.lift_fresh_copy.default", "aten.type_as.default",
}
_POINTWISE = _UNARY_LINEAR | {
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar",
    "aten.div.Scalar", "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.pow.Tensor_Scalar", "aten.pow.Scalar",
    "aten.pow.Tensor_Tensor", "aten.rsqrt.default", "aten.sqrt.default", "aten.exp.default", "aten.log.default",
    "aten.silu.default", "aten.gelu.default", "aten.relu.default", "aten.tanh.default", "aten.sigmoid.default",
    "aten.cos.default", "aten.sin.default", "aten.abs.default", "aten.reciprocal.default", "aten.erf.default",
    "aten.dropout.default", "aten.where.self", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar", "aten.lt.Tensor", "aten.lt.Scalar",
    "aten.le.Tensor", "aten.le.Scalar", "aten.gt.Tensor", "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar",
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.logical_and.default", "aten.logical_or.default", "aten.logical_not.default", "aten.clamp.default",
    "aten.minimum.default", "aten.maximum.default", "aten.square.default", "aten.tanh_backward.default",
    "aten.gelu_backward.default", "aten.bitwise_not.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.full_like.default", "aten.native_dropout.default",
}
_PAIRWISE_ADD = {"aten.add.Tensor", "aten.sub.Tensor"}
_SCALE_BY_OTHER = {"aten.mul.Tensor", "aten.div.Tensor"}  # P * R -> P ; P / R -> P
_SCALAR_SCALE = {"aten.mul.Scalar", "aten.div.Scalar"}


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _divisible(size: int, n: int) -> bool:
    return size % n == 0 and size >= n


# ---------------------------------------------------------------------------------------------
# dim maps for view-like ops: out dim -> input dim (or None for new/broadcast dims)


def _view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> Optional[dict[int, int]]:
    """For a reshape, map an output dim to the input dim whose shard it carries.

    Input and output dims are grouped into runs of equal product; within a run only the first
    non-unit dim of the input can stay sharded, and it maps to the first non-unit dim of the output.
    """
    mapping: dict[int, int] = {}
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        gi, gj = [i], [j]
        if i >= n_in or j >= n_out:
            break
        pi, pj = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= n_in:
                    return None
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                if j >= n_out:
                    return None
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        first_in = next((d for d in gi if in_shape[d] != 1), None)
        first_out = next((d for d in gj if out_shape[d] != 1), None)
        if first_in is not None and first_out is not None:
            # the sharded input dim must be the outermost of its run, and keep its size or be split
            if out_shape[first_out] % in_shape[first_in] == 0 or in_shape[first_in] % out_shape[first_out] == 0:
                mapping[first_out] = first_in
    return mapping


def _sized(shape: Sequence[int], expressions: Optional[tuple]) -> tuple:
    """Each size with its expression (``OpGraph.symbolic``; None where static)."""
    return tuple(zip(shape, expressions[0] if expressions else (None,) * len(shape)))


def _dim_map(node: OpNode, symbolic: Optional[Mapping] = None) -> Optional[dict[int, int]]:
    """out dim -> in dim for single-input view-like ops; None when the op is not view-like.

    ``symbolic`` (``OpGraph.symbolic``): where sizes are dynamic, a slice or expand keeps a dim whole
    only if its size is the same expression on both sides, not merely the same at the example's
    sizes (``pos[:x.size(1)]`` is all of ``pos`` only when the sequence is as long as the table)."""
    t = node.target
    ins, out = node.input_infos[0].shape, node.output.shape
    args = node.args_repr.split(",")
    if t in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unflatten.int",
             "aten.flatten.using_ints", "aten.view_as.default"):
        return _view_groups(ins, out)
    if t == "aten.transpose.int":
        d0, d1 = (_norm(int(a), len(ins)) for a in args[1:3])
        perm = list(range(len(ins)))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return {o: perm[o] for o in range(len(out))}
    if t == "aten.t.default":
        return {0: 1, 1: 0} if len(ins) == 2 else {0: 0}
    if t == "aten.permute.default":
        dims = [int(x) for x in node.args_repr.split("[", 1)[1].split("]")[0].split(",")]
        return {o: _norm(d, len(ins)) for o, d in enumerate(dims)}
    if t == "aten.unsqueeze.default":
        d = _norm(int(args[1]), len(out))
        return {o: (o if o < d else o - 1) for o in range(len(out)) if o != d}
    if t in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
        keep = [d for d in range(len(ins)) if not (ins[d] == 1 and len(ins) != len(out))]
        if len(keep) != len(out):  # squeeze of only some unit dims: fall back to the general reshape map
            return _view_groups(ins, out)
        return {o: d for o, d in enumerate(keep)}
    if symbolic and t in ("aten.expand.default", "aten.slice.Tensor"):  # compare (size, expression) pairs
        ins, out = _sized(ins, symbolic.get(node.inputs[0])), _sized(out, symbolic.get(node.name))
    if t == "aten.expand.default":
        lead = len(out) - len(ins)
        return {o: o - lead for o in range(lead, len(out)) if ins[o - lead] == out[o]}
    if t == "aten.slice.Tensor":
        d = _norm(int(args[1]), len(ins)) if len(args) > 1 else 0
        full = ins[d] == out[d]
        return {o: o for o in range(len(out)) if o != d or full}
    if t == "aten.select.int":
        d = _norm(int(args[1]), len(ins))
        return {o: (o if o < d else o + 1) for o in range(len(out))}
    if t in _UNARY_LINEAR or t == "getitem":
        return {o: o for o in range(len(out))}
    return None


# ---------------------------------------------------------------------------------------------
# single-axis rules


def _placeholder_choices(node: OpNode, n: int) -> list[AxisChoice]:
    if node.role == PARAMETER:
        shape = node.output.shape
        return [((), R)] + [((), S(d)) for d in range(len(shape)) if _divisible(shape[d], n)]
    return [((), R)]  # buffers, constants, user inputs: replicated (R -> S is a free slice on the edge)


def _view_choices(node: OpNode, n: int, dim_map: dict[int, int]) -> list[AxisChoice]:
    out = node.output.shape
    extra = (None,) * (len(node.inputs) - 1)
    choices: list[AxisChoice] = [((R, *extra), R)]
    if node.output.is_float:  # integers and booleans are not summed: no partial masks or indices
        choices.append(((P, *extra), P))
    for o, i in sorted(dim_map.items()):
        if _divisible(out[o], n) and _divisible(node.input_infos[0].shape[i], n):
            choices.append(((S(i), *extra), S(o)))
    if node.target not in _UNARY_LINEAR and node.target not in ("getitem",) and not node.target.startswith(
        ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.transpose", "aten.permute", "aten.unsqueeze",
         "aten.squeeze", "aten.expand", "aten.t.", "aten.slice", "aten.select", "aten.unflatten", "aten.flatten")):
        choices = [c for c in choices if c[1] != P]
    return choices


def _broadcast_in(in_info: TensorInfo, out_info: TensorInfo, out_dim: int) -> Placement:
    """Placement an input of a broadcasting op needs when the output is split along ``out_dim``."""
    lead = out_info.ndim - in_info.ndim
    d = out_dim - lead
    if d < 0 or in_info.shape[d] != out_info.shape[out_dim]:
        return R
    return S(d)


def _pointwise_choices(node: OpNode, n: int, no_shard_dims: Iterable[int] = ()) -> list[AxisChoice]:
    out = node.output
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    blocked = set(no_shard_dims)
    for d in range(out.ndim):
        if d in blocked or not _divisible(out.shape[d], n):
            continue
        choices.append((tuple(_broadcast_in(i, out, d) for i in node.input_infos), S(d)))
    t = node.target
    scalar_operand = len(node.inputs) < node.args_repr.count(",") + 1 and t in _PAIRWISE_ADD
    if t in _UNARY_LINEAR or t in _SCALAR_SCALE:
        # a cast to an integer or bool dtype truncates each summand: not linear
        if k == 1 and (out.is_float or not node.input_infos[0].is_float):
            choices.append(((P,), P))
    elif t in _PAIRWISE_ADD and k == 2 and not scalar_operand:
        choices.append(((P, P), P))
    elif t in _SCALE_BY_OTHER and k == 2:
        choices.append(((P, R), P))
        if t == "aten.mul.Tensor":
            choices.append(((R, P), P))
    elif t in _SCALE_BY_OTHER and k == 1:  # multiplied or divided by a Python number
        choices.append(((P,), P))
    return choices


def _reduction_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """sum / mean over dims: sharding a kept dim carries over; sum over a split dim is partial."""
    x, out = node.input_infos[0], node.output
    args = node.args_repr.split(",", 1)
    dims_text = args[1] if len(args) > 1 else ""
    if "[" in dims_text:
        raw = dims_text.split("[", 1)[1].split("]")[0]
        dims = {_norm(int(v), x.ndim) for v in raw.split(",") if v.strip() and v.strip() != "None"}
    else:
        dims = set()
    if not dims:
        dims = set(range(x.ndim))
    keepdim = "True" in node.args_repr.split("]")[-1]
    choices: list[AxisChoice] = [((R,), R), ((P,), P)]
    kept = [d for d in range(x.ndim) if d not in dims]
    for d in range(x.ndim):
        if not _divisible(x.shape[d], n):
            continue
        if d in dims:
            if node.target.startswith("aten.sum"):
                choices.append(((S(d),), P))
        else:
            o = d if keepdim else kept.index(d)
            choices.append(((S(d),), S(o)))
    return choices


def _linear_choices(node: OpNode, n: int) -> list[AxisChoice]:
    x, w = node.input_infos[0], node.input_infos[1]
    has_bias = len(node.inputs) == 3
    out = node.output
    last = out.ndim - 1
    b = (lambda p: (p,)) if has_bias else (lambda p: ())
    choices: list[AxisChoice] = [((R, R, *b(R)), R)]
    if _divisible(w.shape[0], n):
        choices.append(((R, S(0), *b(S(0))), S(last)))  # colwise
    if _divisible(w.shape[1], n):
        choices.append(((S(x.ndim - 1), S(1), *b(P)), P))  # rowwise; the bias is added once
    for d in range(out.ndim - 1):
        if _divisible(out.shape[d], n):
            choices.append(((S(d), R, *b(R)), S(d)))  # batch / sequence
    choices.append(((P, R, *b(P)), P))
    return choices


def _matmul_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """mm / bmm / matmul: split rows, columns, the contraction (partial) or a batch dim."""
    a, b = node.input_infos[0], node.input_infos[1]
    out = node.output
    if a.ndim < 2 or b.ndim < 2:
        return [((R, R), R)]
    choices: list[AxisChoice] = [((R, R), R), ((P, R), P), ((R, P), P)]
    if _divisible(a.shape[-2], n):
        choices.append(((S(a.ndim - 2), R), S(out.ndim - 2)))
    if _divisible(b.shape[-1], n):
        choices.append(((R, S(b.ndim - 1)), S(out.ndim - 1)))
    if _divisible(a.shape[-1], n):
        choices.append(((S(a.ndim - 1), S(b.ndim - 2)), P))
    for d in range(out.ndim - 2):
        if _divisible(out.shape[d], n):
            choices.append(((_broadcast_in(a, out, d), _broadcast_in(b, out, d)), S(d)))
    return choices


def _addmm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """addmm(bias (N,), a (M, K), b (K, N)): a matmul plus a bias broadcast over rows (HF Conv1D)."""
    bias, a, b = node.input_infos[0], node.input_infos[1], node.input_infos[2]
    if a.ndim != 2 or b.ndim != 2:
        return [((R, R, R), R)]
    bias_cols = S(bias.ndim - 1) if bias.ndim >= 1 and bias.shape[-1] == b.shape[1] else R
    choices: list[AxisChoice] = [((R, R, R), R), ((P, P, R), P)]
    if _divisible(a.shape[0], n):
        choices.append(((R, S(0), R), S(0)))  # rows
    if _divisible(b.shape[1], n) and bias_cols != R:
        choices.append(((bias_cols, R, S(1)), S(1)))  # columns: colwise
    if _divisible(a.shape[1], n):
        choices.append(((P, S(1), S(0)), P))  # contraction: rowwise, the bias added once
    return choices


def _embedding_choices(node: OpNode, n: int) -> list[AxisChoice]:
    w, idx = node.input_infos[0], node.input_infos[1]
    out = node.output
    choices: list[AxisChoice] = [((R, R), R)]
    if _divisible(w.shape[1], n):
        choices.append(((S(1), R), S(out.ndim - 1)))  # colwise: split the embedding dim
    if _divisible(w.shape[0], n):
        choices.append(((S(0), R), P))  # rowwise: each rank looks up its rows, zeros elsewhere
    for d in range(idx.ndim):
        if _divisible(idx.shape[d], n):
            choices.append(((R, S(d)), S(d)))
    return choices


def _sdpa_choices(node: OpNode, n: int) -> list[AxisChoice]:
    q, k = node.input_infos[0], node.input_infos[1]
    k_in = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k_in, R)]
    for d in (0, 1):  # batch, heads: attention is independent across both
        if not (_divisible(q.shape[d], n) and _divisible(k.shape[d], n)):
            continue
        extra = tuple(_broadcast_in(m, node.output, d) if m.ndim == node.output.ndim else R
                      for m in node.input_infos[3:])
        choices.append(((S(d), S(d), S(d), *extra), S(d)))
    return choices


def _softmax_choices(node: OpNode, n: int) -> list[AxisChoice]:
    dim = _norm(int(node.args_repr.split(",")[1]), node.output.ndim)
    return _pointwise_choices(node, n, no_shard_dims=(dim,))


def _norm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """layer_norm / rms_norm: the normalized (trailing) dims stay whole; weight and bias replicated."""
    x = node.input_infos[0]
    inner = node.args_repr.split("[", 1)[1].split("]")[0]
    k = len([v for v in inner.split(",") if v.strip()])
    choices: list[AxisChoice] = [((R,) * len(node.inputs), R)]
    for d in range(x.ndim - k):
        if _divisible(x.shape[d], n):
            choices.append(((S(d),) + (R,) * (len(node.inputs) - 1), S(d)))
    return choices


def _cat_choices(node: OpNode, n: int) -> list[AxisChoice]:
    out = node.output
    dim = _norm(int(node.args_repr.rsplit(",", 1)[-1]) if node.args_repr.count(",") else 0, out.ndim) \
        if not node.args_repr.endswith("]") else 0
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R), ((P,) * k, P)]
    for d in range(out.ndim):
        if d != dim and _divisible(out.shape[d], n) and all(i.ndim == out.ndim for i in node.input_infos):
            choices.append(((S(d),) * k, S(d)))
    return choices


def _replicated(node: OpNode, n: int) -> list[AxisChoice]:
    return [((R,) * len(node.inputs), R)]


def _factory(node: OpNode, n: int) -> list[AxisChoice]:
    return [((None,) * len(node.inputs), R)]


_RULES: dict[str, Callable[[OpNode, int], list[AxisChoice]]] = {
    "aten.linear.default": _linear_choices,
    "aten.mm.default": _matmul_choices,
    "aten.addmm.default": _addmm_choices,
    "aten.bmm.default": _matmul_choices,
    "aten.matmul.default": _matmul_choices,
    "aten.embedding.default": _embedding_choices,
    "aten.scaled_dot_product_attention.default": _sdpa_choices,
    "aten.softmax.int": _softmax_choices,
    "aten._softmax.default": _softmax_choices,
    "aten.log_softmax.int": _softmax_choices,
    "aten._log_softmax.default": _softmax_choices,
    "aten.layer_norm.default": _norm_choices,
    "aten.rms_norm.default": _norm_choices,
    "aten.sum.dim_IntList": _reduction_choices,
    "aten.mean.dim": _reduction_choices,
    "aten.sum.default": _reduction_choices,
    "aten.mean.default": _reduction_choices,
    "aten.cat.default": _cat_choices,
}


class _Warned:
    """Op kinds already warned about, per planning run (no global state)."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()


def _factory_or_all(node: OpNode) -> tuple:
    """Input slots of the replicated choice: None where the node reads only dtype and device."""
    return (None,) * len(node.inputs) if node.target in _FACTORY else (R,) * len(node.inputs)


def axis_choices(node: OpNode, n: int, warned: Optional[_Warned] = None,
                 graph: Optional[OpGraph] = None) -> list[AxisChoice]:
    """The single-axis choices of ``node`` on an axis of ``n`` ranks.

    An op no own rule covers is looked up in DTensor's registry (which needs ``graph``, the
    node's OpGraph, for the exported fx node); if that has nothing either, it runs replicated.
    """
    if n == 1:  # an axis of one rank: splitting across it changes nothing and only adds steps
        return [(tuple(None if c is None else R for c in _factory_or_all(node)), R)]
    if node.is_placeholder:
        return _placeholder_choices(node, n)
    t = node.target
    if t in _FACTORY:
        return _factory(node, n)
    rule = _RULES.get(t)
    if rule is not None:
        return rule(node, n)
    if len(node.outputs) == 1 and len(node.inputs) >= 1:
        if t in _POINTWISE:
            return _pointwise_choices(node, n)
        dim_map = _dim_map(node, getattr(graph, "symbolic", None))
        if dim_map is not None:
            return _view_choices(node, n, dim_map)
    if len(node.inputs) == 1 and t in ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"):
        d = _norm(int(node.args_repr.split(",")[2]) if node.args_repr.count(",") >= 2 else 0, node.input_infos[0].ndim)
        x = node.input_infos[0]
        return [((R,), R), ((P,), P)] + [((S(i),), S(i)) for i in range(x.ndim) if i != d and _divisible(x.shape[i], n)]
    if graph is not None:
        from autotp.dtensor_rules import registry_axis_choices  # imports torch.distributed.tensor

        choices = registry_axis_choices(graph, node, n)
        if choices is not None:
            return choices
    if warned is not None and t not in warned.kinds:
        warned.kinds.add(t)
        log.warning("autotp: no sharding rule for %s (first seen at node %s); it runs replicated", t, node.name)
    return _replicated(node, n)


def _valid(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim splits evenly over the axes that split it, and no dim is split twice."""
    tensors = list(zip(strategy.inputs, node.input_infos)) + [(strategy.output, o) for o in node.outputs[:1]]
    for placements, info in tensors:
        if placements is None:
            continue
        seen: set[int] = set()
        for p in placements:
            if p.is_shard:
                if p.dim in seen or p.dim >= info.ndim:
                    return False
                seen.add(p.dim)
        for d in seen:
            if info.shape[d] % math.prod(n for p, n in zip(placements, mesh_shape) if p.is_shard and p.dim == d):
                return False
    return True


def node_strategies(graph: OpGraph, node: OpNode, mesh_shape: Sequence[int],
                    warned: Optional[_Warned] = None) -> list[Strategy]:
    """All strategies of ``node`` on a mesh of ``mesh_shape``, in a fixed order."""
    per_axis = [axis_choices(node, n, warned, graph) for n in mesh_shape]
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    for combo in itertools.product(*per_axis):
        inputs = tuple(
            None if any(c[0][k] is None for c in combo) else tuple(c[0][k] for c in combo)
            for k in range(len(node.inputs))
        )
        s = Strategy(inputs, tuple(c[1] for c in combo))
        if s not in seen and _valid(node, s, mesh_shape):
            seen.add(s)
            out.append(s)
    return out


def all_strategies(graph: OpGraph, mesh_shape: Sequence[int], nodes: Optional[Iterable[OpNode]] = None
                   ) -> dict[str, list[Strategy]]:
    """Strategies of every node (or of ``nodes``), keyed by node name."""
    warned = _Warned()
    return {n.name: node_strategies(graph, n, mesh_shape, warned) for n in (nodes if nodes is not None else graph.nodes)}
