"""Variants of the built-in profiles for planning tests sized on a given balance of compute to
links: each is a real way of running the device, named for what it changes."""

from __future__ import annotations

import dataclasses

from cost_models import HardwareProfile, load_profile


def h100_without_tf32() -> HardwareProfile:
    """``h100-sxm`` as a program that turns cuDNN's TF32 off (``torch.backends.cudnn.allow_tf32 =
    False``) runs: float32 convolutions at the float32 rate, as float32 matmuls."""
    p = load_profile("h100-sxm")
    return dataclasses.replace(p, name="h100-sxm-no-tf32", device=dataclasses.replace(p.device, convolution_peak_flops=None))

