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
  reads ``t`` as ``q``, replicated on ``a``, while working on shards there or while its own output's
  gradient is partial there (``Rg``; either way the gradient it returns is partial on ``a``: the
  strategies ``B(c,a,q)``) and ``t``'s output is neither split on ``a`` nor ``Rg`` there (an ``Rg``
  producer passes the partial gradient on, and the reads of its own inputs need the reduction
  instead; an edge from ``Rg`` to a reader that returns a whole gradient is infeasible). Where the edge
  ``t → c`` has product variables, ``z[t,a,q] ≥ Σ y_c[p,κ]`` over the pairs with ``p[a]`` neither a
  shard nor ``Rg`` and ``κ = (q, A)``, ``a ∈ A``: the joint of the two conditions. Where the edge has none (it
  costs nothing, or depends on one end only and was folded into it, or the reader is a view merged
  into ``t``, or its ``y`` were built for a tensor without gradient and so lack the axes ``A``) ``z ≥ Σ_{s ∈ B(c,a,q)} x[c,s] − Σ_{s' ∈ S_a(t)} x[t,s']``, with ``S_a(t)`` the
  strategies of ``t`` whose output is split on ``a`` or ``Rg`` there. Both rows have the same integer points; the
  first keeps the LP relaxation tight (the second, used everywhere, left the 70B shape's root bound
  23% below its optimum). When ``t`` is split on ``a`` the read gathers, and the gather's backward
  reduce-scatters the partial gradient instead: the edges price that, keyed by the consumer's
  placement and its partial-gradient axes ``(q, A)`` rather than by ``q`` alone.
* **memory**: ``Σ_r m_r Σ_s mem(r,s) x[r,s] ≤ budget`` (parameters, gradients, optimizer state,
  activations kept for backward), added only when the optimum without it does not fit (that
  optimum, if it fits, is the optimum with it) and left out when even the largest choice of every
  node fits.
* **recompute** (training; :mod:`autotp.recompute`): per chain ``g`` of ``L`` tied layers, how many
  layers ``k_g`` recompute their activations (the first ``k_g``). With ``k_g`` fixed the problem
  stays linear and as tight as without: the objective adds ``k_g`` times the layer's forward
  seconds per root strategy and ``k_g`` times the forward part of each redistribution read inside
  the layer (on its product or shared-read variable); the memory row takes ``k_g`` times the
  activations the layer need not keep (all but those read outside it) off, and adds one layer's
  activations back when every layer recomputes (that layer runs again while all others still hold
  their inputs). The counts are searched outside the ILP (:mod:`autotp.recompute_counts`): one exact solve
  per count, from the least that can fit the budget upwards. (A count as an integer variable with
  exact products ``v = k x`` left the LP bound 30% below the optimum on a 2-layer Llama, and the
  solve 20 times slower than without recompute.) Only when the budget binds: a plan that fits
  keeps every activation.
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
from typing import Any, Mapping, Optional, Sequence

import pulp

from autotp.costing import INFEASIBLE_S, CostModel
from autotp.graph import OpGraph
from autotp.ilp import SolverError, solve_with_first_solver
from autotp.followers import merge_followers
from autotp.placement import Placement, Strategy, plain
from autotp.recompute import Layer
from autotp.recompute_counts import all_but_one, candidates, freed_bytes, least_bytes, search
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
    recompute: Mapping[int, int] = None  # type: ignore[assignment]  # chain index -> layers recomputed


class _Formulation:
    def __init__(self, graph: OpGraph, strategies: Mapping[str, Sequence[Strategy]], rep: Mapping[str, str],
                 cost: CostModel, memory_budget_bytes: Optional[float],
                 chains: Sequence[Sequence[Layer]] = ()) -> None:
        self.graph, self.strategies, self.rep, self.cost = graph, strategies, rep, cost
        self.layers: dict[int, int] = {}  # layers of chain g that recompute in the problem as it stands
        self._parts: dict[int, tuple[dict, dict, dict]] = {}
        # the forward part of redistributions read inside a chain's layer: (chain, variable, seconds per layer)
        # and, where the cost folded into one node, (chain, node, strategy -> seconds per layer)
        self.recompute_edges: list[tuple[int, Any, Any]] = []  # (seconds per layer: a _Lazy)
        self.recompute_folded: list[tuple[int, str, Any]] = []
        # ... and where it has product variables (exactly one of them is 1): (chain, y, seconds per pair)
        self.recompute_products: list[tuple[int, Mapping[tuple, Any], Any]] = []
        self.budget = memory_budget_bytes
        self.prob = pulp.LpProblem("autotp", pulp.LpMinimize)
        self.reps = [n.name for n in graph.nodes if rep[n.name] == n.name]
        self.mult: dict[str, int] = defaultdict(int)
        for n in graph.nodes:
            self.mult[rep[n.name]] += 1
        # chains of tied layers that may recompute (each node of a chain's first layer stands for one node
        # per layer), and which chain each node of a first layer is in
        self.chains = {g: c for g, c in enumerate(chains)
                       if all(rep[n] == n and self.mult[n] == len(c) for n in c[0].nodes)}
        self.chain_of = {n: g for g, c in self.chains.items() for n in c[0].nodes}
        self.lengths = {g: len(c) for g, c in self.chains.items()}
        self.root, self.fmap, self.parent = merge_followers(graph, strategies, rep, self.reps)
        self.roots = [r for r in self.reps if self.root[r] == r]
        self.node_cost: dict[str, list[float]] = {r: [0.0] * len(strategies[r]) for r in self.roots}
        self.objective: list = []
        self.x: dict[str, list[pulp.LpVariable]] = {}
        self.n_vars = 0
        self.mem: dict[str, list[float]] = {}
        self.memory_terms: list = []  # the memory row's terms, in GiB; added only if a plan without it does not fit
        self.memory_needed = False
        # product variables of each edge that has them, keyed (producer rep, reader rep, input index),
        # when they were built with the readers' partial-gradient axes (a tensor that carries a gradient)
        self.products: dict[tuple[str, str, int], dict[tuple, pulp.LpVariable]] = {}

    def var(self, name: str, low: float, up: Optional[float], cat: str = pulp.LpContinuous) -> pulp.LpVariable:
        """A new variable of the problem (PuLP 3.3+ attaches variables to their problem)."""
        if hasattr(self.prob, "add_variable"):
            return self.prob.add_variable(name, low, up, cat=cat)
        return pulp.LpVariable(name, low, up, cat=cat)

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
            chain = self.chain_of.get(rv)
            # the forward part, per layer of the reader's chain: priced only if recompute is tried
            fwd = _Lazy(lambda pairs=pairs, k=k, outs=outs, ins=ins, chain=chain: self._forward_parts(
                Counter(self.graph[v].input_infos[k] for _, v in pairs), outs, ins, len(self.chains[chain])))
            if len(outs) == 1 or len(ins) == 1:  # the cost depends on one end only: fold it in
                if len(ins) == 1:
                    self.add_cost(ru, lambda st: c[(st.output, ins[0])])
                    if chain is not None:
                        self.recompute_folded.append((chain, ru, lambda st, fwd=fwd, i=ins[0]: fwd()[(st.output, i)]))
                else:
                    self.add_cost(rv, lambda st: c[(outs[0], self._requirement(st, k, grad))])
                    if chain is not None:
                        self.recompute_folded.append((chain, rv, lambda st, fwd=fwd, o=outs[0], k=k, grad=grad:
                                                      fwd()[(o, self._requirement(st, k, grad))]))
                continue
            y = self._product(f"{e}_{g}", ru, outs, rv, need, ins, c)
            if grad:
                self.products[(ru, rv, k)] = y
            for pq, var in y.items():
                if c[pq] not in (0.0, INFEASIBLE_S):
                    self.objective.append(c[pq] * var)
            if chain is not None:
                self.recompute_products.append((chain, y, fwd))

    def _forward_parts(self, infos: Counter, outs: list, ins: list, per_layer: int) -> dict[tuple, float]:
        """Forward seconds per (output placement, requirement) of reads of ``infos``, per layer."""
        fwd: dict[tuple, float] = defaultdict(float)
        for info, count in infos.items():
            for p in outs:
                for q, axes in ins:
                    fwd[(p, (q, axes))] += count * self.cost.edge_forward_s(info, p, q, axes) / per_layer
        return fwd

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
        forward_of: dict[tuple, list] = defaultdict(list)  # ... and what its forward part is priced on
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
                # the steps from the value as it is (Rg is R): which readers may read an Rg at all,
                # the readers' own product variables say (c above)
                shared[(p, once)] += count * self.cost.edge_s(info, plain(p), once[0], grad, once[1])
                forward_of[(p, once)].append((count, info))
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
        chains = {self.chain_of.get(rv) for rv, _ in readers_rep}
        if len(chains) == 1 and None not in chains:  # every reader inside one chain's layers
            chain = chains.pop()
            for key, var in pay.items():
                p, (q, axes) = key
                self.recompute_edges.append((chain, var, _Lazy(lambda p=p, q=q, axes=axes, uses=forward_of[key]: sum(
                    n * self.cost.edge_forward_s(info, p, q, axes) for n, info in uses) / len(self.chains[chain]))))
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
        return (q, tuple(a for a in range(self.cost.mesh.ndim) if q[a].is_replicate and st.partial_grads_on(a)))

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
                            if q is not None and q[a].is_replicate and st.partial_grads_on(a):
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
            # split on a: the read gathers and its backward reduce-scatters; Rg: the producer passes it on
            split = self.x_of(rt, (s for s, st in enumerate(self.strategies[rt])
                                   if st.output[a].is_shard or st.output[a].grad_partial))
            for j, (rc, k, idx) in enumerate(sorted(bad[key])):
                y = self.products.get((rt, rc, k))
                if y is None:
                    self.prob += z >= self.x_of(rc, idx) - split, f"grad_{i}_{j}"
                else:
                    self.prob += z >= pulp.lpSum(var for (p, (qq, axes)), var in y.items()
                                                 if qq == q and a in axes and not p[a].is_shard
                                                 and not p[a].grad_partial), f"grad_{i}_{j}"

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
        if minimum > self.budget and self.chains:
            minimum = self.least_bytes(all_but_one(self.lengths))
        if minimum > self.budget:
            budget, needed = format_bytes_pair(self.budget, minimum)
            raise MemoryBudgetError(
                f"memory budget {budget} per device is below the minimum any plan needs on mesh "
                f"{self.cost.mesh}: {needed} in {self.cost.mode} mode; raise the budget to at least "
                f"{minimum:.0f} bytes, use more devices, or plan in inference mode", minimum)
        if sum(max(v) for v in mem.values()) <= self.budget:
            return  # every plan fits: the row could never bind
        # in GiB: coefficients near 1 keep the LP well scaled (bytes would reach 1e11)
        self.memory_terms = [m / 2**30 * self.x[r][s] for r in self.roots for s, m in enumerate(mem[r]) if m]
        self.memory_needed = True

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
                        memory.append(-freed / 2**30 * x)
            for chain, y, seconds_of in self.recompute_products:
                if chain == g:
                    objective += [k * seconds_of()[pq] * var for pq, var in y.items() if seconds_of().get(pq)]
            for chain, var, seconds in self.recompute_edges:
                if chain == g and seconds():
                    objective.append(k * seconds() * var)
        self.prob.setObjective(pulp.lpSum(objective) * OBJECTIVE_SCALE)
        _drop_constraint(self.prob, "memory")
        if self.memory_needed:
            self.prob += pulp.lpSum(memory) <= self.budget / 2**30, "memory"
        self.layers = dict(layers)

    def forward_floor_s(self, g: int) -> float:
        """The least one more recomputed layer of chain ``g`` can cost: its forward at the cheapest strategies."""
        return sum(min(v) for v in self._layer_parts(g)[0].values())

    def least_bytes(self, counts: Mapping[int, int]) -> float:
        """The least memory any plan needs with ``counts`` (:func:`autotp.recompute_counts.least_bytes`)."""
        return least_bytes(self.mem, {g: self._layer_parts(g) for g in self.chains}, self.lengths, counts)

    def memory_bytes(self, choice_rep: Mapping[str, int], layers: Mapping[int, int]) -> float:
        """Bytes per device of a choice (root -> strategy index) with ``layers[g]`` layers of chain g
        recomputing."""
        total = sum(self.mem[r][s] for r, s in choice_rep.items())
        for g, k in layers.items():
            _, act, saved = self._layer_parts(g)
            total -= sum(freed_bytes(k, self.lengths[g], saved[r][choice_rep[r]], act[r][choice_rep[r]])
                         for r in saved)
        return total



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
          memory_budget_bytes: Optional[float] = None, time_limit_s: float = 60.0,
          chains: Sequence[Sequence[Layer]] = (), recompute: Optional[bool] = None) -> Solution:
    """Choose one strategy per node, and how many layers of each of ``chains`` recompute (``recompute``:
    None lets the solver choose when memory is short, True recomputes every layer, False none); see
    the module docstring for the formulation."""
    start = time.perf_counter()
    f = _Formulation(graph, strategies, rep, cost, memory_budget_bytes,
                     chains if cost.train and recompute is not False else ())
    f.one_hot()
    f.edges()
    f.grad_reductions()
    f.memory()
    f.objective_terms()
    if recompute and f.chains:  # every layer recomputes: fixed from the start
        f.fix_recompute({g: len(c) for g, c in f.chains.items()})
    # The memory row goes in only when the best plan without it does not fit: a plan that is optimal
    # without the row and fits is optimal with it, and the row (a knapsack over every choice) can only
    # make the search harder. (With the loose gradient rows of an earlier formulation it slowed 70B on
    # (8, 8) from 18 s to 25 s; with the tight ones it changes nothing measurable there, 1.4-1.6 s.)
    name, choice_rep = _run(f, time_limit_s, memory_budget_bytes)
    untried = 0  # recompute counts the time limit left unsolved
    result = (name, choice_rep, _objective_s(f), f.prob.sol_status == pulp.LpSolutionOptimal, dict(f.layers))
    if f.memory_needed and f.memory_bytes(choice_rep, f.layers) > f.budget:
        # the constrained solves get what is left, but never less than half the limit: a first solve
        # that ran long must not leave the real ones too little time to find any plan
        now = time.perf_counter()
        deadline = now + max(time_limit_s / 2, time_limit_s - (now - start))
        if recompute is None and f.chains:
            # the plan without a budget bounds every plan's time from below only if it was proven optimal
            result, untried = _with_recompute(f, deadline, memory_budget_bytes, result[2] if result[3] else 0.0)
        else:
            f.fix_recompute(f.layers)
            name, choice_rep = _run(f, deadline - time.perf_counter(), memory_budget_bytes)
            result = (name, choice_rep, _objective_s(f), f.prob.sol_status == pulp.LpSolutionOptimal, dict(f.layers))
    name, choice_rep, objective_s, optimal, layers = result
    spent_s = time.perf_counter() - start
    status = "optimal" if optimal else f"best found in {spent_s:.0f} s (not proven optimal)"
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


class _Lazy:
    """A value computed on first use (the recompute prices of reads: needed only if memory is short)."""

    def __init__(self, compute) -> None:
        self.compute, self.done, self.value = compute, False, None

    def __call__(self):
        if not self.done:
            self.value, self.done = self.compute(), True
        return self.value


def _drop_constraint(prob: pulp.LpProblem, name: str) -> None:
    """Remove a named row (PuLP 3.3 deprecates the dict view of ``constraints``; older ones only have it)."""
    store = getattr(prob, "_constraints", None)
    (store if isinstance(store, dict) else prob.constraints).pop(name, None)


def _objective_s(f: _Formulation) -> float:
    return float(pulp.value(f.prob.objective) or 0.0) / OBJECTIVE_SCALE


def _with_recompute(f: _Formulation, deadline: float, budget: Optional[float], unconstrained_s: float) -> tuple:
    """The best plan over recompute counts (:func:`autotp.recompute_counts.search`), one exact solve each,
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
        raise MemoryBudgetError(f"no plan fits the memory budget {format_bytes(budget or 0)} per device on mesh "
                                f"{f.cost.mesh}, even with layers recomputing their activations",
                                f.least_bytes(all_but_one(f.lengths)))
    return best, untried


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
