"""Batch, group and instance normalization: statistics over the batch, over groups of channels.

**Batch norm in training** normalizes each channel by its mean and variance over the batch and
space. With the channels split each rank has whole channels: its statistics are exact. With the
batch (or space) split each rank's statistics would be its own piece's, so the rule's op does not
run on its pieces as it is: it runs as :class:`autotp.local.batch_norm.ShardedBatchNorm`
(synchronized batch norm, :func:`local_batch_norm`), whose statistics are all-reduced over the
axes that split the batch or space (the per-channel sums, then the centred sums of squares), and
whose backward all-reduces the two per-channel sums its input gradient needs. The weight's and
bias's gradients are each rank's own sums, partial over those axes: the plan's gradient reduction
adds them, as for any weight read whole by an op on a split batch. The running statistics buffers
stay whole and equal on every rank: every rank updates them with the same global statistics, and
where channels are split, each rank's new values for its channels are summed into place over the
channel axis (a zero elsewhere). :func:`norm_collectives` lists what it runs, for the cost model
and the program.

**Batch norm in eval** is an affine map per channel: any split, the parameters and statistics cut
like the channels. **Group norm** splits the batch, or the channels in whole groups (a rank runs
it with ``num_groups`` divided by the pieces:
:func:`autotp.planning.rules.convolutions.local_grouped`); **instance norm** without running
statistics splits the batch or the channels.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from autotp.local.batch_norm import ShardedBatchNorm
from autotp.local.site import LocalSite
from autotp.placement import R, S, Strategy
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode

__all__ = ["BATCH_NORM", "batch_norm_choices", "synced", "stat_axes", "channel_axes", "norm_collectives",
           "local_batch_norm", "RULES", "LOCAL"]

BATCH_NORM = "aten.batch_norm.default"
STATISTICS_BYTES = 4  # per-channel statistics are reduced in float32
_PARAMS = ("weight", "bias")
_STATS = ("running_mean", "running_var")


def _present(node: OpNode, names: Sequence[str]) -> list[str]:
    """Of ``names``, the arguments that are tensors (absent: an affine-free norm, no running stats)."""
    return [name for name in names if node.args.is_tensor(name)]


def batch_norm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """(input, weight?, bias?, running_mean?, running_var?) in the node's order."""
    x = node.input_infos[0]
    training = bool(node.args.get("training", False))
    params, stats = _present(node, _PARAMS), _present(node, _STATS)
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    if x.ndim >= 2 and divisible(x.shape[1], n):
        # channels: the parameters cut alike; in training the running statistics are read whole
        # (each rank updates every channel: ShardedBatchNorm), in eval read cut like the channels
        choices.append(((S(1), *(S(0),) * len(params), *((R if training else S(0)),) * len(stats)), S(1)))
    for d in range(x.ndim):
        if d != 1 and divisible(x.shape[d], n):
            choices.append(((S(d),) + (R,) * (k - 1), S(d)))  # batch or space: synchronized in training
    return choices


def synced(node: OpNode) -> bool:
    """The op is batch norm computing batch statistics (the ones :class:`ShardedBatchNorm` runs)."""
    return node.target == BATCH_NORM and bool(node.args.get("training", False))


def _axes(node: OpNode, strategy: Strategy, channels: bool) -> tuple[int, ...]:
    if not synced(node) or not strategy.inputs or strategy.inputs[0] is None:
        return ()
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if p.is_shard and (p.dim == 1) == channels)


def stat_axes(node: OpNode, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes over which a training batch norm's statistics are summed: those that split
    the batch or space of its input."""
    return _axes(node, strategy, channels=False)


def channel_axes(node: OpNode, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes that split a training batch norm's channels."""
    return _axes(node, strategy, channels=True)


def norm_collectives(node: OpNode, strategy: Strategy,
                     mesh_shape: Sequence[int]) -> list[tuple[str, str, int, float]]:
    """``(kind, phase, axis, bytes)`` of the collectives a training batch norm on split data runs
    inside itself, in order: forward, per axis splitting the batch or space, the per-channel sums
    with the count, then the centred sums of squares; per axis splitting the channels, the new
    running mean and variance (when tracked); backward, per batch axis, the two per-channel sums
    of the input gradient. Sizes are the channels a rank holds."""
    stats, chans = stat_axes(node, strategy), channel_axes(node, strategy)
    if not stats and not chans:
        return []
    channels = node.input_infos[0].shape[1]
    local = channels
    for a in chans:
        local //= mesh_shape[a]
    out: list[tuple[str, str, int, float]] = []
    out += [("all_reduce", "forward", a, float((local + 1) * STATISTICS_BYTES)) for a in stats]
    out += [("all_reduce", "forward", a, float(local * STATISTICS_BYTES)) for a in stats]
    if _present(node, _STATS):
        out += [("all_reduce", "forward", a, float(2 * channels * STATISTICS_BYTES)) for a in chans]
    out += [("all_reduce", "backward", a, float(2 * local * STATISTICS_BYTES)) for a in stats]
    return out


def group_norm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """(input, weight?, bias?): the batch, or channels in whole groups."""
    x = node.input_infos[0]
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    if divisible(x.shape[0], n):
        choices.append(((S(0),) + (R,) * (k - 1), S(0)))
    groups = node.args.int("num_groups")
    if x.ndim >= 2 and groups % n == 0 and x.shape[1] % n == 0:
        choices.append(((S(1),) + (S(0),) * (k - 1), S(1)))
    return choices


def instance_norm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """(input, weight?, bias?, running_mean?, running_var?): per sample and channel. With running
    statistics in use (tracked, or read in eval) it stays whole: they average over the batch."""
    x = node.input_infos[0]
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    if _present(node, _STATS):
        return choices
    if divisible(x.shape[0], n):
        choices.append(((S(0),) + (R,) * (k - 1), S(0)))
    if x.ndim >= 2 and divisible(x.shape[1], n):
        choices.append(((S(1),) + (S(0),) * (k - 1), S(1)))
    return choices


RULES = {
    BATCH_NORM: batch_norm_choices,
    "aten.group_norm.default": group_norm_choices,
    "aten.instance_norm.default": instance_norm_choices,
}


def local_batch_norm(site: LocalSite) -> Optional[Any]:
    """A training batch norm with its batch or space split (statistics summed over those axes) or
    its channels split (running statistics summed into place over those); None otherwise (the op
    as it is: eval, or nothing split)."""
    node, strategy = site.node, site.strategy
    stats, chans = stat_axes(node, strategy), channel_axes(node, strategy)
    if not stats and not chans:
        return None
    channels = node.input_infos[0].shape[1]
    start, stop = site.piece_of(channels, strategy.inputs[0], chans)
    module = ShardedBatchNorm(start, stop, channels, [site.groups[a] for a in stats], [site.groups[a] for a in chans],
                              [site.axis_names[a] for a in stats])
    return site.call_module(module, "batch_norm", site.args, site.kwargs)


LOCAL = {BATCH_NORM: local_batch_norm}
