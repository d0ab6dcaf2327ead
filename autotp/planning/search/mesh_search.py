"""The mesh chosen too: a device count in, the cheapest plan over the mesh shapes it factors into.

``autotp.plan(model, 64, inputs)`` plans the captured graph (once) on each shape of 64 devices,
one axis or two: ``(64,)``, ``(2, 32)``, ``(4, 16)``, ``(8, 8)``, ``(16, 4)``, ``(32, 2)``. Ranks are
numbered row-major, so the last axis holds neighbouring ranks: it stays inside a node while it has
no more ranks than the profile's ``devices_per_node``, and its collectives are priced on the
``intra_node`` link, the first axis's on ``inter_node`` where its groups cross nodes
(``cost_models.communication.axis_link_name``). Axis names carry no meaning to the planner: on each
shape the ILP decides per axis what to split, the batch (data parallelism), the weights (tensor
parallelism), or both. The plan of least predicted step time wins; a shape on which no plan fits
the memory budget is listed with the least it would need. The plan carries every candidate
(:class:`MeshCandidate`, best first, with why each lost) to the report and its JSON.

Pipeline stages are not among the candidates yet: each shape is tensor and data parallelism only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from autotp.planning.errors import MemoryBudgetError

__all__ = ["MeshCandidate", "mesh_shapes", "search_meshes"]


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape the search planned: its predicted step (None where no plan fits), the step's
    compute and communication seconds, the peak bytes per device, and why it lost (empty: it won)."""

    shape: tuple[int, ...]
    step_s: Optional[float]
    compute_s: Optional[float]
    communication_s: Optional[float]
    peak_bytes: Optional[float]
    links: tuple[str, ...]
    why: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "MeshCandidate":
        return cls(**{**d, "shape": tuple(d["shape"]), "links": tuple(d["links"])})


def mesh_shapes(devices: int) -> list[tuple[int, ...]]:
    """The shapes of ``devices`` ranks the search plans: one axis, and every two-axis factorization
    with both axes of two or more ranks."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: expected a device count (an int >= 1) or a mesh such as (8,) "
                         f"or (2, 4)")
    shapes: list[tuple[int, ...]] = [(devices,)]
    shapes += [(a, devices // a) for a in range(2, devices // 2 + 1) if devices % a == 0 and devices // a >= 2]
    return shapes


def search_meshes(devices: int, devices_per_node: int, plan_on: Callable[[tuple[int, ...]], Any]):
    """``plan_on(shape)`` for each of :func:`mesh_shapes`; the plan of least predicted step, carrying
    every candidate, best first. Raises the least-demanding :class:`MemoryBudgetError` when no shape
    has a plan that fits."""
    from autotp.planning.solve.ilp import SolverError  # noqa: PLC0415
    from cost_models import axis_link_name  # noqa: PLC0415 - numbers only

    planned: list[tuple[tuple[int, ...], Any, Optional[Exception]]] = []
    for shape in mesh_shapes(devices):
        try:
            planned.append((shape, plan_on(shape), None))
        except (MemoryBudgetError, SolverError) as err:  # listed with the reason; the others still compete
            planned.append((shape, None, err))
    fitting = [(shape, p) for shape, p, _ in planned if p is not None]
    if not fitting:
        budget_errors = [err for _, _, err in planned if isinstance(err, MemoryBudgetError)]
        if not budget_errors:
            raise planned[0][2]
        least = min(budget_errors, key=lambda e: e.minimum_bytes)
        raise MemoryBudgetError(f"no mesh of {devices} devices has a plan that fits: {least}", least.minimum_bytes)
    _, best = min(fitting, key=lambda sp: (sp[1].predicted_time().total_s, len(sp[0])))
    bt = best.predicted_time()
    candidates = []
    for shape, p, err in planned:
        links = tuple(axis_link_name(shape, a, devices_per_node) for a in range(len(shape)))
        if p is None:
            candidates.append(MeshCandidate(shape, None, None, None, None, links, (
                f"no plan fits the memory budget (least {err.minimum_bytes / 2**30:.1f} GiB)"
                if isinstance(err, MemoryBudgetError) else f"the solver found no plan: {err}")))
            continue
        t = p.predicted_time()
        why = "" if p is best else _why(t, bt)
        candidates.append(MeshCandidate(shape, t.total_s, t.compute_s, t.communication_s, p.memory.peak_bytes,
                                        links, why))
    # fitting ones by step time, the chosen first of equals; then the others by the least they need
    least = {shape: getattr(err, "minimum_bytes", math.inf) for shape, _, err in planned if err is not None}
    candidates.sort(key=lambda c: (c.step_s is None, c.step_s if c.step_s is not None else least[c.shape],
                                   c.why != ""))
    return replace(best, mesh_search=tuple(candidates))


def _why(t, best) -> str:
    """Why a plan lost to the best: the part of its step that is longer, communication or compute."""
    if math.isclose(t.total_s, best.total_s, rel_tol=1e-9, abs_tol=1e-12):
        return "as fast (of equals the search keeps the one with fewer axes, then the first listed)"
    more_comm, more_comp = t.communication_s - best.communication_s, t.compute_s - best.compute_s
    if more_comm >= more_comp:
        return f"communication +{more_comm * 1e3:.3f} ms"
    return f"compute +{more_comp * 1e3:.3f} ms"
