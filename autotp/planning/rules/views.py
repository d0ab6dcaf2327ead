"""View-like ops: each output dim carries the shard of the input dim it comes from.

A view runs on a shard as on the whole tensor once its shape arguments are made local (the
family's local executions do that: :data:`LOCAL`), so an output dim may be split wherever it is one
input dim, unchanged or cut evenly: :func:`dim_map` says which input dim each output dim carries.
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence

import torch

from autotp import ops
from autotp.local.site import Call, LocalSite
from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode, SizeArg

# views that pass a partial sum through (linear and elementwise on the values); squeezes,
# expands, slices and selects included: a part of a sum is the sum of the parts
_PARTIAL_VIEW_PREFIXES = (
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.transpose", "aten.permute", "aten.unsqueeze",
    "aten.squeeze", "aten.expand", "aten.t.", "aten.slice", "aten.select", "aten.unflatten", "aten.flatten",
    "aten.numpy_T",
)


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> Optional[dict[int, int]]:
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


def strided_slice(node: OpNode, symbolic: Optional[Mapping] = None) -> Optional[int]:
    """The step of a slice ``x[..., r::step]`` that may keep its dim split: it starts before its
    first step, runs to the end and the step divides the dim (each rank's piece, a multiple of
    the step long, then starts at a multiple of it: the local slice ``[r::step]`` is its piece of
    the output). None for any other slice, and where the dim's size is dynamic."""
    x = node.input_infos[0]
    d = node.args.int("dim", x.ndim)
    start, end, step = node.args.get("start"), node.args.get("end"), node.args.get("step", 1)
    expressions = (symbolic or {}).get(node.inputs[0])
    if not isinstance(step, int) or step <= 1 or (expressions and expressions[0][d] is not None):
        return None
    start = 0 if start is None else start
    if not isinstance(start, int) or not 0 <= start < step or isinstance(end, SizeArg):
        return None
    if end is not None and end < x.shape[d]:
        return None
    return step if x.shape[d] % step == 0 and node.output.shape[d] * step == x.shape[d] else None


def dim_map(node: OpNode, symbolic: Optional[Mapping] = None) -> Optional[dict[int, int]]:
    """out dim -> in dim for single-input view-like ops; None when the op is not view-like.

    ``symbolic`` (``OpGraph.symbolic``): where sizes are dynamic, a slice or expand keeps a dim whole
    only if its size is the same expression on both sides, not merely the same at the example's
    sizes (``pos[:x.size(1)]`` is all of ``pos`` only when the sequence is as long as the table)."""
    t, a = node.target, node.args
    ins, out = node.input_infos[0].shape, node.output.shape
    if t in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unflatten.int",
             "aten.flatten.using_ints", "aten.view_as.default"):
        return view_groups(ins, out)
    if t == "aten.transpose.int":
        d0, d1 = a.int("dim0", len(ins)), a.int("dim1", len(ins))
        perm = list(range(len(ins)))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return {o: perm[o] for o in range(len(out))}
    if t in ("aten.t.default", "aten.numpy_T.default"):
        return {o: len(ins) - 1 - o for o in range(len(out))}
    if t == "aten.permute.default":
        return {o: d for o, d in enumerate(a.ints("dims", len(ins)))}
    if t == "aten.unsqueeze.default":
        d = a.int("dim", len(out))
        return {o: (o if o < d else o - 1) for o in range(len(out)) if o != d}
    if t in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
        keep = [d for d in range(len(ins)) if not (ins[d] == 1 and len(ins) != len(out))]
        if len(keep) != len(out):  # squeeze of only some unit dims: fall back to the general reshape map
            return view_groups(ins, out)
        return {o: d for o, d in enumerate(keep)}
    if t == "aten.view_as_complex.default":  # (..., 2) real -> (...) complex: the pair dim stays whole
        return {o: o for o in range(len(out))}
    if t == "aten.view_as_real.default":
        return {o: o for o in range(len(ins))}
    if symbolic and t in ("aten.expand.default", "aten.slice.Tensor"):  # compare (size, expression) pairs
        ins, out = _sized(ins, symbolic.get(node.inputs[0])), _sized(out, symbolic.get(node.name))
    if t == "aten.expand.default":
        lead = len(out) - len(ins)
        return {o: o - lead for o in range(lead, len(out)) if ins[o - lead] == out[o]}
    if t == "aten.slice.Tensor":
        d = a.int("dim", len(ins))
        keep = ins[d] == out[d] or strided_slice(node, symbolic) is not None
        return {o: o for o in range(len(out)) if o != d or keep}
    if t == "aten.select.int":
        d = a.int("dim", len(ins))
        return {o: (o if o < d else o + 1) for o in range(len(out))}
    if t in ops.UNARY_LINEAR or t == "getitem":
        return {o: o for o in range(len(out))}
    return None


def view_choices(node: OpNode, n: int, mapping: dict[int, int]) -> list[AxisChoice]:
    out = node.output.shape
    extra = (None,) * (len(node.inputs) - 1)
    choices: list[AxisChoice] = [((R, *extra), R)]
    if node.output.is_float:  # integers and booleans are not summed: no partial masks or indices
        choices.append(((P, *extra), P))
    for o, i in sorted(mapping.items()):
        if divisible(out[o], n) and divisible(node.input_infos[0].shape[i], n):
            choices.append(((S(i), *extra), S(o)))
    if node.target not in ops.UNARY_LINEAR and node.target != "getitem" \
            and not node.target.startswith(_PARTIAL_VIEW_PREFIXES):
        choices = [c for c in choices if c[1] != P]
    return choices


def split_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """split / chunk: every piece keeps the other dims' shards."""
    x = node.input_infos[0]
    d = node.args.int("dim", x.ndim)
    return [((R,), R), ((P,), P)] + [((S(i),), S(i)) for i in range(x.ndim) if i != d and divisible(x.shape[i], n)]


SPLITS = frozenset({"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"})


def local_squeeze(site: LocalSite) -> Call:
    """``squeeze()`` of the dims of size 1 in the whole tensor: a rank's piece of a split dim may be
    1 long too."""
    ones = [d for d, size in enumerate(site.node.input_infos[0].shape) if size == 1]
    return site.called(target=torch.ops.aten.squeeze.dims, args=(site.args[0], ones))


def local_shape_argument(site: LocalSite) -> Call:
    """``view``, ``reshape``, ``expand``: the shape argument of this rank's piece."""
    args = site.args
    return site.called(args=(args[0], site.local_sizes(args[1]), *args[2:]))


def local_unflatten(site: LocalSite) -> Optional[Call]:
    """``unflatten`` into a split dim: the sizes of the new dims are this rank's piece of each."""
    node, args = site.node, site.args
    if not any(p.is_shard for p in site.strategy.output):
        return None
    d, k = args[1] % node.input_infos[0].ndim, len(args[2])
    full = [*node.output.shape[:d], *args[2], *node.output.shape[d + k:]]
    return site.called(args=(args[0], args[1], site.local_sizes(full)[d:d + k], *args[3:]))


def local_strided_slice(site: LocalSite) -> Optional[Call]:
    """A slice of a split dim runs to the end of each piece: all of it, or every step-th element from
    a start before the first step (:func:`strided_slice`). None for a slice of a whole dim."""
    node = site.node
    dim = node.args.int("dim", node.input_infos[0].ndim)
    q = site.strategy.inputs[0]
    if q is None or not any(p.is_shard and p.dim == dim for p in q):
        return None
    step = node.args.get("step", 1)
    start = (node.args.get("start") or 0) if step != 1 else 0
    return site.called(args=(site.args[0], dim, start, sys.maxsize, step))


LOCAL = {
    "aten.squeeze.default": local_squeeze,
    **{name: local_shape_argument for name in ops.SHAPE_ARGUMENT},
    "aten.unflatten.int": local_unflatten,
    "aten.slice.Tensor": local_strided_slice,  # after blocks.local_cut: a cut into blocks first
}
