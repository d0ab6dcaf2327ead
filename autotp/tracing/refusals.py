"""What capture refuses: constructs a plan cannot place or would place wrongly, each raised as a
:class:`CaptureError` that names the op, its module and what to do (``autotp/tracing/export.py`` calls
these checks on the exported graph and on the OpGraph it builds)."""

from __future__ import annotations

import torch
import torch.fx

from autotp import ops
from autotp.tracing.aliasing import storage_roots, writes_in_place, written_elsewhere
from autotp.tracing.graph import PARAMETER, OpGraph, OpNode

__all__ = ["CaptureError", "module_info", "check_higher_order_ops", "check_data_dependent_sizes",
           "check_written_arguments", "check_parameter_writes", "check_operand_dtypes"]


class CaptureError(RuntimeError):
    """The model could not be captured; the message says what failed and what to do."""


def module_info(node: torch.fx.Node) -> tuple[str, str, tuple[str, ...]]:
    """``(module path, module type name, the stack of paths)`` of the module that ran ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return "", "", ()
    paths = tuple(str(e[0]) for e in entries)
    last_type = entries[-1][1]
    type_name = last_type if isinstance(last_type, str) else getattr(last_type, "__qualname__", str(last_type))
    return paths[-1], type_name.rsplit(".", 1)[-1], paths


# what a higher-order op in the exported graph stands for in the user's code, and what to do about it
HIGHER_ORDER = {
    "wrap_with_autocast": (
        "a torch.autocast region with autocast on inside forward() (autocast off is inlined)",
        "cast explicitly in forward() (x.to(dtype)) or build the model in the dtype it should compute in"),
    "cond": ("torch.cond (a branch on tensor values)",
             "branch on shapes or config flags instead, so one branch is traced"),
    "while_loop": ("torch.while_loop (a loop on tensor values)", "unroll the loop to a static count"),
    "map": ("torch.map over a tensor", "write the loop over a static count"),
    "scan": ("torch.scan", "write the loop over a static count"),
}


def check_higher_order_ops(exported: torch.export.ExportedProgram, model: torch.nn.Module) -> None:
    """autotp places ATen ops; a higher-order op holds a subgraph it cannot place: refuse it by name."""
    for node in exported.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            name = node.target.name()
            construct, todo = HIGHER_ORDER.get(name, (
                f"the higher-order op {name}", "rewrite that part of forward() as plain tensor operations"))
            path, mtype, _ = module_info(node)
            where = f"module {path!r} ({mtype})" if path else f"{type(model).__name__}.forward()"
            raise CaptureError(
                f"autotp cannot place {construct}: torch.export keeps it as the higher-order op {name} "
                f"(node {node.name}), at {where}.\n  what to do: {todo}.")


def check_data_dependent_sizes(exported: torch.export.ExportedProgram, model: torch.nn.Module) -> None:
    """A tensor whose size the trace could only name by a data-dependent symbol (``u0``: sizes read
    from tensor values by ``.tolist()``, ``nonzero``, a boolean mask) has no size to price or split,
    and a value read into Python (``.item()``) would differ between ranks' pieces: refuse the first op
    that makes either, by name."""
    scalars = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for node in exported.graph.nodes:
        val = node.meta.get("val")
        for value in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(value, scalars) and value.node.hint is None:
                what = (f"reads a tensor's value into Python ({value}: .item(), .tolist()), and a plan runs the "
                        f"same ops on every rank's piece, where that value differs")
            elif isinstance(value, torch.Tensor) and any(
                    isinstance(s, torch.SymInt) and s.node.hint is None for s in value.shape):
                unknown = [str(s) for s in value.shape if isinstance(s, torch.SymInt) and s.node.hint is None]
                what = (f"its output's size {list(value.shape)} depends on tensor values ({', '.join(unknown)}: "
                        f"sizes read from a tensor by .tolist() or .item(), or made by nonzero or a boolean mask), "
                        f"and a plan prices and splits sizes it knows")
            else:
                continue
            path, mtype, _ = module_info(node)
            where = f"module {path!r} ({mtype})" if path else f"{type(model).__name__}.forward()"
            instead = FIXED_SIZE.get(str(node.target), "")
            raise CaptureError(
                f"autotp cannot plan {node.target} (node {node.name}) at {where}: {what}.\n  what to do: compute "
                f"with tensors and with sizes fixed by the inputs' shapes{instead} (for experts, a batched or padded "
                f"implementation rather than splitting the tokens by the counts the router gives each expert).")


# ops whose size depends on values and the op of a fixed size that computes the same
FIXED_SIZE = {
    "aten.bincount.default": (": bincount's length is the largest id + 1 where that exceeds minlength; counts "
                              "of E ids have the fixed length E by torch.histc(ids.float(), bins=E, min=0, max=E - 1)"),
}


def check_written_arguments(node: torch.fx.Node) -> None:
    """An op that writes into an argument other than its first tensor (``out=``, ``_foreach_mul_``'s
    list): the planner follows writes in place into the first tensor only, so it is refused."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return
    argument = written_elsewhere(str(node.target))
    if argument is None:
        return
    path, mtype, _ = module_info(node)
    where = f"module {path!r} ({mtype})" if path else "forward()"
    raise CaptureError(
        f"{node.target} (node {node.name}) at {where} writes into its argument {argument!r}: autotp follows "
        f"writes in place only into an op's first argument, where it is one tensor (add_, copy_, index_put_).\n  what to do: use the form "
        f"that returns its result (y = torch.mul(a, 2) rather than out=y; a loop of mul_ rather than "
        f"torch._foreach_mul_).")


def check_parameter_writes(graph: OpGraph) -> None:
    """A write in place into a parameter inside ``forward()`` (under ``no_grad``: autograd refuses it
    otherwise) is state the trace cannot keep: code that rescales weights once (RWKV on its first
    call in eval mode) is traced as a rescale on every call."""
    root = storage_roots(graph)
    for node in graph.nodes:
        target = graph[root[node.name]]
        if writes_in_place(node) and target.role == PARAMETER:
            where = f"module {node.module_path!r} ({node.module_type})" if node.module_path else "forward()"
            raise CaptureError(
                f"{node.target} (node {node.name}) at {where} writes into the parameter {target.param_fqn!r} "
                f"inside forward(): autotp splits parameters once and does not follow writes into them, and a "
                f"write forward() makes once (RWKV rescales its weights on its first call in eval mode) would "
                f"be traced as a write on every call.\n  what to do: change the parameter before autotp sees "
                f"the model (for a one-time rescale, call the model once first; for nn.Embedding(max_norm=...), "
                f"renormalize the weight once and drop max_norm), or compute a new tensor instead of writing "
                f"in place.")


def check_operand_dtypes(nodes: list[OpNode]) -> None:
    """Tracing with fake tensors lets ``x.double() @ w.float()`` through; the real kernel would refuse it."""
    for node in nodes:
        if node.target in ops.SAME_DTYPE and len({i.dtype for i in node.input_infos}) > 1:
            raise CaptureError(
                f"{node.target} at {node.module_path or 'the model'} (node {node.name}) gets operands of dtypes "
                f"{[i.dtype for i in node.input_infos]}; expected one dtype: give example inputs of the dtype the "
                f"model computes in")
        if node.target == "aten.embedding.default" and len(node.input_infos) > 1 and node.input_infos[1].is_float:
            raise CaptureError(
                f"embedding at {node.module_path or 'the model'} (node {node.name}) gets indices of dtype "
                f"{node.input_infos[1].dtype}; expected integer token ids (torch.long)")
