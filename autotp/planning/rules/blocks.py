"""Blocked splits: where a fused projection's output is cut into its parts, split each part.

A fused q|k|v (or gate|up) projection computes one tensor whose last dim is ``k`` equal blocks,
and a later op cuts it into them (``split``, ``chunk``, ``split_with_sizes``, or a slice per
block). A plain column split hands rank 0 the first ``1/n`` of the dim, which mixes the blocks,
so the cut needs a gather. A **blocked split** ``S(d)[k]`` hands each rank its piece of every
block instead; the cut then finds each block's piece on its rank, and the projection's weight is
split the same way (Megatron's interleaved layout).

:func:`block_counts` finds, from the graph alone, which dims of which tensors such a cut reads
(the seeds) and follows them back through the ops that carry a split dim unchanged (views that
keep the dim's size, elementwise ops, the output features of linear / addmm / matmul / grouped
matmul, to their weight and bias). :func:`blocked_variants` adds to an op's choices the blocked
twin of each choice that splits such a dim; :func:`cut_choices` gives the cutting ops their
choice: a blocked input, a plain split out. On a rank the cut runs on its pieces of the blocks with
local sizes and bounds (:func:`local_cut`, the family's local execution).

>>> import torch, autotp
>>> class Fused(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.qkv = torch.nn.Linear(8, 24)
...     def forward(self, x):
...         q, k, v = self.qkv(x).split(8, dim=-1)
...         return q * k + v
>>> g = autotp.capture(Fused(), (torch.randn(2, 8),))
>>> sorted((name, dim, k) for (name, dim), ks in block_counts(g).items() for k in ks)
[('linear', 1, 3), ('p_qkv_bias', 0, 3), ('p_qkv_weight', 0, 3)]
"""

from __future__ import annotations

import weakref
from typing import Mapping, Optional, Union

import torch

from autotp import ops
from autotp.local.site import Call, LocalSite
from autotp.placement import Placement, S, local_shape
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpGraph, OpNode

# Ops that cut a dim into pieces, one output each.
CUTS = frozenset({"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"})
# Ops whose output dim is the same dim of these inputs (position of the input -> its dim), by op:
# the output features of a matmul-like op come from its weight (and bias).
_FEATURES = {
    "aten.linear.default": lambda node, d: {1: 0, 2: 0} if d == node.output.ndim - 1 else {},
    "aten.addmm.default": lambda node, d: {0: node.input_infos[0].ndim - 1, 2: 1} if d == 1 else {},
    "aten.mm.default": lambda node, d: {1: 1} if d == 1 else {},
    "aten.matmul.default": lambda node, d: {1: node.input_infos[1].ndim - 1} if d == node.output.ndim - 1 else {},
    "aten._grouped_mm.default": lambda node, d: {1: 2} if d == node.output.ndim - 1 else {},
    "transformers.grouped_mm_fallback.default": lambda node, d: {1: 2} if d == node.output.ndim - 1 else {},
}


Blocks = Union[int, tuple[int, ...]]  # k equal blocks, or the sizes of unequal ones


def fits(blocks: Blocks, size: int, n: int) -> bool:
    """Whether a dim of ``size`` is ``blocks`` that each split evenly over ``n`` ranks."""
    if isinstance(blocks, tuple):
        return sum(blocks) == size and all(b % n == 0 for b in blocks)
    return size % blocks == 0 and divisible(size // blocks, n)


def cut_blocks(node: OpNode) -> Optional[tuple[int, Blocks]]:
    """``(dim, k)`` when ``node`` cuts dim ``dim`` of its first input into ``k`` >= 2 equal blocks;
    ``(dim, sizes)`` when ``split_with_sizes`` cuts it into blocks of unequal ``sizes`` (a fused
    q|k|v with fewer k and v heads than q heads)."""
    if node.target not in CUTS and node.target != "aten.slice.Tensor" or not node.inputs:
        return None
    x = node.input_infos[0]
    if node.target in CUTS:
        d = node.args.int("dim", x.ndim)
        size = x.shape[d]
        if node.target == "aten.chunk.default":
            k = node.args.int("chunks")
            return (d, k) if k >= 2 and size % k == 0 else None
        if node.target == "aten.split.Tensor":
            piece = node.args.int("split_size")
            return (d, size // piece) if piece and size % piece == 0 and size // piece >= 2 else None
        sizes = tuple(node.args.ints("split_sizes"))
        if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != size:
            return None
        return (d, len(sizes)) if len(set(sizes)) == 1 else (d, sizes)
    r = slice_range(node)
    if r is not None:
        d, start, stop = r
        size, width = x.shape[d], stop - start
        if 0 < width < size and size % width == 0 and start % width == 0:
            return d, size // width
    return None


def slice_range(node: OpNode) -> Optional[tuple[int, int, int]]:
    """``(dim, start, stop)`` of a slice with step 1 and static bounds inside the dim, else None."""
    if node.target != "aten.slice.Tensor" or node.args.get("step", 1) != 1 or not node.inputs:
        return None
    x = node.input_infos[0]
    d = node.args.int("dim", x.ndim)
    start, end = node.args.get("start") or 0, node.args.get("end")
    if not isinstance(start, int) or not isinstance(end, int) or start < 0:
        return None
    return d, start, min(end, x.shape[d])


def _slice_tiles(graph: OpGraph) -> dict[tuple[str, int], tuple[int, ...]]:
    """``(tensor, dim) -> sizes`` where slices of the tensor cut the dim into unequal blocks that
    tile it (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``)."""
    ranges: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for node in graph.nodes:
        r = slice_range(node)
        if r is not None:
            ranges.setdefault((node.inputs[0], r[0]), set()).add(r[1:])
    tiles = {}
    for (name, d), found in ranges.items():
        ordered = sorted(found)
        size = graph[name].outputs[0].shape[d] if len(graph[name].outputs) == 1 else None
        widths = tuple(b - a for a, b in ordered)
        if (size is not None and len(ordered) >= 2 and ordered[0][0] == 0 and ordered[-1][1] == size
                and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])) and len(set(widths)) > 1
                and min(widths) > 0):
            tiles[(name, d)] = widths
    return tiles


def slice_block(node: OpNode, sizes: tuple[int, ...]) -> Optional[int]:
    """The block of unequal ``sizes`` that the slice ``node`` takes whole, if it takes one."""
    r = slice_range(node)
    if r is None:
        return None
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    j = starts.index(r[1]) if r[1] in starts else None
    return j if j is not None and r[2] == starts[j] + sizes[j] else None


def _sources(node: OpNode, d: int, mapping: Optional[dict[int, int]]) -> dict[int, int]:
    """input position -> its dim that carries output dim ``d`` unchanged through ``node``."""
    if node.target in _FEATURES:  # (a linear without bias has no third input)
        return {k: e for k, e in _FEATURES[node.target](node, d).items() if k < len(node.inputs)}
    if node.target in ops.POINTWISE:
        out = node.output
        found = {}
        for k, info in enumerate(node.input_infos):
            e = d - (out.ndim - info.ndim)
            if e >= 0 and info.shape[e] == out.shape[d]:
                found[k] = e
        return found
    if mapping is not None and d in mapping and node.input_infos[0].shape[mapping[d]] == node.output.shape[d]:
        return {0: mapping[d]}
    return {}


def static_cut(node: OpNode, graph: OpGraph) -> Optional[tuple[int, Blocks]]:
    """:func:`cut_blocks` of a dim of static size (a dynamic dim's blocks change with its size)."""
    cut = cut_blocks(node)
    dims = graph.symbolic.get(node.inputs[0]) if cut is not None else None
    return None if cut is None or (dims and dims[0][cut[0]] is not None) else cut


_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def block_counts(graph: OpGraph) -> Mapping[tuple[str, int], frozenset[Blocks]]:
    """``(node, dim) -> block counts`` (or sizes of unequal blocks) for the dims a blocked split
    could carry to a cut."""
    if graph in _CACHE:
        return _CACHE[graph]
    from autotp.planning.rules.views import dim_map

    counts: dict[tuple[str, int], set[Blocks]] = {}
    for (name, d), sizes in _slice_tiles(graph).items():
        dims = graph.symbolic.get(name)
        if not dims or dims[0][d] is None:  # a static dim
            counts.setdefault((name, d), set()).add(sizes)
    for node in reversed(graph.nodes):
        if node.is_placeholder or not node.inputs:
            continue
        if len(node.outputs) == 1 or node.target in CUTS:
            cut = static_cut(node, graph)
            if cut is not None:
                counts.setdefault((node.inputs[0], cut[0]), set()).add(cut[1])
        if len(node.outputs) != 1:
            continue
        mapping = dim_map(node, graph.symbolic) if node.target not in ops.POINTWISE else None
        for d in range(node.output.ndim):
            ks = counts.get((node.name, d))
            if not ks:
                continue
            for k_in, e in _sources(node, d, mapping).items():
                counts.setdefault((node.inputs[k_in], e), set()).update(ks)
    result = {key: frozenset(ks) for key, ks in counts.items()}
    _CACHE[graph] = result
    return result


def blocked_variants(node: OpNode, n: int, choices: list[AxisChoice],
                     counts: Mapping[tuple[str, int], frozenset[int]]) -> list[AxisChoice]:
    """The blocked twin of each choice that splits an output dim a cut downstream reads in blocks:
    the output ``S(d)[k]``, and each input split on a dim of the same size blocked alike (an op
    exact on contiguous pieces of the dim is exact on a piece of every block: it maps the dim's
    positions one to one)."""
    out = []
    for ins, placement in choices:
        if not placement.is_shard or placement.is_blocked or placement.is_uneven \
                or any(p is not None and p.is_uneven for p in ins):
            continue
        size = node.outputs[0].shape[placement.dim]
        for k in _ordered(counts.get((node.name, placement.dim), ())):
            if not fits(k, size, n) or not all(
                    p is None or not p.is_shard or info.shape[p.dim] == size
                    for p, info in zip(ins, node.input_infos)):
                continue
            twin = (tuple(S(p.dim, k) if p is not None and p.is_shard else p for p in ins), S(placement.dim, k))
            if twin not in choices and twin not in out:
                out.append(twin)
    return out


def parameter_variants(node: OpNode, n: int, counts: Mapping[tuple[str, int], frozenset[int]]) -> list[AxisChoice]:
    """A parameter stored with a blocked split of a dim a cut reads in blocks."""
    shape = node.output.shape
    return [((), S(d, k)) for d in range(len(shape)) for k in _ordered(counts.get((node.name, d), ()))
            if fits(k, shape[d], n)]


def _ordered(blocks) -> list[Blocks]:
    """Equal block counts in order, then unequal sizes in order (a fixed order of strategies)."""
    return sorted(b for b in blocks if isinstance(b, int)) + sorted(b for b in blocks if isinstance(b, tuple))


def cut_choices(node: OpNode, n: int, counts: Optional[Mapping[tuple[str, int], frozenset[Blocks]]] = None
                ) -> list[AxisChoice]:
    """A cut of a blocked dim into its blocks: each block's piece is on its rank, a plain split.
    With ``counts``, also a slice that takes one whole block of unequal ones (:func:`_slice_tiles`)."""
    cut = cut_blocks(node)
    r = slice_range(node)
    unequal = [((S(r[0], sizes), *(None,) * (len(node.inputs) - 1)), S(r[0]))
               for sizes in _ordered((counts or {}).get((node.inputs[0], r[0]), ()) if r else ())
               if isinstance(sizes, tuple) and slice_block(node, sizes) is not None
               and fits(sizes, node.input_infos[0].shape[r[0]], n)]
    if cut is None:
        return unequal
    d, k = cut
    x = node.input_infos[0]
    if not fits(k, x.shape[d], n):
        return unequal
    extra = (None,) * (len(node.inputs) - 1)
    return [((S(d, k), *extra), S(d))] + unequal


def local_cut_arguments(node: OpNode, blocked: Placement, n: int, piece: Optional[int] = None) -> dict[str, object]:
    """The arguments a cut takes on the rank's pieces of a blocked input: sizes and bounds along
    the cut dim divided by the ranks (``chunk`` keeps its count), or, for whole units of each
    block (``S(d)[k]~g``), the rank's ``piece`` of a block."""
    a = node.args
    if blocked.is_unequal:  # each block's piece: split_with_sizes of them all, or a slice of one
        if node.target == "aten.slice.Tensor":
            j = slice_block(node, blocked.sizes)
            start = sum(b // n for b in blocked.sizes[:j])
            return {"start": start, "end": start + blocked.sizes[j] // n}
        return {"split_sizes": [b // n for b in blocked.sizes]}
    size = node.input_infos[0].shape[blocked.dim]
    block = size // blocked.blocks
    piece = block // n if piece is None else piece
    if node.target == "aten.split.Tensor":
        return {"split_size": piece}
    if node.target == "aten.split_with_sizes.default":
        return {"split_sizes": [piece] * len(a.ints("split_sizes"))}
    if node.target == "aten.slice.Tensor":
        start = (a.get("start") or 0) // block * piece
        return {"start": start, "end": start + (min(a.int("end"), size) - (a.get("start") or 0)) // block * piece}
    return {}


def local_cut(site: LocalSite) -> Optional[Call]:
    """A fused output cut into its blocks, read blocked along the cut dim: each block's piece is on
    this rank, so the cut takes the local sizes and bounds (:func:`local_cut_arguments`). None for a
    cut of another input."""
    node, inputs = site.node, site.strategy.inputs[0]
    cut = cut_blocks(node)
    sliced = slice_range(node)
    cut_dim = cut[0] if cut else sliced[0] if sliced else None
    blocked = [(a, p) for a, p in enumerate(inputs or ()) if p.is_blocked] if cut_dim is not None else []
    if not (blocked and blocked[0][1].dim == cut_dim and (cut is not None or blocked[0][1].is_unequal)):
        return None
    a, p = blocked[0]
    piece = None
    if p.is_uneven:  # this rank's length of each block
        piece = local_shape(node.input_infos[0].shape, inputs, site.mesh_shape, site.coordinate)[p.dim] // p.blocks
    local = local_cut_arguments(node, p, site.mesh_shape[a], piece)
    x = site.args[0]
    if node.target == "aten.split.Tensor" and piece == 0:  # nothing here: split(0) would give one piece
        return site.called(target=torch.ops.aten.split_with_sizes.default, args=(x, [0] * p.blocks, p.dim))
    if node.target == "aten.slice.Tensor":
        return site.called(args=(x, p.dim, local["start"], local["end"], 1))
    if local:
        return site.called(args=(x, *local.values(), p.dim))
    return site.called()


# the cuts run on a rank's pieces of the blocks; a slice that is no such cut is the views' (strided_slice)
LOCAL = {name: local_cut for name in (*CUTS, "aten.slice.Tensor")}
