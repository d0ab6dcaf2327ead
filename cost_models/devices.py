"""Which built-in profile a device is priced with, by the name the device reports.

A CUDA device is known by ``torch.cuda.get_device_name()`` ("NVIDIA H100 80GB HBM3", "NVIDIA H100
PCIe", "NVIDIA H200", "NVIDIA B200", "NVIDIA A100-SXM4-80GB"). The name is cut into words (upper
case, split at anything but letters and digits) and the first row of ``GPU_PROFILES`` whose words
are all among them, and none of whose ``unless`` words is, names the profile. A new GPU is one
profile file in ``cost_models/profiles/`` and one row here. A CPU is priced with ``cpu-gloo``.

>>> profile_for_device("cuda", "NVIDIA H100 80GB HBM3"), profile_for_device("cuda", "NVIDIA H100 NVL")
('h100-sxm', 'h100-nvl')
>>> profile_for_device("cpu")
'cpu-gloo'
>>> profile_for_device("cuda", "NVIDIA H200 NVL")
Traceback (most recent call last):
...
ValueError: no built-in hardware profile for the CUDA device 'NVIDIA H200 NVL' (built-in GPU profiles: a100-pcie, a100-sxm, b200, h100-nvl, h100-pcie, h100-sxm, h200); measure this machine with `autotp profile -o my.json` and pass hardware="my.json"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["GPU_PROFILES", "GpuRow", "device_words", "profile_for_device"]


@dataclass(frozen=True)
class GpuRow:
    """One row of the table: a device whose name has every word of ``words`` and none of
    ``unless`` is priced with the built-in profile ``profile``."""

    words: tuple[str, ...]
    profile: str
    unless: tuple[str, ...] = ()

    def matches(self, name_words: frozenset[str]) -> bool:
        return all(w in name_words for w in self.words) and not any(w in name_words for w in self.unless)


# First match wins. The H200 NVL (a PCIe card: other compute, other links) has no profile yet.
GPU_PROFILES = (
    GpuRow(("H100", "HBM3"), "h100-sxm"),  # "NVIDIA H100 80GB HBM3": the SXM5 part
    GpuRow(("H100", "SXM5"), "h100-sxm"),
    GpuRow(("H100", "PCIE"), "h100-pcie"),
    GpuRow(("H100", "NVL"), "h100-nvl"),
    GpuRow(("H200",), "h200", unless=("NVL",)),
    GpuRow(("B200",), "b200"),
    GpuRow(("A100", "SXM4"), "a100-sxm"),
    GpuRow(("A100", "PCIE"), "a100-pcie"),
)
CPU_PROFILE = "cpu-gloo"


def device_words(name: str) -> frozenset[str]:
    """The words of a device name, upper case: ``NVIDIA A100-SXM4-80GB`` -> NVIDIA, A100, SXM4, 80GB."""
    return frozenset(w for w in re.split(r"[^0-9A-Z]+", name.upper()) if w)


def profile_for_device(device_type: str, device_name: Optional[str] = None) -> str:
    """The built-in profile for a device of ``device_type`` (``"cpu"``, or ``"cuda"`` with its
    ``device_name``); ``ValueError`` naming the device where no row matches."""
    if device_type == "cpu":
        return CPU_PROFILE
    if device_type != "cuda":
        raise ValueError(f"no built-in hardware profile for the device type {device_type!r} (built-in profiles are "
                         f"for 'cpu' and 'cuda' devices); measure this machine with `autotp profile -o my.json` and "
                         f'pass hardware="my.json"')
    if not isinstance(device_name, str) or not device_name.strip():
        raise ValueError(f"a CUDA device's profile is chosen by its name (torch.cuda.get_device_name()), got "
                         f"{device_name!r}")
    words = device_words(device_name)
    for row in GPU_PROFILES:
        if row.matches(words):
            return row.profile
    known = ", ".join(sorted({row.profile for row in GPU_PROFILES}))
    raise ValueError(f"no built-in hardware profile for the CUDA device {device_name!r} (built-in GPU profiles: "
                     f'{known}); measure this machine with `autotp profile -o my.json` and pass hardware="my.json"')
