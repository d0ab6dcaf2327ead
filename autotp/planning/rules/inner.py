"""The collectives an op runs inside itself: the rules whose op does not run on its pieces
as it is (cross-entropy on split classes, :mod:`.losses`; batch norm on a split batch,
:mod:`.norms`; a grouped matmul that sends routed rows to their experts' ranks, :mod:`.routed`;
causal attention computing balanced rows, or passing keys and values around a ring, :mod:`.attention`). The cost model prices them with the op, the program lists them, and the op's local
execution runs it as a module that holds them."""

from __future__ import annotations

from typing import Sequence

from autotp.placement import Strategy
from autotp.planning.rules.attention import attention_collectives
from autotp.planning.rules.losses import loss_collectives
from autotp.planning.rules.norms import norm_collectives
from autotp.planning.rules.routed import routed_collectives
from autotp.tracing.graph import OpNode

__all__ = ["inner_collectives"]


def inner_collectives(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int],
                      train: bool = True) -> list[tuple[str, str, int, float]]:
    """``(kind, phase, axis, bytes)`` of each collective ``node`` runs inside itself under
    ``strategy``, forward ones first; the backward ones only when ``train``."""
    out = [(kind, "forward", a, size) for kind, a, size in loss_collectives(node, strategy, mesh_shape)]
    out += [c for c in norm_collectives(node, strategy, mesh_shape) if train or c[1] == "forward"]
    routed = routed_collectives(node, strategy, mesh_shape, train) + attention_collectives(node, strategy, mesh_shape, train)
    return [c for c in out if c[1] == "forward"] + [c for c in routed if c[1] == "forward"] + \
        [c for c in (*out, *routed) if c[1] != "forward"]
