"""``autotp.plan``'s captures shared between its calls: a test that plans one model several times
(under several budgets or profiles) traces it once per set of arguments, and everything after the
capture runs as in an ordinary call."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from autotp.planning import planner


def _key(value: Any) -> Any:
    """A hashable description of a capture argument: a tensor by its shape, dtype and device; a
    module by its identity, its mode and its parameter count (a model whose stack autotp cut to one
    layer of each kind is a different trace); containers element by element."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, torch.nn.Module):
        return ("module", id(value), value.training, sum(p.numel() for p in value.parameters()))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    return value


@contextmanager
def captures_shared() -> Iterator[dict]:
    """Within the block, ``autotp.plan`` captures each (model, inputs, options) once; yields the
    captures taken, keyed by their arguments."""
    real, taken = planner.capture, {}

    def capture_once(*args: Any, **kwargs: Any) -> Any:
        key = _key((args, tuple(sorted(kwargs.items()))))
        if key not in taken:
            taken[key] = real(*args, **kwargs)
        return taken[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "capture", capture_once)
        yield taken
