"""What every rule family shares: the shape of a single-axis choice and the evenness test."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

from autotp.placement import Placement, R, S
from autotp.tracing.graph import TensorInfo

# One single-axis choice: input placements (None = any: the input's values are not read) and
# the output placement.
AxisChoice = tuple[tuple[Optional[Placement], ...], Placement]


_RELAXED = contextvars.ContextVar("autotp_relaxed_evenness", default=False)


def divisible(size: int, n: int) -> bool:
    """A dim of ``size`` splits evenly over ``n`` ranks, each getting at least one element (within
    :func:`relaxed`: any dim of two or more elements, which :mod:`autotp.planning.rules.uneven` cuts in units)."""
    if _RELAXED.get():
        return size >= 2
    return size % n == 0 and size >= n


def is_relaxed() -> bool:
    """Whether the rules are being asked within :func:`relaxed` (a rule whose split reads positions
    along a dim leaves that split out then)."""
    return _RELAXED.get()


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """Within: :func:`divisible` accepts any size of two or more, so a rule lists the splits it would
    make if the dims divided (for :func:`autotp.planning.rules.uneven.uneven_choices` to cut in units)."""
    token = _RELAXED.set(True)
    try:
        yield
    finally:
        _RELAXED.reset(token)


def broadcast_in(in_info: TensorInfo, out_info: TensorInfo, out_dim: int) -> Placement:
    """Placement an input of a broadcasting op needs when the output is split along ``out_dim``."""
    lead = out_info.ndim - in_info.ndim
    d = out_dim - lead
    if d < 0 or in_info.shape[d] != out_info.shape[out_dim]:
        return R
    return S(d)
