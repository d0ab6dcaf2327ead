"""What every rank must hold the same: the plan and the dropout seed, both from the mesh's first rank.

Only the rank at the mesh's first coordinate solves; it broadcasts the plan as JSON, or its error,
along each mesh axis in turn. Ranks can thus never build from plans that differ (a solver stopped at
its time limit is not deterministic), and a first-rank error (a memory budget no plan meets) is
raised on every rank rather than leaving the others waiting.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from autotp.mesh import MeshSpec
from autotp.planning.errors import MemoryBudgetError, PlanError
from autotp.planning.planner import plan_graph
from autotp.planning.result.plan import Plan
from autotp.planning.rules.randomness import has_active_dropout

__all__ = ["agreed_plan", "dropout_seed", "from_first_rank"]

_ERRORS = {"PlanError": PlanError, "ValueError": ValueError, "TypeError": TypeError}


def from_first_rank(mesh, payload: list[Any]) -> list[Any]:
    """The first rank's ``payload`` on every rank: a broadcast along each axis in turn (from
    coordinate 0 of that axis; ranks at coordinate 0 of the later axes pass it on)."""
    import torch.distributed as dist

    coordinate = mesh.get_coordinate()
    for axis in range(mesh.ndim):
        if all(c == 0 for c in coordinate[axis + 1:]):
            dist.broadcast_object_list(payload, group=mesh.get_group(axis), group_src=0)
    return payload


def agreed_plan(graph, spec: MeshSpec, mesh, hardware: Any, mode: str, memory_budget: Any, capture_s: float,
                 optimizer: Any = "adamw", recompute: Optional[bool] = None, keep: Any = None,
                 hardware_source: Optional[str] = None) -> Plan:
    """The rank at the mesh's first coordinate plans; its plan (or its error) reaches every rank by a
    broadcast along each axis in turn (from coordinate 0 of that axis), and every rank returns it."""
    coordinate = mesh.get_coordinate()
    payload: list[Any] = [None]
    plan = None
    error: Optional[BaseException] = None
    if all(c == 0 for c in coordinate):
        try:
            # not explainable: the plan would keep the capture, which holds the model's tensors (the
            # parallel module keeps its plan, and `del model` must free the model)
            plan = plan_graph(graph, spec, hardware, mode, memory_budget, capture_s=capture_s, optimizer=optimizer,
                              recompute=recompute, keep=keep, hardware_source=hardware_source, explainable=False)
            payload = [("plan", plan.to_json())]
        except MemoryBudgetError as err:
            payload, error = [("budget", str(err), err.minimum_bytes)], err
        except (PlanError, ValueError, TypeError) as err:
            name = type(err).__name__ if type(err).__name__ in _ERRORS else "ValueError"
            payload, error = [("error", name, str(err))], err
        except BaseException as err:  # anything else: tell the others, then raise it here
            payload, error = [("error", "RuntimeError", f"the first rank failed to plan: {type(err).__name__}: {err}")], err
    payload = from_first_rank(mesh, payload)
    if error is not None:
        raise error
    kind, *rest = payload[0]
    if plan is not None:
        return plan
    if kind == "plan":
        return Plan.from_json(rest[0])
    if kind == "budget":
        raise MemoryBudgetError(rest[0], rest[1])
    raise _ERRORS.get(rest[0], RuntimeError)(rest[1])


def dropout_seed(mesh, graph) -> Optional[int]:
    """The base seed of the dropout masks, the first rank's on every rank (:mod:`autotp.local.dropout`);
    None (and no broadcast) for a graph that drops nothing."""
    return from_first_rank(mesh, [torch.initial_seed()])[0] if has_active_dropout(graph) else None
