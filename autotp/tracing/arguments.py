"""An exported fx node's arguments as data: which are tensors (in one order), and the typed
:class:`~autotp.tracing.graph.OpArgs` named by the op's schema that capture records on each OpNode.

>>> import torch
>>> from autotp.tracing.graph import TensorArg
>>> TensorArg(0)
%0
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

import torch
import torch.fx

from autotp.tracing.dynamic import size_expression, size_hint
from autotp.tracing.graph import OpArgs, SizeArg, TensorArg, TensorInfo

__all__ = ["map_tensor_arguments", "tensor_arguments", "op_args"]


def _tensor_info(val: Any) -> TensorInfo | None:
    if isinstance(val, torch.Tensor):
        return TensorInfo(tuple(size_hint(s) for s in val.shape), str(val.dtype).removeprefix("torch."))
    return None


def _node_outputs(node: torch.fx.Node) -> tuple[TensorInfo, ...]:
    val = node.meta.get("val")
    info = _tensor_info(val)
    if info is not None:
        return (info,)
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return tuple(_tensor_info(v) for v in val)  # type: ignore[misc]
    return ()


def map_tensor_arguments(node: torch.fx.Node, fn: Callable[[int, torch.fx.Node], Any],
                         other: Callable[[Any], Any] = lambda a: a) -> tuple[Any, Any]:
    """``(args, kwargs)`` of ``node`` with its k-th tensor argument replaced by ``fn(k, argument)``
    and every other leaf by ``other(leaf)``.

    The one definition of the order of tensor arguments: positional then keyword arguments, one
    entry per occurrence (``mul(h, h)`` has two). ``OpNode.inputs``, ``OpArgs`` and the rewrite
    all follow it."""
    count = itertools.count()

    def visit(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and _node_outputs(a):
            return fn(next(count), a)
        return other(a)

    return torch.fx.node.map_aggregate(node.args, visit), torch.fx.node.map_aggregate(node.kwargs, visit)


def tensor_arguments(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor arguments of a node in the order of :func:`map_tensor_arguments`."""
    found: list[torch.fx.Node] = []
    map_tensor_arguments(node, lambda k, a: found.append(a))
    return found


def _plain(value: Any) -> Any:
    """An argument as plain, hashable data: lists as tuples, a symbolic size as a SizeArg."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.fx.Node):  # a size computed in the graph (dynamic dims), or another non-tensor
        val = value.meta.get("val")
        if isinstance(val, (torch.SymInt, int)):
            return SizeArg(size_expression(val) or str(size_hint(val)), size_hint(val))
        if isinstance(val, (torch.SymFloat, torch.SymBool)):  # by its expression, as a size (layers tie)
            return SizeArg(str(val.node.expr), 0)
        return SizeArg(value.name, 0)
    if isinstance(value, torch.SymInt):
        return SizeArg(size_expression(value) or str(size_hint(value)), size_hint(value))
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    return value


def op_args(node: torch.fx.Node) -> OpArgs:
    """The arguments of a call node as :class:`~autotp.tracing.graph.OpArgs`, named by the op's schema."""
    args, kwargs = map_tensor_arguments(node, lambda k, a: TensorArg(k))
    args, kwargs = tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}
    if node.target is operator.getitem:
        return OpArgs(("self", "index"), args[:2])
    schema = getattr(node.target, "_schema", None)
    if schema is None:  # not an OpOverload: positional arguments by position, then keywords
        names = tuple(f"arg{i}" for i in range(len(args))) + tuple(sorted(kwargs))
        return OpArgs(names, args + tuple(kwargs[k] for k in sorted(kwargs)))
    names, values = [], []
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        else:
            value = _plain(a.default_value) if a.has_default_value() else None
        names.append(a.name)
        values.append(value)
    return OpArgs(tuple(names), tuple(values))
