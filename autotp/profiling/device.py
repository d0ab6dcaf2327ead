"""What one device can do: matmul FLOP/s per dtype, memory bandwidth, per-kernel overhead.

Measured on the device the ranks compute on (``cuda`` with nccl, ``cpu`` with gloo), by
every rank at once, as they compute at once in a training step (``autotp profile`` keeps the
slowest rank's figures). On CPU the figure is for the threads this process has
(``torch.get_num_threads()``): when N ranks share one host, each is given its share of
the cores, so the figure is that of one of the N "devices".

* dtypes (``dtypes.py``): a probe times a small matmul in each candidate dtype next to
  float32 and marks a dtype *emulated* below a quarter of float32's rate (bfloat16 on a CPU
  without AVX-512-BF16 or AMX runs at a few percent of it); which dtypes are measured follows.
* time budget: each measured dtype gets ``budget_s`` (``CPU_BUDGET_S``, ``GPU_BUDGET_S``) for
  its matmuls, half of it for the peak sizes and the rest for the curve. Sizes rise from a
  small ``n``, and a larger one is measured only while its predicted time (at the best rate
  seen so far, the probe's included) is under ``GROW_WHILE`` of the budget left; the size reached
  is recorded (``DtypeReach``). An emulated dtype thus ends at small sizes, in bounded time.
* matmul: ``torch.mm`` of square ``n x n`` matrices for ``n`` in ``matmul_sizes`` (256 to 2048
  on CPU; 1024 to 8192 on a GPU, which 2048 leaves half idle), ``2 n^3`` FLOPs per product,
  repeated for at least ``min_time_s``; the best ``n`` gives the dtype's figure.
* matmul curve: what a matmul of a given size achieves in training, per dtype: for each
  ``n`` in ``matmul_curve_sizes`` the three products of a linear layer with ``n`` tokens,
  ``n`` inputs and ``4 n`` outputs (forward ``x W^T``, input gradient ``g W``, weight gradient
  ``g^T x``: the layouts a training step runs), ``8 n^3`` FLOPs each, on operands taken in
  turn from a ring of ``ring_bytes / 4`` (fewer sets where one pass would not fit the budget:
  a slow dtype is compute-bound anyway) and into fresh outputs kept until the ring is done
  (as the memory curve below); a point is ``(8 n^3, FLOPs / seconds of the three)``.
  Becomes the profile's ``device.matmul_curve``.
* memory bandwidth: ``dst.copy_(src)`` of a large buffer; bytes read plus bytes written
  over the time, best of several.
* memory curve: what a memory-bound op achieves as a training step runs it: an out-of-place
  add ``a + b`` into a freshly allocated output (kept, as activations are kept for the
  backward), its operands taken in turn from a ring of ``ring_bytes`` so that no cache holds
  them; for each operand size in ``memory_curve_bytes`` a point ``(3 size, bytes / second)``.
  On a CPU a large fresh output costs page faults, which a copy into a reused buffer never
  sees. Becomes ``device.memory_curve``.
* memory overlap: how much of a kernel's memory time runs under its compute time. A float32
  ``(n, k) @ (k, n)`` product into a fresh output of ``overlap_bytes``, ``k`` chosen so that
  its compute time (on the matmul curve) and its memory time (on the memory curve) are about
  equal; ``(compute + memory - measured) / min(compute, memory)``, clamped to 0..1: 1 when
  the measured time is the longer of the two (a GPU), 0 when it is their sum (a CPU thread
  stalls on its loads and page faults). Becomes ``device.memory_overlap``.
* kernel overhead: mean time of an in-place add on a one-element tensor (nothing to
  compute, so the time is the fixed cost of issuing an op).

The float32 memory figures move a bounded number of bytes (``ring_bytes``, ``copy_bytes``,
``overlap_bytes``), so they take bounded time on any device. ``on_progress`` is called before
each measured size (the worker beats its heartbeat there), ``on_dtype`` after each dtype.

>>> m = measure_device(torch.device("cpu"), matmul_sizes=(32, 64), copy_bytes=1 << 20, min_time_s=0.01,
...                    matmul_curve_sizes=(16, 32), memory_curve_bytes=(1 << 12, 1 << 16), ring_bytes=1 << 18,
...                    overlap_bytes=1 << 16, dtypes=("float32", "bfloat16"), budget_s=5.0)
>>> m.peak_flops["float32"] > 0 and m.memory_bandwidth_bytes_per_s > 0
True
>>> [flops for flops, _ in m.matmul_curve["float32"]], [size for size, _ in m.memory_curve]
([32768.0, 262144.0], [12288.0, 196608.0])
>>> [(r.dtype, r.matmul_n, r.curve_n) for r in m.reach]  # tiny sizes: well within the budget
[('float32', 64, 32), ('bfloat16', 64, 32)]
>>> m.emulated_dtypes == tuple(p.dtype for p in m.probes if p.emulated)  # ('bfloat16',) here
True
>>> 0.0 <= m.memory_overlap <= 1.0
True
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from autotp.profiling.dtypes import DTYPES, EMULATED_BELOW, PROBE_N, DtypeProbe, agree, candidate_dtypes, choose_dtypes

GROW_WHILE = 0.5  # measure a larger size only if its predicted time is under this share of the budget left
CPU_BUDGET_S = 8.0  # per dtype: its peak sizes and its matmul curve
GPU_BUDGET_S = 20.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class MatmulMeasurement:
    dtype: str
    n: int
    time_s: float  # per product
    flops_per_s: float


@dataclass(frozen=True)
class DtypeReach:
    """How far a dtype's matmuls got in its time budget: the largest ``n`` of the peak products
    and of the curve, and whether a larger size was left out for want of time (``cut``)."""

    dtype: str
    budget_s: float
    spent_s: float
    matmul_n: int
    curve_n: int  # 0: no curve sizes asked for
    cut: bool
    emulated: bool = False

    def describe(self) -> str:
        how = "emulated, " if self.emulated else ""
        stop = "; larger sizes left out (over the budget)" if self.cut else ""
        curve = f", curve up to n={self.curve_n}" if self.curve_n else ""
        return (f"device: {self.dtype} ({how}{self.spent_s:.1f} s, budget {self.budget_s:g} s): "
                f"matmul up to n={self.matmul_n}{curve}{stop}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    # dtype -> ((FLOPs of one product, FLOP/s), ...) and ((bytes moved, bytes/s), ...), sizes rising
    matmul_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    memory_curve: tuple[tuple[float, float], ...] = field(default=())
    memory_overlap: float | None = None  # None: not measured
    emulated_dtypes: tuple[str, ...] = ()  # measured, but the device has no fast kernels for them
    probes: tuple[DtypeProbe, ...] = ()
    reach: tuple[DtypeReach, ...] = ()
    skipped_dtypes: tuple[str, ...] = ()  # default candidates left out as emulated

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
            "matmul_curve": {
                dtype: [{"flops": f, "flops_per_s": r} for f, r in points] for dtype, points in self.matmul_curve.items()
            },
            "memory_curve": [{"bytes": b, "bytes_per_s": r} for b, r in self.memory_curve],
            "memory_overlap": self.memory_overlap,
            "emulated_dtypes": list(self.emulated_dtypes),
            "skipped_dtypes": list(self.skipped_dtypes),
            "emulated_below": EMULATED_BELOW,
            "dtype_probes": [p.to_dict() for p in self.probes],
            "reach": {r.dtype: r.to_dict() for r in self.reach},
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


def _repeat_cost_s(call_s: float, min_time_s: float, min_reps: int = 2) -> float:
    """About what :func:`_repeat` spends on a ``call_s`` call: a warm-up, then the timed calls."""
    return call_s + max(min_reps * call_s, min_time_s + call_s)


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


def _ring_sets(dtype: str, n: int, ring_bytes: int) -> int:
    """Operand sets (x, w, g) of the matmul curve at ``n`` that fill ``ring_bytes``."""
    size = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return max(1, ring_bytes // (9 * n * n * size))


def measure_matmul_training(dtype: str, n: int, device: torch.device, min_time_s: float = 0.2,
                            ring_bytes: int = 64 << 20, max_sets: int | None = None) -> tuple[float, float]:
    """``(FLOPs of one product, FLOP/s)`` of a linear layer's three training products at size ``n``,
    as a step runs them: operands from a ring of ``ring_bytes`` (no cache holds them; at most
    ``max_sets`` sets), outputs fresh and kept until the pass ends."""
    sets = _ring_sets(dtype, n, ring_bytes)
    if max_sets is not None:
        sets = max(1, min(sets, max_sets))
    first = (torch.randn(n, n, device=device).to(DTYPES[dtype]),  # x (tokens, in)
             torch.randn(4 * n, n, device=device).to(DTYPES[dtype]),  # w (out, in)
             torch.randn(n, 4 * n, device=device).to(DTYPES[dtype]))  # g (tokens, out)
    ring = [first] + [tuple(t.clone() for t in first) for _ in range(sets - 1)]  # copies: quicker than randn

    def one_pass() -> None:
        kept = [(torch.nn.functional.linear(x, w), g @ w, g.t() @ x) for x, w, g in ring]
        del kept

    flops = 8.0 * n**3
    return flops, 3 * flops * sets / _repeat(one_pass, device, min_time_s)


def measure_memory_curve_point(size_bytes: int, device: torch.device, ring_bytes: int = 256 << 20,
                               min_time_s: float = 0.2) -> tuple[float, float]:
    """``(bytes moved, bytes/s)`` of ``a + b`` into a fresh output, operands of ``size_bytes`` each."""
    numel = max(1, size_bytes // 4)
    pairs = max(1, ring_bytes // (2 * numel * 4))
    first = (torch.rand(numel, device=device), torch.rand(numel, device=device))
    ring = [first] + [(first[0].clone(), first[1].clone()) for _ in range(pairs - 1)]  # copies: quicker than rand

    def one_pass() -> None:
        kept = [a + b for a, b in ring]  # fresh outputs, held like activations until the pass ends
        del kept

    time_s = _repeat(one_pass, device, min_time_s, min_reps=3)
    moved = 3.0 * numel * 4
    return moved, moved * pairs / time_s


def measure_memory_overlap(device: torch.device, matmul_curve: Sequence[tuple[float, float]],
                           memory_curve: Sequence[tuple[float, float]], overlap_bytes: int = 64 << 20,
                           min_time_s: float = 0.2) -> float:
    """Share (0..1) of a float32 matmul's memory time hidden under its compute time (module doc)."""
    from cost_models.device import interpolate_rate

    matmul_curve, memory_curve = tuple(matmul_curve), tuple(memory_curve)
    n = max(16, int(math.isqrt(overlap_bytes // 4)))
    flops_per_s, bytes_per_s = matmul_curve[-1][1], interpolate_rate(memory_curve, 4.0 * n * n)
    k = int(min(n, max(16, 16 * round(2 * flops_per_s / bytes_per_s / 16))))  # compute ~ memory
    x = torch.randn(n, k, device=device)
    w = torch.randn(k, n, device=device)
    flops, moved = 2.0 * n * k * n, 4.0 * (2 * n * k + n * n)
    compute_s = flops / interpolate_rate(matmul_curve, flops)
    memory_s = moved / interpolate_rate(memory_curve, moved)
    time_s = _repeat(lambda: x @ w, device, min_time_s, min_reps=3)  # a fresh (n, n) output each time
    return min(1.0, max(0.0, (compute_s + memory_s - time_s) / min(compute_s, memory_s)))


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


CPU_MATMUL_SIZES = (256, 512, 1024, 2048)
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
CPU_MATMUL_CURVE_SIZES = (128, 256, 512, 1024)
GPU_MATMUL_CURVE_SIZES = (512, 1024, 2048, 4096, 8192)
CPU_MEMORY_CURVE_BYTES = (1 << 18, 1 << 21, 1 << 24, 1 << 27)  # 256 KiB .. 128 MiB operands
GPU_MEMORY_CURVE_BYTES = (1 << 20, 1 << 23, 1 << 26, 1 << 29)  # 1 MiB .. 512 MiB operands


def default_budget_s(device: torch.device) -> float:
    """Seconds per dtype for its matmuls when none is given."""
    return GPU_BUDGET_S if device.type == "cuda" else CPU_BUDGET_S


def _tell(on_progress: Progress | None, what: str) -> None:
    if on_progress is not None:
        on_progress(what)


def probe_dtypes(device: torch.device, dtypes: Sequence[str], n: int = PROBE_N, min_time_s: float = 0.05,
                 on_progress: Progress | None = None) -> tuple[DtypeProbe, ...]:
    """Each of ``dtypes`` (float32 added) timed at ``n`` next to float32 (see ``dtypes.py``)."""
    rates = {}
    for dtype in dict.fromkeys(("float32", *dtypes)):
        _tell(on_progress, f"probing {dtype} matmul n={n}")
        rates[dtype] = measure_matmul(dtype, n, device, min_time_s).flops_per_s
    supported = {d: True for d in rates}
    if device.type == "cuda" and "bfloat16" in rates:
        supported["bfloat16"] = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return tuple(DtypeProbe(d, n, rate, rates["float32"], supported[d]) for d, rate in rates.items())


def agree_probes(mine: Sequence[DtypeProbe], world_size: int) -> tuple[DtypeProbe, ...]:
    """``dtypes.agree`` over every rank's probes (a collective: every rank must call it)."""
    import torch.distributed as dist

    every = [None] * world_size
    dist.all_gather_object(every, tuple(mine))
    return agree(every)


def _matmul_ladder(dtype: str, sizes: Sequence[int], device: torch.device, min_time_s: float, deadline: float,
                   rate_hint: float, on_progress: Progress | None) -> tuple[list[MatmulMeasurement], bool]:
    """Peak products at rising ``n`` while the next one's predicted time fits; (them, cut). The
    prediction takes the best rate seen (``rate_hint``: the probe's): a small size's time is mostly
    fixed costs, which scaled by ``n^3`` would stop the ladder early."""
    done: list[MatmulMeasurement] = []
    for n in sorted(sizes):
        if done:
            rate = max(rate_hint, *(m.flops_per_s for m in done))
            if _repeat_cost_s(2.0 * n**3 / rate, min_time_s) > GROW_WHILE * (deadline - time.perf_counter()):
                return done, True
        _tell(on_progress, f"{dtype} matmul n={n}")
        done.append(measure_matmul(dtype, n, device, min_time_s))
    return done, False


def _curve_ladder(dtype: str, sizes: Sequence[int], device: torch.device, min_time_s: float, ring_bytes: int,
                  deadline: float, rate_guess: float, on_progress: Progress | None
                  ) -> tuple[list[tuple[float, float]], int, bool]:
    """Matmul curve points at rising ``n`` while the next one's predicted time fits, each pass
    of the ring at most a share of the budget left; (points, largest n, cut)."""
    points: list[tuple[float, float]] = []
    last_n = 0
    for n in sorted(sizes):
        left_s = deadline - time.perf_counter()
        rate = max(r for _, r in points) if points else rate_guess
        set_s = 3 * 8.0 * n**3 / rate  # one set: three products
        sets = min(_ring_sets(dtype, n, ring_bytes), max(1, int(GROW_WHILE * left_s / 8 / set_s)))
        if points and _repeat_cost_s(sets * set_s, min_time_s) > GROW_WHILE * left_s:
            return points, last_n, True
        _tell(on_progress, f"{dtype} matmul curve n={n}")
        points.append(measure_matmul_training(dtype, n, device, min_time_s, ring_bytes, max_sets=sets))
        last_n = n
    return points, last_n, False


def slowest(measurements: Sequence[DeviceMeasurement]) -> DeviceMeasurement:
    """The figures of the slowest of ``measurements`` (one per rank, measured at once): least
    FLOP/s and bandwidth, most kernel overhead, curves point by point (a rank that stopped a
    curve early, a slow device, ends it for all), the dtypes every rank measured, marked
    emulated where any rank found them so."""
    first = measurements[0]
    dtypes = [d for d in first.peak_flops if all(d in m.peak_flops for m in measurements)]

    def least(curves):
        return tuple((points[0][0], min(rate for _, rate in points)) for points in zip(*curves))

    def reach(dtype: str) -> DtypeReach | None:
        every = [r for m in measurements for r in m.reach if r.dtype == dtype]
        if not every:
            return None
        return dataclasses.replace(every[0], spent_s=max(r.spent_s for r in every),
                                   matmul_n=min(r.matmul_n for r in every), curve_n=min(r.curve_n for r in every),
                                   cut=any(r.cut for r in every), emulated=any(r.emulated for r in every))

    emulated = {d for m in measurements for d in m.emulated_dtypes}
    curve_dtypes = [d for d in first.matmul_curve if all(d in m.matmul_curve for m in measurements)]
    return dataclasses.replace(
        first,
        peak_flops={dtype: min(m.peak_flops[dtype] for m in measurements) for dtype in dtypes},
        memory_bandwidth_bytes_per_s=min(m.memory_bandwidth_bytes_per_s for m in measurements),
        kernel_overhead_s=max(m.kernel_overhead_s for m in measurements),
        matmul_curve={dtype: least([m.matmul_curve[dtype] for m in measurements]) for dtype in curve_dtypes},
        memory_curve=least([m.memory_curve for m in measurements]),
        memory_overlap=None if first.memory_overlap is None else min(m.memory_overlap for m in measurements),
        emulated_dtypes=tuple(d for d in dtypes if d in emulated),
        probes=agree([m.probes for m in measurements]),
        reach=tuple(r for r in map(reach, dtypes) if r is not None),
        skipped_dtypes=tuple(dict.fromkeys(d for m in measurements for d in m.skipped_dtypes if d not in dtypes)),
    )


def slowest_rank(mine: DeviceMeasurement, world_size: int) -> DeviceMeasurement:
    """:func:`slowest` over every rank's ``mine`` (a collective: every rank must call it)."""
    import torch.distributed as dist

    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return slowest(every)


def measure_device(
    device: torch.device,
    matmul_sizes: Sequence[int] | None = None,
    copy_bytes: int = 256 << 20,
    min_time_s: float = 0.2,
    matmul_curve_sizes: Sequence[int] | None = None,
    memory_curve_bytes: Sequence[int] | None = None,
    ring_bytes: int | None = None,
    overlap_bytes: int | None = None,
    dtypes: Sequence[str] | None = None,
    budget_s: float | None = None,
    probes: Sequence[DtypeProbe] | None = None,
    on_progress: Progress | None = None,
    on_dtype: Callable[[DtypeReach], None] | None = None,
) -> DeviceMeasurement:
    """All figures of the module docstring for ``device``: ``dtypes`` as ``--dtypes`` (None: the
    default of ``dtypes.choose_dtypes``), each within ``budget_s`` (None: ``default_budget_s``);
    ``probes`` as :func:`probe_dtypes` returns them (None: probed here)."""
    gpu = device.type == "cuda"
    if matmul_sizes is None:
        matmul_sizes = GPU_MATMUL_SIZES if gpu else CPU_MATMUL_SIZES
    if matmul_curve_sizes is None:
        matmul_curve_sizes = GPU_MATMUL_CURVE_SIZES if gpu else CPU_MATMUL_CURVE_SIZES
    if memory_curve_bytes is None:
        memory_curve_bytes = GPU_MEMORY_CURVE_BYTES if gpu else CPU_MEMORY_CURVE_BYTES
    if ring_bytes is None:
        ring_bytes = (2 << 30) if gpu else (256 << 20)
    if overlap_bytes is None:
        overlap_bytes = (1 << 30) if gpu else (64 << 20)
    if budget_s is None:
        budget_s = default_budget_s(device)
    if probes is None:
        probes = probe_dtypes(device, candidate_dtypes(dtypes), on_progress=on_progress)
    choice = choose_dtypes(dtypes, probes)
    probed = {p.dtype: p.flops_per_s for p in probes}
    matmuls, peak, curve, reaches = [], {}, {}, []
    for dtype in choice.measured:
        start = time.perf_counter()
        done, cut = _matmul_ladder(dtype, matmul_sizes, device, min_time_s, start + budget_s / 2,
                                   probed.get(dtype, 0.0), on_progress)
        matmuls += done
        peak[dtype] = max(m.flops_per_s for m in done)
        points, curve_n, curve_cut = _curve_ladder(dtype, matmul_curve_sizes, device, min_time_s, ring_bytes // 4,
                                                   start + budget_s, peak[dtype], on_progress)
        curve[dtype] = tuple(points)
        reaches.append(DtypeReach(dtype, budget_s, time.perf_counter() - start, done[-1].n, curve_n,
                                  cut or curve_cut, dtype in choice.emulated))
        if on_dtype is not None:
            on_dtype(reaches[-1])
    memory_curve = []
    for size in sorted(memory_curve_bytes):
        _tell(on_progress, f"memory curve {size} B")
        memory_curve.append(measure_memory_curve_point(size, device, max(ring_bytes, 2 * size), min_time_s))
    _tell(on_progress, "memory bandwidth, kernel overhead")
    bandwidth = measure_memory_bandwidth(device, copy_bytes, min_time_s)
    overhead = measure_kernel_overhead(device)
    _tell(on_progress, "memory overlap")
    overlap = measure_memory_overlap(device, curve["float32"], memory_curve, overlap_bytes, min_time_s)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return DeviceMeasurement(
        device_type=device.type,
        device_name=name,
        threads=torch.get_num_threads(),
        peak_flops=peak,
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=total_memory_bytes(device),
        kernel_overhead_s=overhead,
        matmuls=tuple(matmuls),
        matmul_curve=curve,
        memory_curve=tuple(memory_curve),
        memory_overlap=overlap,
        emulated_dtypes=choice.emulated,
        probes=tuple(probes),
        reach=tuple(reaches),
        skipped_dtypes=choice.skipped,
    )
