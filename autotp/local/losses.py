"""Cross-entropy on this rank's piece of the classes (:mod:`autotp.planning.rules.losses`).

``VocabParallelCrossEntropy`` stands for ``aten.cross_entropy_loss(logits, targets, None,
reduction, ignore_index)`` where the plan split the logits' class dim: each rank holds classes
``[start, stop)``. Per row it all-reduces the largest logit (max) and then, together, the sum of
the exponents and the target's logit (sum), over the groups of the axes that split the classes,
with ``torch.distributed``'s functional collectives; the loss equals one device's. The backward
is local: ``softmax - one_hot`` on the piece, times the loss's gradient (divided by the rows
counted for a mean). It keeps the piece's softmax for it, as one device's loss keeps the
log-softmax.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

__all__ = ["VocabParallelCrossEntropy", "REDUCTIONS"]

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # ATen's reduction enum


def _reduce(x: torch.Tensor, op: str, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    for group in groups:
        x = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, group))
    return x


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, module: "VocabParallelCrossEntropy"):  # type: ignore[override]
        dim = 1 if logits.ndim >= 2 else 0
        rows = logits.movedim(dim, -1)
        shape = rows.shape[:-1]
        x = rows.reshape(-1, rows.shape[-1]).float()
        t = targets.reshape(-1)
        top = _reduce(x.max(dim=-1).values if x.shape[-1] else x.new_full((x.shape[0],), -torch.inf), "max",
                      module.groups)
        shifted = x - top.unsqueeze(-1)
        exp = shifted.exp()
        local = t - module.start
        mine = (local >= 0) & (local < x.shape[-1])
        index = local.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1) if x.shape[-1] else torch.zeros_like(top)
        sums = _reduce(torch.stack([exp.sum(-1), torch.where(mine, picked, torch.zeros_like(picked))]), "sum",
                       module.groups)
        total, target_logit = sums[0], sums[1]
        valid = t != module.ignore_index
        per_row = torch.where(valid, total.log() - target_logit, torch.zeros_like(total))
        if module.reduction == "mean":
            count = valid.sum()
            loss = per_row.sum() / count
        elif module.reduction == "sum":
            count = None
            loss = per_row.sum()
        else:
            count = None
            loss = per_row.reshape(shape)
        softmax = exp.div_(total.unsqueeze(-1))  # the piece's softmax, kept for the backward
        ctx.save_for_backward(softmax, index, mine & valid, valid, count if count is not None else torch.ones((), device=x.device))
        ctx.reduction, ctx.rows_shape, ctx.dtype, ctx.dim = module.reduction, rows.shape, logits.dtype, dim
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        softmax, index, hit, valid, count = ctx.saved_tensors
        g = grad.float()
        if ctx.reduction == "mean":
            scale = (g / count).expand(valid.shape)
        elif ctx.reduction == "sum":
            scale = g.expand(valid.shape)
        else:
            scale = g.reshape(-1)
        out = softmax.clone()
        out.scatter_add_(-1, index, -hit.to(out.dtype).unsqueeze(-1))
        out.mul_((scale * valid).unsqueeze(-1))
        out = out.reshape(ctx.rows_shape).movedim(-1, ctx.dim).to(ctx.dtype)
        return out, None, None


class VocabParallelCrossEntropy(nn.Module):
    """The loss of logits whose classes ``[start, stop)`` this rank holds (module docstring);
    ``groups``: the process groups of the mesh axes that split the classes."""

    def __init__(self, start: int, stop: int, groups: Sequence[dist.ProcessGroup], axis_names: Sequence[str],
                 reduction: int = 1, ignore_index: int = -100) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r}: expected one of {sorted(REDUCTIONS)} (ATen's enum)")
        self.start, self.stop = start, stop
        self.groups, self.axis_names = tuple(groups), tuple(axis_names)
        self.reduction, self.ignore_index = REDUCTIONS[reduction], ignore_index

    def extra_repr(self) -> str:
        return (f"classes [{self.start}, {self.stop}) over {', '.join(self.axis_names)}, "
                f"reduction={self.reduction}, ignore_index={self.ignore_index}")

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, *args) -> torch.Tensor:
        return _Loss.apply(logits, targets, self)
