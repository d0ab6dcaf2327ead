"""The op tables: which ATen ops autotp treats alike, in one place.

Every stage that sorts ops by kind (capture: views and gradients; the rules: pointwise, linear in
a partial sum, factories; the families' local executions: shape arguments, means and dropout; the
plan: where a weight enters a matmul) reads its set here. Ops are named as ``str(op)`` prints an
``OpOverload`` (``"aten.view.default"``), which is how :class:`autotp.tracing.graph.OpNode` stores
its target.

>>> "aten.view.default" in VIEW and "aten.view.default" in SHAPE_ARGUMENT
True
"""

from __future__ import annotations

# Ops that only create a view (or a no-op alias): no kernel, no bytes.
VIEW = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int",
    "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.expand.default", "aten.t.default", "aten.alias.default", "aten.slice.Tensor",
    "aten.select.int", "aten.detach.default", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.chunk.default", "aten.unflatten.int", "aten.flatten.using_ints", "aten.view_as.default",
    "aten.expand_as.default", "aten.lift_fresh_copy.default", "aten.view_as_complex.default",
    "aten.view_as_real.default", "aten.numpy_T.default", "getitem",
})

# Ops whose output carries no gradient back to their inputs, whatever those carry.
NO_GRADIENT = frozenset({
    "aten.detach.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default",
    "aten.full_like.default", "aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
})

# Grouped matmuls of rows sorted by group: (S, K) x (G, K, N) with offsets (G,) -> (S, N), each row
# through its group's matrix (routed experts: autotp.planning.rules.experts).
GROUPED_MATMULS = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})

# Ops whose tensor operands must share one dtype (fake tensors let a mix through; kernels refuse it).
SAME_DTYPE = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.addmm.default",
    "aten.baddbmm.default", "aten.convolution.default",
})

# Ops that make a tensor from nothing but sizes, dtype and device (``new_*`` read only those of their input).
FACTORY = frozenset({
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
    "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default",
    "aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default",
    "aten.rand.default", "aten.randn.default",
})

# Factories whose every element is the same value (or undefined): a rank's piece of the output is the
# factory at the piece's shape. Value: the position of the shape argument.
UNIFORM_FACTORY = {
    "aten.new_empty.default": 1, "aten.new_zeros.default": 1, "aten.new_ones.default": 1,
    "aten.new_full.default": 1, "aten.zeros.default": 0, "aten.ones.default": 0, "aten.full.default": 0,
    "aten.empty.memory_format": 0,
}

# One-input ops linear in their input: f(sum of partials) = sum of f(partials).
UNARY_LINEAR = frozenset({
    "aten.neg.default", "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default", "aten.detach.default",
    "aten.lift_fresh_copy.default", "aten.type_as.default",
})

# Elementwise ops with broadcasting: an output dim may be split wherever the inputs have it.
POINTWISE = UNARY_LINEAR | frozenset({
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar",
    "aten.div.Scalar", "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.pow.Tensor_Scalar",
    "aten.pow.Scalar", "aten.pow.Tensor_Tensor", "aten.rsqrt.default", "aten.sqrt.default", "aten.exp.default",
    "aten.log.default", "aten.silu.default", "aten.gelu.default", "aten.relu.default", "aten.tanh.default",
    "aten.sigmoid.default", "aten.cos.default", "aten.sin.default", "aten.abs.default", "aten.reciprocal.default",
    "aten.erf.default", "aten.dropout.default", "aten.where.self", "aten.where.ScalarOther",
    "aten.where.ScalarSelf", "aten.where.Scalar", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar", "aten.lt.Tensor", "aten.lt.Scalar",
    "aten.le.Tensor", "aten.le.Scalar", "aten.gt.Tensor", "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar",
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.logical_and.default", "aten.logical_or.default", "aten.logical_not.default", "aten.clamp.default",
    "aten.minimum.default", "aten.maximum.default", "aten.square.default", "aten.tanh_backward.default",
    "aten.gelu_backward.default", "aten.bitwise_not.default", "aten.zeros_like.default", "aten.ones_like.default",
    "aten.full_like.default", "aten.native_dropout.default", "aten.polar.default", "aten.complex.default",
})
# pointwise ops that keep a partial sum partial, given how their operands are placed
PAIRWISE_ADD = frozenset({"aten.add.Tensor", "aten.sub.Tensor"})  # P + P -> P
SCALE_BY_OTHER = frozenset({"aten.mul.Tensor", "aten.div.Tensor"})  # P * R -> P ; P / R -> P
SCALAR_SCALE = frozenset({"aten.mul.Scalar", "aten.div.Scalar"})  # P * 2 -> P

# Ops whose second argument is a shape, made local sizes on a rank (autotp.planning.rules.views).
SHAPE_ARGUMENT = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                            "aten.expand.default"})
DROPOUT = frozenset({"aten.dropout.default", "aten.native_dropout.default"})
MEAN = frozenset({"aten.mean.dim", "aten.mean.default"})

# Casts: the tensor itself when it already has the dtype (and device) asked for.
CASTS = frozenset({"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device"})

# Ops that return their input unchanged (when the dtype does not change): followers of their input.
NO_OP = frozenset({"aten.alias.default", "aten.detach.default", "aten.clone.default", "aten.contiguous.default",
                   "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default"})

# Where the weight enters a matmul-like op (its input position), for module styles.
CONVOLUTIONS = frozenset({"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.conv1d.padding",
                          "aten.conv2d.padding", "aten.conv3d.padding", "aten.conv_transpose1d.default",
                          "aten.conv_transpose2d.input", "aten.conv_transpose3d.input", "aten.convolution.default"})
CHANNELS_FIRST = CONVOLUTIONS | frozenset({"aten.batch_norm.default", "aten.group_norm.default",
                                           "aten.instance_norm.default"})
WEIGHT_INPUT = {"aten.linear.default": 1, "aten.embedding.default": 0, "aten.mm.default": 1,
                "aten.matmul.default": 1, "aten.addmm.default": 2, **{name: 1 for name in CONVOLUTIONS}}
TRANSPOSE = frozenset({"aten.t.default", "aten.numpy_T.default", "aten.transpose.int"})
