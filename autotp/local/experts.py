"""A grouped matmul on the rows of this rank's experts: the experts' weights split by expert.

Tokens sorted by expert ``(S, K)``, every expert's weight ``(E, K, N)`` and the cumulative counts
``offs`` ``(E,)`` (expert ``e`` owns rows ``[offs[e-1], offs[e])``) give ``(S, N)``. A rank holding
experts ``[first, last)`` computes rows ``[offs[first-1], offs[last-1])`` with its weights and
leaves every other row zero: summed over the ranks, the pieces are the whole output, and each
element is nonzero on one rank at most (``Pd``, :mod:`autotp.placement`).

The rows are found on the device, with no host read: the input is rotated so that this rank's first
row comes first (a row gather by ``(i + start) % S``), the op runs on the local offsets (each
expert's end less ``start``) with the rows past this rank's last masked to zero, and the output is
rotated back. The mask is applied to the input too, so the backward sends no gradient to other
ranks' rows (a kernel may leave the rows past the last offset unwritten).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ExpertRows"]


class ExpertRows(nn.Module):
    """``op(x, weight, offs)`` on the rows of experts ``[first, last)``, whose weights ``weight``
    holds; the other rows zero."""

    def __init__(self, op: Any, first: int, last: int) -> None:
        super().__init__()
        if not 0 <= first < last:
            raise ValueError(f"experts [{first}, {last}): expected at least one expert, first >= 0")
        self.__dict__["op"] = op  # an op overload, not a module
        self.first, self.last = first, last

    def extra_repr(self) -> str:
        return f"{self.op}: experts [{self.first}, {self.last})"

    def forward(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if weight.shape[0] != self.last - self.first:
            raise ValueError(f"the weight holds {weight.shape[0]} experts; this rank's are [{self.first}, "
                             f"{self.last})")
        rows = x.shape[0]
        start = offs[self.first - 1] if self.first > 0 else offs.new_zeros(())
        ends = offs[self.first:self.last] - start  # this rank's offsets, its first row at 0
        index = torch.arange(rows, device=x.device)
        mine = (index < ends[-1]).unsqueeze(-1)
        rotated = torch.where(mine, x[(index + start) % rows], 0)
        out = torch.where(mine, self.op(rotated, weight, ends), 0)
        return out[(index - start) % rows]
