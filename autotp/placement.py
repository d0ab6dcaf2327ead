"""Placements and strategies: the declaration of a sharding, separate from the code that applies it.

A **placement** says how one tensor lives on one mesh **axis**: ``R`` (replicated), ``S(d)``
(split along tensor **dim** ``d``; blocked ``S(d)[k]`` and uneven ``S(d)~g`` below) or ``P`` (each
rank holds a partial sum). A tensor on an N-axis
mesh has one placement per axis. A **strategy** of a node lists the placements its inputs must
have and the placement of its output, and prints the way DTensor prints it:

>>> from autotp.placement import R, S, P, Strategy
>>> str(Strategy(((R,), (S(0),)), (S(1),)))
'(R, S(0)) -> S(1)'
>>> str(Strategy(((S(0), R), (R, S(0))), (S(0), S(1))))
'(S(0)R, RS(0)) -> S(0)S(1)'
>>> Strategy.parse("(R, S(0)[3]) -> S(1)[3]").output[0].blocks
3
>>> Strategy.parse("(S(2)~64) -> S(2)~1").inputs[0][0].grain
64

In training, a replicated output may carry a **partial gradient**, ``Rg``: the value is the same
on every rank, but its gradient arrives as one partial sum per rank, because the op runs replicated
and every reader returns its partial gradient unreduced. The backward of a replicated op is linear in
its output's gradient, so it passes the partial sums on to its own inputs, and one all_reduce (or
the reduce-scatter of a gather) further up sums them, on a tensor that may be smaller or already
reduced for other readers (:mod:`autotp.planning.rules.gradients`).

>>> str(Strategy(((R,), (R,)), (Rg,)))
'(R, R) -> Rg'

A partial sum whose summands have **disjoint support**, ``Pd``, is a ``P`` in which every element
is nonzero on one rank at most (zero on the others): the rows a rank computes for the experts it
holds (:mod:`autotp.planning.rules.experts`). Such a sum passes exactly through ops that keep zeros
zero (``silu(0) = 0``), products with the same support and row gathers; it reads as ``P`` for
free, and redistributes as ``P`` does.

>>> str(Strategy(((Pd,), (R,)), (Pd,)))
'(Pd, R) -> Pd'

Routed rows, where the expert split moves tokens by all-to-all (:mod:`autotp.planning.rules.routed`):
``St`` is what the model computes from this rank's tokens alone (its piece of a batch split ``S(0)``
of the tokens, then sorted, gathered as the model does: rows in the rank's own order, not a piece
of the whole tensor), ``Se`` the rows routed to the experts this rank holds (from every rank, sorted
by expert), ``Pt`` what the model counts from this rank's tokens alone (a partial sum of the whole
batch's counts). They pass only between the ops of one routed region: nothing becomes one of them,
and none becomes anything else.

>>> str(Strategy(((St,), (S(0),)), (Se,)))
'(St, S(0)) -> Se'

An input placement of ``None`` means the node reads only the input's dtype and device (for
example ``new_ones``), so any placement will do and nothing moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["Placement", "R", "Rg", "P", "Pd", "S", "St", "Se", "Pt", "plain", "summed", "Placements", "Strategy", "format_placements", "parse_placements",
           "local_shape", "shard_divisor", "dim_pieces", "dim_divisor", "piece_sizes", "piece_range", "axis_divisor",
           "block_sizes", "block_permutation"]


@dataclass(frozen=True, order=True)
class Placement:
    """How a tensor lives on one mesh axis: ``kind`` is "R", "S" or "P"; ``dim`` is set for "S".

    ``blocks`` > 1 makes a **blocked split** ``S(d)[k]``: dim ``d`` is ``k`` equal blocks (a fused
    q|k|v or gate|up output) and each block is split evenly, so a rank holds its piece of every
    block, in block order (DTensor's ``_StridedShard(d, split_factor=k)``). A later op that cuts the
    dim into its blocks then finds each block's piece on the rank that needs it.

    ``sizes`` (with ``blocks`` their count) makes the blocks unequal, ``S(d)[s1,s2,...]``: a fused
    q|k|v with fewer k and v heads than q heads (grouped or multi-query attention). Each block is
    split evenly, so a rank holds ``s_i / n`` of block ``i``, in block order: the whole dim seen in
    the order of :func:`block_permutation` is split plainly. DTensor has no such placement.

    ``grain`` > 0 makes an **uneven split** ``S(d)~g``: dim ``d`` is ``u = size / g`` units of ``g``
    elements (a head of ``g`` features, or ``g = 1``), ``u`` not a multiple of the ranks, and the
    units are dealt out as ``torch.chunk`` deals them: ``ceil(u / n)`` to each rank in order, the
    last ranks fewer (or none). With ``g = 1`` this is DTensor's uneven ``Shard(d)``. The slowest
    rank holds ``ceil(u / n)`` units, and that is what the cost model prices (:func:`shard_divisor`).

    ``grad_partial`` (only on ``R``, printed ``Rg``) marks a replicated output whose gradient is left
    as partial sums (see the module docstring). It is an output placement only: readers read it as ``R``.

    ``disjoint`` (only on ``P``, printed ``Pd``) marks a partial sum whose summands have disjoint
    support: each element is nonzero on one rank at most (see the module docstring). Only a ``Pd``
    becomes a ``Pd``; it reads as ``P`` with no step.

    ``routed`` (on ``S(0)``, printed ``St`` or ``Se``, and on ``P``, printed ``Pt``) marks routed
    rows: ``"t"`` the rows of this rank's tokens in its own order (or on ``P``, what is counted from
    them), ``"e"`` the rows routed to this rank's experts (see the module docstring).
    """

    kind: str
    dim: int = -1
    blocks: int = 1
    grain: int = 0
    sizes: tuple[int, ...] = ()
    grad_partial: bool = False
    disjoint: bool = False
    routed: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P"):
            raise ValueError(f"placement kind must be 'R', 'S' or 'P', got {self.kind!r}")
        if (self.kind == "S") != (self.dim >= 0):
            raise ValueError(f"placement {self.kind} with dim {self.dim}: S needs a dim >= 0, R and P none")
        if self.blocks < 1 or (self.blocks > 1 and self.kind != "S"):
            raise ValueError(f"placement {self.kind} with {self.blocks} blocks: only S may be blocked (blocks >= 1)")
        if self.grain < 0 or (self.grain and self.kind != "S"):
            raise ValueError(f"placement {self.kind} with grain {self.grain}: only S may be uneven (grain >= 1)")
        if self.sizes and (len(self.sizes) != self.blocks or self.grain or len(set(self.sizes)) == 1
                           or min(self.sizes) < 1):
            raise ValueError(f"placement S({self.dim}) with block sizes {list(self.sizes)}: unequal blocks are "
                             f"two or more sizes >= 1 that differ, one per block ({self.blocks}), and not uneven")
        if self.grad_partial and self.kind != "R":
            raise ValueError(f"placement {self.kind} with a partial gradient: only R may leave its gradient partial")
        if self.disjoint and self.kind != "P":
            raise ValueError(f"placement {self.kind} with disjoint summands: only P may be a sum of disjoint parts")
        if self.routed and not ((self.routed in ("t", "e") and self.kind == "S" and self.dim == 0
                                 and self.blocks == 1 and not self.grain)
                                or (self.routed == "t" and self.kind == "P" and not self.disjoint)):
            raise ValueError(f"routed rows {self.routed!r} on {self.kind}({self.dim}): expected 't' or 'e' on a plain "
                             "S(0), or 't' on P")

    @property
    def is_uneven(self) -> bool:
        return self.grain > 0

    @property
    def is_blocked(self) -> bool:
        return self.blocks > 1

    @property
    def is_unequal(self) -> bool:
        """A blocked split whose blocks differ in size (``S(d)[s1,s2,...]``)."""
        return bool(self.sizes)

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:
        if self.routed:
            return self.kind + self.routed
        if self.kind != "S":
            return self.kind + ("g" if self.grad_partial else "") + ("d" if self.disjoint else "")
        blocks = ",".join(map(str, self.sizes)) if self.sizes else str(self.blocks)
        text = f"S({self.dim})[{blocks}]" if self.blocks > 1 else f"S({self.dim})"
        return f"{text}~{self.grain}" if self.grain else text

    __repr__ = __str__


R = Placement("R")
Rg = Placement("R", grad_partial=True)
P = Placement("P")
Pd = Placement("P", disjoint=True)
St = Placement("S", 0, routed="t")
Se = Placement("S", 0, routed="e")
Pt = Placement("P", routed="t")


def plain(placements: Optional[Sequence[Placement]]) -> Optional[tuple[Placement, ...]]:
    """``placements`` with ``Rg`` read as ``R``: what the value is, whatever its gradient."""
    if placements is None:
        return None
    return tuple(R if p.grad_partial else p for p in placements)


def summed(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with ``Pd`` read as ``P`` (and ``Rg`` as ``R``, routed rows as ``S(0)`` or
    ``P``): what a redistribution starts from, a sum of disjoint parts being a partial sum."""
    return tuple(P if p.disjoint or p == Pt else S(0) if p.routed else p for p in plain(placements))


def S(dim: int, blocks: "int | Sequence[int]" = 1, grain: int = 0) -> Placement:
    """Shard along tensor dim ``dim`` (``blocks`` > 1: a blocked split, a tuple of sizes: one of
    unequal blocks; ``grain`` > 0: an uneven split in units of ``grain`` elements; see
    :class:`Placement`)."""
    if not isinstance(blocks, int):
        sizes = tuple(blocks)
        if len(set(sizes)) == 1:
            return Placement("S", dim, len(sizes), grain)
        return Placement("S", dim, len(sizes), grain, sizes)
    return Placement("S", dim, blocks, grain)


def block_sizes(p: Placement, size: int) -> tuple[int, ...]:
    """The sizes of the blocks of a dim of ``size`` that ``p`` splits (one block if not blocked)."""
    return p.sizes if p.sizes else (size // p.blocks,) * p.blocks


def block_permutation(p: Placement, n: int, size: int) -> list[int]:
    """Positions along the dim in the order the ranks hold them under ``p`` (a blocked split over
    ``n`` ranks): rank 0's piece of each block, then rank 1's, ... A plain split of the dim taken in
    this order gives each rank its piece.

    >>> block_permutation(S(0, (4, 2)), 2, 6)
    [0, 1, 4, 2, 3, 5]
    """
    starts, order = [0], []
    for b in block_sizes(p, size)[:-1]:
        starts.append(starts[-1] + b)
    for c in range(n):
        for start, b in zip(starts, block_sizes(p, size)):
            order.extend(range(start + c * (b // n), start + (c + 1) * (b // n)))
    return order


Placements = tuple  # tuple[Placement, ...], one per mesh axis


def format_placements(placements: Optional[Sequence[Placement]]) -> str:
    """``(S(0),)`` → ``"S(0)"``; ``(S(0), R)`` → ``"S(0)R"``; ``None`` → ``"*"`` (any)."""
    if placements is None:
        return "*"
    return "".join(str(p) for p in placements)


def parse_placements(text: str) -> Optional[tuple[Placement, ...]]:
    """Inverse of :func:`format_placements`."""
    if text == "*":
        return None
    out: list[Placement] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "R" and text.startswith("Rg", i):
            out.append(Rg)
            i += 2
        elif c == "P" and text.startswith("Pd", i):
            out.append(Pd)
            i += 2
        elif text.startswith(("St", "Se", "Pt"), i):
            out.append({"St": St, "Se": Se, "Pt": Pt}[text[i:i + 2]])
            i += 2
        elif c in "RP":
            out.append(Placement(c))
            i += 1
        elif c == "S":
            j = text.index(")", i)
            dim, blocks, grain = int(text[i + 2 : j]), 1, 0
            i = j + 1
            if text.startswith("[", i):
                j = text.index("]", i)
                inside = [int(b) for b in text[i + 1 : j].split(",")]
                blocks, i = (inside[0] if len(inside) == 1 else tuple(inside)), j + 1
            if text.startswith("~", i):
                j = i + 1
                while j < len(text) and text[j].isdigit():
                    j += 1
                grain, i = int(text[i + 1 : j]), j
            out.append(S(dim, blocks, grain))
        else:
            raise ValueError(f"cannot parse placements {text!r} at {text[i:]!r}")
    return tuple(out)


@dataclass(frozen=True)
class Strategy:
    """Input placements → output placement of one node (each a tuple, one placement per mesh axis).

    ``variant`` names a local execution that differs under the same placements (empty: the op on
    its pieces, as its family runs it): ``"balanced"``, a causal attention split by query rows
    that computes balanced rows inside; ``"ring"`` and ``"ring_balanced"``, attention whose keys
    and values split with the queries, passed around a ring (:mod:`autotp.planning.rules.attention`),
    and ``"ring/kv4"``, ``"ring_balanced/kv4"``, the same passing them as they were before the
    model repeated them for 4 query heads (:mod:`autotp.planning.rules.attention_kv`).
    It prints after the output:

    >>> str(Strategy.parse("(S(2), R, R) -> S(2) balanced"))
    '(S(2), R, R) -> S(2) balanced'
    """

    inputs: tuple[Optional[tuple[Placement, ...]], ...]
    output: tuple[Placement, ...]
    variant: str = ""

    def __str__(self) -> str:
        text = "(" + ", ".join(format_placements(i) for i in self.inputs) + ") -> " + format_placements(self.output)
        return f"{text} {self.variant}" if self.variant else text

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        left, right = text.split(" -> ")
        inner = left.strip()[1:-1]
        inputs = tuple(parse_placements(t.strip()) for t in _top_level(inner)) if inner.strip() else ()
        placements, _, variant = right.strip().partition(" ")
        out = parse_placements(placements)
        assert out is not None
        return cls(inputs, out, variant.strip())

    def sharded_on(self, axis: int) -> bool:
        """True when any tensor of the strategy is not replicated on ``axis``."""
        if not self.output[axis].is_replicate:
            return True
        return any(i is not None and not i[axis].is_replicate for i in self.inputs)

    def partial_grads_on(self, axis: int) -> bool:
        """True when the gradients the node returns to the inputs it reads replicated on ``axis`` are
        partial sums: it works on shards there, or its output's gradient is partial (``Rg``)."""
        return self.sharded_on(axis) or self.output[axis].grad_partial

    def split_on(self, axis: int) -> bool:
        """True when some tensor of the strategy is cut in pieces (``S``) on ``axis``. Unlike
        :meth:`sharded_on`, a partial (``P``) does not count: it has its full shape on every rank."""
        return any(p is not None and p[axis].is_shard for p in (*self.inputs, self.output))


def _top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets (unequal blocks list their sizes with commas)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def piece_sizes(size: int, p: Placement, n: int) -> tuple[int, ...]:
    """The length of each rank's piece of a dim of ``size`` that ``p`` splits over ``n`` ranks
    (``torch.chunk``'s sizes; in units of the grain for an uneven split; of each block for a
    blocked split: a rank holds that much of every block).

    >>> piece_sizes(8, S(0), 4)
    (2, 2, 2, 2)
    >>> piece_sizes(36 * 2, S(0, grain=2), 8)  # 36 heads of 2 over 8 ranks: 5 heads each, 1 on the last
    (10, 10, 10, 10, 10, 10, 10, 2)
    """
    grain = p.grain or 1
    units = size // p.blocks // grain
    per = -(-units // n)
    return tuple(max(0, min(per, units - c * per)) * grain for c in range(n))


def piece_range(size: int, p: Placement, n: int, c: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``c``'s piece of a dim of ``size`` that ``p`` splits over ``n`` ranks."""
    sizes = piece_sizes(size, p, n)
    start = sum(sizes[:c])
    return start, start + sizes[c]


def axis_divisor(size: int, p: Placement, n: int) -> float:
    """How many times smaller than ``size`` the largest piece is: ``n`` for an even split, less for an
    uneven one (36 heads over 8 ranks: the largest piece is 5 heads, 36 / 5 = 7.2)."""
    if not p.is_uneven:
        return float(n)
    return size / p.blocks / max(piece_sizes(size, p, n))


def shard_divisor(shape: Sequence[int], placements: Iterable[Placement], mesh_shape: Sequence[int]) -> float:
    """How many pieces the tensor is cut into (product of axis sizes over the sharded axes); for an
    uneven split, the full size over the largest piece's (what the slowest rank holds)."""
    return math.prod(axis_divisor(shape[p.dim], p, n) if p.is_uneven else n
                     for p, n in zip(placements, mesh_shape) if p.is_shard)


def dim_pieces(placements: Iterable[Placement], mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces dim ``dim`` is cut into (product of the sizes of the axes that split it)."""
    return math.prod(n for p, n in zip(placements, mesh_shape) if p.is_shard and p.dim == dim)


def dim_divisor(placements: Iterable[Placement], mesh_shape: Sequence[int], dim: int) -> int:
    """What the size of dim ``dim`` must be a multiple of for the placements to split it evenly: the
    axes that split it, times the blocks of a blocked split (each block splits over its axes); an
    uneven split needs whole units: its grain. Unequal blocks need ``n`` here; that each block splits
    evenly is :func:`local_shape`'s check (and the strategies')."""
    return math.prod((p.grain * p.blocks if p.is_uneven else n if p.is_unequal else n * p.blocks)
                     for p, n in zip(placements, mesh_shape) if p.is_shard and p.dim == dim)


def local_shape(shape: Sequence[int], placements: Iterable[Placement], mesh_shape: Sequence[int],
                coordinate: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The shape each rank holds: sharded dims divided by the sizes of the axes that split them. An
    uneven split's piece depends on the rank: give its ``coordinate`` on the mesh."""
    out = list(shape)
    for a, (p, n) in enumerate(zip(placements, mesh_shape)):
        if p.is_uneven:
            if coordinate is None:
                raise ValueError(f"{p} splits dim {p.dim} unevenly: the local shape depends on the rank's coordinate")
            out[p.dim] = piece_sizes(out[p.dim], p, n)[coordinate[a]] * p.blocks
        elif p.is_unequal:
            if sum(p.sizes) != out[p.dim] or any(b % n for b in p.sizes):
                raise ValueError(f"dim {p.dim} of size {out[p.dim]} is not blocks {list(p.sizes)} that each split "
                                 f"evenly over {n} ranks")
            out[p.dim] //= n
        elif p.is_shard:
            if out[p.dim] % (n * p.blocks):
                raise ValueError(f"dim {p.dim} of size {out[p.dim]} does not split evenly over {n} ranks"
                                 + (f" in each of its {p.blocks} blocks" if p.is_blocked else ""))
            out[p.dim] //= n
    return tuple(out)
