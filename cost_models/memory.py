"""Bytes of model state per device: parameters, gradients and optimizer state.

For a parameter of ``numel`` elements of which a device holds ``shard_fraction``
(1.0 replicated, 1/n sharded over n ranks), per device:

- parameters: ``numel * shard_fraction * param_dtype_bytes``
- gradients (``mode="train"``): the same as the parameters (same dtype, same shard)
- optimizer state (``mode="train"``), per local element: the optimizer's parameter-shaped state
  tensors (:data:`OPTIMIZER_STATES`: AdamW and Adam two moments, SGD with momentum one buffer,
  plain SGD and Adafactor-like factored optimizers none) in the parameter's dtype, as
  ``torch.optim`` allocates them (``zeros_like(param)``), or in ``state_dtype_bytes`` if given;
  with mixed precision (``master_dtype_bytes``: e.g. bf16 parameters, fp32 master weights) one
  master copy per element too, and the state in the master's dtype.
- step temporaries (``mode="train"``): what the optimizer's step allocates while it runs and frees
  after (:meth:`OptimizerSpec.step_temporary_bytes_per_element`).
- ``mode="inference"``: no gradients and no optimizer state.

Not modelled: activations (priced per node elsewhere), allocator fragmentation, an Adafactor's
factored row and column statistics (O(rows + cols), not O(rows * cols)).

>>> s = model_state_bytes(numel=1000, param_dtype_bytes=2, shard_fraction=0.25)  # bf16, AdamW
>>> s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes, s.total_bytes
(500.0, 500.0, 1000.0, 2000.0)
>>> mixed = OptimizerSpec("adamw", master_dtype_bytes=4)  # bf16 weights, fp32 master and moments
>>> model_state_bytes(1000, 2, 0.25, optimizer=mixed).optimizer_bytes
3000.0
>>> model_state_bytes(1000, 2, 0.25, mode="inference").total_bytes
500.0
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Union

MODES = ("train", "inference")
# parameter-shaped state tensors each optimizer keeps per parameter
OPTIMIZER_STATES = MappingProxyType({"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "adafactor": 0})


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer keeps per parameter element: ``name`` (one of :data:`OPTIMIZER_STATES`),
    the dtype size of its state (None: the parameter's, or the master's under mixed precision) and of
    a master copy of the weights (None: no master copy)."""

    name: str = "adamw"
    state_dtype_bytes: Optional[int] = None
    master_dtype_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer {self.name!r}: expected one of {', '.join(OPTIMIZER_STATES)}")
        for field in ("state_dtype_bytes", "master_dtype_bytes"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
                raise ValueError(f"optimizer {field} must be an int >= 1 (4 for float32) or None, got {value!r}")

    def bytes_per_element(self, param_dtype_bytes: int) -> float:
        """Optimizer bytes per local parameter element: its state, and the master copy if any."""
        state = self.state_dtype_bytes or self.master_dtype_bytes or param_dtype_bytes
        return OPTIMIZER_STATES[self.name] * state + (self.master_dtype_bytes or 0)

    def step_temporary_bytes_per_element(self, param_dtype_bytes: int) -> float:
        """Bytes per local parameter element the optimizer's step allocates while it runs, beside its
        state: ``torch.optim``'s multi-tensor (foreach) step, the default on CUDA, makes one
        parameter-sized list of intermediates (Adam's ``sqrt(v) + eps``; SGD's momentum update); plain
        SGD none."""
        if not OPTIMIZER_STATES[self.name]:
            return 0.0
        return float(self.state_dtype_bytes or self.master_dtype_bytes or param_dtype_bytes)

    def describe(self) -> str:
        extra = []
        if self.master_dtype_bytes:
            extra.append(f"{self.master_dtype_bytes}-byte master weights")
        if self.state_dtype_bytes:
            extra.append(f"{self.state_dtype_bytes}-byte state")
        return self.name + (f" ({', '.join(extra)})" if extra else "")


def optimizer_spec(optimizer: Union[str, OptimizerSpec, None]) -> OptimizerSpec:
    """A name (``"adamw"``, ``"sgd"``, ...; None: no state, as ``"sgd"``) or a spec → a spec."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if optimizer is None or (isinstance(optimizer, str) and optimizer.lower() == "none"):
        return OptimizerSpec("sgd")
    if isinstance(optimizer, str):
        return OptimizerSpec(optimizer.lower())
    raise ValueError(f"optimizer {optimizer!r}: expected a name ({', '.join(OPTIMIZER_STATES)}), "
                     f"an OptimizerSpec or None")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state one device holds."""

    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    step_temporary_bytes: float = 0.0  # allocated while the optimizer's step runs, then freed

    @property
    def total_bytes(self) -> float:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes


def model_state_bytes(
    numel: float,
    param_dtype_bytes: int,
    shard_fraction: float,
    mode: str = "train",
    optimizer: Union[str, OptimizerSpec, None] = "adamw",
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
    spec = optimizer_spec(optimizer)
    local_numel = float(numel) * float(shard_fraction)
    parameters_bytes = local_numel * int(param_dtype_bytes)
    if mode == "inference":
        return ModelStateBytes(parameters_bytes, 0.0, 0.0)
    return ModelStateBytes(parameters_bytes, parameters_bytes, local_numel * spec.bytes_per_element(dtype_bytes),
                           local_numel * spec.step_temporary_bytes_per_element(dtype_bytes))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
