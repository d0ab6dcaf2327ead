"""The ILP that picks one strategy per node: :mod:`autotp.planning.solve.formulation` builds its choice rows and
prices each plan's seconds (compute, redistributions, gradient reductions); here are the memory
row and activation recompute, and the solve.

In the same notation (``r`` a representative node, ``m_r`` the nodes it stands for):

* **memory**: one row per phase of a step where the memory peaks, each ``≤ budget``: the
  backward's start, ``Σ_r m_r Σ_s start(r,s) x[r,s]`` (parameters, optimizer state, the activations
  the backward keeps, :mod:`autotp.planning.costs.saved`, and the first gradients: no parameter's
  gradient exists yet), and in training the optimizer's step, ``Σ_r m_r Σ_s step(r,s) x[r,s]``
  (parameters, optimizer state, every gradient, the step's temporaries; no activation). A peak is
  the larger of the two, and both at most the budget is the peak at most the budget. Added only
  when the optimum without them does not fit (that optimum, if it fits, is the optimum with them)
  and left out when even the largest choice of every node fits. A budget no plan fits is an error
  that states the least peak of any plan (a solve minimizing the larger row, with all layers but
  one recomputing and with none, each with the plan's time limit and solved again for longer where
  that stops it before it proves the least) plus the margin: the least budget a plan fits.
* **recompute** (training; :mod:`autotp.planning.costs.recompute`): per chain ``g`` of ``L`` tied layers, how many
  layers ``k_g`` recompute their activations (the first ``k_g``). With ``k_g`` fixed the problem
  stays linear and as tight as without: the objective adds ``k_g`` times the layer's forward
  seconds per root strategy and ``k_g`` times the forward part of each redistribution read inside
  the layer (on its product or shared-read variable); the backward's row takes ``k_g`` times the
  activations the layer need not keep (all but those read outside it) off, and adds one layer's
  activations back when every layer recomputes (that layer runs again while all others still hold
  their inputs). The counts are searched outside the ILP (:mod:`autotp.planning.costs.recompute_counts`): one exact solve
  per count, from the least that can fit the budget upwards. (A count as an integer variable with
  exact products ``v = k x`` left the LP bound 30% below the optimum on a 2-layer Llama, and the
  solve 20 times slower than without recompute.) Only when the budget binds: a plan that fits
  keeps every activation.

HiGHS (through ``highspy``) solves it; CBC is the fallback. A time limit returns the best plan
found, marked as not proven optimal. The same inputs always give the same plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import pulp

from autotp.placement import Strategy
from autotp.planning.costs.costing import CostModel
from autotp.planning.costs.recompute import Layer
from autotp.planning.costs.recompute_counts import all_but_one, candidates, freed_bytes, least_bytes, search
from autotp.planning.costs.saved import forward_liveness
from autotp.planning.errors import MemoryBudgetError
from autotp.planning.solve.formulation import OBJECTIVE_SCALE, Formulation
from autotp.planning.solve.ilp import MIP_GAP, SolverError, solve_with_first_solver
from autotp.tracing.graph import OpGraph
from autotp.units import format_bytes, format_bytes_pair

__all__ = ["solve", "Solution", "SolverError"]


@dataclass(frozen=True)
class Solution:
    """Chosen strategy index per node (all nodes, ties expanded) and how the solve went."""

    choice: Mapping[str, int]
    objective_s: float
    variables: int
    constraints: int
    seconds: float
    optimal: bool
    solver: str
    status: str
    representatives: int
    recompute: Mapping[int, int] = None  # type: ignore[assignment]  # chain index -> layers recomputed



FORWARD_STEPS = 8  # the forward's fullest steps an inference plan's memory row bounds
# The share of the budget a plan leaves free: the predicted peak is at most budget x (1 - margin).
# benchmarks/memory.py measures the prediction at 0.98-1.02 of the peak on CPU (docs/memory.md#figures),
# where the count is exact storage bytes; a CUDA caching allocator rounds each block up (to 512 B, large ones to
# 2 MiB) and its free pieces fragment, which that count does not see.
MEMORY_MARGIN = 0.05


class _Problem(Formulation):
    """The formulation with the memory row and a fixed count of recomputing layers per chain."""

    live_steps: list = []
    transient: dict = {}
    # rows that bound the memory row's epigraph variables (the backward's largest conversion, the
    # forward's fullest step): in the problem only with the memory row
    event_constraints: list = []
    scale = float(2**30)  # bytes per unit of the memory rows (set by memory() where they go in)
    time_limit_s = 60.0  # the solve's: each of below_budget's minimizing solves has it
    least_proven = True  # every minimizing solve so far proved its least (least_peak_bytes)

    def memory(self) -> None:
        self.event_constraints = []
        mem = {r: [0.0] * len(self.strategies[r]) for r in self.roots}
        step = {r: [0.0] * len(self.strategies[r]) for r in self.roots}
        transient = {r: [0.0] * len(self.strategies[r]) for r in self.roots}
        # the instances a representative stands for, by what the backward keeps of each: tied layers
        # compute alike, but the last one's output may be returned (its gradient arrives) and not
        # saved by a next layer, so each kind counts at its own figure
        kinds: dict[str, dict[tuple, list]] = {}
        for n in self.graph.nodes:
            r = self.rep[n.name]
            if r in self.fmap:
                kinds.setdefault(r, {}).setdefault(self.cost.memory_key(n), [n.name, 0])[1] += 1
        for r in self.reps:
            for name, count in kinds.get(r, {}).values():
                for s, mine in enumerate(self.fmap[r]):
                    parts = self.cost.node_memory(self.graph[name], self.strategies[r][mine])
                    mem[self.root[r]][s] += count * parts.backward_start_bytes
                    step[self.root[r]][s] += count * parts.optimizer_step_bytes
                    transient[self.root[r]][s] += count * parts.transient_bytes
        for root, row in self.copy_mem.items():  # gathered copies kept, where a node's choice decides them
            for s, b in enumerate(row):
                mem[root][s] += b
        self.mem, self.mem_step = mem, step
        live = self._forward_steps()  # inference: the outputs alive at the forward's fullest steps
        least_live = max((sum(min(row) for row in terms.values()) for terms in live), default=0.0)
        most_live = max((sum(max(row) for row in terms.values()) for terms in live), default=0.0)
        minimum = max(sum(min(v) for v in mem.values()) + least_live, sum(min(v) for v in step.values()))
        if self.budget is None:
            return
        if minimum > self.budget and self.chains:
            minimum = self.least_bytes(all_but_one(self.lengths))
        copies = sum(b for b, _ in self.copy_terms)  # at most: every redistribution's copy kept
        events = max((max(b for b, _ in row) for row in self.event_rows), default=0.0)
        if minimum <= self.budget and max(sum(max(v) for v in mem.values()) + copies + most_live + events,
                                          sum(max(v) for v in step.values())) <= self.budget:
            return  # every plan fits: the rows could never bind
        # in budgets: the row's bound is 1, so coefficients near it keep the LP well scaled at any size
        # (bytes would reach 1e11; GiB put a KiB model's row under the solver's 1e-7 tolerance)
        self.scale = max(self.budget, minimum, 1.0)  # the least solve of a budget error: the plan's size
        self.memory_terms = [m / self.scale * self.x[r][s] for r in self.roots for s, m in enumerate(mem[r]) if m]
        self.memory_terms += [b / self.scale * var for b, var in self.copy_terms]
        if self.event_rows:  # the backward's start: the loss's gradients, or a larger conversion's buffers
            more = self.var("backward_event", 0, None)
            self.n_vars += 1
            already = [b / self.scale * self.x[r][s] for r, row in transient.items() for s, b in enumerate(row) if b]
            # added with the memory row (fix_recompute): they only bound what it counts
            self.event_constraints += [
                (more >= pulp.lpSum(b / self.scale * var for b, var in row) - pulp.lpSum(already), f"backward_event_{i}")
                for i, row in enumerate(self.event_rows)]
            self.memory_terms.append(more)
        self.transient = transient
        if live:  # the forward's peak: at least each of its fullest steps
            peak = self.var("forward_peak", 0, None)
            self.n_vars += 1
            self.event_constraints += [
                (peak >= pulp.lpSum(b / self.scale * self.x[r][s] for r, row in terms.items() for s, b in enumerate(row) if b),
                 f"forward_step_{i}") for i, terms in enumerate(live)]
            self.memory_terms.append(peak)
        self.step_terms = [m / self.scale * self.x[r][s] for r in self.roots for s, m in enumerate(step[r]) if m]
        self.memory_needed = True
        if minimum > self.budget:  # below a bound every plan is above: say what the least plan needs
            raise self.below_budget(all_but_one(self.lengths) if self.chains else {})

    def below_budget(self, layers: Mapping[int, int], time_limit_s: Optional[float] = None) -> MemoryBudgetError:
        """The error for a budget no plan fits, stating the least peak a plan has (:meth:`least_peak_bytes`)
        with ``layers`` recomputing or with none, whichever is less, plus the margin: the least budget
        a plan fits, not only a bound below every plan. Each minimizing solve has the plan's own time
        limit (``time_limit_s``, default the solve's) and is solved to optimality where that allows:
        with 2 s, Jamba's stopped at a plan's peak half again above the least (a budget well under the
        figure it named planned). The problem is spent afterwards."""
        # recompute lowers the backward's start only where its activations lead, so try without too
        tries = [dict(layers)] + ([{}] if any(layers.values()) else [])
        limit_s = self.time_limit_s if time_limit_s is None else time_limit_s
        peaks = [(self.least_peak_bytes(counts, limit_s / len(tries)), counts) for counts in tries]
        lowest = min(p for p, _ in peaks)  # the fewest layers recomputing among the lowest (to solver precision)
        peak, layers = min(((p, c) for p, c in peaks if p <= lowest * (1 + 1e-6)), key=lambda pc: sum(pc[1].values()))
        least = peak / (1 - MEMORY_MARGIN)
        if math.isinf(least):
            return MemoryBudgetError(
                f"memory budget {format_bytes(self.budget / (1 - MEMORY_MARGIN))} per device is below "
                f"the minimum any plan needs on mesh {self.cost.mesh} in {self.cost.mode} mode, and the solver found "
                f"no plan to state that minimum from in its time; raise the budget or use more devices", math.inf)
        budget, needed = format_bytes_pair(self.budget / (1 - MEMORY_MARGIN), least)
        recomputing = " with layers recomputing their activations" if any(layers.values()) else ""
        unproven = ("" if self.least_proven else
                    f"; the solver did not prove it the least within {limit_s:.0f} s: a budget that plans, and a "
                    f"larger time_limit_s may find a smaller one")
        return MemoryBudgetError(
            f"memory budget {budget} per device is below the minimum any plan needs on mesh "
            f"{self.cost.mesh}: {needed} in {self.cost.mode} mode{recomputing} (with the {MEMORY_MARGIN:.0%} the "
            f"planner keeps free{unproven}); raise the budget to at least {math.ceil(least)} bytes"
            + (", use more devices, or plan in inference mode" if self.cost.train else " or use more devices"),
            math.ceil(least))

    def least_peak_bytes(self, layers: Mapping[int, int], time_limit_s: float = 30.0,
                         enough_bytes: float = -math.inf) -> float:
        """The least predicted peak of any plan with ``layers`` recomputing: one solve whose objective
        is the larger of the phases' rows (an epigraph variable), the budget rows left out. The
        problem is spent afterwards (its objective and rows replaced; the variables hold the plan
        found, its solver in ``least_solver``). A plan at or under ``enough_bytes`` ends the search
        before the least is proven."""
        self.fix_recompute(layers)
        for row in ("memory", "memory_step", "least_start", "least_step"):
            _drop_constraint(self.prob, row)
        self._least_solves = getattr(self, "_least_solves", 0) + 1
        peak = self.var(f"least_peak_{self._least_solves}", 0, None)
        self.prob += peak >= pulp.lpSum(self.memory_row), "least_start"
        if self.cost.train:
            self.prob += peak >= pulp.lpSum(self.step_terms), "least_step"
        self.prob.setObjective(peak)
        # a solve the time limit stops is solved again, longer: before any plan it says nothing, and
        # after one it states that plan's peak, a budget that plans but not the least. Where the longer
        # solve is stopped too, its plan's peak is stated (least_proven False), or with no plan at all
        # the least is not known (infinite), never 0
        found = math.inf
        for limit_s in (time_limit_s, max(30.0, 10 * time_limit_s)):
            self.least_solver = solve_with_first_solver(self.prob, limit_s, lambda prob: None)
            if peak.varValue is not None and self.prob.sol_status in (pulp.LpSolutionOptimal,
                                                                      pulp.LpSolutionIntegerFeasible):
                found = min(found, float(peak.varValue) * self.scale)
                if self.prob.sol_status == pulp.LpSolutionOptimal or found <= enough_bytes:
                    return found
        self.least_proven = False
        return found

    def _forward_steps(self) -> list[dict[str, list[float]]]:
        """In inference, the forward's fullest steps (:func:`autotp.planning.costs.saved.forward_liveness`;
        the :data:`FORWARD_STEPS` fullest with every tensor whole): per step, per root, the bytes
        its strategies leave alive then."""
        if self.cost.train:
            return []
        liveness = forward_liveness(self.graph)
        whole = {n.name: sum(o.nbytes for o in n.outputs) for n in self.graph.nodes}
        out = []
        for alive in liveness.largest(whole.__getitem__, FORWARD_STEPS):
            terms: dict[str, list[float]] = {}
            for name in alive:
                rep = self.rep[name]
                root = self.root[rep]
                row = terms.setdefault(root, [0.0] * len(self.strategies[root]))
                for s, mine in enumerate(self.fmap[rep]):
                    row[s] += self.cost.alive_bytes(self.graph[name], self.strategies[rep][mine])
            out.append(terms)
        self.live_steps = out
        return out

    # -- activation recompute ----------------------------------------------------------------------

    def _layer_parts(self, g: int) -> tuple[dict, dict, dict]:
        """Per root touched by chain ``g``'s first layer, per root strategy: the forward seconds of the
        layer's nodes, its activation bytes, and the bytes recompute frees (those not read outside)."""
        if g not in self._parts:
            self._parts[g] = self._layer_parts_uncached(g)
        return self._parts[g]

    def _layer_parts_uncached(self, g: int) -> tuple[dict, dict, dict]:
        layer = self.chains[g][0]
        fwd: dict[str, list[float]] = {}
        act: dict[str, list[float]] = {}
        saved: dict[str, list[float]] = {}
        for r in layer.nodes:
            root = self.root[r]
            for d in (fwd, act, saved):
                d.setdefault(root, [0.0] * len(self.strategies[root]))
            for s, mine in enumerate(self.fmap[r]):
                st = self.strategies[r][mine]
                a = self.cost.node_memory(self.graph[r], st).activations_bytes
                fwd[root][s] += self.cost.node_forward_s(self.graph[r], st)
                act[root][s] += a
                if r not in layer.outputs:
                    saved[root][s] += a
        for chain, r, cost_of in self.recompute_folded:
            if chain == g:
                root = self.root[r]
                for d in (fwd, act, saved):
                    d.setdefault(root, [0.0] * len(self.strategies[root]))
                for s, mine in enumerate(self.fmap[r]):
                    fwd[root][s] += cost_of(self.strategies[r][mine])
        return fwd, act, saved

    def fix_recompute(self, layers: Mapping[int, int]) -> None:
        """Make the problem the one where ``layers[g]`` layers of chain ``g`` recompute: with the count
        fixed, recompute is linear in the choices. The objective adds ``k_g fwd(r,s)`` to each root
        strategy (the layer's forward again) and ``k_g c_f`` to each redistribution read inside the
        layer (its forward part again); the memory row takes ``k_g saved(r,s)`` off (activations not
        read outside the layer) and, when every layer of the chain recomputes, adds ``act(r,s)`` back
        (one layer live again in its backward)."""
        objective = list(self.objective)
        memory = list(self.memory_terms)
        for g, k in layers.items():
            if not k:
                continue
            fwd, act, saved = self._layer_parts(g)
            for root in fwd:
                for s, x in enumerate(self.x[root]):
                    if fwd[root][s]:
                        objective.append(k * fwd[root][s] * x)
                    freed = freed_bytes(k, self.lengths[g], saved[root][s], act[root][s])
                    if freed:
                        memory.append(-freed / self.scale * x)
            for chain, y, seconds_of in self.recompute_products:
                if chain == g:
                    objective += [k * seconds_of()[pq] * var for pq, var in y.items() if seconds_of().get(pq)]
            for chain, var, seconds in self.recompute_edges:
                if chain == g and seconds():
                    objective.append(k * seconds() * var)
        self.prob.setObjective(pulp.lpSum(objective) * OBJECTIVE_SCALE)
        _drop_constraint(self.prob, "memory")
        _drop_constraint(self.prob, "memory_step")
        self.memory_row = memory
        if self.memory_needed:
            for row, row_name in self.event_constraints:  # once: the memory row is replaced, these stay
                self.prob += row, row_name
            self.event_constraints = []
            self.prob += pulp.lpSum(memory) <= self.budget / self.scale, "memory"
            if self.cost.train:  # the optimizer's step: recompute changes nothing there
                self.prob += pulp.lpSum(self.step_terms) <= self.budget / self.scale, "memory_step"
        self.layers = dict(layers)

    def forward_floor_s(self, g: int) -> float:
        """The least one more recomputed layer of chain ``g`` can cost: its forward at the cheapest strategies."""
        return sum(min(v) for v in self._layer_parts(g)[0].values())

    def least_bytes(self, counts: Mapping[int, int]) -> float:
        """The least memory any plan needs with ``counts`` (:func:`autotp.planning.costs.recompute_counts.least_bytes`
        at the backward's start; the optimizer's step needs at least its own least)."""
        return max(least_bytes(self.mem, {g: self._layer_parts(g) for g in self.chains}, self.lengths, counts),
                   sum(min(v) for v in self.mem_step.values()))

    def memory_bytes(self, choice_rep: Mapping[str, int], layers: Mapping[int, int]) -> float:
        """Bytes per device of a choice (root -> strategy index) with ``layers[g]`` layers of chain g
        recomputing."""
        total = sum(self.mem[r][s] for r, s in choice_rep.items())
        total += sum(b * (var.varValue or 0.0) for b, var in self.copy_terms)  # the solve's redistributions
        total += max((sum(row[choice_rep[r]] for r, row in terms.items()) for terms in self.live_steps), default=0.0)
        if self.event_rows:
            had = sum(row[choice_rep[r]] for r, row in self.transient.items())
            total += max(0.0, max(sum(b * (var.varValue or 0.0) for b, var in row) for row in self.event_rows) - had)
        for g, k in layers.items():
            _, act, saved = self._layer_parts(g)
            total -= sum(freed_bytes(k, self.lengths[g], saved[r][choice_rep[r]], act[r][choice_rep[r]])
                         for r in saved)
        return max(total, sum(self.mem_step[r][s] for r, s in choice_rep.items()))


def solve(graph: OpGraph, strategies: Mapping[str, Sequence[Strategy]], rep: Mapping[str, str], cost: CostModel,
          memory_budget_bytes: Optional[float] = None, time_limit_s: float = 60.0,
          chains: Sequence[Sequence[Layer]] = (), recompute: Optional[bool] = None) -> Solution:
    """Choose one strategy per node, and how many layers of each of ``chains`` recompute (``recompute``:
    None lets the solver choose when memory is short, True recomputes every layer, False none); see
    the module docstring for the formulation."""
    start = time.perf_counter()
    # the rows bound the predicted peak by the budget less the margin (MEMORY_MARGIN)
    limit = memory_budget_bytes * (1 - MEMORY_MARGIN) if memory_budget_bytes is not None else None
    f = _Problem(graph, strategies, rep, cost, limit,
                     chains if cost.train and recompute is not False else ())
    f.time_limit_s = time_limit_s
    f.one_hot()
    f.edges()
    f.working_memory()
    f.grad_reductions()
    # the objective's terms first: they bar the strategies no reader can take (x = 0), which the least
    # solve of a budget error (raised from memory()) must respect too, or it names a least no plan meets
    f.objective_terms()
    f.memory()
    if recompute and f.chains:  # every layer recomputes: fixed from the start
        f.fix_recompute({g: len(c) for g, c in f.chains.items()})
    # The memory row goes in only when the best plan without it does not fit: a plan that is optimal
    # without the row and fits is optimal with it, and the row (a knapsack over every choice) can only
    # make the search harder. (With the loose gradient rows of an earlier formulation it slowed 70B on
    # (8, 8) from 18 s to 25 s; with the tight ones it changes nothing measurable there, 1.4-1.6 s.)
    try:
        name, choice_rep = _run(f, time_limit_s, memory_budget_bytes)
    except MemoryBudgetError:  # every layer recomputing (recompute=True), and still no plan fits
        raise f.below_budget(f.layers) from None
    untried = 0  # recompute counts the time limit left unsolved
    result = (name, choice_rep, _objective_s(f), f.prob.sol_status == pulp.LpSolutionOptimal, dict(f.layers))
    if f.memory_needed and f.memory_bytes(choice_rep, f.layers) > f.budget:
        # the constrained solves get what is left, but never less than half the limit: a first solve
        # that ran long must not leave the real ones too little time to find any plan
        now = time.perf_counter()
        deadline = now + max(time_limit_s / 2, time_limit_s - (now - start))
        try:
            if recompute is None and f.chains:
                # the plan without a budget bounds every plan's time from below only if it was proven optimal
                result, untried = _with_recompute(f, deadline, memory_budget_bytes, result[2] if result[3] else 0.0)
            else:
                f.fix_recompute(f.layers)
                try:
                    name, choice_rep = _run(f, deadline - time.perf_counter(), memory_budget_bytes)
                except MemoryBudgetError:
                    raise f.below_budget(f.layers) from None
                result = (name, choice_rep, _objective_s(f), f.prob.sol_status == pulp.LpSolutionOptimal,
                          dict(f.layers))
        except SolverError:
            # no plan within the time limit: near the least budget the fastest plan is hard to find while
            # a plan that fits exists (the least a budget error names is one). The least-memory plan is
            # that plan: kept where it fits, the status says it is no fastest plan
            least = _least_memory_plan(f, time_limit_s)
            if least is None:
                raise
            result = least
    name, choice_rep, objective_s, optimal, layers = result
    spent_s = time.perf_counter() - start
    status = "optimal" if optimal else f"best found in {spent_s:.0f} s (not proven optimal)"
    if f.memory_needed and not optimal and name.endswith(LEAST_MEMORY):
        status = (f"the plan of least memory: the solver found no faster plan that fits the budget within "
                  f"{spent_s:.0f} s (a larger time_limit_s, CLI --time-limit, or a larger budget finds one)")
    if untried:
        status += (f" among the recompute counts solved; the time limit left {untried} more count"
                   f"{'s' if untried > 1 else ''} unsolved (a larger time_limit_s, CLI --time-limit, solves them)")
    return Solution(
        choice={n.name: f.fmap[rep[n.name]][choice_rep[f.root[rep[n.name]]]] for n in graph.nodes},
        objective_s=objective_s, variables=f.n_vars,
        constraints=f.prob.numConstraints(), seconds=spent_s, optimal=optimal,
        solver=name, status=status,
        representatives=len(f.roots), recompute=layers,
    )


LEAST_MEMORY = " (least memory)"  # the solver's name, marked, on a plan the least-memory solve chose


def _least_memory_plan(f: _Problem, time_limit_s: float) -> Optional[tuple]:
    """The plan of least peak memory where it fits the budget, as :func:`solve`'s result tuple (its
    step priced by the time objective, not proven optimal); None where none fits. The recompute counts
    tried are those :meth:`_Problem.below_budget` names the least from."""
    tries = [dict(f.layers), all_but_one(f.lengths), {}] if f.chains else [{}]
    for counts in [c for k, c in enumerate(tries) if c not in tries[:k]]:
        # within the solver's gap of the least: a solve that stops anywhere inside it (this one, or the
        # one that named the least) is the least to its precision; the margin kept free covers the gap
        within = f.budget * (1 + MIP_GAP)
        peak = f.least_peak_bytes(counts, time_limit_s, enough_bytes=within)
        if peak <= within and all(v.varValue is not None for v in f.x[f.roots[0]]):
            choice_rep = {r: max(range(len(xs)), key=lambda s: (xs[s].varValue or 0.0, -s)) for r, xs in f.x.items()}
            objective_s = float(pulp.value(pulp.lpSum(f.objective)) or 0.0)
            return f.least_solver + LEAST_MEMORY, choice_rep, objective_s, False, dict(counts)
    return None


def _drop_constraint(prob: pulp.LpProblem, name: str) -> None:
    """Remove a named row (PuLP 3.3 deprecates the dict view of ``constraints``; older ones only have it)."""
    store = getattr(prob, "_constraints", None)
    (store if isinstance(store, dict) else prob.constraints).pop(name, None)


def _objective_s(f: _Problem) -> float:
    return float(pulp.value(f.prob.objective) or 0.0) / OBJECTIVE_SCALE


def _with_recompute(f: _Problem, deadline: float, budget: Optional[float], unconstrained_s: float) -> tuple:
    """The best plan over recompute counts (:func:`autotp.planning.costs.recompute_counts.search`), one exact solve each,
    from the least count that can fit, and how many counts the deadline left unsolved. ``unconstrained_s`` plus the cheapest forward of the layers
    recomputed bounds a count's plan from below."""

    def solve_at(counts: Mapping[int, int]) -> tuple:
        f.fix_recompute(counts)
        name, choice_rep = _run(f, max(1.0, deadline - time.perf_counter()), budget)
        return name, choice_rep, _objective_s(f), f.prob.sol_status == pulp.LpSolutionOptimal, dict(counts)

    tries = candidates(f.lengths, lambda counts: f.least_bytes(counts) <= f.budget)
    best, failure, untried = search(tries, solve_at, lambda counts: unconstrained_s + sum(
        k * f.forward_floor_s(g) for g, k in counts.items()), deadline, (MemoryBudgetError, SolverError))
    if best is None:
        if isinstance(failure, SolverError):
            raise failure
        raise f.below_budget(all_but_one(f.lengths))
    return best, untried


def _run(f: _Problem, time_limit_s: float, memory_budget_bytes: Optional[float]) -> tuple[str, dict[str, int]]:
    """Solve the problem as it stands: (solver name, root -> strategy)."""

    def problem(prob: pulp.LpProblem) -> Optional[str]:
        status = pulp.LpStatus[prob.status]
        if status == "Infeasible" and not f.memory_needed:  # no memory row: the placements allowed conflict
            raise ValueError(
                f"no plan on mesh {f.cost.mesh} gives every pinned parameter its pinned placements: a pin "
                f"leaves some op no strategy that reads it, or conflicts with a read that an in-place write "
                f"needs as it is (a write through a view into a tensor read again later, autotp/tracing/aliasing.py); "
                f"change or drop pins")
        if status == "Infeasible":  # the caller says what would fit (_Problem.below_budget)
            raise MemoryBudgetError(
                f"no plan fits the memory budget {format_bytes(memory_budget_bytes or 0)} per device on mesh {f.cost.mesh}", 0.0)
        if status not in ("Optimal", "Not Solved") or any(v.varValue is None for v in f.x[f.roots[0]]):
            return f"status {status}"
        # stopped by the time limit before any plan: the variables read 0, which is no plan at all
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return f"no plan found within its time limit of {time_limit_s:.1f} s (raise time_limit_s)"
        return None

    name = solve_with_first_solver(f.prob, time_limit_s, problem)
    return name, {r: max(range(len(xs)), key=lambda s: (xs[s].varValue or 0.0, -s)) for r, xs in f.x.items()}
