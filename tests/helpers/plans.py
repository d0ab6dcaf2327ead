"""A small model planned so that it shards: the plans the weights tests load into and gather from;
the solver's objective recorded beside a plan."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest

import autotp
import autotp.planning.planner
from autotp.planning.planner import plan_graph
from examples import models


def sharded_mlp(world: int = 2) -> tuple[Any, Any, Any]:
    """``(model, graph, plan)``: ``examples.models.mlp`` captured and planned on ``(world,)`` under the
    least memory any plan needs and a little more, so some weight is split (checked)."""
    model, inputs = models.mlp()
    graph = autotp.capture(model, inputs)
    try:
        plan_graph(graph, (world,), "cpu-gloo", "train", memory_budget=1)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (world,), "cpu-gloo", "train", memory_budget=int(err.minimum_bytes * 1.05))
    assert any(v != "R" for v in plan.parameter_placements.values()), plan.parameter_placements
    return model, graph, plan


@contextmanager
def solver_objective() -> Iterator[dict]:
    """Inside, each solve of ``plan_graph`` records its objective: the dict yielded holds the last
    one's seconds under ``"s"``."""
    objective: dict = {}
    solve = autotp.planning.planner.solve

    def recording(*args, **kwargs):
        solution = solve(*args, **kwargs)
        objective["s"] = solution.objective_s
        return solution

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotp.planning.planner, "solve", recording)
        yield objective


@contextmanager
def without_pd() -> Iterator[None]:
    """Inside, the planner offers no ``Pd`` (sums of disjoint parts: experts placed whole with every
    token on every rank), so experts pinned ``S(0)`` run the all-to-all variant (the routed region)
    wherever the graph has one, whatever the cost model prefers."""
    from autotp.placement import Pd
    from autotp.planning.choices import strategies

    offered = strategies.axis_choices

    def choices(node, n, warned=None, graph=None):
        return [c for c in offered(node, n, warned, graph) if c[1] != Pd and Pd not in c[0]]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategies, "axis_choices", choices)
        yield


@contextmanager
def without_routed() -> Iterator[None]:
    """Inside, the planner offers no routed region (no all-to-all dispatch of the tokens), so experts
    pinned ``S(0)`` keep every token on every rank (``Pd``), whatever the cost model prefers."""
    from autotp.planning.choices import strategies

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategies, "routed_choices", lambda node, n, graph: [])
        yield
