"""Batch norm in training on split data (:mod:`autotp.planning.rules.norms`).

``ShardedBatchNorm`` stands for ``aten.batch_norm(input, weight, bias, running_mean, running_var,
True, momentum, eps, cudnn_enabled)`` where the plan split the input's batch or space (over the
``stat_groups``) and/or its channels (this rank holds channels ``[start, stop)``). It takes the
same arguments, the parameters cut like the channels and the running statistics whole. Forward:
the per-channel sums and the element count, all-reduced; the mean; the centred sums of squares,
all-reduced; the biased variance normalizes, the unbiased one goes into the running variance,
as one device's batch norm does. Backward: the sums of the output gradient and of its product with
the normalized input, all-reduced, give the input's gradient; the weight's and bias's gradients
are this rank's own sums (partial over the batch axes: the plan's gradient reduction adds them).
Statistics are computed in float32 (float64 for a float64 input). The running statistics: every rank computes the same global
values for its channels; where channels are split, the new values are placed into a zero vector of
all channels and summed over the ``channel_groups``, so every rank writes every channel, the same.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

__all__ = ["ShardedBatchNorm"]


def _sum(x: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    for group in groups:
        x = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    return x


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics in float32 at least (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _shape(x: torch.Tensor) -> list[int]:
    """Broadcast shape of a per-channel vector against ``x`` (channels on dim 1)."""
    return [1, -1] + [1] * (x.ndim - 2)


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],  # type: ignore[override]
                eps: float, groups: tuple):
        dims = [d for d in range(x.ndim) if d != 1]
        xf = x.to(_compute_dtype(x))
        local_count = xf.numel() // max(xf.shape[1], 1)
        sums = _sum(torch.cat([xf.sum(dims), xf.new_full((1,), float(local_count))]), groups)
        count = sums[-1]
        mean = sums[:-1] / count
        centred = xf - mean.view(_shape(x))
        var = _sum(centred.square().sum(dims), groups) / count
        invstd = torch.rsqrt(var + eps)
        xhat = centred * invstd.view(_shape(x))
        y = xhat
        if weight is not None:
            y = y * weight.to(xf.dtype).view(_shape(x))
        if bias is not None:
            y = y + bias.to(xf.dtype).view(_shape(x))
        ctx.save_for_backward(xhat, invstd, weight if weight is not None else invstd.new_ones(()), count)
        ctx.has_weight, ctx.has_bias, ctx.groups, ctx.dtype = weight is not None, bias is not None, groups, x.dtype
        ctx.mark_non_differentiable(mean, var, count)
        return y.to(x.dtype), mean, var, count

    @staticmethod
    def backward(ctx, grad: torch.Tensor, *_unused):  # type: ignore[override]
        xhat, invstd, weight, count = ctx.saved_tensors
        dims = [d for d in range(grad.ndim) if d != 1]
        g = grad.to(xhat.dtype)
        sum_g = g.sum(dims)
        sum_g_xhat = (g * xhat).sum(dims)
        both = _sum(torch.stack([sum_g, sum_g_xhat]), ctx.groups) / count
        scale = invstd * (weight.to(g.dtype) if ctx.has_weight else 1.0)
        dx = (g - both[0].view(_shape(g)) - xhat * both[1].view(_shape(g))) * scale.view(_shape(g))
        dw = sum_g_xhat.to(weight.dtype) if ctx.has_weight else None
        db = sum_g.to(weight.dtype if ctx.has_weight else grad.dtype) if ctx.has_bias else None
        return dx.to(ctx.dtype), dw, db, None, None


class ShardedBatchNorm(nn.Module):
    """Synchronized batch norm over this rank's piece; called like ``aten.batch_norm``."""

    def __init__(self, start: int, stop: int, channels: int, stat_groups: Sequence[dist.ProcessGroup],
                 channel_groups: Sequence[dist.ProcessGroup], axis_names: Sequence[str]) -> None:
        super().__init__()
        self.start, self.stop, self.channels = start, stop, channels
        self.stat_groups, self.channel_groups = tuple(stat_groups), tuple(channel_groups)
        self.axis_names = tuple(axis_names)

    def extra_repr(self) -> str:
        return f"channels [{self.start}, {self.stop}) of {self.channels}, statistics summed over {list(self.axis_names)}"

    def forward(self, input: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                running_mean: Optional[torch.Tensor] = None, running_var: Optional[torch.Tensor] = None,
                training: bool = True, momentum: float = 0.1, eps: float = 1e-5,
                cudnn_enabled: bool = False) -> torch.Tensor:
        y, mean, var, count = _Normalize.apply(input, weight, bias, eps, self.stat_groups)
        if running_mean is not None or running_var is not None:
            with torch.no_grad():
                new = torch.stack([mean, var * count / (count - 1).clamp(min=1)])  # the unbiased variance
                if self.channel_groups:  # every channel's new values, from the rank that holds it
                    whole = new.new_zeros(2, self.channels)
                    whole[:, self.start:self.stop] = new
                    new = _sum(whole, self.channel_groups)
                for running, value in zip((running_mean, running_var), new):
                    if running is not None:
                        running.mul_(1.0 - momentum).add_(value.to(running.dtype), alpha=momentum)
        return y
