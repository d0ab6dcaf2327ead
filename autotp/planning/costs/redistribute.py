"""Redistribution: the collectives that turn one placement into another, forward and backward.

Both the cost model and the runtime read these steps, so what is priced is what runs. Per mesh
axis, ``src → dst``:

==========  ==================  =====================================================
src → dst   forward             backward (the gradient goes dst → src)
==========  ==================  =====================================================
R → S(d)    slice (free)        all_gather
R → P       keep on one rank    nothing (the gradient of a sum is the same everywhere)
S(d) → R    all_gather          slice (free)
S(d)→S(e)   all_to_all          all_to_all
P → R       all_reduce          nothing
P → S(d)    reduce_scatter      all_gather
S(d) → P    not allowed
Pd → P      nothing (a sum of disjoint parts is a partial sum)
x → Pd      not allowed unless x is Pd (the parts' support is the producer's)
St, Se, Pt  to and from nothing else (routed rows stay in their region)
==========  ==================  =====================================================

From ``Pd`` every step is ``P``'s.

An uneven split ``S(d)~g`` (:mod:`autotp.planning.rules.uneven`) takes part only in the slice, the gather
and the reduce_scatter: the runtime pads each piece to the largest before the collective and
trims after it, and the cost model prices the padded size. So do unequal blocks ``S(d)[s1,s2,...]``:
they are a plain split of the tensor with dim ``d`` taken in the ranks' order
(:func:`autotp.placement.block_permutation`), so the runtime reorders a whole (or partial) tensor
into that order before the steps and a gathered one back after them (one local copy each).

Steps that shrink or keep the tensor run first, gathers last, so collectives move as few bytes as
the two placements allow, but in an order every intermediate layout is valid: a dim split on two
axes is split by the outer axis (lower index) first, then each piece by the inner one (DTensor's
``(S(0), S(0))``), so a step on axis ``a`` that splits or gathers dim ``d`` waits until no axis
after ``a`` holds ``S(d)``. Where every remaining step waits (``(S(0), S(1)) -> (S(1), S(0))``),
the inner axis in the way is gathered first and split again later.

When the readers of a gathered tensor (``S(d) → R``) work on shards of that axis, the gradient
they return is a partial sum; the backward of the gather then reduce-scatters it (``grad_axes``)
instead of slicing a gradient that would need a separate all_reduce: Megatron's sequence-parallel
pairing of all_gather forward with reduce_scatter backward.

**Local copies.** Collectives move whole buffers along dim 0, so a step on any other dim
rearranges memory on the rank, and the runtime (:mod:`autotp.local.collectives`) does it with one copy
kernel each; its all_reduce (PyTorch's functional one, which leaves its input untouched) reduces
into a clone of the input. Bytes read plus written, for a contiguous input; ``size`` is the full
tensor along the axis, ``shard = size / n``:

=================  =====================================================  ==================
primitive          copies                                                 when
=================  =====================================================  ==================
slice S(d)         the shard out of the tensor: ``2 shard``               d not leading
all_gather S(d)    the shard to dim 0 first, the result back: ``2 shard``  d not leading
                   and ``2 size``
reduce_scatter     the input to dim 0 first, the shard back: ``2 size``    d not leading
S(d)               and ``2 shard``
all_to_all         the pieces stacked, the received ones concatenated:    always
                   ``2 shard`` each
R -> P             rank 0 keeps a clone: ``2 size``                        always
all_reduce         its input cloned, then reduced in place: ``2 size``     always
                   (P -> R, and every gradient reduction)
=================  =====================================================  ==================

A dim is *leading* when every dim before it has size 1: moving it to the front is then a view
of the same memory. :func:`step_copies` lists them per step, forward and backward, and the cost
model prices each as a memory-bound kernel, so what is priced is what runs here too.

>>> from autotp.placement import R, S, P
>>> [str(s) for s in conversion_steps((S(0), P), (R, R), (2, 4))]
['axis 1: P -> R (forward all_reduce)', 'axis 0: S(0) -> R (forward all_gather)']
>>> step, = conversion_steps((S(2),), (R,), (2,))  # gather the last dim of a (4, 8, 16) float32
>>> step_copies(step, (4, 8, 16), 2, 8192.0)  # forward: the shard in, the result out; backward: a slice
((8192.0, 16384.0), (8192.0,))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

from autotp.placement import Placement, S, axis_divisor, summed

__all__ = ["Step", "Conversion", "conversion", "unblocked", "conversion_steps", "step_kinds", "is_convertible",
           "fused_axes", "reduced_axes", "step_copies", "step_bytes",
           "all_reduce_copies"]


@dataclass(frozen=True)
class Step:
    """One axis of a redistribution; ``cuts`` are the dims the other axes cut the tensor along and
    in how many pieces (``(dim, pieces)`` per other axis; for an uneven split, the full size over
    its largest piece, which may be fractional: the largest piece is what the step moves)."""

    axis: int
    src: Placement
    dst: Placement
    forward: Optional[str]
    backward: Optional[str]
    cuts: tuple[tuple[int, float], ...] = ()

    @property
    def divisor(self) -> int:
        """How many pieces the other axes cut the tensor into."""
        return math.prod(pieces for _, pieces in self.cuts)

    def __str__(self) -> str:
        what = f"forward {self.forward}" if self.forward else "free"
        return f"axis {self.axis}: {self.src} -> {self.dst} ({what})"


def step_kinds(src: Placement, dst: Placement) -> tuple[Optional[str], Optional[str]]:
    """(forward collective, backward collective) of one axis; ValueError for S → P."""
    if src == dst:
        return None, None
    if src.is_replicate:
        return (None, "all_gather") if dst.is_shard else (None, None)
    if src.is_shard:
        if dst.is_replicate:
            return "all_gather", None
        if dst.is_shard:
            return "all_to_all", "all_to_all"
        raise ValueError(f"cannot redistribute {src} -> {dst}")
    # src is partial
    return ("all_reduce", None) if dst.is_replicate else ("reduce_scatter", "all_gather")


def is_convertible(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether ``src`` redistributes to ``dst``: not ``S -> P``, and an uneven split ``S(d)~g`` only
    gathered (padded to its largest piece), sliced from a whole tensor or reduce-scattered from a
    partial sum, never moved to another split; nothing becomes ``Pd`` but a ``Pd``; routed rows
    (``St``, ``Se``, ``Pt``) stay as they are."""
    return _is_convertible(tuple(src), tuple(dst))


@lru_cache(maxsize=1 << 14)  # asked once per read of every layer: the same few pairs over and over
def _is_convertible(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> bool:
    if any(d.disjoint and s != d for s, d in zip(src, dst)):
        return False
    if any((s.routed or d.routed) and s != d for s, d in zip(src, dst)):
        return False
    src, dst = summed(src), summed(dst)
    for s, d in zip(src, dst):
        if s != d and (((s.is_uneven or s.is_unequal) and not d.is_replicate)
                       or ((d.is_uneven or d.is_unequal) and s.is_shard)):
            return False
    viewed = unblocked(src, dst)
    return viewed is not None and not any(s.is_shard and d.is_partial for s, d in zip(viewed[1], viewed[2]))


def unblocked(src: Sequence[Placement], dst: Sequence[Placement]
              ) -> Optional[tuple[Optional[tuple[int, int]], tuple[Placement, ...], tuple[Placement, ...]]]:
    """``(view, src, dst)``: a redistribution with a blocked split ``S(d)[k]`` as one of plain
    placements of the tensor viewed with dim ``d`` as ``(k, block)``, where the blocked split is
    ``S(d + 1)`` and later dims move up by one; ``view`` is ``(d, k)`` (None when nothing is blocked).
    None when the two do not convert: blocks of two kinds, one dim both blocked and plainly split, or
    unequal blocks moved to another axis.

    >>> from autotp.placement import R, S
    >>> unblocked((S(1, 3),), (R,))
    ((1, 3), (S(2),), (R,))
    >>> unblocked((S(1, 3),), (S(1),)) is None
    True
    """
    blocked = {(p.dim, p.blocks) for p in (*src, *dst) if p.is_blocked and not p.is_unequal}
    unequal = {p for p in (*src, *dst) if p.is_unequal}
    if unequal:  # a plain split of the tensor reordered (Conversion.reorder_before / reorder_after)
        (u,) = unequal if len(unequal) == 1 and not blocked else (None,)
        if u is None or any(p.is_shard and p.dim == u.dim and p != u for p in (*src, *dst)):
            return None
        held = [{a for a, p in enumerate(side) if p == u} for side in (src, dst)]
        if all(held) and held[0] != held[1]:  # moved to another axis: each axis size has its own order
            return None
        return None, tuple(S(p.dim) if p == u else p for p in src), tuple(S(p.dim) if p == u else p for p in dst)
    if not blocked:
        return None, tuple(src), tuple(dst)
    if len(blocked) > 1:
        return None
    ((d, k),) = blocked
    if any(p.is_shard and p.dim == d and not p.is_blocked for p in (*src, *dst)):
        return None

    def move(p: Placement) -> Placement:
        return Placement("S", p.dim + 1, 1, p.grain) if p.is_shard and p.dim >= d else p

    return (d, k), tuple(move(p) for p in src), tuple(move(p) for p in dst)


@dataclass(frozen=True)
class Conversion:
    """A redistribution as priced and run: ``steps`` on the tensor of ``shape``, which is the
    tensor itself or, where ``view`` is ``(d, k)``, the tensor with dim ``d`` unflattened to
    ``(k, -1)`` (flattened back after the steps)."""

    view: Optional[tuple[int, int]]
    shape: tuple[int, ...]
    steps: tuple[Step, ...]
    # unequal blocks (axis, placement): the whole tensor reordered into the ranks' order before the
    # steps (from R or P), or the gathered one put back in place after them (to R)
    reorder_before: Optional[tuple[int, Placement]] = None
    reorder_after: Optional[tuple[int, Placement]] = None


def conversion(shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement],
               mesh_shape: Sequence[int], grad_axes: Sequence[int] = ()) -> Conversion:
    """The steps of ``src -> dst`` for a tensor of ``shape``, blocked splits included (``Rg`` is
    ``R`` here: whether its gradient is partial is the caller's business)."""
    if not is_convertible(src, dst):
        raise ValueError(f"cannot redistribute {''.join(map(str, src))} -> {''.join(map(str, dst))}: only a "
                         "sum of disjoint parts (Pd) becomes one")
    return _conversion(tuple(shape), summed(src), summed(dst), tuple(mesh_shape), tuple(grad_axes))


@lru_cache(maxsize=1 << 14)  # the program asks once per read of every layer, and the layers read alike
def _conversion(shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...],
                mesh_shape: tuple[int, ...], grad_axes: tuple[int, ...]) -> Conversion:
    viewed = unblocked(src, dst)
    if viewed is None or not is_convertible(src, dst):
        raise ValueError(f"cannot redistribute {''.join(map(str, src))} -> {''.join(map(str, dst))}: "
                         "blocks of two kinds, a dim both blocked and split plainly, an uneven split "
                         "moved to another split, or unequal blocks moved to another mesh axis")
    view, src_v, dst_v = viewed
    shape = tuple(shape)
    if view is not None:
        d, k = view
        shape = shape[:d] + (k, shape[d] // k) + shape[d + 1:]
    before = after = None
    for a, (s, d) in enumerate(zip(src, dst)):
        if s != d and d.is_unequal:
            before = (a, d)
        if s != d and s.is_unequal:
            after = (a, s)
    return Conversion(view, shape, tuple(conversion_steps(src_v, dst_v, mesh_shape, grad_axes, shape)),
                      before, after)


def fused_axes(src: Sequence[Placement], dst: Sequence[Placement], grad_axes: Sequence[int]) -> tuple[int, ...]:
    """Axes of ``grad_axes`` whose partial gradient the gather's backward reduce-scatters."""
    return tuple(a for a in grad_axes if src[a].is_shard and dst[a].is_replicate)


def reduced_axes(src: Sequence[Placement], dst: Sequence[Placement], grad_axes: Sequence[int]) -> tuple[int, ...]:
    """Axes of ``grad_axes`` whose partial gradient a read from ``src`` all-reduces itself: not those a
    gather's backward reduce-scatters (:func:`fused_axes`), nor those where ``src`` is ``Rg`` (its
    producer passes the partial gradient on, to be summed further up)."""
    fused = fused_axes(src, dst, grad_axes)
    return tuple(a for a in grad_axes if a not in fused and not src[a].grad_partial)


def conversion_steps(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int],
                     grad_axes: Sequence[int] = (), shape: Optional[Sequence[int]] = None) -> list[Step]:
    """The ordered steps that turn ``src`` into ``dst`` (only the axes that change).

    ``grad_axes``: axes on which the readers return partial gradients (see the module docstring).
    ``shape``: the tensor's, needed where another axis splits it unevenly (:attr:`Step.cuts`).
    """
    if any(p.is_blocked for p in (*src, *dst)):
        raise ValueError("blocked splits convert on a view of the tensor: use conversion(shape, src, dst, ...)")
    if not is_convertible(src, dst):
        raise ValueError(f"cannot redistribute {''.join(map(str, src))} -> {''.join(map(str, dst))}")
    current = list(src)
    steps: list[Step] = []
    changing = [a for a in range(len(src)) if src[a] != dst[a]]
    gathers = [a for a in changing if src[a].is_shard and dst[a].is_replicate]
    pending = [a for a in changing if a not in gathers] + gathers  # preferred order

    def blocked(a: int, target: Placement) -> Optional[int]:
        """The innermost axis after ``a`` that splits a dim this step splits or gathers, if any."""
        dims = {p.dim for p in (current[a], target) if p.is_shard}
        inner = [b for b in range(a + 1, len(current)) if current[b].is_shard and current[b].dim in dims]
        return inner[-1] if inner else None

    def step(a: int, target: Placement) -> None:
        fwd, bwd = step_kinds(current[a], target)
        if a in grad_axes and src[a].is_shard and dst[a].is_replicate and target == dst[a]:
            bwd = "reduce_scatter"
        was = current[a]
        current[a] = target
        cuts = tuple((p.dim, _pieces(p, n, shape)) for b, (p, n) in enumerate(zip(current, mesh_shape))
                     if b != a and p.is_shard)
        steps.append(Step(a, was, target, fwd, bwd, cuts))

    def blocks_another(a: int) -> bool:
        """Would this step's split make a pending step on an outer axis wait?"""
        return dst[a].is_shard and any(
            c < a and dst[a].dim in {p.dim for p in (current[c], dst[c]) if p.is_shard} for c in pending)

    while pending:
        free = [a for a in pending if blocked(a, dst[a]) is None]
        ready = next((a for a in free if not blocks_another(a)), None)
        waiting = [blocked(a, dst[a]) for a in pending if blocked(a, dst[a]) is not None]
        if ready is None and waiting:
            # the steps left wait on an inner axis: gather the innermost one in the way, split it later
            b = max(waiting)
            step(b, Placement("R"))
            if b not in pending:
                pending.append(b)
            continue
        pending.remove(ready)  # set: the outermost pending step waits on nothing and delays nothing
        step(ready, dst[ready])
    return steps


def _pieces(p: Placement, n: int, shape: Optional[Sequence[int]]) -> float:
    """How many times smaller than the tensor the largest piece ``p`` cuts along its dim is."""
    if not p.is_uneven:
        return n
    if shape is None:
        raise ValueError(f"{p} splits unevenly: the steps need the tensor's shape")
    return axis_divisor(shape[p.dim], p, n)


def step_bytes(step: Step, shape: Sequence[int], nbytes: float, mesh_shape: Sequence[int]) -> float:
    """Bytes of the collective of ``step`` on a tensor of ``nbytes`` (``shape``: the one the steps run
    on, :attr:`Conversion.shape`), as the profile sizes its kind: the tensor cut by the other axes,
    and for an uneven split, every piece padded to the largest (what the runtime sends); for an
    all_to_all (``S(d) -> S(e)``), one rank's buffer, its piece of that: the profile, as nccl-tests,
    times an all_to_all by the buffer each rank sends from."""
    size = nbytes / step.divisor
    if step.forward == "all_to_all":  # never uneven: an uneven split is only gathered or sliced
        return size / mesh_shape[step.axis]
    uneven = next((p for p in (step.src, step.dst) if p.is_uneven), None)
    if uneven is not None:
        n = mesh_shape[step.axis]
        size *= n / axis_divisor(shape[uneven.dim], uneven, n)
    return size


def reorder_copies(conv: Conversion, nbytes: float) -> list[tuple[int, float]]:
    """``(axis, bytes read plus written)`` of each reorder of unequal blocks ``conv`` runs (an
    ``index_select`` of the tensor whole along the dim, in the forward; its backward, an ``index_add``,
    moves as much). ``nbytes``: the tensor's, an upper bound where another axis cuts it."""
    return [(axis, 2.0 * nbytes) for axis, _ in (r for r in (conv.reorder_before, conv.reorder_after) if r)]


def all_reduce_copies(size_bytes: float) -> tuple[float, ...]:
    """Bytes of the copy kernels the runtime's all_reduce of ``size_bytes`` runs: one clone of its
    input, which it then reduces in place (the forward of ``P -> R`` and every gradient reduction)."""
    return (2.0 * size_bytes,)


def step_copies(step: Step, shape: Sequence[int], n: int, nbytes: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Bytes (read plus written) of each local copy kernel the runtime runs for ``step``: forward,
    then backward (the backward ones run only for a tensor that carries a gradient, in training).

    ``shape`` is the tensor's (full) shape, ``n`` the size of the step's mesh axis, ``nbytes`` the
    full tensor's bytes. See the module docstring for the table. Whether a dim is leading is judged
    on the tensor the step runs on: the full shape cut by the other axes (``step.cuts``).
    """
    size = nbytes / step.divisor
    shard = size / n
    local = list(shape)
    for dim, pieces in step.cuts:
        local[dim] = max(1, round(local[dim] / pieces))

    def moved(dim: int) -> bool:  # a copy is needed to bring ``dim`` to the front, or back
        return math.prod(local[:dim]) > 1

    def sliced(dim: int) -> tuple[float, ...]:
        return (2 * shard,) if moved(dim) else ()

    def gathered(dim: int) -> tuple[float, ...]:
        return (2 * shard, 2 * size) if moved(dim) else ()

    def scattered(dim: int) -> tuple[float, ...]:
        return (2 * size, 2 * shard) if moved(dim) else ()

    s, d = step.src, step.dst
    if s.is_replicate:
        if d.is_shard:
            return sliced(d.dim), gathered(d.dim)
        return (2 * size,), ()  # R -> P
    if s.is_shard:
        if d.is_shard:
            return (2 * shard, 2 * shard), (2 * shard, 2 * shard)
        return gathered(s.dim), (scattered(s.dim) if step.backward == "reduce_scatter" else sliced(s.dim))
    if d.is_shard:  # P -> S(d)
        return scattered(d.dim), gathered(d.dim)
    return all_reduce_copies(size), ()  # P -> R
