"""Seconds of one kernel: the roofline plus a fixed per-kernel overhead.

    compute_time_s = max(flops / peak_flops_for(dtype), bytes_moved / memory_bandwidth)
                     + kernel_overhead_s

``flops`` as ``torch.utils.flop_counter`` counts them (a matmul of (M, K) @ (K, N) is
2*M*K*N); ``bytes_moved`` is what the kernel reads plus what it writes. A node with no
FLOPs and no bytes (a view, a reshape) launches no kernel and costs exactly 0.0.

>>> from cost_models.hardware import DeviceSpec
>>> dev = DeviceSpec({"float32": 1e12, "bfloat16": 4e12}, memory_bandwidth_bytes_per_s=1e11,
...                  memory_bytes=8e10, kernel_overhead_s=5e-6)
>>> t = compute_time_s(dev, flops=2 * 4096**3, bytes_moved=3 * 4096**2 * 2, dtype="bfloat16")
>>> t == 2 * 4096**3 / 4e12 + 5e-6  # compute-bound: 34 ms of FLOPs beat 1 ms of bytes
True
>>> t = compute_time_s(dev, flops=4096**2, bytes_moved=3 * 4096**2 * 4, dtype="float32")
>>> t == 3 * 4096**2 * 4 / 1e11 + 5e-6  # memory-bound: an elementwise op
True
>>> compute_time_s(dev, flops=0, bytes_moved=0, dtype="float32")
0.0
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cost_models.hardware import DeviceSpec


def compute_time_s(device: DeviceSpec, flops: float, bytes_moved: float, dtype: str) -> float:
    """Roofline seconds of one kernel doing ``flops`` and moving ``bytes_moved`` in ``dtype``."""
    flops = _non_negative(flops, "flops")
    bytes_moved = _non_negative(bytes_moved, "bytes_moved")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    compute_s = flops / device.peak_flops_for(dtype)
    memory_s = bytes_moved / device.memory_bandwidth_bytes_per_s
    return max(compute_s, memory_s) + device.kernel_overhead_s


def _non_negative(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)
