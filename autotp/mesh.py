"""MeshSpec: the shape and axis names of a device mesh, from a ``DeviceMesh`` or a plain shape.

Planning needs only the shape and the names, so a mesh may be given as ``(8,)`` or ``(2, 4)`` and
no process is started. A shape's default names are :func:`autotp.layout.plain_axis_names`: every axis
of a plain mesh is planned by the ILP, whatever its name (``dp`` included; a data axis of replicas is
a :class:`autotp.layout.Layout`'s).

>>> MeshSpec.of((2, 4))
MeshSpec(shape=(2, 4), axis_names=('dp', 'tp'), device_type=None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from autotp.layout import plain_axis_names
from autotp.words import with_article

__all__ = ["MeshSpec"]

@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_type: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.shape or any((not isinstance(n, int)) or n < 1 for n in self.shape):
            raise ValueError(f"mesh shape {self.shape!r}: expected a tuple of positive ints such as (8,) or (2, 4)")
        if len(self.axis_names) != len(self.shape) or len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names {self.axis_names!r} do not name the {len(self.shape)} axes of "
                             f"shape {self.shape} once each")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + " (" + ", ".join(self.axis_names) + ")"

    @classmethod
    def of(cls, mesh: Any, axis_names: Optional[Sequence[str]] = None) -> "MeshSpec":
        """From a ``torch.distributed.DeviceMesh``, a shape tuple/list, an int, or a MeshSpec."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, int) and not isinstance(mesh, bool):
            mesh = (mesh,)
        if isinstance(mesh, (tuple, list)):
            shape = tuple(mesh)
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
                raise TypeError(f"mesh {mesh!r}: expected a DeviceMesh or a shape of ints such as (8,) or (2, 4)")
            names = tuple(axis_names) if axis_names else plain_axis_names(len(shape))
            return cls(shape, names)
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # pragma: no cover - torch without distributed
            DeviceMesh = ()  # type: ignore[assignment]
        if isinstance(mesh, DeviceMesh):
            shape = tuple(int(n) for n in mesh.mesh.shape)
            names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else plain_axis_names(len(shape))
            return cls(shape, names, mesh.device_type)
        raise TypeError(f"mesh is {with_article(type(mesh).__name__)}; expected a DeviceMesh or a shape such as (8,) or (2, 4)")
