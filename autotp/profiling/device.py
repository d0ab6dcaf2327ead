"""What one device can do: matmul FLOP/s per dtype, memory bandwidth, per-kernel overhead.

Measured on the device the ranks compute on (``cuda`` with nccl, ``cpu`` with gloo), by
one rank while the others wait. On CPU the figure is for the threads this process has
(``torch.get_num_threads()``): when N ranks share one host, each is given its share of
the cores, so the figure is that of one of the N "devices".

* matmul: ``torch.mm`` of square ``n x n`` matrices for each ``n`` in ``matmul_sizes``
  (1024 and 2048 on CPU; 2048, 4096 and 8192 on a GPU, which 2048 leaves half idle),
  ``2 n^3`` FLOPs per product, repeated for at least ``min_time_s``; the best ``n``
  gives the dtype's figure.
* memory bandwidth: ``dst.copy_(src)`` of a large buffer; bytes read plus bytes written
  over the time, best of several.
* kernel overhead: mean time of an in-place add on a one-element tensor (nothing to
  compute, so the time is the fixed cost of issuing an op).

>>> m = measure_device(torch.device("cpu"), matmul_sizes=(64,), copy_bytes=1 << 20, min_time_s=0.01)
>>> m.peak_flops["float32"] > 0 and m.memory_bandwidth_bytes_per_s > 0
True
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MatmulMeasurement:
    dtype: str
    n: int
    time_s: float  # per product
    flops_per_s: float


@dataclass(frozen=True)
class DeviceMeasurement:
    device_type: str
    device_name: str
    threads: int
    peak_flops: dict[str, float]
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    kernel_overhead_s: float
    matmuls: tuple[MatmulMeasurement, ...] = field(default=())

    def to_dict(self) -> dict:
        return {
            "device_type": self.device_type,
            "device_name": self.device_name,
            "threads": self.threads,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "memory_bytes": self.memory_bytes,
            "kernel_overhead_s": self.kernel_overhead_s,
            "matmuls": [m.__dict__ for m in self.matmuls],
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _repeat(fn, device: torch.device, min_time_s: float, min_reps: int = 2) -> float:
    """Best seconds per call of ``fn`` over batches, for at least ``min_time_s`` in all."""
    fn()  # warm-up: allocation, kernel selection
    _sync(device)
    best_s = float("inf")
    spent_s, reps = 0.0, 0
    while spent_s < min_time_s or reps < min_reps:
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        best_s = min(best_s, elapsed)
        spent_s += elapsed
        reps += 1
    return best_s


def measure_matmul(dtype: str, n: int, device: torch.device, min_time_s: float = 0.2) -> MatmulMeasurement:
    a = torch.randn(n, n, device=device).to(DTYPES[dtype])
    b = torch.randn(n, n, device=device).to(DTYPES[dtype])
    time_s = _repeat(lambda: torch.mm(a, b), device, min_time_s)
    return MatmulMeasurement(dtype=dtype, n=n, time_s=time_s, flops_per_s=2.0 * n**3 / time_s)


def measure_memory_bandwidth(device: torch.device, copy_bytes: int = 256 << 20, min_time_s: float = 0.2) -> float:
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    time_s = _repeat(lambda: dst.copy_(src), device, min_time_s, min_reps=3)
    return 2.0 * src.numel() * 4 / time_s


def measure_kernel_overhead(device: torch.device, ops: int = 2000) -> float:
    x = torch.zeros(1, device=device)

    def many() -> None:
        for _ in range(ops):
            x.add_(1.0)

    return _repeat(many, device, min_time_s=0.05) / ops


def total_memory_bytes(device: torch.device) -> int:
    """Device memory (cuda) or the host's physical RAM (cpu)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


CPU_MATMUL_SIZES = (1024, 2048)
GPU_MATMUL_SIZES = (2048, 4096, 8192)


def measure_device(
    device: torch.device,
    matmul_sizes: Sequence[int] | None = None,
    copy_bytes: int = 256 << 20,
    min_time_s: float = 0.2,
) -> DeviceMeasurement:
    """All figures of the module docstring for ``device``."""
    if matmul_sizes is None:
        matmul_sizes = GPU_MATMUL_SIZES if device.type == "cuda" else CPU_MATMUL_SIZES
    matmuls = []
    peak = {}
    for dtype in DTYPES:
        for n in matmul_sizes:
            m = measure_matmul(dtype, n, device, min_time_s)
            matmuls.append(m)
            peak[dtype] = max(peak.get(dtype, 0.0), m.flops_per_s)
            if m.time_s > 2.0:  # a slow device: the larger sizes would only cost time
                break
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return DeviceMeasurement(
        device_type=device.type,
        device_name=name,
        threads=torch.get_num_threads(),
        peak_flops=peak,
        memory_bandwidth_bytes_per_s=measure_memory_bandwidth(device, copy_bytes, min_time_s),
        memory_bytes=total_memory_bytes(device),
        kernel_overhead_s=measure_kernel_overhead(device),
        matmuls=tuple(matmuls),
    )
