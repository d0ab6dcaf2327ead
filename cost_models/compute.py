"""Seconds of one kernel: the roofline plus a fixed per-kernel overhead.

    compute_s = flops / flops_per_s_for(dtype, flops, convolution)
    memory_s = bytes_moved / bandwidth_for(bytes_moved)
    compute_time_s = max(compute_s, memory_s) + (1 - memory_overlap) * min(compute_s, memory_s)
                     + kernel_overhead_s

``flops`` as ``torch.utils.flop_counter`` counts them (a matmul of (M, K) @ (K, N) is
2*M*K*N; it counts only matmul-like ops); ``bytes_moved`` is what the kernel reads plus
what it writes. A node with no FLOPs and no bytes (a view, a reshape) launches no kernel
and costs exactly 0.0. The rates are the device's: ``peak_flops[dtype]`` times its
``achievable_fraction`` (a ``convolution`` at ``convolution_peak_flops[dtype]`` times it, where the
dtype has one) and ``memory_bandwidth_bytes_per_s``, or, where the profile measured them, the
FLOP/s a matmul of that many FLOPs achieves (``matmul_curve``) and the bytes/s a memory-bound
kernel moving that many bytes achieves (``memory_curve``); see ``DeviceSpec``. ``memory_overlap`` is the
share of the shorter time hidden under the longer: 1 (the default) is the roofline's max, 0 the
sum of the two.

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

With measured curves, a small matmul runs below the peak and a large copy below the best bandwidth:

>>> dev = DeviceSpec({"float32": 1e12}, memory_bandwidth_bytes_per_s=1e11, memory_bytes=8e10,
...                  kernel_overhead_s=0.0, matmul_curve={"float32": ((1e6, 1e11), (1e10, 5e11))},
...                  memory_curve=((1e6, 8e10), (1e8, 4e10)))
>>> math.isclose(compute_time_s(dev, flops=1e8, bytes_moved=1e3, dtype="float32"), 1e8 / 3e11)  # halfway in log
True
>>> compute_time_s(dev, flops=0, bytes_moved=1e9, dtype="float32") == 1e9 / 4e10  # past the last point
True
>>> cpu = DeviceSpec({"float32": 1e11}, 1e10, 8e10, 0.0, memory_overlap=0.0)
>>> math.isclose(compute_time_s(cpu, flops=1e9, bytes_moved=5e7, dtype="float32"), 1e9 / 1e11 + 5e7 / 1e10)
True
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cost_models.hardware import DeviceSpec


def compute_time_s(device: DeviceSpec, flops: float, bytes_moved: float, dtype: str,
                   convolution: bool = False) -> float:
    """Roofline seconds of one kernel doing ``flops`` and moving ``bytes_moved`` in ``dtype``
    (``convolution``: the kernel is a convolution, priced at its own rate where the device has one)."""
    flops = _non_negative(flops, "flops")
    bytes_moved = _non_negative(bytes_moved, "bytes_moved")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    compute_s = flops / device.flops_per_s_for(dtype, flops, convolution) if flops else 0.0
    memory_s = bytes_moved / device.bandwidth_for(bytes_moved) if bytes_moved else 0.0
    exposed = (1.0 - device.memory_overlap) * min(compute_s, memory_s)  # 0.0 with the default overlap of 1
    return max(compute_s, memory_s) + exposed + device.kernel_overhead_s


def _non_negative(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)
