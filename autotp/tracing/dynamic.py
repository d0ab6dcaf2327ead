"""Dynamic dims: the input sizes a parallel module accepts besides the example's.

Capture marks the batch and sequence dims of the example inputs dynamic (:func:`export_spec`):
``torch.export`` then traces sizes as symbols (``s0``, ``s1``) instead of numbers, keeps a dim
symbolic only where the model's code allows any size, and writes every shape that follows from it
(a ``view`` to ``[s0, s1, 4, 16]``) as arithmetic on the inputs' sizes. The planner prices the plan
at the example sizes; the rewrite turns each symbolic shape into its local shape at run time.

What a plan requires of a dynamic dim follows from where it splits it: a tensor dim of size
``s1`` split over 2 ranks needs ``s1`` even (:func:`requirements`). The module checks this, and the
dims' ranges, before anything else runs (:mod:`autotp.runtime.guard`), and the report lists both.

>>> req = Divisibility("s1*s0", 2, "view_3")
>>> req.holds({"s0": 3, "s1": 5}), req.holds({"s0": 4, "s1": 5})
(False, True)
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from autotp.placement import dim_divisor
from autotp.words import with_article

__all__ = ["DynamicDim", "Divisibility", "export_spec", "requirements", "evaluate", "compiled", "size_hint",
           "size_expression", "in_input_terms"]


@dataclass(frozen=True)
class DynamicDim:
    """A dim of a user input that may take other sizes than the example's.

    ``symbol`` names its size in the graph's shape arithmetic (two dims that must be equal, such as
    the sequence dims of ``input_ids`` and ``attention_mask``, share one); ``minimum`` and
    ``maximum`` (None: no bound) are the sizes the trace holds for.
    """

    input: str
    dim: int
    symbol: str
    example: int
    minimum: int
    maximum: Optional[int] = None


@dataclass(frozen=True)
class Divisibility:
    """The plan splits a tensor dim of size ``expression`` (in the dims' symbols) over ``divisor``
    ranks: the size must be a multiple of it. ``tensor`` names one such tensor of the graph."""

    expression: str
    divisor: int
    tensor: str

    def holds(self, sizes: Mapping[str, int]) -> bool:
        return evaluate(self.expression, sizes) % self.divisor == 0


@functools.lru_cache(maxsize=None)
def compiled(expression: str):
    """``(symbol names, function of their sizes)`` for a size expression."""
    import sympy

    expr = sympy.sympify(expression)
    names = tuple(sorted(str(s) for s in expr.free_symbols))
    return names, sympy.lambdify(names, expr, modules="math")


def evaluate(expression: str, sizes: Mapping[str, int]) -> int:
    """The integer value of a size expression (``"2*s1"``) given the symbols' sizes."""
    names, fn = compiled(expression)
    return int(fn(*(sizes[n] for n in names)))


def size_hint(size: Any) -> int:
    """A size as a number: a symbolic size (a dynamic dim) at its example value."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def size_expression(size: Any) -> Optional[str]:
    """A symbolic size as an expression in the dims' symbols (``"s1*s0"``), None for a static one."""
    return str(size.node.expr) if isinstance(size, torch.SymInt) and not size.node.expr.is_number else None


def in_input_terms(expression: str, names: Mapping[str, str]) -> str:
    """``expression`` with each symbol written as ``names`` says (``"input_ids.size(1)"``)."""
    for symbol in sorted(names, key=len, reverse=True):
        expression = re.sub(rf"\b{symbol}\b", names[symbol], expression)
    return expression


# -- which dims capture marks dynamic -------------------------------------------------------------

def _auto_dims(value: torch.Tensor) -> tuple[int, ...]:
    """Batch and sequence dims by the tensor's kind: every dim of integer tokens, ids and masks; every
    dim but the last (features, fixed by the weights) of a float tensor. Size-1 dims stay static
    (``torch.export`` specializes them)."""
    dims = range(value.ndim) if not value.is_floating_point() else range(value.ndim - 1)
    return tuple(d for d in dims if value.shape[d] > 1)


def export_spec(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_dims: Any) -> Optional[dict]:
    """``dynamic_shapes`` for ``torch.export`` (keyed by ``forward``'s argument names), or None for a
    static trace.

    ``dynamic_dims``: None picks the batch and sequence dims (:func:`_auto_dims`) and lets the trace
    keep static any the model fixes (``Dim.AUTO``); False traces every dim static; a mapping
    ``{argument name: dims}`` marks exactly those dims, and the trace fails if the model fixes one.
    """
    if dynamic_dims is False:
        return None
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        if dynamic_dims is None:
            return None  # a static trace reports what does not fit
        raise
    params = inspect.signature(model.forward).parameters
    named: dict[str, Any] = {}  # every tensor argument by name, **kwargs' entries by their own
    for name, value in bound.arguments.items():
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif params[name].kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        else:
            named[name] = value
    tensors = {name: v for name, v in named.items() if isinstance(v, torch.Tensor)}
    if dynamic_dims is None:
        chosen = {name: _auto_dims(v) for name, v in tensors.items()}
        kind = torch.export.Dim.AUTO
    else:
        if not isinstance(dynamic_dims, Mapping):
            raise TypeError(f"dynamic_dims is {with_article(type(dynamic_dims).__name__)}; expected None (detect), False (none) "
                            f"or a dict {{argument name: dims}}, e.g. {{'input_ids': (0, 1)}}")
        unknown = sorted(set(dynamic_dims) - set(tensors))
        if unknown:
            raise ValueError(f"dynamic_dims names {unknown}, which are not tensor arguments of "
                             f"{type(model).__name__}.forward in the example inputs (those are {sorted(tensors)})")
        chosen = {}
        for name, dims in dynamic_dims.items():
            dims = tuple(int(d) for d in ((dims,) if isinstance(dims, int) else dims))
            ndim = tensors[name].ndim
            bad = [d for d in dims if not -ndim <= d < ndim]
            if bad:
                raise ValueError(f"dynamic_dims[{name!r}] = {list(dims)}: the example {name} has {ndim} dims "
                                 f"(shape {list(tensors[name].shape)})")
            chosen[name] = tuple(d % ndim for d in dims)
        kind = torch.export.Dim.DYNAMIC
    if not any(chosen.values()):
        return None

    def entry(name: str, value: Any) -> Any:
        return {d: kind for d in chosen[name]} or None if name in chosen else None

    spec: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            spec[name] = {k: entry(k, v) for k, v in value.items()}
        elif params[name].kind is inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple(entry(f"{name}[{i}]", v) for i, v in enumerate(value))
        else:
            spec[name] = entry(name, value)
    return spec


# -- what a plan requires of them -------------------------------------------------------------------

def requirements(symbolic: Mapping[str, tuple[tuple[Optional[str], ...], ...]], nodes, strategies,
                 mesh_shape: tuple[int, ...]) -> tuple[Divisibility, ...]:
    """Every symbolic tensor dim the plan splits, with the number of ranks it is split over (the
    least common multiple where several tensors of one size are split differently).

    ``symbolic`` maps a node to its outputs' dims as expressions (None: static); ``nodes`` are the
    graph's nodes, ``strategies`` the plan's per node."""
    found: dict[str, tuple[int, str]] = {}

    def visit(expressions: tuple[Optional[str], ...], placements, tensor: str) -> None:
        for d in {p.dim for p in (placements or ()) if p.is_shard}:
            if d >= len(expressions) or expressions[d] is None:
                continue
            ranks = dim_divisor(placements, mesh_shape, d)
            old, where = found.get(expressions[d], (1, tensor))
            found[expressions[d]] = (math.lcm(old, ranks), where)

    for node in nodes:
        strat = strategies[node.name]
        for expressions in symbolic.get(node.name, ()):  # a multi-output op: one placement for all
            visit(expressions, strat.output, node.name)
        for src, placements in zip(node.inputs, strat.inputs):
            for expressions in symbolic.get(src, ()):
                visit(expressions, placements, src)
    return tuple(Divisibility(e, r, t) for e, (r, t) in sorted(found.items()) if r > 1)
