"""The ILP that picks one strategy per node.

Formulation (all costs in seconds, memory in bytes; ``r`` ranges over representative nodes after
layer tying, ``m_r`` is how many nodes ``r`` stands for):

* **one_hot**: binary ``x[r,s]`` per strategy ``s`` of ``r``; ``Σ_s x[r,s] = 1``.
* **edges** (a value read by one node): for each group of graph edges ``u → v`` (input ``k``) sharing representatives, continuous
  ``y[e,p,q] ≥ 0`` over the producer's output placements ``p`` and the consumer's required input
  placements ``q``, tied to the choices by ``Σ_q y[e,p,q] = Σ_{s: out(s)=p} x[u,s]`` and
  ``Σ_p y[e,p,q] = Σ_{s: in_k(s)=q} x[v,s]``. With one-hot ``x`` the only solution is the product,
  so the linear cost ``Σ c(p,q) y[e,p,q]`` is the redistribution cost exactly. Pairs that cannot be
  converted (``S → P``) have ``y`` fixed to 0. Edges whose cost depends on one end only fold into
  that end's node cost.
* **shared reads** (a value read by several nodes, e.g. q, k and v reading one normalized input):
  readers that need the same placement share one redistribution, as at run time, so it is paid
  once: each reader ``c`` has its product variables ``y_c[p,κ]`` (as above, over the reader's
  requirements ``κ = (q, partial-gradient axes)``) and ``w[t,p,κ] ≥ y_c[p,κ]`` for every reader,
  with cost ``c(p,κ) w``.
* **grad_reductions**: for a tensor ``t`` that carries a gradient, a mesh axis ``a`` and a placement
  ``q`` it is read with, continuous ``z[t,a,q] ∈ [0,1]``: one backward all_reduce of the size ``q``
  holds (cost ``g[t,a,q]``) serves every read that needs it. A consumer ``c`` needs it when it
  reads ``t`` as ``q``, replicated on ``a``, while working on shards there (its gradient is partial
  on ``a``: the strategies ``B(c,a,q)``) and ``t``'s output is not split on ``a``. Where the edge
  ``t → c`` has product variables, ``z[t,a,q] ≥ Σ y_c[p,κ]`` over the pairs with ``p[a]`` not a
  shard and ``κ = (q, A)``, ``a ∈ A``: the joint of the two conditions. Where the edge has none (it
  costs nothing, or depends on one end only and was folded into it, or the reader is a view merged
  into ``t``, or its ``y`` were built for a tensor without gradient and so lack the axes ``A``) ``z ≥ Σ_{s ∈ B(c,a,q)} x[c,s] − Σ_{s' ∈ S_a(t)} x[t,s']``, with ``S_a(t)`` the
  strategies of ``t`` whose output is split on ``a``. Both rows have the same integer points; the
  first keeps the LP relaxation tight (the second, used everywhere, left the 70B shape's root bound
  23% below its optimum). When ``t`` is split on ``a`` the read gathers, and the gather's backward
  reduce-scatters the partial gradient instead: the edges price that, keyed by the consumer's
  placement and its partial-gradient axes ``(q, A)`` rather than by ``q`` alone.
* **memory**: ``Σ_r m_r Σ_s mem(r,s) x[r,s] ≤ budget`` (parameters, gradients, optimizer state,
  activations kept for backward), added only when the optimum without it does not fit (that
  optimum, if it fits, is the optimum with it) and left out when even the largest choice of every
  node fits.
* **objective**: ``Σ_r m_r Σ_s compute(r,s) x[r,s] + Σ_e Σ c(p,q) y + Σ g z``; ``compute(r,s)``
  also holds, once per member of r's tie group, the additions of that member's output gradients
  (``OpGraph.gradient_reads``: the last block's output is read less often than the others').

HiGHS (through ``highspy``) solves it; CBC is the fallback. A time limit returns the best plan
found, marked as not proven optimal. The same inputs always give the same plan.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import pulp

from autotp.costing import INFEASIBLE_S, CostModel
from autotp.graph import OpGraph
from autotp.ilp import SolverError, solve_with_first_solver
from autotp.placement import Placement, Strategy
from autotp.redistribute import fused_axes
from autotp.units import format_bytes, format_bytes_pair

__all__ = ["solve", "Solution", "MemoryBudgetError", "SolverError"]


OBJECTIVE_SCALE = 1e3  # the objective is handed to the solver in milliseconds


class MemoryBudgetError(ValueError):
    """No plan fits the memory budget; the message states the minimum any plan needs."""

    def __init__(self, message: str, minimum_bytes: float) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


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


class _Formulation:
    def __init__(self, graph: OpGraph, strategies: Mapping[str, Sequence[Strategy]], rep: Mapping[str, str],
                 cost: CostModel, memory_budget_bytes: Optional[float]) -> None:
        self.graph, self.strategies, self.rep, self.cost = graph, strategies, rep, cost
        self.budget = memory_budget_bytes
        self.prob = pulp.LpProblem("autotp", pulp.LpMinimize)
        self.reps = [n.name for n in graph.nodes if rep[n.name] == n.name]
        self.mult: dict[str, int] = defaultdict(int)
        for n in graph.nodes:
            self.mult[rep[n.name]] += 1
        self.root, self.fmap, self.parent = self._merge_followers()
        self.roots = [r for r in self.reps if self.root[r] == r]
        self.node_cost: dict[str, list[float]] = {r: [0.0] * len(strategies[r]) for r in self.roots}
        self.objective: list = []
        self.x: dict[str, list[pulp.LpVariable]] = {}
        self.n_vars = 0
        self.mem: dict[str, list[float]] = {}
        self.memory_row: Optional[pulp.LpConstraint] = None  # added only if a plan without it does not fit
        # product variables of each edge that has them, keyed (producer rep, reader rep, input index),
        # when they were built with the readers' partial-gradient axes (a tensor that carries a gradient)
        self.products: dict[tuple[str, str, int], dict[tuple, pulp.LpVariable]] = {}

    def var(self, name: str, low: float, up: Optional[float], cat: str = pulp.LpContinuous) -> pulp.LpVariable:
        """A new variable of the problem (PuLP 3.3+ attaches variables to their problem)."""
        if hasattr(self.prob, "add_variable"):
            return self.prob.add_variable(name, low, up, cat=cat)
        return pulp.LpVariable(name, low, up, cat=cat)

    # -- following ops -------------------------------------------------------------------------

    def _merge_followers(self) -> tuple[dict[str, str], dict[str, list[int]], dict[str, str]]:
        """Merge a view (or no-op cast) into its input when it can follow every placement the input
        takes and nothing else reads that input: choosing the producer then fixes the view, and any
        redistribution the view's readers need can happen after it, on as many bytes. No option is lost.

        Returns, per representative, its group root, the map from the root's strategy index to its
        own, and (for merged ones) the representative it follows.
        """
        root = {r: r for r in self.reps}
        fmap = {r: list(range(len(self.strategies[r]))) for r in self.reps}
        parent: dict[str, str] = {}
        instances: dict[str, list[str]] = defaultdict(list)
        for n in self.graph.nodes:
            instances[self.rep[n.name]].append(n.name)
        outputs = set(self.graph.outputs)
        for r in self.reps:
            node = self.graph[r]
            if not _is_follower(node):
                continue
            u = self.rep[node.inputs[0]]
            if any(self.rep[self.graph[i].inputs[0]] != u or self.graph.consumers(self.graph[i].inputs[0]) != (i,)
                   or self.graph[i].inputs[0] in outputs for i in instances[r]):
                continue
            by_input: dict[tuple, list[int]] = defaultdict(list)
            for idx, st in enumerate(self.strategies[r]):
                by_input[st.inputs[0]].append(idx)
            mine = []
            for s_root in range(len(self.strategies[root[u]])):
                match = by_input.get(self.strategies[u][fmap[u][s_root]].output, [])
                if len(match) != 1:
                    break
                mine.append(match[0])
            else:
                root[r], fmap[r], parent[r] = root[u], mine, u
        return root, fmap, parent

    def x_of(self, r: str, idxs) -> pulp.LpAffineExpression:
        """Σ x over the root strategies under which representative ``r`` takes one of ``idxs``."""
        wanted = set(idxs)
        return pulp.lpSum(self.x[self.root[r]][s] for s, mine in enumerate(self.fmap[r]) if mine in wanted)

    def add_cost(self, r: str, cost_of) -> None:
        """Add ``cost_of(strategy of r)`` to the cost of each strategy of r's root."""
        root = self.root[r]
        for s, mine in enumerate(self.fmap[r]):
            self.node_cost[root][s] += cost_of(self.strategies[r][mine])

    # -- constraint groups ---------------------------------------------------------------------

    def one_hot(self) -> None:
        for i, r in enumerate(self.roots):
            xs = [self.var(f"x{i}_{s}", 0, 1, pulp.LpBinary) for s in range(len(self.strategies[r]))]
            self.x[r] = xs
            self.n_vars += len(xs)
            self.prob += pulp.lpSum(xs) == 1, f"one_hot_{i}"
        for r in self.reps:  # tied nodes are identical: price the representative once, times its count
            node, m = self.graph[r], self.mult[r]
            self.add_cost(r, lambda st, node=node, m=m: m * self.cost.node_compute_s(node, st))
        # ... but not how often their outputs are read: the last block's output feeds the final norm
        # alone, the others' the next block's norm and residual too; each adds its own gradients
        for n in self.graph.nodes:
            reads = self.graph.gradient_reads(n.name)
            if reads > 1:
                self.add_cost(self.rep[n.name], lambda st, n=n, reads=reads: self.cost.gradient_sums_s(n, st, reads))
        # graph outputs are returned replicated (plain tensors, as the original model returns them)
        for o in self.graph.outputs:
            node = self.graph[o]
            self.add_cost(self.rep[o], lambda st, node=node: self.cost.edge_s(
                node.outputs[0], st.output, (_R,) * len(st.output), node.requires_grad))

    def edges(self) -> None:
        """Redistribution costs, grouped by the value read (a producer, or one item of a multi-output op)."""
        values: dict[tuple, dict[str, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
        for v in self.graph.nodes:
            for k, u in enumerate(v.inputs):
                if self.parent.get(self.rep[v.name]) == self.rep[u]:
                    continue  # a merged view follows its input: nothing moves
                if v.target == "getitem":  # each item is its own value
                    values[(self.rep[u], self.rep[v.name])][f"{u}[{v.name}]"].append((v.name, k))
                else:
                    values[(self.rep[u],)][u].append((v.name, k))
        for e, (vkey, instances) in enumerate(sorted(values.items())):
            if any(len(readers) > 1 for readers in instances.values()):
                self._shared_value(e, vkey[0], instances)
            else:
                self._single_reader(e, vkey[0], instances)

    def _single_reader(self, e: int, ru: str, instances: Mapping[str, list[tuple[str, int]]]) -> None:
        """Each instance has one reader: the exact product formulation (tight LP relaxation)."""
        groups: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
        for u, readers in instances.items():
            v, k = readers[0]
            groups[(self.rep[v], k)].append((u.split("[")[0], v))
        for g, ((rv, k), pairs) in enumerate(sorted(groups.items())):
            su, sv = self.strategies[ru], self.strategies[rv]
            grad = self.cost.train and self.graph[pairs[0][0]].requires_grad
            need = [self._requirement(st, k, grad) for st in sv]
            outs = sorted({s.output for s in su})
            ins = sorted(set(need), key=_key_order)
            c: dict[tuple, float] = defaultdict(float)
            for info, count in Counter(self.graph[v].input_infos[k] for _, v in pairs).items():
                for p in outs:
                    for q, axes in ins:
                        c[(p, (q, axes))] += count * self.cost.edge_s(info, p, q, grad, axes)
            if all(val == 0.0 for val in c.values()):
                continue
            if len(outs) == 1 or len(ins) == 1:  # the cost depends on one end only: fold it in
                if len(ins) == 1:
                    self.add_cost(ru, lambda st: c[(st.output, ins[0])])
                else:
                    self.add_cost(rv, lambda st: c[(outs[0], self._requirement(st, k, grad))])
                continue
            y = self._product(f"{e}_{g}", ru, outs, rv, need, ins, c)
            if grad:
                self.products[(ru, rv, k)] = y
            for pq, var in y.items():
                if c[pq] not in (0.0, INFEASIBLE_S):
                    self.objective.append(c[pq] * var)

    def _shared_value(self, e: int, ru: str, instances: Mapping[str, list[tuple[str, int]]]) -> None:
        """Several readers: readers that need the same thing share one redistribution, paid once.

        Each reader ``c`` gets the exact product variables ``y_c[p,κ]`` of the single-reader case, and
        ``w[p,ρ] ≥ y_c[p,κ]`` for every reader pays the redistribution ``ρ`` that ``κ`` needs from
        ``p`` once. Two requirements that differ only in partial-gradient axes where no gather
        runs need the same redistribution (:func:`_redistribution`), as the program shares it.
        """
        su = self.strategies[ru]
        outs = sorted({s.output for s in su})
        c: dict[tuple, float] = defaultdict(float)  # per (p, requirement): what that pair costs
        shared: dict[tuple, float] = defaultdict(float)  # per (p, redistribution): what it costs once
        readers_rep: set[tuple[str, int]] = set()
        keys: set[tuple] = set()
        alike: Counter = Counter()  # instances with the same tensor, grad flag and readers cost the same
        for u, readers in instances.items():
            name = u.split("[")[0]
            grad = self.cost.train and self.graph[name].requires_grad
            info = self.graph[readers[0][0]].input_infos[readers[0][1]]
            alike[(info, grad, tuple(sorted((self.rep[v], k) for v, k in readers)))] += 1
        for (info, grad, reps_read), count in alike.items():
            mine: set[tuple] = set()
            for rv, k in reps_read:
                readers_rep.add((rv, k))
                mine.update(self._requirement(st, k, grad) for st in self.strategies[rv])
            for q, axes in mine:
                for p in outs:
                    c[(p, (q, axes))] += count * self.cost.edge_s(info, p, q, grad, axes)
            for p, once in {_redistribution(p, kk) for kk in mine for p in outs}:
                shared[(p, once)] += count * self.cost.edge_s(info, p, once[0], grad, once[1])
            keys |= mine
        if not any(c[(p, kk)] for kk in keys for p in outs):
            return
        ordered = sorted({_redistribution(p, kk)[1] for kk in keys for p in outs}, key=_key_order)
        pay: dict[tuple, pulp.LpVariable] = {}
        for i, p in enumerate(outs):
            for j, once in enumerate(ordered):
                if shared[(p, once)] not in (0.0, INFEASIBLE_S):
                    pay[(p, once)] = self.var(f"w{e}_{i}_{j}", 0, 1)
                    self.objective.append(shared[(p, once)] * pay[(p, once)])
        self.n_vars += len(pay)
        grad = self.cost.train and any(self.graph[u.split("[")[0]].requires_grad for u in instances)
        for r, (rv, k) in enumerate(sorted(readers_rep)):
            need = [self._requirement(st, k, grad) for st in self.strategies[rv]]
            y = self._product(f"{e}_r{r}", ru, outs, rv, need, sorted(set(need), key=_key_order), c)
            if grad:
                self.products[(ru, rv, k)] = y
            for n, ((p, kk), var) in enumerate(y.items()):
                once = _redistribution(p, kk)
                if once in pay:
                    self.prob += pay[once] >= var, f"pay_{e}_{r}_{n}"

    def _product(self, tag: str, ru: str, outs: list, rv: str, need: list, ins: list,
                 c: Mapping[tuple, float]) -> dict[tuple, pulp.LpVariable]:
        """Variables y[p,κ] equal to (producer outputs p) × (reader needs κ), by their two marginals.

        With one-hot choices the marginals leave exactly one y at 1: the pair that was chosen. Pairs
        that cannot be converted are fixed at 0.
        """
        su = self.strategies[ru]
        y = {}
        for i, p in enumerate(outs):
            for j, kk in enumerate(ins):
                infeasible = c.get((p, kk), 0.0) == INFEASIBLE_S
                y[(p, kk)] = self.var(f"y{tag}_{i}_{j}", 0, 0 if infeasible else 1)
        self.n_vars += len(y)
        for i, p in enumerate(outs):
            self.prob += (pulp.lpSum(y[(p, kk)] for kk in ins)
                          == self.x_of(ru, (s for s, st in enumerate(su) if st.output == p))), f"out_{tag}_{i}"
        for j, kk in enumerate(ins):
            self.prob += (pulp.lpSum(y[(p, kk)] for p in outs)
                          == self.x_of(rv, (s for s in range(len(need)) if need[s] == kk))), f"in_{tag}_{j}"
        return y

    def _requirement(self, st: Strategy, k: int, grad: bool) -> tuple:
        """What a consumer strategy asks of input ``k``: its placements and its partial-gradient axes."""
        q = st.inputs[k]
        if not grad or q is None:
            return (q, ())
        return (q, tuple(a for a in range(self.cost.mesh.ndim) if q[a].is_replicate and st.sharded_on(a)))

    def grad_reductions(self) -> None:
        """One z per (tensor, axis, placement read): reads with the same placement share one reduction,
        priced at the size that placement holds on the other axes.

        Where the edge has product variables, the row bounds ``z`` by the joint ``y`` (the reader needs
        the reduction *and* the tensor is not split on the axis), not by the difference of the two
        marginals (see the module docstring).
        """
        if not self.cost.train:
            return
        cost: dict[tuple, float] = defaultdict(float)
        bad: dict[tuple, set[tuple[str, int, tuple[int, ...]]]] = defaultdict(set)
        for t in self.graph.nodes:
            if not t.requires_grad:
                continue
            rt = self.rep[t.name]
            counted: set[tuple] = set()
            for cname in self.graph.consumers(t.name):
                rc = self.rep[cname]
                c = self.graph[cname]
                for k, src in enumerate(c.inputs):
                    if src != t.name:
                        continue
                    for a in range(self.cost.mesh.ndim):
                        by_q: dict[tuple, list[int]] = defaultdict(list)
                        for s, st in enumerate(self.strategies[rc]):
                            q = st.inputs[k]
                            if q is not None and q[a].is_replicate and st.sharded_on(a):
                                by_q[q].append(s)
                        for q, idx in by_q.items():
                            key = (rt, a, q)
                            bad[key].add((rc, k, tuple(idx)))
                            if (t.name, a, q) not in counted:  # once per tensor instance, not per reader
                                counted.add((t.name, a, q))
                                cost[key] += self.cost.grad_reduce_s(t.outputs[0], q, a)
        for i, key in enumerate(sorted(bad)):
            rt, a, q = key
            z = self.var(f"z{i}", 0, 1)
            self.n_vars += 1
            self.objective.append(cost[key] * z)
            split = self.x_of(rt, (s for s, st in enumerate(self.strategies[rt]) if st.output[a].is_shard))
            for j, (rc, k, idx) in enumerate(sorted(bad[key])):
                y = self.products.get((rt, rc, k))
                if y is None:
                    self.prob += z >= self.x_of(rc, idx) - split, f"grad_{i}_{j}"
                else:
                    self.prob += z >= pulp.lpSum(var for (p, (qq, axes)), var in y.items()
                                                 if qq == q and a in axes and not p[a].is_shard), f"grad_{i}_{j}"

    def memory(self) -> None:
        mem = {r: [0.0] * len(self.strategies[r]) for r in self.roots}
        for r in self.reps:
            for s, mine in enumerate(self.fmap[r]):
                mem[self.root[r]][s] += self.mult[r] * self.cost.node_memory(
                    self.graph[r], self.strategies[r][mine]).total_bytes
        self.mem = mem
        minimum = sum(min(v) for v in mem.values())
        if self.budget is None:
            return
        if minimum > self.budget:
            budget, needed = format_bytes_pair(self.budget, minimum)
            raise MemoryBudgetError(
                f"memory budget {budget} per device is below the minimum any plan needs on mesh "
                f"{self.cost.mesh}: {needed} in {self.cost.mode} mode; raise the budget to at least "
                f"{minimum:.0f} bytes, use more devices, or plan in inference mode", minimum)
        if sum(max(v) for v in mem.values()) <= self.budget:
            return  # every plan fits: the row could never bind
        # in GiB: coefficients near 1 keep the LP well scaled (bytes would reach 1e11)
        terms = [m / 2**30 * self.x[r][s] for r in self.roots for s, m in enumerate(mem[r]) if m]
        self.memory_row = pulp.lpSum(terms) <= self.budget / 2**30

    def memory_bytes(self, choice_rep: Mapping[str, int]) -> float:
        """Bytes per device of a choice (root -> strategy index)."""
        return sum(self.mem[r][s] for r, s in choice_rep.items())

    def objective_terms(self) -> None:
        for r in self.roots:
            for s, c in enumerate(self.node_cost[r]):
                if c == INFEASIBLE_S:  # e.g. a placement its only reader cannot be given
                    self.prob += self.x[r][s] == 0, f"infeasible_{r}_{s}"
                elif c:
                    self.objective.append(c * self.x[r][s])  # c already sums the tied and merged nodes
        # in milliseconds: step costs span 1e-6..1 s, and the solver's tolerances are absolute
        self.prob += pulp.lpSum(self.objective) * OBJECTIVE_SCALE


_R = Placement("R")
_NOOP_TARGETS = {"aten.alias.default", "aten.detach.default", "aten.clone.default", "aten.contiguous.default",
                 "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy.default"}


def _is_follower(node) -> bool:
    """A view, or an op that returns its input unchanged (a cast to the same dtype, a copy)."""
    if node.is_placeholder or len(node.inputs) != 1 or node.target == "getitem" or len(node.outputs) != 1:
        return False
    if node.is_view:
        return True
    return node.target in _NOOP_TARGETS and node.input_infos[0] == node.output


def _redistribution(p: tuple, requirement: tuple) -> tuple:
    """``(p, (q, fused))``: the redistribution from ``p`` that a read needing ``(q, grad_axes)``
    runs. Its steps depend on the gradient axes only where a gather absorbs the reduction
    (:func:`autotp.redistribute.fused_axes`); the program shares reads with the same one."""
    q, axes = requirement
    if q is None:
        return p, requirement
    return p, (q, fused_axes(p, q, axes))


def _key_order(kk: tuple) -> tuple:
    q, axes = kk
    return (q is None, q or (), axes)


def solve(graph: OpGraph, strategies: Mapping[str, Sequence[Strategy]], rep: Mapping[str, str], cost: CostModel,
          memory_budget_bytes: Optional[float] = None, time_limit_s: float = 60.0) -> Solution:
    """Choose one strategy per node; see the module docstring for the formulation."""
    start = time.perf_counter()
    f = _Formulation(graph, strategies, rep, cost, memory_budget_bytes)
    f.one_hot()
    f.edges()
    f.grad_reductions()
    f.memory()
    f.objective_terms()
    # The memory row goes in only when the best plan without it does not fit: a plan that is optimal
    # without the row and fits is optimal with it, and the row (a knapsack over every choice) can only
    # make the search harder. (With the loose gradient rows of an earlier formulation it slowed 70B on
    # (8, 8) from 18 s to 25 s; with the tight ones it changes nothing measurable there, 1.4-1.6 s.)
    name, choice_rep = _run(f, time_limit_s, memory_budget_bytes)
    if f.memory_row is not None and f.memory_bytes(choice_rep) > f.budget:
        f.prob += f.memory_row, "memory"
        # the constrained solve gets what is left, but never less than half the limit: a first solve
        # that ran long must not leave the real one too little time to find any plan
        left_s = max(time_limit_s / 2, time_limit_s - (time.perf_counter() - start))
        name, choice_rep = _run(f, left_s, memory_budget_bytes)
    optimal = f.prob.sol_status == pulp.LpSolutionOptimal
    spent_s = time.perf_counter() - start
    return Solution(
        choice={n.name: f.fmap[rep[n.name]][choice_rep[f.root[rep[n.name]]]] for n in graph.nodes},
        objective_s=float(pulp.value(f.prob.objective) or 0.0) / OBJECTIVE_SCALE, variables=f.n_vars,
        constraints=f.prob.numConstraints(), seconds=spent_s, optimal=optimal,
        solver=name, status="optimal" if optimal else f"best found in {spent_s:.0f} s (not proven optimal)",
        representatives=len(f.roots),
    )


def _run(f: _Formulation, time_limit_s: float, memory_budget_bytes: Optional[float]) -> tuple[str, dict[str, int]]:
    """Solve the problem as it stands: (solver name, root -> strategy)."""

    def problem(prob: pulp.LpProblem) -> Optional[str]:
        status = pulp.LpStatus[prob.status]
        if status == "Infeasible":
            raise MemoryBudgetError(
                f"no plan fits the memory budget {format_bytes(memory_budget_bytes or 0)} per device on mesh {f.cost.mesh}", 0.0)
        if status not in ("Optimal", "Not Solved") or any(v.varValue is None for v in f.x[f.roots[0]]):
            return f"status {status}"
        return None

    name = solve_with_first_solver(f.prob, time_limit_s, problem)
    return name, {r: max(range(len(xs)), key=lambda s: (xs[s].varValue or 0.0, -s)) for r, xs in f.x.items()}
