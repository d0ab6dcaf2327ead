"""Cross-entropy on logits split by class (vocabulary-parallel cross-entropy).

Where a language model's head is split by output features, its logits are split by vocabulary,
and gathering them for the loss moves and keeps a logits-sized tensor per rank. The loss needs, per
row, only three numbers from the whole vocabulary: the largest logit (for a stable exponent), the
sum of the exponents, and the target's logit. Each rank computes them on its piece and two small
all-reduces over the axes that split the classes combine them (a max, then a sum of two values per
row); the gradient, ``softmax - one_hot``, is local to each piece (Megatron-LM computes its loss
this way). The output is the loss itself, the same on every rank.

:func:`cross_entropy_choices` is the rule of ``aten.cross_entropy_loss``: replicated, or the class
dim split (no class weights, no label smoothing: each needs another sum over the classes).
:func:`class_split_axes` says which mesh axes a strategy splits the classes over, and
:func:`loss_collectives` what they run: the cost model prices them with the op
(:meth:`autotp.planning.costs.costing.CostModel.node_compute_s`), the program lists them
(:func:`autotp.planning.costs.program.program`), and on a rank the op runs as
:class:`autotp.local.losses.VocabParallelCrossEntropy` (:func:`local_cross_entropy`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from autotp.local.losses import VocabParallelCrossEntropy
from autotp.local.site import LocalSite
from autotp.placement import R, S, Strategy
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode

__all__ = ["CROSS_ENTROPY", "cross_entropy_choices", "class_dim", "class_split_axes", "loss_collectives",
           "local_cross_entropy", "RULES", "LOCAL"]

CROSS_ENTROPY = "aten.cross_entropy_loss.default"
STATISTICS_BYTES = 4  # the per-row statistics are reduced in float32


def class_dim(node: OpNode) -> int:
    """The dim of the logits that holds the classes: 1, or 0 for one unbatched row."""
    return 1 if node.input_infos[0].ndim >= 2 else 0


def splittable(node: OpNode) -> bool:
    """The loss can run on split classes: no class weights, no label smoothing, float logits."""
    args = node.args
    weighted = "weight" in args and args.is_tensor("weight")
    smoothing = float(args.get("label_smoothing", 0.0) or 0.0)
    return not weighted and smoothing == 0.0 and node.input_infos[0].is_float


def cross_entropy_choices(node: OpNode, n: int) -> list[AxisChoice]:
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    d = class_dim(node)
    if splittable(node) and divisible(node.input_infos[0].shape[d], n):
        choices.append(((S(d),) + (R,) * (k - 1), R))
    return choices


def class_split_axes(node: OpNode, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes over which ``strategy`` splits the loss's classes (none for another op)."""
    if node.target != CROSS_ENTROPY or not strategy.inputs or strategy.inputs[0] is None:
        return ()
    d = class_dim(node)
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if p.is_shard and p.dim == d)


def rows(node: OpNode) -> int:
    """How many rows (positions) the loss is over: the logits' elements per class."""
    x = node.input_infos[0]
    return x.numel // max(x.shape[class_dim(node)], 1)


def loss_collectives(node: OpNode, strategy: Strategy, mesh_shape: Sequence[int]) -> list[tuple[str, int, float]]:
    """``(kind, axis, bytes)`` of the forward all-reduces the split loss runs, in order: per axis
    that splits the classes, the rows' maxima, then their sums of exponents and target logits. Its
    backward runs none. Sizes are the rows a rank holds (the rows are never split here)."""
    out: list[tuple[str, int, float]] = []
    axes = class_split_axes(node, strategy)
    if not axes:
        return out
    size = rows(node) * STATISTICS_BYTES
    for a in axes:
        out.append(("all_reduce", a, float(size)))
    for a in axes:
        out.append(("all_reduce", a, float(2 * size)))
    return out


RULES = {CROSS_ENTROPY: cross_entropy_choices}


def local_cross_entropy(site: LocalSite) -> Optional[Any]:
    """The loss on this rank's classes, its per-row numbers all-reduced over the axes that split
    them; None where the classes are whole (the op as it is)."""
    node = site.node
    axes = class_split_axes(node, site.strategy)
    if not axes:
        return None
    start, stop = site.piece_of(node.input_infos[0].shape[class_dim(node)], site.strategy.inputs[0], axes)
    module = VocabParallelCrossEntropy(start, stop, [site.groups[a] for a in axes], [site.axis_names[a] for a in axes],
                                       int(node.args.get("reduction", 1)), int(node.args.get("ignore_index", -100)))
    return site.call_module(module, "vocab_parallel_loss", site.args[:2])


LOCAL = {CROSS_ENTROPY: local_cross_entropy}
