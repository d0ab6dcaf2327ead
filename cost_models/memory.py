"""Bytes of model state per device: parameters, gradients and optimizer state.

For a parameter of ``numel`` elements of which a device holds ``shard_fraction``
(1.0 replicated, 1/n sharded over n ranks), per device:

- parameters: ``numel * shard_fraction * param_dtype_bytes``
- gradients (``mode="train"``): the same as the parameters (same dtype, same shard)
- optimizer state (``mode="train"``), per local element:
  ``"adamw"`` / ``"adam"``: two fp32 moments, 8 bytes; ``"sgd_momentum"``: one fp32
  buffer, 4 bytes; ``"sgd"`` or ``None``: nothing.
- ``mode="inference"``: no gradients and no optimizer state.

Not modelled: fp32 master weights of mixed-precision training, activations (priced
per node elsewhere), allocator fragmentation.

>>> s = model_state_bytes(numel=1000, param_dtype_bytes=2, shard_fraction=0.25)
>>> s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes, s.total_bytes
(500.0, 500.0, 2000.0, 3000.0)
>>> model_state_bytes(1000, 2, 0.25, mode="inference").total_bytes
500.0
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType

MODES = ("train", "inference")
OPTIMIZER_STATE_BYTES_PER_ELEMENT = MappingProxyType(
    {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}  # fp32 state bytes per local element
)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state one device holds."""

    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes


def model_state_bytes(
    numel: float,
    param_dtype_bytes: int,
    shard_fraction: float,
    mode: str = "train",
    optimizer: str | None = "adamw",
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes per device for ``numel`` parameter elements."""
    if not _is_real(numel) or not math.isfinite(numel) or numel < 0:
        raise ValueError(f"numel must be a finite number >= 0, got {numel!r}")
    dtype_bytes = param_dtype_bytes
    if not _is_real(dtype_bytes) or not isinstance(dtype_bytes, numbers.Integral) or dtype_bytes < 1:
        raise ValueError(f"param_dtype_bytes must be an int >= 1 (2 for bfloat16), got {dtype_bytes!r}")
    if not _is_real(shard_fraction) or not 0 < shard_fraction <= 1:
        raise ValueError(f"shard_fraction must be in (0, 1] (1.0 = replicated), got {shard_fraction!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if optimizer is not None and optimizer not in OPTIMIZER_STATE_BYTES_PER_ELEMENT:
        names = ", ".join(OPTIMIZER_STATE_BYTES_PER_ELEMENT)
        raise ValueError(f"optimizer must be one of {names} or None, got {optimizer!r}")
    local_numel = float(numel) * float(shard_fraction)
    parameters_bytes = local_numel * int(param_dtype_bytes)
    if mode == "inference":
        return ModelStateBytes(parameters_bytes, 0.0, 0.0)
    per_element = OPTIMIZER_STATE_BYTES_PER_ELEMENT[optimizer] if optimizer is not None else 0
    return ModelStateBytes(parameters_bytes, parameters_bytes, local_numel * per_element)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
