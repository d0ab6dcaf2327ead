"""The parallel module's input check: the first node of its graph, before any collective.

The rewritten graph computes on local shards whose shapes come from the example inputs (a
``view`` of the token ids to ``[8, 64]``, a split of 64 positions in two). Called with inputs of
another shape it would fail deep inside the graph, hang in a collective of the wrong size, or,
worst, return an answer of the wrong shape with no error (a batch of 16 x 32 tokens viewed as
8 x 64). ``InputGuard`` refuses such a call up front, naming the input, the dim, the size given and
the size the module was built for.

>>> import torch
>>> guard = InputGuard((InputSpec("input_ids", (8, 64), "int64"),))
>>> guard(torch.zeros(8, 64, dtype=torch.int64))
>>> guard(torch.zeros(16, 32, dtype=torch.int64))
Traceback (most recent call last):
...
ValueError: input 'input_ids': dim 0 has size 16, but this parallel module was built for size 8 (shape [8, 64] given [16, 32]); call autotp.parallelize again with example inputs of this shape
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["InputSpec", "InputGuard"]


@dataclass(frozen=True)
class InputSpec:
    """One flattened user input as the module was built for it."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, value: torch.Tensor) -> "InputSpec":
        return cls(name, tuple(int(n) for n in value.shape), str(value.dtype).removeprefix("torch."))


class InputGuard(nn.Module):
    """Raises ``ValueError`` unless every input has the rank, sizes and dtype of its ``InputSpec``."""

    def __init__(self, specs: tuple[InputSpec, ...]) -> None:
        super().__init__()
        self.specs = tuple(specs)

    def extra_repr(self) -> str:
        return ", ".join(f"{s.name}: {list(s.shape)} {s.dtype}" for s in self.specs)

    def forward(self, *inputs: Any) -> None:
        for spec, value in zip(self.specs, inputs):
            _check(spec, value)


_AGAIN = "call autotp.parallelize again with example inputs of this shape"


def _check(spec: InputSpec, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"input {spec.name!r} is a {type(value).__name__}; this parallel module was built for a "
                        f"tensor of shape {list(spec.shape)} and dtype {spec.dtype}")
    given = tuple(int(n) for n in value.shape)
    if len(given) != len(spec.shape):
        raise ValueError(f"input {spec.name!r} has {len(given)} dims (shape {list(given)}), but this parallel module "
                         f"was built for {len(spec.shape)} (shape {list(spec.shape)}); {_AGAIN}")
    for dim, (n, want) in enumerate(zip(given, spec.shape)):
        if n != want:
            raise ValueError(f"input {spec.name!r}: dim {dim} has size {n}, but this parallel module was built for "
                             f"size {want} (shape {list(spec.shape)} given {list(given)}); {_AGAIN}")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype != spec.dtype:
        raise ValueError(f"input {spec.name!r} is {dtype}, but this parallel module was built for {spec.dtype}; "
                         f"convert the input, or {_AGAIN.replace('shape', 'dtype')}")
