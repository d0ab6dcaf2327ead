"""Layout: the axes of a device mesh, each with its role, its name and its size.

A mesh's axis has one of these roles:

- **pipeline** (``pp``): the model's stack of layers cut into stages, one stage per rank of the axis;
- **data** (``dp``): replicas, each running its rows of the batch, their gradients averaged over the
  axis under ZeRO 0 or parameters, gradients and optimizer state sharded over it under ZeRO 1 or 3
  (:mod:`autotp.runtime.data_parallel`); the ILP does not plan it;
- **tensor** (``tp``): planned by the ILP, which decides per op whether it splits the weights, the
  batch or both;
- **expert** (``ep``): planned by the ILP like the tensor axis, for a Mixture-of-Experts model: the
  batch split over it (each rank routes its own rows) and the routed experts split over it, the
  tokens sent to their experts' ranks by all-to-all (:mod:`autotp.planning.rules.routed`); the
  weights the experts do not hold are replicated over it, their gradients summed over it once a
  step. The search sizes it (:mod:`autotp.planning.search.pipeline_search`); the pipeline runtime
  runs it as a planned axis of each stage (:meth:`Layout.planned_mesh`), every rank of it given the
  same micro-batch of ``ep`` ranks' rows, which the plan splits;
- **context** (``cp``): planned by the ILP like the tensor axis, for a model with attention at long
  sequence: every activation's sequence dim split over it (the inputs' sequence dim pinned split,
  the ILP placing the rest: attention splits its query rows, balanced causal rows or its heads
  there) and every weight replicated over it, its gradients summed over it where the plan reads it
  (:mod:`autotp.planning.search.context_axis`). Every rank of it is given the same micro-batch whole
  and keeps its piece of the sequence. The search sizes it and the pipeline runtime runs it as a
  planned axis of each stage, as it runs the expert axis;

:class:`Layout` is what ``autotp.plan(..., pipeline=True)`` chooses (``plan.pipeline.layout``), what
the report prints and what the runtime builds its sub-meshes from. The mesh of a layout has its
axes in the order pipeline, data, expert, context, tensor (ranks numbered row-major, so the tensor
axis holds neighbouring ranks): the tensor axis always; the pipeline axis with stages, replicas,
experts or the sequence split (of size 1 without stages, which the runtime runs as one stage); the
data axis with replicas; the expert axis where experts are split; the context axis where the
sequence is.
``pp 1 x dp 1 x tp n`` is a plain tensor-parallel plan on ``(tp,)``.

A **plain mesh** (``autotp.plan(model, (2, 4), ...)``, ``autotp.parallelize`` without a pipeline
plan) has no data or pipeline role: every one of its axes is planned by the ILP. Its default names,
:func:`plain_axis_names`, call the outer of two axes ``dp`` by habit (it is where the ILP usually
splits the batch, across nodes); that name says nothing about its role. The data role is a
layout's axis only, and only a layout's data axis holds replicas.

>>> Layout(pp=4, dp=2, tp=8, zero=1)
Layout(pp=4, dp=2, tp=8, zero=1, ep=1, cp=1)
>>> print(Layout(pp=4, dp=2, tp=8, zero=1))
pp 4 x dp 2 (ZeRO 1) x tp 8
>>> Layout(pp=4, dp=2, tp=8).mesh_shape, Layout(pp=4, dp=2, tp=8).axis_names
((4, 2, 8), ('pp', 'dp', 'tp'))
>>> Layout(pp=2, tp=4).axis_names, Layout(dp=2, tp=4).axis_names, Layout(tp=4).axis_names
(('pp', 'tp'), ('pp', 'dp', 'tp'), ('tp',))
>>> Layout(dp=2, tp=4).planned_axes, Layout(dp=2, tp=4).replica_axes
(('tp',), ('dp',))
>>> Layout(pp=4, ep=8).axis_names, Layout(pp=4, ep=8).planned_axes, str(Layout(pp=4, ep=8))
(('pp', 'ep', 'tp'), ('ep',), 'pp 4 x dp 1 x ep 8 x tp 1')
>>> Layout(ep=2).mesh_shape, Layout(ep=2).plain
((1, 2, 1), False)
>>> Layout(cp=2, tp=4).axis_names, Layout(cp=2, tp=4).planned_axes, str(Layout(cp=2))
(('pp', 'cp', 'tp'), ('cp', 'tp'), 'pp 1 x dp 1 x cp 2 x tp 1')
>>> plain_axis_names(2)
('dp', 'tp')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "DataAxis", "ROLES", "AXIS_NAMES", "ZERO_STAGES", "plain_axis_names"]

PIPELINE, DATA, EXPERT, CONTEXT, TENSOR = "pipeline", "data", "expert", "context", "tensor"
ROLES = (PIPELINE, DATA, EXPERT, CONTEXT, TENSOR)  # the order of a layout's axes, outermost first
AXIS_NAMES = {PIPELINE: "pp", DATA: "dp", EXPERT: "ep", CONTEXT: "cp", TENSOR: "tp"}
ZERO_STAGES = (0, 1, 3)  # what the search prices and the runtime runs over a data axis
# a plain mesh's default names; every one of its axes is planned by the ILP (module docstring)
_PLAIN_NAMES = {1: (AXIS_NAMES[TENSOR],), 2: ("dp", AXIS_NAMES[TENSOR])}


def plain_axis_names(ndim: int) -> tuple[str, ...]:
    """The default names of a plain mesh's ``ndim`` axes, all planned by the ILP: ``("tp",)``,
    ``("dp", "tp")`` (``dp`` a name only, module docstring), else ``axis0``, ``axis1``, ..."""
    return _PLAIN_NAMES.get(ndim, tuple(f"axis{i}" for i in range(ndim)))


@dataclass(frozen=True)
class DataAxis:
    """A layout's data axis: its name, its replicas and the ZeRO stage its runtime runs
    (:mod:`autotp.runtime.data_parallel`)."""

    name: str
    size: int
    zero: int


@dataclass(frozen=True)
class Layout:
    """The sizes of a mesh's axes by role, and the ZeRO stage over the data axis (module docstring).
    Built with positive sizes; ``zero`` one of :data:`ZERO_STAGES`, above 0 only with a data axis."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    zero: int = 0
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for role, size in self.sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"layout: {AXIS_NAMES[role]}={size!r}; expected a positive int, the {role} "
                                 f"axis's number of ranks")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"layout: zero={self.zero!r}; expected one of {ZERO_STAGES} (ZeRO 1 and 3 run as "
                             f"FSDP2, ZeRO 0 as averaged gradients)")
        if self.zero and self.dp == 1:
            raise ValueError(f"layout: zero={self.zero} shards over the data axis, and dp is 1; give dp > 1 or "
                             f"zero=0")

    @property
    def sizes(self) -> dict[str, int]:
        """Each role's axis size, in :data:`ROLES`' order."""
        return {PIPELINE: self.pp, DATA: self.dp, EXPERT: self.ep, CONTEXT: self.cp, TENSOR: self.tp}

    @property
    def devices(self) -> int:
        out = 1
        for size in self.sizes.values():
            out *= size
        return out

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of the mesh's axes, outermost first (module docstring): the tensor axis always,
        the pipeline axis with stages, replicas, experts or the sequence split (each run by the pipeline
        runtime), the data axis with replicas, the expert axis with experts split, the context axis with
        the sequence split."""
        staged = self.pp > 1 or self.dp > 1 or self.ep > 1 or self.cp > 1
        return (((PIPELINE,) if staged else ()) + ((DATA,) if self.dp > 1 else ()) + ((EXPERT,) if self.ep > 1 else ())
                + ((CONTEXT,) if self.cp > 1 else ()) + (TENSOR,))

    @property
    def plain(self) -> bool:
        """No stages, no replicas, no expert or context axis (pp 1 x dp 1 x ep 1 x cp 1): a plain
        tensor-parallel plan on ``(tp,)``."""
        return self.roles == (TENSOR,)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[r] for r in self.roles)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(AXIS_NAMES[r] for r in self.roles)

    @property
    def planned_axes(self) -> tuple[str, ...]:
        """The axes the ILP plans: the tensor axis, or with experts or the sequence split the expert and
        the context axes of more than one rank and the tensor axis where it has more than one (the
        plan's mesh)."""
        return tuple(AXIS_NAMES[r] for r in self._planned_roles)

    @property
    def planned_shape(self) -> tuple[int, ...]:
        """The sizes of :attr:`planned_axes`: the mesh the ILP plans one micro-batch on."""
        return tuple(self.sizes[r] for r in self._planned_roles)

    @property
    def _planned_roles(self) -> tuple[str, ...]:
        split = tuple(r for r in (EXPERT, CONTEXT) if self.sizes[r] > 1)
        return split + ((TENSOR,) if self.tp > 1 or not split else ())

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The axes of replicas: the data axis, where the layout has one."""
        return (AXIS_NAMES[DATA],) if self.dp > 1 else ()

    @property
    def data(self) -> DataAxis | None:
        """The data axis, or None without one."""
        return DataAxis(AXIS_NAMES[DATA], self.dp, self.zero) if self.dp > 1 else None

    def sub_mesh(self, mesh: Any, role: str) -> Any:
        """The one-axis sub-mesh of ``mesh`` (a ``DeviceMesh`` :meth:`mesh_problem` accepts) that plays
        ``role``, or None where the layout's mesh has no such axis."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        return mesh[AXIS_NAMES[role]] if role in self.roles else None

    def planned_mesh(self, mesh: Any) -> Any:
        """The sub-mesh of ``mesh`` the plan's collectives run on: :attr:`planned_axes` (the tensor axis,
        or the expert and context axes and a tensor axis of more than one rank), shaped
        :attr:`planned_shape`."""
        axes = self.planned_axes
        return mesh[axes[0]] if len(axes) == 1 else mesh[axes]

    def mesh_problem(self, mesh: Any, described: str = "") -> str:
        """What is wrong with ``mesh`` (a ``DeviceMesh``) for this layout, or ``""``: its shape and axis
        names must be :attr:`mesh_shape` and :attr:`axis_names`. ``described``: the layout as the
        message names it (default: ``str(self)``)."""
        names = tuple(mesh.mesh_dim_names or ())
        shape = tuple(int(x) for x in mesh.mesh.shape)
        want, want_names = self.mesh_shape, self.axis_names
        if names == want_names and shape == want:
            return ""
        return (f"the plan's layout is {described or self}: its stages run on a mesh of shape {want} with axes named "
                f"{want_names}, e.g. init_device_mesh(device, {want}, mesh_dim_names={want_names}); given shape "
                f"{shape} named {names}")

    def __str__(self) -> str:
        parts = []
        for role, size in self.sizes.items():
            if role in (PIPELINE, DATA, TENSOR) or size > 1:
                parts.append(f"{AXIS_NAMES[role]} {size}" + (f" (ZeRO {self.zero})" if role == DATA and size > 1
                                                              else ""))
        return " x ".join(parts)
