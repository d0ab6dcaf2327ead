"""Where a plan put its routed experts and why: each placement of each MoE layer kind, priced.

For each kind of routed MoE layer (:func:`autotp.planning.choices.expert_placements.moe_kinds`,
found from the grouped matmuls, never by name), the placement the plan chose and the best plan
with each other placement (split by features; whole on ranks with every token on every rank;
whole on ranks with the tokens sent by all-to-all), made by solving the ILP again with that
kind's experts placed and stored so and everything else free (the rest of the model may follow).
Each is priced in the terms that decide between them: the kind's grouped matmuls' compute (at the
busiest rank's rows where the experts are whole on ranks: the mean rows plus the larger of a tenth
and three standard deviations of uniform routing), the step's collectives by kind, the other ops'
compute, the local copies; these add up to the plan's predicted step.

It costs one ILP per other placement and kind (none for a model with no grouped matmuls), so it
runs when asked (``plan.expert_choices()``, or the report, which shows it) and is kept on the plan.
Like ``plan.explain`` it needs the captured graph; a loaded plan says only what it chose.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from autotp.planning.choices.expert_placements import MoeLayer, describe_placement, moe_kinds, placement_of
from autotp.planning.costs.costing import CostModel
from autotp.planning.errors import MemoryBudgetError, PlanError
from autotp.planning.rules.experts import GROUPED_MM, busiest_rows

if TYPE_CHECKING:
    from autotp.planning.result.plan import Plan

__all__ = ["PlacementPrice", "ExpertChoice", "expert_choices", "expert_lines"]

_PRICED = ("features", "whole", "routed")


@dataclass(frozen=True)
class PlacementPrice:
    """One placement of a kind's experts: the best plan with it, in the terms that decide, or why
    there is none (``refused``)."""

    placement: str  # "features", "whole", "routed" or "replicated"
    words: str  # the placement with its axes, in words
    chosen: bool
    step_s: Optional[float] = None
    grouped_mm_s: float = 0.0  # this kind's grouped matmuls, forward and backward, every layer of the kind
    busiest: float = 1.0  # the busiest rank's rows over the mean rows (1.0: every rank the same rows)
    collectives: tuple[tuple[str, int, float], ...] = ()  # the step's collectives: (kind, how many, seconds)
    other_compute_s: float = 0.0
    copies_s: float = 0.0
    weights: Mapping[str, str] = None  # type: ignore[assignment]  # the expert weights' placements in that plan
    refused: str = ""

    def terms(self) -> str:
        """"grouped matmuls 43.6 ms (busiest rank 1.1x the mean rows), all_to_all 10 x 0.64 ms, ..."."""
        busiest = f" (busiest rank {self.busiest:.2f}x the mean rows)" if self.busiest != 1.0 else ""
        parts = [f"grouped matmuls {_ms(self.grouped_mm_s)}{busiest}"]
        parts += [f"{kind} {n} x {_ms(s / n)}" for kind, n, s in self.collectives]
        parts += [f"other compute {_ms(self.other_compute_s)}"]
        if self.copies_s > 1e-7:
            parts.append(f"local copies {_ms(self.copies_s)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class ExpertChoice:
    """A kind of routed MoE layer: how many layers, their experts and weight shapes, and each
    placement priced (the chosen first)."""

    layers: int
    experts: int
    rows: int
    shapes: tuple[tuple[int, ...], ...]
    prices: tuple[PlacementPrice, ...]

    @property
    def chosen(self) -> PlacementPrice:
        return next(p for p in self.prices if p.chosen)

    def price(self, placement: str) -> Optional[PlacementPrice]:
        return next((p for p in self.prices if p.placement == placement), None)

    def lines(self) -> list[str]:
        chosen = self.chosen
        if chosen.step_s is None:  # a plan without its graph: what it chose, unpriced
            return [f"grouped matmuls: experts {chosen.words} (the other placements are priced for a plan made "
                    f"in this process, which keeps the captured graph)"]
        layers = f"{self.layers} MoE layer{'s' if self.layers > 1 else ''}"
        shapes = " and ".join(str(list(s)) for s in self.shapes)
        head = (f"{layers} of {self.experts} experts (grouped matmul weights {shapes}, {self.rows} routed rows): "
                f"chosen {chosen.words}")
        others = []
        for p in self.prices:
            if p.chosen:
                continue
            if p.refused:
                others.append(f"{p.words}: no plan ({p.refused})")
            else:
                others.append(f"{p.words} {_ms(p.step_s)} ({p.step_s / chosen.step_s:.2f}x)")
        head += f", step {_ms(chosen.step_s)}" + (f"; the best plan pinned {'; '.join(others)}" if others else "")
        out = [head, f"  {chosen.words} (chosen): {chosen.terms()}"]
        out += [f"  {p.words}: {p.terms()}" for p in self.prices if not p.chosen and not p.refused]
        return out


def _ms(s: Optional[float]) -> str:
    return f"{s * 1e3:.2f} ms" if s is not None and s >= 1e-3 else f"{(s or 0.0) * 1e6:.1f} us"


def _price(plan: "Plan", kind: tuple[MoeLayer, ...], cost: CostModel, graph, chosen: bool) -> PlacementPrice:
    first = kind[0].grouped[0]
    placement, axis, features = placement_of(plan.strategy(first))
    grouped = [g for layer in kind for g in layer.grouped]
    mm_s = sum(cost.node_compute_s(graph[g], plan.strategy(g), graph.gradient_reads(g))
               - cost.inner_collectives_s(graph[g], plan.strategy(g)) for g in grouped)
    busiest = 1.0
    if axis is not None:
        n, rows = plan.mesh.shape[axis], kind[0].rows
        busiest = busiest_rows(rows, n) / (rows / n)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for c in plan.collective_list:
        by_kind[c.kind].append(cost.collective_s(c.kind, plan.mesh.axis_names.index(c.mesh_axis), c.bytes))
    collectives = tuple((k, len(v), sum(v)) for k, v in sorted(by_kind.items()))
    weights = {fqn: plan.parameter_placements[fqn] for layer in kind for fqn in layer.weights if fqn}
    return PlacementPrice(placement, describe_placement(placement, axis, features, plan.mesh.axis_names), chosen,
                          plan.time.total_s, mm_s, busiest, collectives, plan.time.compute_s - mm_s,
                          max(0.0, plan.time.communication_s - sum(s for _, _, s in collectives)), weights)


def expert_choices(plan: "Plan") -> tuple[ExpertChoice, ...]:
    """Each kind of routed MoE layer of ``plan``'s graph with its placements priced (module
    docstring); empty for a model with none. Without the captured graph (a loaded plan, a layout
    search's stage plan), each distinct placement of the plan's grouped matmuls, unpriced."""
    context = plan._context
    if context is None:
        seen: dict[str, ExpertChoice] = {}
        for n in plan.nodes:
            if n.target in GROUPED_MM and len(n.shape) == 2:
                placement, axis, features = placement_of(plan.strategy(n.name))
                words = describe_placement(placement, axis, features, plan.mesh.axis_names)
                seen.setdefault(words, ExpertChoice(0, 0, 0, (), (PlacementPrice(placement, words, True),)))
        return tuple(seen.values())
    graph = context.graph
    kinds = moe_kinds(graph)
    if not kinds:  # a dense model: nothing to solve or price
        return ()
    cost = CostModel(plan.mesh, plan.hardware, plan.mode, plan.optimizer, graph)
    out = []
    for kind in kinds:
        chosen = _price(plan, kind, cost, graph, True)
        prices = [chosen]
        for placement in _PRICED:
            if placement == chosen.placement:
                continue
            words = describe_placement(placement)
            try:
                other = context.solve(dict(context.pin), {g: placement for layer in kind for g in layer.grouped})
            except MemoryBudgetError as err:
                prices.append(PlacementPrice(placement, words, False, refused=f"over the memory budget: {err}"))
            except (PlanError, ValueError) as err:
                prices.append(PlacementPrice(placement, words, False, refused=str(err)))
            else:
                prices.append(_price(other, kind, cost, graph, False))
        out.append(ExpertChoice(len(kind), kind[0].experts, kind[0].rows, kind[0].shapes, tuple(prices)))
    return tuple(out)


def expert_lines(plan: "Plan") -> list[str]:
    """The report's section: a line per kind of routed MoE layer (:class:`ExpertChoice`); none for a
    model without."""
    choices = plan.expert_choices()
    if not choices:
        return []
    lines = ["", "Experts (routed MoE layers found from their grouped matmuls; each other placement is the best plan "
                 "with the layers' experts pinned so, solved again)"]
    for choice in choices:
        lines += [f"  {line}" for line in choice.lines()]
    return lines
