"""Cost models of autotp, in seconds and bytes: pure numbers, no torch, no autotp.

- ``hardware``: ``HardwareProfile`` (device roofline figures, links per collective kind),
  JSON in and out, built-in profiles (``load_profile``, ``builtin_profile_names``), and the
  hardware a plan is priced with (``resolve_hardware``: a name, a file, a profile or the default).
- ``communication``: alpha-beta time of a collective with nccl-tests' bus factors; which
  link a mesh axis uses.
- ``compute``: roofline time of a kernel.
- ``memory``: parameter, gradient and optimizer bytes per device (``OptimizerSpec``).
- ``devices``: which built-in profile a device is priced with, by its name (``profile_for_device``).

>>> import cost_models as cm
>>> p = cm.load_profile("a100-sxm")
>>> t = cm.axis_collective_time_s(p, (2, 8), 1, "all_reduce", 2**20)
>>> c = p.links["intra_node"].cost("all_reduce")
>>> t == c.latency_s + 2**20 * 2 * 7 / 8 / c.bus_bandwidth_bytes_per_s
True
"""

from cost_models.communication import (
    COLLECTIVE_KINDS,
    axis_collective_time_s,
    axis_link_name,
    collective_factor,
    collective_time_s,
    send_time_s,
)
from cost_models.compute import compute_time_s
from cost_models.devices import profile_for_device
from cost_models.hardware import (
    DEFAULT_HARDWARE,
    CollectiveCost,
    CostSegment,
    DeviceSpec,
    HardwareProfile,
    LinkSpec,
    ProfileError,
    builtin_profile_names,
    hardware_origin,
    load_profile,
    resolve_hardware,
)
from cost_models.memory import OPTIMIZER_STATES, ModelStateBytes, OptimizerSpec, model_state_bytes, optimizer_spec

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveCost",
    "CostSegment",
    "DEFAULT_HARDWARE",
    "DeviceSpec",
    "HardwareProfile",
    "LinkSpec",
    "ModelStateBytes",
    "OPTIMIZER_STATES",
    "OptimizerSpec",
    "ProfileError",
    "axis_collective_time_s",
    "axis_link_name",
    "builtin_profile_names",
    "collective_factor",
    "collective_time_s",
    "compute_time_s",
    "hardware_origin",
    "load_profile",
    "model_state_bytes",
    "optimizer_spec",
    "resolve_hardware",
    "profile_for_device",
    "send_time_s",
]
