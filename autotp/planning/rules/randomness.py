"""Random ops: dropout and the random draws, which run on a rank from streams of their own.

Their choices are elementwise ones: dropout is pointwise (:data:`autotp.ops.POINTWISE`), the draws
shaped like their input (``rand_like``, ``bernoulli``, ...) split like it (:data:`RULES`), the other
draws are factories or DTensor's. What differs is how they run on a rank's pieces: left to the
global generators, ranks would draw one mask for different pieces (correlated) or different values
for a tensor held whole (replicas drifting apart). So an active dropout runs as
:class:`autotp.local.dropout.ShardedDropout` and every random op as
:class:`autotp.local.dropout.SharedRandom`, each from a stream of its own seeded alike where ranks
hold the same values and apart where they hold different pieces (:mod:`autotp.local.dropout` says
how). Attention that drops its weights is the contractions' (:mod:`.contractions`).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from autotp import ops
from autotp.local.dropout import RANDOM_OPS, ShardedDropout, SharedRandom, attention_dropout_p
from autotp.local.site import LocalSite
from autotp.planning.rules.pointwise import pointwise_choices
from autotp.tracing.graph import OpGraph

__all__ = ["active_dropout", "has_active_dropout", "local_dropout", "local_random", "RULES", "LOCAL"]

ATTENTION = "aten.scaled_dot_product_attention.default"


def active_dropout(args: tuple) -> bool:
    """``dropout(x, p, train)`` that drops anything: train set and ``p > 0``."""
    p = args[1] if len(args) > 1 else 0.5
    train = args[2] if len(args) > 2 else True
    return (train is None or bool(train)) and p is not None and float(p) > 0.0  # native_dropout: None is train


def has_active_dropout(graph: OpGraph) -> bool:
    """Whether the graph drops anything at run time (then its ranks must agree on a seed)."""
    return graph.exported is not None and any(
        n.op == "call_function" and (
            (str(n.target) in ops.DROPOUT and active_dropout(n.args))
            or (str(n.target) == ATTENTION and attention_dropout_p(n.args, n.kwargs) > 0))
        for n in graph.exported.graph.nodes)


def local_dropout(site: LocalSite) -> Optional[Any]:
    """An active dropout: the mask drawn on this rank's piece from the node's own stream, alike on
    the ranks that read the same piece. None for one that drops nothing (the op as it is)."""
    if not active_dropout(site.args):
        return None
    stream = site.new_stream()
    module = ShardedDropout(site.args[1], site.seed, stream, site.shard_key(site.reads[0]))
    call = site.call_module(module, "dropout", (site.args[0],))
    native = site.node.target == "aten.native_dropout.default"
    return call if native else site.call(operator.getitem, (call, 0))


def local_random(site: LocalSite) -> Any:
    """A random op drawn from a stream of its own: alike where ranks hold the same values."""
    stream = site.new_stream()
    module = SharedRandom(site.target, site.seed, stream, site.shard_key(site.strategy.output or ()))
    return site.call_module(module, "random", site.args, site.kwargs)


# random values shaped like the input: a piece of them is drawn independently on each rank that
# holds it (local_random), the same in distribution, not value by value
RULES = {op: pointwise_choices for op in ("aten.rand_like.default", "aten.randn_like.default",
                                          "aten.randint_like.default", "aten.randint_like.low_dtype",
                                          "aten.bernoulli.default", "aten.bernoulli.p")}

LOCAL = {**{name: local_dropout for name in ops.DROPOUT}, **{name: local_random for name in RANDOM_OPS}}
