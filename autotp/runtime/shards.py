"""Shards: this rank's piece of a tensor under autotp's placements, and the DTensor that holds it.

:func:`local_shard` cuts a rank's piece from a whole tensor, :func:`local_ranges` says where it lies
(what ``autotp.load_weights`` reads from a file), and :func:`as_dtensor` wraps a piece as the
DTensor a parallel module's parameter is. DTensor's placements say less than autotp's: a blocked
split is a ``_StridedShard``, an uneven split of whole heads a ``Shard`` whose pieces DTensor would
size by elements, so :func:`placements_of` reads autotp's own from where the rewrite records them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotp.placement import Placement, block_permutation, piece_range

__all__ = ["local_shard", "local_ranges", "as_dtensor", "placements_of", "from_dtensor", "dtensor_placements",
           "block_index"]


def block_index(p: Placement, n: int, size: int, inverse: bool = False) -> torch.Tensor:
    """The ``index_select`` index that takes a dim of ``size`` into the order in which ``n`` ranks hold
    unequal blocks ``p`` (:func:`autotp.placement.block_permutation`), or, ``inverse``, back from it."""
    order = torch.tensor(block_permutation(p, n, size))
    return torch.argsort(order) if inverse else order


def local_shard(full: torch.Tensor, placements: tuple[Placement, ...], coordinate: list[int],
                mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of a full tensor."""
    out = full
    for p, c, n in zip(placements, coordinate, mesh_shape):
        if p.is_unequal:  # the rank's piece of each block, blocks of unequal sizes
            out = torch.cat([b.chunk(n, dim=p.dim)[c] for b in out.split(list(p.sizes), dim=p.dim)], dim=p.dim)
        elif p.is_blocked and p.is_uneven:  # the rank's whole units of each block
            start, stop = piece_range(out.shape[p.dim], p, n, c)
            out = out.unflatten(p.dim, (p.blocks, -1)).narrow(p.dim + 1, start, stop - start).flatten(p.dim, p.dim + 1)
        elif p.is_blocked:  # the rank's piece of each block, in block order
            out = out.unflatten(p.dim, (p.blocks, -1)).chunk(n, dim=p.dim + 1)[c].flatten(p.dim, p.dim + 1)
        elif p.is_uneven:  # whole units, torch.chunk's count of them (some ranks may hold none)
            start, stop = piece_range(out.shape[p.dim], p, n, c)
            out = out.narrow(p.dim, start, stop - start)
        elif p.is_shard:
            out = out.chunk(n, dim=p.dim)[c]
    out = out.contiguous()
    if out.untyped_storage().nbytes() > out.numel() * out.element_size():
        out = out.clone()  # a piece of a larger storage (a dim-0 chunk is a view): hold only the piece
    return out


def local_ranges(shape: tuple[int, ...], placements: tuple[Placement, ...], coordinate: list[int],
                 mesh_shape: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per dim, the ``(start, stop)`` ranges of this rank's piece of a tensor of ``shape``, in order:
    what :func:`local_shard` keeps (axis 0 splits first, ``torch.chunk``'s sizes). A dim has one
    range, or one per block where a blocked split cuts it.

    >>> from autotp.placement import R, S
    >>> local_ranges((8, 6), (S(0), S(0)), [1, 0], (2, 2))  # rows 4..5 of 8, every column
    (((4, 6),), ((0, 6),))
    >>> local_ranges((12, 2), (S(0, 3),), [1], (2,))  # the second half of each block of 4 rows
    (((2, 4), (6, 8), (10, 12)), ((0, 2),))
    >>> local_ranges((10, 2), (S(0, grain=2),), [1], (2,))  # 5 units of 2 rows: 3 on rank 0, 2 here
    (((6, 10),), ((0, 2),))
    >>> local_ranges((8, 2), (S(0, (4, 2, 2)),), [1], (2,))  # blocks of 4, 2 and 2 rows
    (((2, 4), (5, 6), (7, 8)), ((0, 2),))
    """
    ranges = [((0, n),) for n in shape]
    for p, c, n in zip(placements, coordinate, mesh_shape):
        if not p.is_shard:
            continue
        cut = []
        for lo, hi in ranges[p.dim]:
            width = (hi - lo) // p.blocks
            starts = [lo + sum(p.sizes[:j]) if p.is_unequal else lo + j * width for j in range(p.blocks)] + [hi]
            for j in range(p.blocks):
                b_lo, b_hi = starts[j], starts[j + 1]
                if p.is_uneven:  # whole units
                    start, stop = piece_range(b_hi - b_lo, Placement("S", p.dim, 1, p.grain), n, c)
                    cut.append((b_lo + start, b_lo + stop))
                    continue
                size = -(-(b_hi - b_lo) // n)  # torch.chunk: ceil
                cut.append((min(b_lo + c * size, b_hi), min(b_lo + (c + 1) * size, b_hi)))
        ranges[p.dim] = tuple(cut)
    return tuple(ranges)


def dtensor_placements(placements: tuple[Placement, ...]) -> list:
    from torch.distributed.tensor.placement_types import _StridedShard

    # unequal blocks have no DTensor placement: a Shard of the dim (autotp's own placements say more)
    return [_StridedShard(p.dim, split_factor=p.blocks) if p.is_blocked and not p.is_unequal
            else Shard(p.dim) if p.is_shard else Replicate() for p in placements]


def placements_of(value: Any) -> tuple[Placement, ...]:
    """autotp's placements of a parameter of a module from :func:`build_parallel_module` (or of any
    DTensor): the rewrite records them on the parameter, where an uneven split's grain is kept (for
    ``DTensor`` a split of whole heads is a ``Shard`` whose pieces it cannot size). ``module.to()``
    makes new parameters without them: the module's ``autotp_placements`` (by name) keeps them."""
    own = getattr(value, "_autotp_placements", None)
    return own if own is not None else from_dtensor(value.placements)


def from_dtensor(placements: Any) -> tuple[Placement, ...]:
    """autotp's placements of a DTensor's: ``Shard``, a blocked split's ``_StridedShard``, or ``R``
    (the inverse of the placements :func:`build_parallel_module` gives its DTensors)."""
    return tuple(Placement("S", p.dim, getattr(p, "split_factor", 1)) if hasattr(p, "dim") else Placement("R")
                 for p in placements)


def as_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: Any,
             sized: bool = False) -> DTensor:
    """The DTensor of this rank's piece ``local`` of a tensor of ``shape``. Where the pieces may differ in
    size (an uneven split; ``sized``: a plain split of a dim the ranks do not divide), the global shape
    is given, with the stride DTensor derives from the local piece (autograd copies a gradient whose
    stride differs from its parameter's into a buffer DTensor sizes evenly, which fails)."""
    dplacements = dtensor_placements(placements)
    if not sized and not any(p.is_uneven for p in placements):
        return DTensor.from_local(local, mesh, dplacements, run_check=False)
    from torch.distributed.tensor._utils import compute_global_tensor_info

    _, stride = compute_global_tensor_info(local, mesh, dplacements)
    return DTensor.from_local(local, mesh, dplacements, run_check=False, shape=tuple(shape), stride=tuple(stride))
