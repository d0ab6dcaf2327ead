"""Factories: ops that make a tensor from sizes, a dtype and a device alone (``zeros``, ``full``,
``arange``, ``new_ones``, ...; :data:`autotp.ops.FACTORY`).

Whole on every rank; a factory of one value (:data:`autotp.ops.UNIFORM_FACTORY`) may also be split
along any dim, each rank making its piece: it runs with the piece's shape (:func:`local_factory`).
They read none of their inputs' values (``new_*`` read only the dtype and device), so their input
placements are ``None``: any.
"""

from __future__ import annotations

from typing import Optional

from autotp import ops
from autotp.local.site import Call, LocalSite
from autotp.placement import R, S
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode

__all__ = ["factory_choices", "local_factory", "LOCAL"]


def factory_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """Whole; a factory of one value also split along any dim (each rank makes its piece)."""
    reads = (None,) * len(node.inputs)
    choices = [(reads, R)]
    if node.target in ops.UNIFORM_FACTORY and len(node.outputs) == 1:
        shape = node.output.shape
        choices += [(reads, S(d)) for d in range(len(shape)) if divisible(shape[d], n)]
    return choices


def local_factory(site: LocalSite) -> Optional[Call]:
    """A split factory of one value: the factory at this rank's piece's shape."""
    if not any(p.is_shard for p in site.strategy.output):
        return None
    at = ops.UNIFORM_FACTORY[site.node.target]  # the position of the shape argument
    args = site.args
    return site.called(args=(*args[:at], site.local_sizes(args[at]), *args[at + 1:]))


LOCAL = {name: local_factory for name in ops.UNIFORM_FACTORY}
