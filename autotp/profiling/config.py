"""What one ``autotp profile`` run was asked to do: sizes, mesh, iterations, limits.

The command line is parsed once, into a :class:`ProfileConfig`; the launcher hands the
same value (as JSON) to every rank it starts, so all ranks agree on the sweep.

>>> parse_size("1K"), parse_size("256M"), parse_size("4096")
(1024, 268435456, 4096)
>>> format_size(3 * 1024 * 1024)
'3 MiB'
>>> size_sweep(1024, 8192, 2)
(1024, 2048, 4096, 8192)
>>> parse_mesh("2x4")
(2, 4)
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from autotp.units import format_bytes

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional binary suffix K, M, G or T.

    ``1K`` is 1024 bytes, as nccl-tests reads it; ``1KB``/``1KiB`` mean the same.
    Raises ``ValueError`` with a message that repeats the text and shows the format.
    """
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a number of bytes with an optional "
            "K, M, G or T suffix (e.g. 1K, 64M, 1G)"
        )
    size_bytes = int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if size_bytes <= 0:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    return size_bytes


def format_size(size_bytes: float) -> str:
    """Short human form with a binary unit: ``1 KiB``, ``1.5 MiB``, ``64 MiB`` (the one byte format
    of autotp, :func:`autotp.units.format_bytes`)."""
    return format_bytes(size_bytes)


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int) -> tuple[int, ...]:
    """Message sizes from ``min_bytes`` up to ``max_bytes``, each ``step_factor`` times the last."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if step_factor < 2:
        raise ValueError(f"step factor must be at least 2, got {step_factor}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    return tuple(sizes)


def parse_mesh(text: str) -> tuple[int, ...]:
    """Mesh shape from ``"2x4"`` (or ``"8"``): positive axis sizes, row-major like DeviceMesh."""
    parts = str(text).lower().replace("*", "x").split("x")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"invalid mesh {text!r}: expected axis sizes joined by 'x', e.g. 8 or 2x4")
    return shape


@dataclass(frozen=True)
class ProfileConfig:
    """Everything a rank needs to run its part of the profile.

    ``mesh`` is ``None`` for "one axis of the whole world". ``timeout_s`` bounds how long
    the run may go without any rank making progress (see ``launch.py``). ``dtypes`` and
    ``device_budget_s`` steer the device measurement (``device.py``).
    """

    backend: str
    mesh: tuple[int, ...] | None
    min_bytes: int
    max_bytes: int
    step_factor: int
    iters: int
    warmup_iters: int
    check: bool
    timeout_s: float
    output: str | None
    min_time_s: float = 0.0
    rounds: int = 1
    held_out: bool = True  # also time the held-out sizes between the fit sizes (sizes.held_out_sizes)
    refine: bool = True  # add fit sizes where the times bend (sizes.refinement_sizes)
    dtypes: tuple[str, ...] | None = None  # matmul dtypes to measure (None: dtypes.choose_dtypes' default)
    device_budget_s: float | None = None  # seconds per dtype for its matmuls (None: device.default_budget_s)

    @property
    def sizes_bytes(self) -> tuple[int, ...]:
        return size_sweep(self.min_bytes, self.max_bytes, self.step_factor)

    def mesh_for(self, world_size: int) -> tuple[int, ...]:
        """The mesh shape for ``world_size`` ranks; raises ``ValueError`` if they disagree."""
        shape = self.mesh if self.mesh is not None else (world_size,)
        product = 1
        for size in shape:
            product *= size
        if product != world_size:
            declared = "x".join(map(str, shape))
            raise ValueError(f"mesh {declared} has {product} ranks but the world size is {world_size}")
        return shape

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ProfileConfig":
        data = json.loads(text)
        for key in ("mesh", "dtypes"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)
