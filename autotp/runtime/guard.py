"""The parallel module's input check: the first node of its graph, before any collective.

The rewritten graph computes on local shards. A static dim's size is baked into it (a ``view`` of
the token ids to ``[8, 64]``); a dynamic dim's (:mod:`autotp.tracing.dynamic`) is read from the inputs, but
may have to divide evenly where the plan splits it. Called with inputs it was not built for, the
graph would fail deep inside, hang in a collective of the wrong size, or, worst, return an answer
of the wrong shape with no error (a batch of 16 x 32 tokens viewed as 8 x 64). ``InputGuard``
refuses such a call up front, naming the input, the dim, the size given and what the module needs,
and an input on another device than the rank's device of the mesh (a tensor left on the CPU for a
CUDA mesh), naming both (:func:`autotp.runtime.devices.wrong_device`).
A mask given as bool where the trace had integers, or the other way round (Hugging Face's
``attention_mask`` takes either), is not refused: the graph reads it converted to the traced dtype
(:func:`as_traced_dtype`, on the tensor's own device). One integer dtype for another still is.

>>> import torch
>>> guard = InputGuard((InputSpec("input_ids", (8, 64), "int64"),))
>>> guard(torch.zeros(8, 64, dtype=torch.int64))
>>> guard(torch.zeros(16, 32, dtype=torch.int64))
Traceback (most recent call last):
...
ValueError: input 'input_ids': dim 0 has size 16, but this parallel module was built for size 8 (shape [8, 64] given [16, 32]); this dim is static (the trace fixed it, or dynamic_dims left it out); call autotp.parallelize again with example inputs of this shape
>>> guard = InputGuard((InputSpec("input_ids", (8, "s1"), "int64"),),
...                    divisibility=(Divisibility("s1", 2, "view_3"),))
>>> guard(torch.zeros(8, 30, dtype=torch.int64))
>>> guard(torch.zeros(8, 33, dtype=torch.int64))
Traceback (most recent call last):
...
ValueError: input 'input_ids': dim 1 has size 33, but the plan splits it over 2 ranks (tensor view_3) and needs a multiple of 2; pad the input to a multiple of 2, or plan with a mesh that does not split this dim
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotp.runtime.devices import wrong_device
from autotp.tracing.dynamic import Divisibility, DynamicDim, compiled, in_input_terms, size_expression, size_hint
from autotp.words import with_article

__all__ = ["InputSpec", "InputGuard", "SameOnEveryRank", "SizeNotTraced", "fingerprint", "as_traced_dtype",
           "DEFAULT_INPUT_CHECKS"]

DEFAULT_INPUT_CHECKS = 8  # calls of each graph whose inputs are compared across the ranks


class SizeNotTraced(ValueError):
    """A dynamic dim's size below the range the trace holds (``torch.export`` specializes sizes 0
    and 1: a batch of one, one new token). Another trace at that size runs it: a module made by
    ``autotp.parallelize`` makes one (:class:`autotp.runtime.module.ParallelModule`); others raise this."""


@dataclass(frozen=True)
class InputSpec:
    """One flattened user input as the module was built for it: per dim its size, or for a dynamic
    dim the symbol (or expression in symbols) of its size."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, value: torch.Tensor) -> "InputSpec":
        return cls(name, tuple(_size(n) for n in value.shape), str(value.dtype).removeprefix("torch."))


def _size(n: Any) -> int | str:
    return size_expression(n) or size_hint(n)


class InputGuard(nn.Module):
    """Raises unless every input has the rank, sizes and dtype of its ``InputSpec``: static dims the
    example's size, dynamic dims a size within their range, equal where the graph needs them equal,
    and divisible as the plan requires (:class:`autotp.tracing.dynamic.Divisibility`)."""

    def __init__(self, specs: tuple[InputSpec, ...], dynamic: tuple[DynamicDim, ...] = (),
                 divisibility: tuple[Divisibility, ...] = (), tensor_positions: tuple[int, ...] | None = None,
                 recorded: Any = None, same_on_ranks: "SameOnEveryRank | None" = None,
                 device: torch.device | None = None) -> None:
        """``tensor_positions``: which of the inputs the specs describe (default: the first ones);
        ``recorded``: export's own check of all the inputs (``ExportedProgram.module()._guards_fn``),
        run after autotp's; ``same_on_ranks``: the check that every rank was given the same inputs;
        ``device``: the device every input must be on (the rank's device of the mesh; None: any)."""
        super().__init__()
        self.device = device
        self.same_on_ranks = same_on_ranks
        self.specs = tuple(specs)
        self.positions = tuple(range(len(self.specs))) if tensor_positions is None else tuple(tensor_positions)
        self.recorded = recorded
        self.dynamic = tuple(dynamic)
        self.divisibility = tuple(divisibility)
        # each size expression as a plain function of the symbols' sizes, made once: torch.compile
        # then traces the checks as arithmetic on the input sizes
        derived = {n for s in self.specs for n in s.shape if isinstance(n, str) and not _SYMBOL.fullmatch(n)}
        self._expressions = {e: compiled(e) for e in {r.expression for r in self.divisibility} | derived}

    def _value(self, expression: str, sizes: dict[str, int]) -> int:
        names, fn = self._expressions[expression]
        missing = [n for n in names if n not in sizes]
        if missing:
            raise ValueError(f"cannot check the size {expression}: {missing} is not the size of an input dim; "
                             f"call autotp.parallelize with dynamic_dims=False")
        return int(fn(*(sizes[n] for n in names)))

    def extra_repr(self) -> str:
        where = f", on {self.device}" if self.device is not None else ""
        return ", ".join(f"{s.name}: {list(s.shape)} {s.dtype}" for s in self.specs) + where

    def forward(self, *args: Any) -> None:
        inputs = [args[i] for i in self.positions]
        sizes: dict[str, int] = {}
        where: dict[str, tuple[str, int]] = {}
        for spec, value in zip(self.specs, inputs):
            _check(spec, value, sizes, where)
            if self.device is not None:  # before any collective: NCCL has no backend for a CPU tensor
                error = wrong_device(spec.name, value.device, self.device)
                if error:
                    raise ValueError(error)
        for spec, value in zip(self.specs, inputs):  # dims whose size is an expression of others
            for dim, want in enumerate(spec.shape):
                if isinstance(want, str) and not _SYMBOL.fullmatch(want):
                    expected = self._value(want, sizes)
                    if value.shape[dim] != expected:
                        raise ValueError(f"input {spec.name!r}: dim {dim} has size {value.shape[dim]}, but the model "
                                         f"needs {want} = {expected} for the other inputs' sizes {sizes}")
        for d in self.dynamic:
            n = sizes.get(d.symbol)
            if n is not None and (n < d.minimum or (d.maximum is not None and n > d.maximum)):
                bounds = f">= {d.minimum}" if d.maximum is None else f"in [{d.minimum}, {d.maximum}]"
                error = SizeNotTraced if n < d.minimum else ValueError
                raise error(f"input {d.input!r}: dim {d.dim} has size {n}, but this parallel module was traced "
                            f"for sizes {bounds} there (torch.export specializes sizes 0 and 1); give example "
                            f"inputs of size {n} in that dim to autotp.parallelize to run it")
        for req in self.divisibility:
            value = self._value(req.expression, sizes)
            if value % req.divisor:
                what = _describe(req.expression, where, value)
                raise ValueError(f"{what}, but the plan splits it over {req.divisor} ranks (tensor {req.tensor}) and "
                                 f"needs a multiple of {req.divisor}; pad the input to a multiple of {req.divisor}, "
                                 f"or plan with a mesh that does not split this dim")
        if self.same_on_ranks is not None:
            self.same_on_ranks(tuple(spec.name for spec in self.specs), inputs)
        if self.recorded is not None:
            try:
                self.recorded(*args)
            except AssertionError as err:
                raise ValueError(f"the inputs break a condition on sizes that the model's code relies on (the trace "
                                 f"followed one branch of it): {err}; call autotp.parallelize with example inputs "
                                 f"that meet the condition you run with, or dynamic_dims=False") from None


# a mask may come as bool or as integers (Hugging Face's attention_mask takes either): given bool where
# the trace had integers, or integers where it had bool, the graph reads it converted to the traced
# dtype (:func:`as_traced_dtype`); one integer type for another is still refused
MASK_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8"})


def as_traced_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in the dtype the trace had (a bool mask where an integer one was traced, or the other
    way round; the guard refused any other difference), on its own device; as it is where it already is."""
    return value if value.dtype == dtype else value.to(dtype)


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Three int64 numbers of ``x``'s bits: their sum, and sums weighted by position along the first
    dim and (over the first 256 rows) along the last, so a batch in another order differs. Integer
    arithmetic: equal inputs give equal numbers on every rank whatever the order of the sums (NaNs
    too); no copy of the input is made."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    if x.is_floating_point():
        x = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    if x.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=x.device)
    rows = x.reshape(x.shape[0] if x.ndim else 1, -1)
    cols = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    by_row = rows.sum(1, dtype=torch.int64)
    by_col = cols[:256].sum(0, dtype=torch.int64)  # a strided sum: a few rows tell the order
    w_row = torch.arange(1, by_row.numel() + 1, device=x.device, dtype=torch.int64)
    w_col = torch.arange(1, by_col.numel() + 1, device=x.device, dtype=torch.int64)
    return torch.stack([by_row.sum(), (by_row * w_row).sum(), (by_col * w_col).sum()])


class SameOnEveryRank:
    """Raises, on every rank, where the ranks of ``mesh`` were given different inputs: each input's
    :func:`fingerprint`, gathered along each mesh axis in turn (every rank ends with every rank's,
    ``len(inputs) * 24`` bytes a rank), compared. ``calls``: how many calls to check (None: all).
    Not run under ``torch.compile`` (a host read of the result would break the graph)."""

    def __init__(self, mesh: Any, calls: int | None) -> None:
        self.mesh, self.remaining = mesh, calls

    def __call__(self, names: tuple[str, ...], inputs: list[torch.Tensor]) -> None:
        if torch.compiler.is_compiling() or self.remaining == 0 or not inputs:
            return
        if self.remaining is not None:
            self.remaining -= 1
        import torch.distributed as dist

        table = torch.stack([fingerprint(x) for x in inputs])
        for axis in range(self.mesh.ndim):  # table[c_last, ..., c_0] after the gathers
            parts = [torch.empty_like(table) for _ in range(self.mesh.size(axis))]
            dist.all_gather(parts, table, group=self.mesh.get_group(axis))
            table = torch.stack(parts)
        table = table.permute(*reversed(range(self.mesh.ndim)), self.mesh.ndim, self.mesh.ndim + 1).cpu()
        ranks = self.mesh.mesh.reshape(-1).tolist()  # global ranks in coordinate order
        prints = table.reshape(len(ranks), len(inputs), -1).tolist()
        for k, name in enumerate(names):
            groups: dict[tuple, list[int]] = {}
            for rank, values in zip(ranks, prints):
                groups.setdefault(tuple(values[k]), []).append(rank)
            if len(groups) > 1:
                raise ValueError(_differ(name, sorted(groups.values(), key=lambda g: (-len(g), g))))


def _differ(name: str, groups: list[list[int]]) -> str:
    if len(groups) == 2 and len(groups[0]) == len(groups[1]) == 1:
        what = f"rank {groups[0][0]} and rank {groups[1][0]} hold different values"
    else:
        what = (f"ranks {', '.join(map(str, groups[0]))} agree; " +
                "; ".join(f"ranks {', '.join(map(str, g))} hold other values" for g in groups[1:]))
    return (f"input {name!r} is not the same on every rank of the mesh: {what}. Every rank must be given the "
            f"whole, same input (the plan reads each rank's share of it): seed the data the same on every rank, "
            f"or load it on one rank and broadcast it; autotp.parallelize(..., check_inputs=False) turns this "
            f"check off")


_AGAIN = "call autotp.parallelize again with example inputs of this shape"
_SYMBOL = re.compile(r"[A-Za-z_]\w*")


def _shape_text(shape: tuple[int | str, ...]) -> str:
    """``[8, 64]``; a dynamic dim shows as ``*``."""
    text = "[" + ", ".join("*" if isinstance(n, str) else str(n) for n in shape) + "]"
    return text + (", * a dynamic dim" if any(isinstance(n, str) for n in shape) else "")


def _describe(expression: str, where: dict[str, tuple[str, int]], value: int) -> str:
    if expression in where:
        name, dim = where[expression]
        return f"input {name!r}: dim {dim} has size {value}"
    text = in_input_terms(expression, {symbol: f"{name}.size({dim})" for symbol, (name, dim) in where.items()})
    return f"the size {text} is {value}"


def _check(spec: InputSpec, value: Any, sizes: dict[str, int], where: dict[str, tuple[str, int]]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"input {spec.name!r} is {with_article(type(value).__name__)}; this parallel module was built for a "
                        f"tensor of shape {_shape_text(spec.shape)} and dtype {spec.dtype}")
    given = tuple(int(n) for n in value.shape)
    if len(given) != len(spec.shape):
        raise ValueError(f"input {spec.name!r} has {len(given)} dims (shape {list(given)}), but this parallel module "
                         f"was built for {len(spec.shape)} (shape {_shape_text(spec.shape)}); {_AGAIN}")
    for dim, (n, want) in enumerate(zip(given, spec.shape)):
        if isinstance(want, str):
            if not _SYMBOL.fullmatch(want):
                continue
            if want in sizes and sizes[want] != n:
                other, other_dim = where[want]
                raise ValueError(f"input {spec.name!r}: dim {dim} has size {n}, but input {other!r} dim {other_dim} "
                                 f"has size {sizes[want]}; the model needs them equal")
            sizes.setdefault(want, n)
            where.setdefault(want, (spec.name, dim))
        elif n != want:
            raise ValueError(f"input {spec.name!r}: dim {dim} has size {n}, but this parallel module was built for "
                             f"size {want} (shape {_shape_text(spec.shape)} given {list(given)}); this dim is static "
                             f"(the trace fixed it, or dynamic_dims left it out); {_AGAIN}")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype != spec.dtype and not ("bool" in (dtype, spec.dtype) and {dtype, spec.dtype} <= MASK_DTYPES):
        raise ValueError(f"input {spec.name!r} is {dtype}, but this parallel module was built for {spec.dtype}; "
                         f"convert the input, or {_AGAIN.replace('shape', 'dtype')}")
