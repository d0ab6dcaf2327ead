"""Convolutions, pooling and resampling: the ops of convnets, vision and audio encoders and UNets.

A convolution is a linear layer applied at every position, and splits as one: the weight by its
output channels (colwise: the output split by channels), by its input channels (rowwise: a partial
sum, the bias added once), or the batch. A grouped (depthwise) convolution splits by whole groups:
each rank convolves its channels with its groups' filters, and runs it with ``groups`` divided by
the pieces (:func:`local_groups`, :func:`local_grouped`). Space splits only where no window crosses a piece's
edge: no padding, no dilation, and windows that tile the input (a 1x1 convolution, a patch embedding
whose stride equals its kernel), each piece a whole number of windows.

Pooling, upsampling and the channel shuffles work per (batch, channel) plane: the dims before the
spatial ones split freely; averaging and interpolating are linear, so a partial sum passes through;
a non-overlapping pool splits space like a patch embedding.
"""

from __future__ import annotations

from typing import Any, Optional

from autotp import ops
from autotp.local.site import Call, LocalSite
from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode

__all__ = ["conv_choices", "local_groups", "local_grouped", "GROUPED", "RULES", "LOCAL"]


def _ints(value: Any, k: int, default: int) -> tuple[int, ...]:
    """A per-spatial-dim argument (an int, a tuple, or empty for the default) as ``k`` ints."""
    if value is None or value == ():
        return (default,) * k
    if isinstance(value, int):
        return (value,) * k
    value = tuple(int(getattr(v, "hint", v)) for v in value)
    return value * k if len(value) == 1 else value


def _is_transposed(node: OpNode) -> bool:
    return "conv_transpose" in node.target or bool(node.args.get("transposed", False))


def _tiles(size: int, kernel: int, stride: int, n: int) -> bool:
    """A spatial dim of ``size`` splits over ``n`` ranks with no window crossing a piece's edge:
    windows of ``kernel`` that step by it (no overlap, no gap) and pieces of whole windows."""
    return kernel == stride and size % (n * stride) == 0 and size >= n * stride


def _zero_padding(node: OpNode, k: int, kernel: tuple[int, ...]) -> bool:
    padding = node.args.get("padding", 0)
    if isinstance(padding, str):  # "valid" is none; "same" is none only for a 1-wide kernel
        return padding == "valid" or all(w == 1 for w in kernel)
    return all(p == 0 for p in _ints(padding, k, 0))


def conv_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """conv1d/2d/3d, their transposes and ``aten.convolution``: (input, weight, bias?)."""
    x, w = node.input_infos[0], node.input_infos[1]
    out = node.output
    has_bias = len(node.inputs) == 3
    b = (lambda p: (p,)) if has_bias else (lambda p: ())
    k = w.ndim - 2  # spatial dims
    c = x.ndim - k - 1  # the channel dim: 1, or 0 for an unbatched input
    transposed = _is_transposed(node)
    groups = node.args.int("groups", default=1)
    choices: list[AxisChoice] = [((R, R, *b(R)), R), ((P, R, *b(P)), P)]  # linear in the input
    if c == 1 and divisible(x.shape[0], n):
        choices.append(((S(0), R, *b(R)), S(0)))  # batch
    out_w, in_w = (1, 0) if transposed else (0, 1)  # the weight dims of output and input channels
    if groups == 1:
        if divisible(out.shape[c], n):
            choices.append(((R, S(out_w), *b(S(0))), S(c)))  # colwise: output channels
        if divisible(x.shape[c], n):
            choices.append(((S(c), S(in_w), *b(P)), P))  # rowwise: input channels, a partial sum
    elif groups % n == 0 and x.shape[c] % n == 0 and out.shape[c] % n == 0:
        # whole groups per rank: the weight's dim 0 lists the filters group by group either way
        choices.append(((S(c), S(0), *b(S(0))), S(c)))
    kernel = tuple(w.shape[2:])
    if not transposed and _zero_padding(node, k, kernel) and all(
            d == 1 for d in _ints(node.args.get("dilation", 1), k, 1)):
        stride = _ints(node.args.get("stride", 1), k, 1)
        for i in range(k):
            d = c + 1 + i
            if _tiles(x.shape[d], kernel[i], stride[i], n):
                choices.append(((S(d), R, *b(R)), S(d)))  # space: whole windows per piece
    return choices


def local_groups(node: OpNode, input_placements, mesh_shape) -> Optional[int]:
    """The ``groups`` argument a rank runs a grouped convolution (or group norm) with: the groups
    divided by the pieces its channels are cut in; None where that is the op's own."""
    groups = node.args.int("groups" if "groups" in node.args else "num_groups", default=1)
    if groups == 1 or input_placements is None:
        return None
    x = node.input_infos[0]
    c = 1 if node.target.startswith("aten.group_norm") else x.ndim - (node.input_infos[1].ndim - 2) - 1
    pieces = 1
    for p, size in zip(input_placements, mesh_shape):
        if p.is_shard and p.dim == c:
            pieces *= size
    return groups // pieces if pieces > 1 else None


def _pool_spatial(node: OpNode) -> int:
    for name in ("kernel_size", "output_size"):
        value = node.args.get(name)
        if value is not None:
            return len(_ints(value, 1, 1)) if not isinstance(value, int) else 1
    return 2


def _leading(node: OpNode, n: int, linear: bool, k: Optional[int] = None) -> list[AxisChoice]:
    """Any split of the dims before the ``k`` spatial ones (batch, channels), the output keeping it."""
    x = node.input_infos[0]
    k = _pool_spatial(node) if k is None else k
    rest = (R,) * (len(node.inputs) - 1)
    choices: list[AxisChoice] = [((R, *rest), R)]
    if linear:
        choices.append(((P, *rest), P))
    for d in range(x.ndim - k):
        if divisible(x.shape[d], n):
            choices.append(((S(d), *rest), S(d)))
    return choices


def pool_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """max/avg pooling: batch and channels; space where the windows tile it (no padding, stride =
    kernel, no dilation, no ceil mode, each piece whole windows)."""
    linear = "avg_pool" in node.target
    choices = _leading(node, n, linear)
    kernel = _ints(node.args["kernel_size"], _pool_spatial(node), 1)
    k = len(kernel)
    stride = _ints(node.args.get("stride"), k, 0)
    stride = tuple(s or kk for s, kk in zip(stride, kernel))  # an empty stride is the kernel
    flat = (all(p == 0 for p in _ints(node.args.get("padding", 0), k, 0))
            and all(d == 1 for d in _ints(node.args.get("dilation", 1), k, 1))
            and not node.args.get("ceil_mode", False) and node.args.get("divisor_override") is None)
    x = node.input_infos[0]
    if flat:
        for i in range(k):
            d = x.ndim - k + i
            if _tiles(x.shape[d], kernel[i], stride[i], n):
                choices.append(((S(d),), S(d)))
    return choices


def adaptive_pool_choices(node: OpNode, n: int) -> list[AxisChoice]:
    return _leading(node, n, linear="avg" in node.target)


def upsample_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """Interpolation (nearest, linear, bilinear, bicubic, trilinear): per plane, linear."""
    k = node.input_infos[0].ndim - 2
    return _leading(node, n, linear=True, k=k)


def shuffle_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """pixel_shuffle (C·r², H, W) -> (C, H·r, W·r) and pixel_unshuffle back: the leading dims, and
    channels where each piece holds whole blocks of r² (the smaller channel count divides)."""
    choices = _leading(node, n, linear=True, k=3)
    x, out = node.input_infos[0], node.output
    c = x.ndim - 3
    fewer = min(x.shape[c], out.shape[c])
    if fewer % n == 0 and fewer >= n:
        choices.append(((S(c),), S(c)))
    return choices


def patches_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """im2col (N, C, H, W) -> (N, C·kh·kw, L) and col2im back: the batch, and channels (the
    column dim lists them channel by channel)."""
    x, out = node.input_infos[0], node.output
    choices: list[AxisChoice] = [((R,), R), ((P,), P)]
    lead = x.ndim - 3 if node.target.startswith("aten.im2col") else x.ndim - 2
    for d in range(lead):
        if divisible(x.shape[d], n):
            choices.append(((S(d),), S(d)))
    c = lead
    channels = x.shape[c] if node.target.startswith("aten.im2col") else out.shape[c]
    if channels % n == 0 and channels >= n:
        choices.append(((S(c),), S(c)))
    return choices


GROUPED = ops.CONVOLUTIONS | {"aten.group_norm.default"}  # ops whose groups argument a rank divides

RULES = {
    **{name: conv_choices for name in ops.CONVOLUTIONS},
    **{f"aten.{kind}_pool{k}d.default": pool_choices for kind in ("max", "avg") for k in (1, 2, 3)},
    **{f"aten.adaptive_{kind}_pool{k}d.default": adaptive_pool_choices for kind in ("max", "avg") for k in (1, 2, 3)},
    **{f"aten.{name}.vec": upsample_choices
       for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
                    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
                    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d")},
    "aten.pixel_shuffle.default": shuffle_choices,
    "aten.pixel_unshuffle.default": shuffle_choices,
    "aten.im2col.default": patches_choices,
    "aten.col2im.default": patches_choices,
}


def local_grouped(site: LocalSite) -> Optional[Call]:
    """Whole groups per rank: the op runs with its share of them (group norm's too). None where the
    channels are whole (the op as it is)."""
    groups = local_groups(site.node, site.strategy.inputs[0], site.mesh_shape)
    if groups is None:
        return None
    return site.called().with_argument("groups" if "groups" in site.node.args else "num_groups", groups)


LOCAL = {name: local_grouped for name in GROUPED}
