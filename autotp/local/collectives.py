"""The runtime's collectives: autograd-aware modules, one per redistribution step of a plan.

Each module is a graph node of the rewritten model (``call_module``), so printing the graph shows
every collective the plan pays for. Forward and backward follow the table in
:mod:`autotp.planning.costs.redistribute`; all of them use ``torch.distributed``'s functional collectives (the
ones ``CommDebugMode`` counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.placement import Placement

__all__ = ["RedistributeStep", "GradAllReduce", "MaskedEmbedding", "to_local"]


# torch 2.13 names the dim-0 collectives *_single; older releases only have *_tensor
_all_gather_dim0 = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_dim0 = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    # concatenating along dim 0 of the moved tensors is concatenating along ``dim``
    # one copy each way unless ``dim`` is leading (autotp.planning.costs.redistribute.step_copies prices them)
    if dim == 0:  # the collective's own output: no view of anything (see _Step.forward)
        return funcol.wait_tensor(_all_gather_dim0(x.contiguous(), 0, group))
    front = x.movedim(dim, 0).contiguous()
    return funcol.wait_tensor(_all_gather_dim0(front, 0, group)).movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    if dim == 0:
        return funcol.wait_tensor(_reduce_scatter_dim0(x.contiguous(), "sum", 0, group))
    front = x.movedim(dim, 0).contiguous()
    return funcol.wait_tensor(_reduce_scatter_dim0(front, "sum", 0, group)).movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _slice(x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    return x.chunk(n, dim=dim)[rank].contiguous()


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size``."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _gather_uneven(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: tuple[int, ...]) -> torch.Tensor:
    """Gather pieces of lengths ``sizes`` along ``dim``: each padded to the largest, then trimmed."""
    top = max(sizes)
    full = _gather(_pad_to(x, dim, top), dim, group)
    return torch.cat([piece.narrow(dim, 0, n) for piece, n in zip(full.split(top, dim), sizes)], dim=dim)


def _slice_uneven(x: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def _reduce_scatter_uneven(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: tuple[int, ...],
                           rank: int) -> torch.Tensor:
    """Sum over the ranks and keep piece ``rank`` of lengths ``sizes``: every piece padded to the largest."""
    top = max(sizes)
    padded = torch.cat([_pad_to(piece, dim, top) for piece in x.split(list(sizes), dim)], dim=dim)
    return _reduce_scatter(padded, dim, group).narrow(dim, 0, sizes[rank])


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sharded on ``src_dim`` → sharded on ``dst_dim``."""
    pieces = torch.stack(x.chunk(n, dim=dst_dim), dim=0).contiguous()  # (n, *local chunk)
    received = funcol.wait_tensor(funcol.all_to_all_single(pieces, None, None, group))
    return torch.cat(received.unbind(0), dim=src_dim)


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module: "RedistributeStep"):  # type: ignore[override]
        ctx.module = module
        out = module.run_forward(x)
        if out._base is not None and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            # a view made inside a custom Function cannot be modified in place afterwards (``h += attn``
            # after a reduce-scatter): a view of the collective's own buffer drops the view relation (no
            # copy). A slice of the input stays a view of it; the rewrite copies it before an op that
            # writes into it (autotp.runtime.rewrite)
            out = out.detach()
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.module.run_backward(grad), None


class RedistributeStep(nn.Module):
    """One axis of a redistribution ``src → dst`` on a mesh axis (see :mod:`autotp.planning.costs.redistribute`).
    ``sizes``: for an uneven split (``src`` or ``dst``), each rank's length along its dim."""

    def __init__(self, src: Placement, dst: Placement, axis_name: str, group: dist.ProcessGroup,
                 n: int, rank: int, reduce_grad: bool = False, sizes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.src, self.dst, self.axis_name = src, dst, axis_name
        self.group, self.n, self.rank = group, n, rank
        self.reduce_grad = reduce_grad  # S -> R whose readers return partial gradients
        self.sizes = tuple(sizes) if sizes is not None else None
        if (src.is_uneven or dst.is_uneven) and (self.sizes is None or len(self.sizes) != n):
            raise ValueError(f"{src} -> {dst} over {n} ranks needs each rank's length along the dim, got {sizes}")

    def extra_repr(self) -> str:
        extra = ", backward reduce_scatter" if self.reduce_grad else ""
        pieces = f", pieces {list(self.sizes)}" if self.sizes else ""
        return f"{self.src} -> {self.dst} over {self.axis_name}{extra}{pieces}"

    def _gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _gather(x, dim, self.group) if self.sizes is None else _gather_uneven(x, dim, self.group, self.sizes)

    def _slice(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _slice(x, dim, self.n, self.rank) if self.sizes is None else _slice_uneven(x, dim, self.sizes, self.rank)

    def _reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.sizes is None:
            return _reduce_scatter(x, dim, self.group)
        return _reduce_scatter_uneven(x, dim, self.group, self.sizes, self.rank)

    def run_forward(self, x: torch.Tensor) -> torch.Tensor:
        s, d = self.src, self.dst
        if s.is_replicate and d.is_shard:
            return self._slice(x, d.dim)
        if s.is_replicate and d.is_partial:
            return x.clone() if self.rank == 0 else torch.zeros_like(x)
        if s.is_shard and d.is_replicate:
            return self._gather(x, s.dim)
        if s.is_shard and d.is_shard:
            return _all_to_all(x, s.dim, d.dim, self.n, self.group)
        if s.is_partial and d.is_replicate:
            return _all_reduce(x, self.group)
        if s.is_partial and d.is_shard:
            return self._reduce_scatter(x, d.dim)
        raise ValueError(f"cannot redistribute {s} -> {d}")

    def run_backward(self, g: torch.Tensor) -> torch.Tensor:
        s, d = self.src, self.dst
        if s.is_replicate and d.is_shard:
            return self._gather(g, d.dim)
        if s.is_shard and d.is_replicate:
            if self.reduce_grad:
                return self._reduce_scatter(g, s.dim)
            return self._slice(g, s.dim)
        if s.is_shard and d.is_shard:
            return _all_to_all(g, d.dim, s.dim, self.n, self.group)
        if s.is_partial and d.is_shard:
            return self._gather(g, d.dim)
        return g  # R -> P and P -> R: the gradient is the same on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return self.run_forward(x)
        return _Step.apply(x, self)


class _GradReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class GradAllReduce(nn.Module):
    """Identity forward; backward sums the partial gradients of the ranks of one mesh axis."""

    def __init__(self, axis_name: str, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.axis_name, self.group = axis_name, group

    def extra_repr(self) -> str:
        return f"backward all_reduce over {self.axis_name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x
        return _GradReduce.apply(x, self.group)


class MaskedEmbedding(nn.Module):
    """Lookup in a row-split embedding: rows outside this rank's range give zeros (a partial sum)."""

    def __init__(self, row_offset: int, local_rows: int) -> None:
        super().__init__()
        self.row_offset, self.local_rows = row_offset, local_rows

    def extra_repr(self) -> str:
        return f"rows [{self.row_offset}, {self.row_offset + self.local_rows})"

    def forward(self, weight: torch.Tensor, indices: torch.Tensor, *args) -> torch.Tensor:
        if self.local_rows == 0:  # an uneven split left this rank no rows: every lookup is zeros
            zeros = weight.new_zeros((*indices.shape, weight.shape[-1]))
            return zeros + weight.sum()  # keeps the (empty) weight in the graph: its gradient exists
        local = indices - self.row_offset
        outside = (local < 0) | (local >= self.local_rows)
        if args and isinstance(args[0], int) and args[0] >= 0:
            # padding_idx names a global row (its lookups get no gradient): this rank's index of it, or
            # none where another rank holds it (global row 0 is not every rank's first local row)
            pad = args[0] - self.row_offset
            args = (pad if 0 <= pad < self.local_rows else -1, *args[1:])
        out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), *args)
        return out.masked_fill(outside.unsqueeze(-1), 0)


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (autograd flows back into the DTensor)."""
    from torch.distributed.tensor import DTensor

    # isinstance, not hasattr: torch.compile answers hasattr on a parameter from the Tensor class
    return t.to_local() if isinstance(t, DTensor) else t
