"""Mesh axes as groups of ranks, laid out row-major like ``torch.distributed.DeviceMesh``.

An axis of a mesh of shape ``(2, 4)`` is a set of disjoint groups: along axis 0 the
groups are the columns ``[0, 4], [1, 5], [2, 6], [3, 7]``; along axis 1 the rows
``[0, 1, 2, 3], [4, 5, 6, 7]``. Every rank takes part in one group of each axis, and all
groups of an axis run their collective at the same time, as they do in a model.

>>> [axis.groups for axis in mesh_axes((2, 4))]
[((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))]
>>> mesh_axes((2, 4))[0].group_of(5)
(1, 5)
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the mesh: its index, its size and the rank groups along it."""

    index: int
    size: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        return f"axis{self.index}"

    def group_of(self, rank: int) -> tuple[int, ...]:
        for group in self.groups:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is not on the mesh of {self.name}")

    def __str__(self) -> str:
        shown = ", ".join(str(list(g)) for g in self.groups[:4])
        more = f", ... ({len(self.groups)} groups)" if len(self.groups) > 4 else ""
        return f"{self.name} (size {self.size}: {shown}{more})"


def mesh_axes(shape: tuple[int, ...]) -> tuple[MeshAxis, ...]:
    """The axes of a row-major mesh of ``shape`` over ranks ``0 .. prod(shape) - 1``."""
    strides = []
    stride = 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    strides.reverse()
    axes = []
    for index, size in enumerate(shape):
        others = [range(s) for i, s in enumerate(shape) if i != index]
        other_strides = [st for i, st in enumerate(strides) if i != index]
        groups = []
        for coords in product(*others):
            base = sum(c * st for c, st in zip(coords, other_strides))
            groups.append(tuple(base + k * strides[index] for k in range(size)))
        axes.append(MeshAxis(index=index, size=size, groups=tuple(groups)))
    return tuple(axes)
