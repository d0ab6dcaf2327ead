"""``plan.explain("module")``: why a module is split the way it is, in the planner's own numbers.

For the module's largest weight, every placement the planner could store it with is tried: the plan
is solved again with that placement pinned (the ops that read the weight compute with it, and
every other choice is free to follow), and each alternative is shown with its predicted step time,
its collectives and its memory per device, or why no plan has it (the memory budget, a split the
ops cannot read). The chosen placement is the cheapest that fits, so every row costs at least as
much: the table says by how much, which is the question a user asks of a module left replicated.

It needs the captured graph, which a plan made by ``autotp.plan`` keeps while it lives (never saved
to JSON; the capture refers to the model's tensors, so a plan of a real model keeps them alive: plan
a model on meta, as the examples do, to hold nothing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from autotp.placement import format_placements
from autotp.planning.choices.strategies import all_strategies
from autotp.planning.errors import MemoryBudgetError, PlanError
from autotp.tracing.graph import OpGraph
from autotp.units import format_bytes

if TYPE_CHECKING:
    from autotp.planning.result.plan import Plan

__all__ = ["Alternative", "Explanation", "ExplainContext", "explain", "explain_replicated"]


@dataclass(frozen=True)
class ExplainContext:
    """What a plan keeps to be explained: the captured graph, the pins it was planned with, and
    ``solve(pin)``, the planner run again with the same arguments and other pins (the planner hands
    it over, so this module needs no import of the planner)."""

    graph: OpGraph
    pin: Mapping[str, str]
    solve: Callable[[dict[str, str]], "Plan"]


@dataclass(frozen=True)
class Alternative:
    """One placement of the weight: the plan it gives, or why there is none."""

    placement: str
    chosen: bool
    style: str = ""
    step_s: Optional[float] = None
    collectives: Optional[int] = None
    memory_bytes: Optional[float] = None
    refused: str = ""  # why no plan stores the weight so (empty: a plan does)


@dataclass(frozen=True)
class Explanation:
    module: str
    weight: str
    shape: tuple[int, ...]
    alternatives: tuple[Alternative, ...]

    def __str__(self) -> str:
        chosen = next(a for a in self.alternatives if a.chosen)
        lines = [f"{self.module or '(root)'}: {chosen.style}, weight {self.weight} {list(self.shape)} stored "
                 f"{chosen.placement}; each placement it could have, the plan solved again with it:"]
        for a in self.alternatives:
            mark = " (chosen)" if a.chosen else ""
            if a.refused:
                lines.append(f"  {a.placement}{mark}: no plan: {a.refused}")
                continue
            extra = a.step_s / chosen.step_s - 1.0 if chosen.step_s else 0.0
            vs = "" if a.chosen else f" ({extra:+.1%} step time)"
            lines.append(f"  {a.placement}{mark}: {a.style}, step {a.step_s * 1e3:.3f} ms{vs}, {a.collectives} "
                         f"collective{'' if a.collectives == 1 else 's'}, {format_bytes(a.memory_bytes)} per device")
        return "\n".join(lines)


def explain(plan: "Plan", module: str) -> Explanation:
    """The alternatives of ``module``'s largest weight (module docstring)."""
    context = plan._context
    if context is None:
        raise PlanError("explain needs the captured model, which this plan does not keep: it was loaded from a file "
                        "or made by autotp.parallelize (whose module must not keep the model's tensors); plan the "
                        "model with autotp.plan in this process")
    graph = context.graph
    params = [p for p in graph.parameters if p.fqn.rpartition(".")[0] == module]
    if not params:
        owners = sorted({p.fqn.rpartition(".")[0] for p in graph.parameters})
        raise ValueError(f"module {module!r} has no parameters of its own; modules with weights: "
                         f"{', '.join(owners[:8])}{', ...' if len(owners) > 8 else ''}")
    weight = max(params, key=lambda p: p.info.numel)
    chosen = plan.parameter_placements[weight.fqn]
    options = all_strategies(graph, plan.mesh.shape, [graph[weight.node]])[weight.node]
    placements = sorted({format_placements(s.output) for s in options}, key=lambda t: (t != chosen, t))
    rows = []
    for text in placements:
        if text == chosen:
            rows.append(_row(text, True, plan, module))
            continue
        try:
            alternative = context.solve({**context.pin, weight.fqn: text})
        except MemoryBudgetError as err:
            rows.append(Alternative(text, False, refused=f"over the memory budget ({err})"))
        except (PlanError, ValueError) as err:
            rows.append(Alternative(text, False, refused=str(err)))
        else:
            rows.append(_row(text, False, alternative, module))
    return Explanation(module, weight.fqn, tuple(weight.info.shape), tuple(rows))


def _row(text: str, chosen: bool, plan: "Plan", module: str) -> Alternative:
    return Alternative(text, chosen, plan.module_styles().get(module, ""), plan.time.total_s,
                       len(plan.collective_list), plan.memory.total_bytes)


def explain_replicated(plan: "Plan", limit: int = 6) -> list[Explanation]:
    """:func:`explain` for the modules with weights that the plan leaves replicated, repeated layers
    once (the first of them), at most ``limit``."""
    seen, out = set(), []
    for m in plan.modules:
        if m.style != "replicate":
            continue
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", m.module)
        if pattern in seen:
            continue
        seen.add(pattern)
        try:
            out.append(explain(plan, m.module))
        except ValueError:  # a module whose weights belong to its children
            continue
        if len(out) == limit:
            break
    return out
