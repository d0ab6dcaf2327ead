"""What every rule family shares: the shape of a single-axis choice and the evenness test."""

from __future__ import annotations

from typing import Optional

from autotp.graph import TensorInfo
from autotp.placement import Placement, R, S

# One single-axis choice: input placements (None = any: the input's values are not read) and
# the output placement.
AxisChoice = tuple[tuple[Optional[Placement], ...], Placement]


def divisible(size: int, n: int) -> bool:
    """A dim of ``size`` splits evenly over ``n`` ranks, each getting at least one element."""
    return size % n == 0 and size >= n


def broadcast_in(in_info: TensorInfo, out_info: TensorInfo, out_dim: int) -> Placement:
    """Placement an input of a broadcasting op needs when the output is split along ``out_dim``."""
    lead = out_info.ndim - in_info.ndim
    d = out_dim - lead
    if d < 0 or in_info.shape[d] != out_info.shape[out_dim]:
        return R
    return S(d)
