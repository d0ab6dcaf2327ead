"""The ILP's variables, its choice rows and the seconds of a plan: one strategy per node, the
redistributions between them, the gradient reductions. :mod:`autotp.planning.solve.solver` adds the memory row
and activation recompute and solves it.

Formulation (all costs in seconds, memory in bytes; ``r`` ranges over representative nodes after
layer tying, ``m_r`` is how many nodes ``r`` stands for):

* **one_hot**: binary ``x[r,s]`` per strategy ``s`` of ``r``; ``Σ_s x[r,s] = 1``.
* **edges** (a value read by one node): for each group of graph edges ``u → v`` (input ``k``) sharing representatives, continuous
  ``y[e,p,q] ≥ 0`` over the producer's output placements ``p`` and the consumer's required input
  placements ``q``, tied to the choices by ``Σ_q y[e,p,q] = Σ_{s: out(s)=p} x[u,s]`` and
  ``Σ_p y[e,p,q] = Σ_{s: in_k(s)=q} x[v,s]``. With one-hot ``x`` the only solution is the product,
  so the linear cost ``Σ c(p,q) y[e,p,q]`` is the redistribution cost exactly. Pairs that cannot be
  converted (``S → P``) have ``y`` fixed to 0, and so do, on a read an in-place write needs as it
  is (:func:`autotp.tracing.aliasing.pinned_reads`), the pairs that would redistribute it or reduce its
  gradient. Edges whose cost depends on one end only fold into that end's node cost. A value read
  after in-place writes into its storage is another value than before them (its reads share apart).
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
* **objective**: ``Σ_r m_r Σ_s compute(r,s) x[r,s] + Σ_e Σ c(p,q) y + Σ g z``; ``compute(r,s)``
  also holds, once per member of r's tie group, the additions of that member's output gradients
  (``OpGraph.gradient_reads``: the last block's output is read less often than the others').
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Mapping, Optional, Sequence

import pulp

from autotp.placement import Placement, Strategy, plain
from autotp.planning.choices.followers import merge_followers
from autotp.planning.costs.costing import INFEASIBLE_S, CostModel
from autotp.planning.costs.recompute import Layer
from autotp.planning.costs.redistribute import fused_axes, reduced_axes
from autotp.tracing.aliasing import pinned_reads, read_versions
from autotp.tracing.graph import OpGraph

__all__ = ["Formulation", "OBJECTIVE_SCALE"]


OBJECTIVE_SCALE = 1e3  # the objective is handed to the solver in milliseconds


class Formulation:
    """The problem as PuLP rows and objective terms, built one constraint group per method (module doc)."""

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
        self.memory_terms: list = []  # the memory rows' terms, in GiB; added only if a plan without them does not fit
        self.step_terms: list = []
        self.mem_step: dict[str, list[float]] = {}
        self.memory_needed = False
        # the gathered copies readers keep for the backward (autotp.planning.costs.saved): bytes on a
        # redistribution's variable, or folded into a node's choices (root -> bytes per strategy)
        self.copy_terms: list[tuple[float, pulp.LpVariable]] = []
        self.copy_mem: dict[str, list[float]] = {}
        # per read whose gradient the backward converts: the bytes that conversion holds at once
        # (CostModel.backward_event_bytes), as terms on its variables; the backward's start peaks at
        # the largest of them or the loss's own gradients
        self.event_rows: list[list[tuple[float, pulp.LpVariable]]] = []
        # product variables of each edge that has them, keyed (producer rep, reader rep, input index),
        # when they were built with the readers' partial-gradient axes (a tensor that carries a gradient)
        self.products: dict[tuple[str, str, int], dict[tuple, pulp.LpVariable]] = {}
        # reads an in-place write needs as they are (autotp.tracing.aliasing), by representative
        self.pinned = {(rep[v], k) for v, k in pinned_reads(graph)}

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
        sums: dict[tuple[str, int], list] = {}  # (representative, reads) -> [members, one of them]: priced once
        for n in self.graph.nodes:
            if (reads := self.graph.gradient_reads(n.name)) > 1:
                sums.setdefault((self.rep[n.name], reads), [0, n])[0] += 1
        for (r, reads), (count, n) in sums.items():
            self.add_cost(r, lambda st, n=n, reads=reads, count=count: count * self.cost.gradient_sums_s(n, st, reads))
        # graph outputs are returned replicated (plain tensors, as the original model returns them),
        # but those nothing reads whole (OpGraph.unread_outputs)
        for o in self.graph.outputs:
            if o in self.graph.unread_outputs:
                continue
            node = self.graph[o]
            self.add_cost(self.rep[o], lambda st, node=node: self.cost.edge_s(
                node.outputs[0], st.output, (_R,) * len(st.output), node.requires_grad))

    def edges(self) -> None:
        """Redistribution costs, grouped by the value read (a producer, or one item of a multi-output op)."""
        values: dict[tuple, dict[str, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
        versions = read_versions(self.graph)
        for v in self.graph.nodes:
            for k, u in enumerate(v.inputs):
                if self.parent.get(self.rep[v.name]) == self.rep[u]:
                    continue  # a merged view follows its input: nothing moves
                # after n writes in place into its storage a value is another one (autotp.tracing.aliasing)
                after = f"@{versions[(v.name, k)]}" if (v.name, k) in versions else ""
                if v.target == "getitem":  # each item is its own value
                    values[(self.rep[u], self.rep[v.name])][f"{u}[{v.name}{after}]"].append((v.name, k))
                else:
                    values[(self.rep[u],)][f"{u}[{after}]" if after else u].append((v.name, k))
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
            if (rv, k) in self.pinned:
                c = self._as_is(c, outs, ins)
            kept = self._copies(pairs, k, outs, ins)
            if all(val == 0.0 for val in c.values()):
                continue
            event: dict[tuple, float] = {}
            if grad:
                info = self.graph[pairs[0][1]].input_infos[k]
                event = {(p, (q, axes)): b for p in outs for q, axes in ins
                         if (b := self.cost.backward_event_bytes(info, p, q, axes))}
            chain = self.chain_of.get(rv)
            # the forward part, per layer of the reader's chain: priced only if recompute is tried
            fwd = _Lazy(lambda pairs=pairs, k=k, outs=outs, ins=ins, chain=chain: self._forward_parts(
                Counter(self.graph[v].input_infos[k] for _, v in pairs), outs, ins, len(self.chains[chain])))
            if len(outs) == 1 or len(ins) == 1:  # the cost depends on one end only: fold it in
                if event:
                    self._add_event(ru, lambda st: event.get((st.output, ins[0]), 0.0)) if len(ins) == 1 else \
                        self._add_event(rv, lambda st: event.get((outs[0], self._requirement(st, k, grad)), 0.0))
                if kept:
                    self._add_copy(ru, lambda st: kept.get((st.output, ins[0]), 0.0)) if len(ins) == 1 else \
                        self._add_copy(rv, lambda st: kept.get((outs[0], self._requirement(st, k, grad)), 0.0))
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
            self.copy_terms += [(kept[pq], var) for pq, var in y.items() if kept.get(pq)]
            if event:
                self.event_rows.append([(event[pq], var) for pq, var in y.items() if event.get(pq)])
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

    def _copies(self, pairs: Sequence[tuple[str, str]], k: int, outs: list, ins: list) -> dict[tuple, float]:
        """Per (output placement, requirement): the bytes the readers in ``pairs`` keep beyond their
        producers' outputs when they keep input ``k`` for the backward (a gathered copy:
        :meth:`autotp.planning.costs.costing.CostModel.copy_bytes`); empty where they keep nothing."""
        saved = self.cost.kept.saved_reads if self.cost.kept is not None else ()
        infos = Counter(self.graph[v].input_infos[k] for _, v in pairs if (v, k) in saved)  # tied layers read alike
        kept: dict[tuple, float] = defaultdict(float)
        for info, count in infos.items():
            for p in outs:
                for q, axes in ins:
                    kept[(p, (q, axes))] += count * self.cost.copy_bytes(info, p, q)
        return {pq: b for pq, b in kept.items() if b}

    def working_memory(self) -> None:
        """Each op's kernel working memory in the backward (:meth:`CostModel.working_bytes`): an
        event of its own, by the op's choice; tied ops hold alike, so a representative stands for them."""
        for r in self.reps:
            node = self.graph[r]
            if r in self.fmap and not node.is_placeholder:
                self._add_event(r, lambda st, node=node: self.cost.working_bytes(node, st))

    def _add_event(self, r: str, bytes_of) -> None:
        """A backward event whose bytes depend on r's strategy alone: a row of its root's choices."""
        root = self.root[r]
        row = [0.0] * len(self.strategies[root])
        for s, mine in enumerate(self.fmap[r]):
            row[s] += bytes_of(self.strategies[r][mine])
        if any(row):
            self.event_rows.append([(b, self.x[root][s]) for s, b in enumerate(row) if b])

    def _add_copy(self, r: str, bytes_of) -> None:
        """Add ``bytes_of(strategy of r)`` to the kept copies of each strategy of r's root."""
        root = self.root[r]
        row = self.copy_mem.setdefault(root, [0.0] * len(self.strategies[root]))
        for s, mine in enumerate(self.fmap[r]):
            row[s] += bytes_of(self.strategies[r][mine])

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
        saved = self.cost.kept.saved_reads if self.cost.kept is not None else ()
        kept: dict[tuple, float] = defaultdict(float)  # per (p, redistribution): the copy its savers keep
        for (info, grad, reps_read), count in alike.items():
            mine: set[tuple] = set()
            copies: dict[tuple, float] = {}  # readers of one value that read it alike keep one copy
            for rv, k in reps_read:
                readers_rep.add((rv, k))
                mine.update(self._requirement(st, k, grad) for st in self.strategies[rv])
                if (rv, k) in saved:
                    for kk in {self._requirement(st, k, grad) for st in self.strategies[rv]}:
                        for p in outs:
                            copies[_redistribution(p, kk)] = count * self.cost.copy_bytes(info, p, kk[0])
            for once, b in copies.items():
                kept[once] += b
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
        grad_any = any(g for _, g, _ in alike)
        ordered = sorted({_redistribution(p, kk)[1] for kk in keys for p in outs}, key=_key_order)
        pay: dict[tuple, pulp.LpVariable] = {}
        for i, p in enumerate(outs):
            for j, once in enumerate(ordered):
                if shared[(p, once)] not in (0.0, INFEASIBLE_S):
                    pay[(p, once)] = self.var(f"w{e}_{i}_{j}", 0, 1)
                    self.objective.append(shared[(p, once)] * pay[(p, once)])
                    if kept.get((p, once)):
                        self.copy_terms.append((kept[(p, once)], pay[(p, once)]))
        if grad_any:
            info = next(iter(alike))[0]
            row = [(b, var) for (p, once), var in pay.items()
                   if (b := self.cost.backward_event_bytes(info, p, once[0], once[1]))]
            if row:
                self.event_rows.append(row)
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
            ins = sorted(set(need), key=_key_order)
            y = self._product(f"{e}_r{r}", ru, outs, rv, need, ins,
                              self._as_is(c, outs, ins) if (rv, k) in self.pinned else c)
            if grad:
                self.products[(ru, rv, k)] = y
            for n, ((p, kk), var) in enumerate(y.items()):
                once = _redistribution(p, kk)
                if once in pay:
                    self.prob += pay[once] >= var, f"pay_{e}_{r}_{n}"

    @staticmethod
    def _as_is(c: Mapping[tuple, float], outs: list, ins: list) -> dict[tuple, float]:
        """``c`` with every pair that would not read the producer's local value as it is (a
        redistribution or a gradient reduction: a new tensor) made infeasible: a pinned read."""
        out = defaultdict(float, c)
        for p in outs:
            for q, axes in ins:
                if q is not None and (plain(p) != q or reduced_axes(p, q, axes)):
                    out[(p, (q, axes))] = INFEASIBLE_S
        return out

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
        reads: dict[tuple[str, int, int], list[tuple[tuple, tuple[int, ...]]]] = {}  # alike readers, once
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
                        if (rc, k, a) not in reads:  # the reader's strategies that return a partial gradient on a
                            by_q: dict[tuple, list[int]] = defaultdict(list)
                            for s, st in enumerate(self.strategies[rc]):
                                q = st.inputs[k]
                                if q is not None and q[a].is_replicate and st.partial_grads_on(a):
                                    by_q[q].append(s)
                            reads[(rc, k, a)] = [(q, tuple(idx)) for q, idx in by_q.items()]
                        for q, idx in reads[(rc, k, a)]:
                            key = (rt, a, q)
                            bad[key].add((rc, k, idx))
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
    (:func:`autotp.planning.costs.redistribute.fused_axes`); the program shares reads with the same one."""
    q, axes = requirement
    if q is None:
        return p, requirement
    return p, (q, fused_axes(p, q, axes))


def _key_order(kk: tuple) -> tuple:
    q, axes = kk
    return (q is None, q or (), axes)



class _Lazy:
    """A value computed on first use (the recompute prices of reads: needed only if memory is short)."""

    def __init__(self, compute) -> None:
        self.compute, self.done, self.value = compute, False, None

    def __call__(self):
        if not self.done:
            self.value, self.done = self.compute(), True
        return self.value
