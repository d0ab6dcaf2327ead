"""A small model planned so that it shards: the plans the weights tests load into and gather from."""

from __future__ import annotations

from typing import Any

import autotp
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
