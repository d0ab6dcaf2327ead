"""Which dtypes ``autotp profile`` measures, and which of them the device only emulates.

A dtype is *emulated* when the device has no fast kernel for it: a CPU without AVX-512-BF16
or AMX runs a bfloat16 matmul through float32 conversions at a few percent of float32's rate.
That is found by measurement, not assumed from the CPU's name or flags (so it follows
``ATEN_CPU_CAPABILITY``, a build without oneDNN, a GPU without bfloat16 units): each
candidate dtype's matmul rate at a small size (``PROBE_N``) is compared with float32's at
the same size, and a dtype below ``EMULATED_BELOW`` of it is emulated (on CUDA also when
``torch.cuda.is_bf16_supported(including_emulation=False)`` says so).

``--dtypes`` names the dtypes to measure (float32 is always among them); without it, the
device's native dtypes are measured, and bfloat16 always, native or not: an emulated
dtype is measured at small sizes within its time budget and marked ``emulated`` in the
profile, so the planner can still price a bfloat16 model. A default candidate that is
emulated and not bfloat16 (float16 on most CPUs) is left out, with a note that says so.

>>> parse_dtypes("bf16,float32")
('float32', 'bfloat16')
>>> probe = DtypeProbe("bfloat16", 256, 1.3e9, 8.2e10)
>>> probe.emulated, f"{probe.ratio:.3f}"
(True, '0.016')
>>> choice = choose_dtypes(None, (DtypeProbe("float32", 256, 8.2e10, 8.2e10), probe,
...                               DtypeProbe("float16", 256, 1.3e9, 8.2e10)))
>>> choice.measured, choice.emulated, choice.skipped
(('float32', 'bfloat16'), ('bfloat16',), ('float16',))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
EMULATED_BELOW = 0.25  # a dtype whose matmul runs under this share of float32's rate is emulated
PROBE_N = 256  # square matmul size of the probe: a few ms even where the dtype is emulated
ALWAYS = ("float32", "bfloat16")  # measured by default even when emulated


def parse_dtypes(text: str) -> tuple[str, ...]:
    """The dtypes of ``--dtypes``: comma-separated names (or fp32/bf16/fp16), float32 first and
    always included, no repeats; ``ValueError`` naming an unknown one and the known ones."""
    names = ["float32"]
    for part in str(text).split(","):
        part = part.strip().lower().removeprefix("torch.")
        if not part:
            continue
        name = ALIASES.get(part, part)
        if name not in DTYPES:
            known = ", ".join([*DTYPES, *ALIASES])
            raise ValueError(f"unknown dtype {part!r} in {text!r}: expected names among {known}, joined by commas")
        if name not in names:
            names.append(name)
    return tuple(names)


def candidate_dtypes(requested: Sequence[str] | None = None) -> tuple[str, ...]:
    """The dtypes to probe: ``requested`` (float32 first), else every dtype :data:`DTYPES` knows."""
    if requested is not None:
        return tuple(dict.fromkeys(("float32", *requested)))
    return tuple(DTYPES)


@dataclass(frozen=True)
class DtypeProbe:
    """A dtype's matmul rate at ``n`` next to float32's at the same ``n``."""

    dtype: str
    n: int
    flops_per_s: float
    float32_flops_per_s: float
    supported: bool = True  # False: torch says the device has no native kernels for it

    @property
    def ratio(self) -> float:
        return self.flops_per_s / self.float32_flops_per_s

    @property
    def emulated(self) -> bool:
        return self.dtype != "float32" and (not self.supported or self.ratio < EMULATED_BELOW)

    def describe(self) -> str:
        rate = f"{self.flops_per_s / 1e9:.3g} GFLOP/s against float32's {self.float32_flops_per_s / 1e9:.3g}"
        if self.emulated:
            why = "" if self.supported else ", and torch reports no native support"
            return f"{self.dtype} is emulated on this device ({rate} at n={self.n}, under {EMULATED_BELOW:g}x{why})"
        return f"{self.dtype} runs natively ({rate} at n={self.n})"

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "n": self.n, "flops_per_s": self.flops_per_s,
                "float32_flops_per_s": self.float32_flops_per_s, "ratio": self.ratio,
                "supported": self.supported, "emulated": self.emulated}


@dataclass(frozen=True)
class DtypeChoice:
    """What to measure: ``measured`` (float32 first), which of them are ``emulated``, and the
    default candidates left out as emulated (``skipped``)."""

    measured: tuple[str, ...]
    emulated: tuple[str, ...]
    skipped: tuple[str, ...] = ()

    def notes(self, probes: Sequence[DtypeProbe]) -> list[str]:
        """One line per probed dtype but float32, for the user (stderr)."""
        lines = []
        for p in probes:
            if p.dtype == "float32":
                continue
            if p.dtype in self.skipped:
                lines.append(f"note: {p.describe()}: not measured (pass --dtypes to measure it anyway)")
            elif p.emulated:
                lines.append(f"note: {p.describe()}: measured at small sizes within its time budget and marked "
                             "emulated in the profile, so that models in it can still be priced")
            else:
                lines.append(f"note: {p.describe()}")
        return lines


def choose_dtypes(requested: Sequence[str] | None, probes: Sequence[DtypeProbe]) -> DtypeChoice:
    """The dtypes to measure: all of ``requested`` (float32 added), else the probed dtypes that
    run natively plus :data:`ALWAYS`; every emulated one measured is marked."""
    by_dtype = {p.dtype: p for p in probes}
    if requested is not None:
        measured = tuple(dict.fromkeys(("float32", *requested)))
        skipped: tuple[str, ...] = ()
    else:
        measured = tuple(d for d in by_dtype if d in ALWAYS or not by_dtype[d].emulated)
        measured = tuple(dict.fromkeys(("float32", *measured)))
        skipped = tuple(d for d in by_dtype if d not in measured)
    emulated = tuple(d for d in measured if d in by_dtype and by_dtype[d].emulated)
    return DtypeChoice(measured, emulated, skipped)


def agree(every_rank: Sequence[Sequence[DtypeProbe]]) -> tuple[DtypeProbe, ...]:
    """One probe per dtype from every rank's probes: the one most likely emulated (lowest ratio,
    unsupported first), so that all ranks choose the same dtypes and a slow rank marks them."""
    best: dict[str, DtypeProbe] = {}
    for probes in every_rank:
        for p in probes:
            old = best.get(p.dtype)
            if old is None or (p.supported, p.ratio) < (old.supported, old.ratio):
                best[p.dtype] = p
    return tuple(best.values())
