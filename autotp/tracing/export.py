"""Capture: a PyTorch model and example inputs → :class:`~autotp.tracing.graph.OpGraph`.

``torch.export`` in non-strict mode traces the model with fake tensors into an ATen-level
``torch.fx`` graph; this pass reads one record per node from it: the op, input and output
shapes and dtypes, forward FLOPs (``torch.utils.flop_counter``'s formulas), bytes moved, the
module path the node came from, and for placeholders whether each is a parameter, a buffer or a
user input. Tied parameters (an embedding shared with the output head) become one parameter.
The model is never modified, and a model on the meta device costs no memory.

>>> import torch, autotp
>>> g = autotp.capture(torch.nn.Linear(4, 8), (torch.randn(2, 4),))
>>> [n.target for n in g.ops()], g.total_flops()
(['aten.linear.default'], 128.0)
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import traceback
import warnings
from typing import Any, Iterator

import torch
import torch.fx
from torch.utils import flop_counter

from autotp import ops
from autotp.masks import MASKED_ATTENTION, MaskSpec, spec_of
from autotp.tracing.arguments import _node_outputs, map_tensor_arguments, op_args, tensor_arguments
from autotp.tracing.dynamic import DynamicDim, export_spec, size_expression, size_hint
from autotp.tracing.graph import BUFFER, CONSTANT, INPUT, OP, PARAMETER, OpGraph, OpNode, ParameterInfo, TensorInfo
from autotp.tracing.heap import old_objects_frozen
from autotp.tracing.masks import ERASED, describe_masks
from autotp.tracing.inputs import (buffers_on_meta, cache_off, check_devices, distinct, in_modes, meta_parameters, modes_of,
                                   normalize_inputs, on_fake_device)
from autotp.tracing.refusals import (CaptureError, check_data_dependent_sizes, check_higher_order_ops, check_operand_dtypes,
                             check_parameter_writes, check_written_arguments, module_info)
from autotp.tracing.regions import RegionError, inline_regions
from autotp.tracing.repeats import capture_unrolled, find_stacks
from autotp.words import with_article

__all__ = ["capture", "CaptureError", "concrete", "op_args", "map_tensor_arguments",
           "tensor_arguments"]

aten = torch.ops.aten


def _explain_export_failure(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    low = text.lower()
    hints = []
    if "cache" in low:
        hints.append("build the model with use_cache=False (a KV cache object cannot be traced)")
    if any(w in low for w in ("data-dependent", "data dependent", "guardondatadependent", "could not guard", "symbool")):
        hints.append("make the control flow static: branch on shapes or config flags, not on tensor values")
    if "unsupported" in low or "not supported" in low:
        hints.append("replace the unsupported construct named above, or move it out of forward()")
    if isinstance(err, TypeError) and any(w in low for w in ("positional argument", "keyword argument", "missing")) \
            or any(w in low for w in ("size mismatch", "cannot be multiplied", "must match the size", "scalar type",
                                      "] x [")):
        hints.append("check the example inputs: they must be what model(*example_inputs) is called with "
                     "(how many, their shapes and dtypes)")
    if _raised_in(err, "_meta_grouped_mm_common") and "bf16" in low:
        hints.append("torch traces torch._grouped_mm (F.grouped_mm) in bfloat16 only (its meta kernel checks the "
                     "dtype, though the op runs other dtypes on CPU): keep the experts' weights in bfloat16 and cast "
                     "the rows to them (x.to(w.dtype)), or call Hugging Face's transformers::grouped_mm_fallback op, "
                     "which traces in any dtype")
    if "decoder_input_ids" in low or "decoder_inputs_embeds" in low:  # T5, Marian: no decoder inputs of their own
        hints.append("give the decoder's inputs in the example inputs, e.g. {'input_ids': ids, "
                     "'decoder_input_ids': ids[:, :4]} (this encoder-decoder does not make them from input_ids)")
    if not hints:
        hints.append("make forward() traceable by torch.export(strict=False): static control flow, no Python "
                     "side effects on tensors, no .item()/.tolist() used for control flow")
    construct = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        "what to do: " + "; ".join(hints) + "\n"
        f"  autotp could not capture the model with torch.export (non-strict): {type(err).__name__}: "
        f"{construct[:300]}\n"
        f"  (the original error is this error's __cause__, its traceback in .original_traceback; "
        f"AUTOTP_FULL_TRACEBACK=1 prints it too)"
    )


def _raised_in(err: BaseException, function: str) -> bool:
    """Whether ``function`` is a frame of the traceback of ``err`` or of an error it was raised from."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(frame.name == function for frame in traceback.extract_tb(err.__traceback__)):
            return True
        err = err.__cause__ or err.__context__
    return False


def capture_error(err: BaseException) -> CaptureError:
    """The CaptureError for a failed ``torch.export``: what to do first; the original error as its
    ``__cause__``, printed as one line (export's traceback, hundreds of lines on every rank, is kept
    as text in ``original_traceback``, and printed in full with ``AUTOTP_FULL_TRACEBACK=1``)."""
    error = CaptureError(_explain_export_failure(err))
    error.original_traceback = "".join(traceback.format_exception(err))
    if os.environ.get("AUTOTP_FULL_TRACEBACK") != "1":
        err.__traceback__ = None
        err.__cause__, err.__context__, err.__suppress_context__ = None, None, True
    error.__cause__ = err
    return error


def _symbolic_dims(node: torch.fx.Node) -> tuple[tuple[str | None, ...], ...] | None:
    """Each tensor output's dims as expressions (None: static), or None if every dim is static."""
    val = node.meta.get("val")
    vals = [val] if isinstance(val, torch.Tensor) else list(val) if isinstance(val, (tuple, list)) else []
    dims = tuple(tuple(size_expression(s) for s in v.shape) for v in vals if isinstance(v, torch.Tensor))
    return dims if any(e is not None for d in dims for e in d) else None


def concrete(value: Any) -> Any:
    """``value`` with every symbolic size at its example value (tensors as meta tensors).

    Code that reads sizes must read these: ``int()`` or a comparison on a symbolic size makes the
    trace's shape environment fix the symbol to the example's value, for good."""
    def one(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return size_hint(v)
        if isinstance(v, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in (*v.shape, *v.stride())):
            return torch.empty_strided([size_hint(n) for n in v.shape], [size_hint(n) for n in v.stride()],
                                       dtype=v.dtype, device="meta")
        return v
    return torch.utils._pytree.tree_map(one, value)


def _flops(node: torch.fx.Node) -> float:
    """Forward FLOPs of one node, as ``FlopCounterMode`` would count the kernels it runs."""
    target = node.target
    # counted at the example's sizes: symbolic sizes (dynamic dims) replaced by their values
    vals = [concrete(a.meta.get("val")) if isinstance(a, torch.fx.Node) else concrete(a) for a in node.args]
    out = concrete(node.meta.get("val"))
    if target in (aten.linear.default, aten.matmul.default):
        a = vals[0]
        k = a.shape[-1]
        return 2.0 * out.numel() * k
    if target is aten.scaled_dot_product_attention.default or target is MASKED_ATTENTION:
        # the pairs of (query, key) the kernel computes: every pair, but half the square and its
        # diagonal under is_causal, and what a described mask allows (autotp/local/attention.py)
        q, k, v = vals[:3]
        full = float(flop_counter.sdpa_flop_count(tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        args = op_args(node)
        spec = spec_of(args) if target is MASKED_ATTENTION else MaskSpec() if args.get("is_causal") else None
        rows, cols = q.shape[-2], k.shape[-2]
        return full if spec is None or not rows * cols else full * spec.pairs(rows, cols) / (rows * cols)
    if str(target) in ops.GROUPED_MATMULS and vals[0].ndim == 2 and vals[1].ndim == 3:
        # each of the S rows through one group's (K, N) matrix (the registry counts none: Hugging
        # Face's fallback op is not in it, and aten._grouped_mm has no formula)
        return 2.0 * vals[0].shape[0] * vals[0].shape[1] * vals[1].shape[2]
    if str(target) in ops.CONVOLUTIONS:  # composite ops the registry knows only as aten.convolution
        x, w = vals[0], vals[1]
        lead = [1] if x.ndim == w.ndim - 1 else []  # an unbatched input: a batch of one
        transposed = "transpose" in str(target) or bool(vals[6] if len(vals) > 6 and str(target).startswith(
            "aten.convolution") else False)
        return float(flop_counter.conv_flop_count([*lead, *x.shape], list(w.shape), [*lead, *out.shape], transposed))
    packet = getattr(target, "overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0.0
    kwargs = {k: concrete(v.meta.get("val") if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs.items()}
    try:
        return float(formula(*vals, out_val=out, **kwargs))
    except Exception:  # a formula that cannot read these arguments counts nothing, as FlopCounterMode would fail
        return 0.0


# torch.export sets process-wide state while it traces (fx's stack-trace switch below, patched
# functions), and a model with its parameters on meta has its buffers swapped for the trace: two
# threads tracing at once would see each other's. One trace at a time.
_EXPORT_LOCK = threading.RLock()


@old_objects_frozen()  # the collector's full passes walk the trace's objects, not torch's
def capture(model: torch.nn.Module, example_inputs: Any, dynamic_dims: Any = False,
            training: bool | None = None, device: Any = None, unroll: bool = False) -> OpGraph:
    """Trace ``model`` on ``example_inputs`` and return its :class:`OpGraph`.

    ``example_inputs`` is what ``model(*example_inputs)`` would be called with (a tuple, a single
    tensor, or a dict of keyword arguments). The model may live on the meta device, or have only its
    parameters there (``autotp.meta_init``): it is then traced on meta, its buffers and the inputs
    moved there for the trace alone. ``dynamic_dims`` (:func:`autotp.tracing.dynamic.export_spec`): False
    traces every size as the example's; None traces the batch and sequence dims as symbols, which
    the graph then records (``OpGraph.dynamic``, ``OpGraph.symbolic``); a dict names the dims.
    ``training``: trace the model in train (True) or eval (False) mode, or in a mix of the two
    (:data:`autotp.tracing.inputs.Modes`), every submodule's flag put back afterwards; None (default)
    traces it in the modes its modules are in, each its own (a frozen batch norm in eval mode inside a
    model in train mode reads its running statistics). ``OpGraph.training`` and
    ``OpGraph.other_mode`` record them.
    ``device``: for a model on meta, the device it will run on (``"cpu"``, ``"cuda"``): it is traced
    with fake tensors that say that device, so code that branches on its tensors' device takes the
    branch the run will take (on meta, it would take another: ``torch.histc`` on integers off CPU).
    ``unroll``: trace each stack of alike layers at three layers and unroll it
    (:mod:`autotp.tracing.repeats`): the same graph, in a time that does not grow with depth, but
    without an exported program (for planning, not for the rewrite); traced whole where it cannot.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is {with_article(type(model).__name__)}; expected a torch.nn.Module")
    if training is not None and modes_of(model) != training:
        with in_modes(model, training):
            return capture(model, example_inputs, dynamic_dims, device=device, unroll=unroll)
    if unroll and dynamic_dims is False:
        with _EXPORT_LOCK:
            stacks = find_stacks(model)
            graph = stacks and capture_unrolled(
                model, lambda: capture(model, example_inputs, dynamic_dims, training, device), stacks)
        if graph:
            return graph
    args, kwargs = distinct(*normalize_inputs(example_inputs))
    spec = export_spec(model, args, kwargs, dynamic_dims)
    with _EXPORT_LOCK, cache_off(model, kwargs):
        if meta_parameters(model):
            args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            if device is not None and torch.device(device).type != "meta":
                with on_fake_device(model, torch.device(device), (args, kwargs)) as (args, kwargs):
                    return _capture(model, args, kwargs, spec, dynamic_dims is None)
            with buffers_on_meta(model):
                return _capture(model, args, kwargs, spec, dynamic_dims is None)
        return _capture(model, args, kwargs, spec, dynamic_dims is None)


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """A trace autotp retries logs each failed op's traceback at error level: the retry says it all."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, spec: Any = None, fall_back: bool = False) -> OpGraph:
    check_devices(model, args, kwargs)
    # Stack traces on every traced node cost about a third of export's time on a large model and
    # autotp never reads them; errors still carry the user's own traceback.
    try:
        import torch.fx.config as fx_config
    except ImportError:  # older torch: no switch, stack traces are recorded
        fx_config = None
    with _EXPORT_LOCK:
        saved = getattr(fx_config, "do_not_emit_stack_traces", None)
        if saved is not None:
            fx_config.do_not_emit_stack_traces = True
        try:
            with _quiet_fake_tensor_errors() if fall_back else contextlib.nullcontext():
                # gradients on: under the caller's no_grad, the model's own no_grad blocks would leave no
                # trace in the graph (autotp/tracing/regions.py), and their parameters would take gradients
                with torch.enable_grad():
                    exported = torch.export.export(model, args, kwargs, dynamic_shapes=spec, strict=False)
        except Exception as err:  # noqa: BLE001 - re-raised with context
            if spec is None or not fall_back:
                raise capture_error(err)
            # dims autotp chose, not the user: a model that traces only at fixed sizes runs at those
            # fresh input tensors: the failed trace left its symbolic sizes memoized on these
            args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
            graph = _capture(model, args, kwargs)  # raises what does not fit, if anything does not
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            warnings.warn(f"autotp could not trace {type(model).__name__} with its batch and sequence dims dynamic "
                          f"({type(err).__name__}: {first}); the parallel module accepts only the example's sizes",
                          stacklevel=4)
            return graph
        finally:
            if saved is not None:
                fx_config.do_not_emit_stack_traces = saved
        return graph_from_exported(exported, model)


def _returns_its_input(target: str, node: torch.fx.Node, inputs: list[TensorInfo], outs: tuple) -> bool:
    """A cast to the dtype (and device) the tensor already has returns the tensor itself: no kernel,
    no bytes (``x.to(x.dtype)``, which models write to be safe; ``copy=True`` copies)."""
    if target not in ops.CASTS or len(inputs) != 1 or outs != (inputs[0],):
        return False
    val, src = node.meta.get("val"), node.args[0].meta.get("val") if node.args else None
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor) or val.device != src.device:
        return False
    return not op_args(node).get("copy", False)


def graph_from_exported(exported: torch.export.ExportedProgram, model: torch.nn.Module) -> OpGraph:
    """Build the OpGraph of an ``ExportedProgram`` traced from ``model`` (its ``no_grad`` and
    autocast-off blocks are inlined into its graph first: ``autotp/tracing/regions.py``)."""
    try:
        renamed = inline_regions(exported.graph_module)
    except RegionError as err:
        raise CaptureError(f"autotp cannot place {err}.\n  what to do: write the block as plain tensor operations "
                           f"(one grad mode or autocast switch at a time)") from None
    for spec in exported.graph_signature.output_specs:  # outputs the inlining renamed (it stays valid)
        if renamed.get(getattr(spec.arg, "name", None)):
            spec.arg.name = renamed[spec.arg.name]
    describe_masks(exported.graph_module)  # attention masks as descriptions, their S x S subgraph gone
    check_higher_order_ops(exported, model)
    check_data_dependent_sizes(exported, model)
    sig = exported.graph_signature
    kinds = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}

    # Tied parameters: every name of a parameter object maps to its first (canonical) name.
    names_by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(p), []).append(fqn)
    canonical = {fqn: names[0] for names in names_by_id.values() for fqn in names}
    aliases_of = {names[0]: tuple(names[1:]) for names in names_by_id.values()}
    requires_grad = {fqn: p.requires_grad for fqn, p in model.named_parameters(remove_duplicate=False)}

    nodes: list[OpNode] = []
    infos: dict[str, tuple[TensorInfo, ...]] = {}
    grad: dict[str, bool] = {}
    rename: dict[str, str] = {}  # placeholder of a tied duplicate -> canonical placeholder
    param_node: dict[str, str] = {}
    parameters: list[ParameterInfo] = []
    outputs: list[str] = []
    symbolic: dict[str, tuple[tuple[str | None, ...], ...]] = {}
    dynamic: list[DynamicDim] = []

    for node in exported.graph.nodes:
        if node.op == "placeholder":
            spec = kinds.get(node.name)
            kind = spec.kind.name if spec is not None else "USER_INPUT"
            outs = _node_outputs(node)
            if not outs:
                continue  # a non-tensor input (an int, None): nothing to place
            fqn, persistent = None, True
            if kind == "PARAMETER":
                fqn = canonical.get(spec.target, spec.target)
                if fqn in param_node:
                    rename[node.name] = param_node[fqn]
                    continue
                param_node[fqn] = node.name
                parameters.append(ParameterInfo(fqn, node.name, outs[0], aliases_of.get(fqn, ())))
                role = PARAMETER
            elif kind == "BUFFER":
                role, fqn = BUFFER, spec.target
                persistent = bool(spec.persistent)
            elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ", "TOKEN"):
                role = CONSTANT
            else:
                role = INPUT
                dynamic.extend(_dynamic_dims(node, exported.range_constraints))
            needs_grad = role == PARAMETER and requires_grad.get(fqn, True)
            grad[node.name] = needs_grad
            infos[node.name] = outs
            if dims := _symbolic_dims(node):
                symbolic[node.name] = dims
            nodes.append(OpNode(node.name, role, role, (), (), outs, param_fqn=fqn, requires_grad=needs_grad,
                                persistent=persistent))
        elif node.op == "call_function":
            check_written_arguments(node)
            outs = _node_outputs(node)
            if not outs:
                continue  # assertions and other ops that return no tensor
            srcs: list[str] = []
            src_infos: list[TensorInfo] = []
            if node.target is operator.getitem:
                src = rename.get(node.args[0].name, node.args[0].name)
                srcs.append(src)
                src_infos.append(infos[src][node.args[1]])
                target = "getitem"
            else:
                target = str(node.target)
                for a in tensor_arguments(node):
                    src = rename.get(a.name, a.name)
                    srcs.append(src)
                    src_infos.append(infos[src][0])
            is_view = target in ops.VIEW or _returns_its_input(target, node, src_infos, outs)
            path, mtype, stack = module_info(node)
            needs_grad = (any(grad.get(s, False) for s in srcs) and any(o.is_float for o in outs)
                          and target not in ops.NO_GRADIENT)
            grad[node.name] = needs_grad
            infos[node.name] = outs
            if dims := _symbolic_dims(node):
                symbolic[node.name] = dims
            nodes.append(
                OpNode(
                    name=node.name, role=OP, target=target, inputs=tuple(srcs), input_infos=tuple(src_infos),
                    outputs=outs, flops=_flops(node) if not is_view else 0.0,
                    bytes_read=0.0 if is_view else float(sum(i.nbytes for i in src_infos)),
                    bytes_written=0.0 if is_view else float(sum(o.nbytes for o in outs)),
                    module_path=path, module_type=mtype, module_stack=stack, requires_grad=needs_grad,
                    is_view=is_view, args=op_args(node),
                )
            )
        elif node.op == "output":
            for a in torch.utils._pytree.tree_leaves(node.args[0]):
                if isinstance(a, torch.fx.Node):
                    name = rename.get(a.name, a.name)
                    if name in infos:
                        outputs.append(name)
        else:
            raise CaptureError(f"unexpected node {node.name} of kind {node.op!r} in the exported graph; "
                               "higher-order ops and submodule calls are not supported yet")
    check_operand_dtypes(nodes)
    graph = OpGraph(
        nodes=tuple(nodes), outputs=tuple(outputs), parameters=tuple(parameters),
        model_type=type(model).__name__, exported=exported, alias_placeholders=rename,
        dynamic=tuple(dynamic), symbolic=symbolic, training=bool(model.training),
        other_mode=() if isinstance(modes_of(model), bool) else modes_of(model)[1],
        erased=tuple(exported.graph_module.meta.get(ERASED, ())),
    )
    check_parameter_writes(graph)
    return graph


def _dynamic_dims(node: torch.fx.Node, ranges: Any) -> list[DynamicDim]:
    """The dims of a user input the trace kept symbolic, with the sizes it holds for."""
    val = node.meta.get("val")
    out = []
    for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
        expr = size_expression(size)
        if expr is None:
            continue
        bounds = ranges.get(size.node.expr)
        low = _finite(bounds.lower) if bounds is not None else None
        high = _finite(bounds.upper) if bounds is not None else None
        out.append(DynamicDim(node.name, d, expr, size_hint(size), low or 0, high))
    return out


def _finite(bound: Any) -> int | None:
    from torch.utils._sympy.numbers import int_oo

    return None if bound in (int_oo, -int_oo) or not bound.is_number or not bound.is_finite else int(bound)
