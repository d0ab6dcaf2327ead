"""How many layers of each stack recompute: the counts worth trying and the search over them.

With the counts fixed the planner's ILP stays linear (:meth:`autotp.planning.solve.solver._Problem.fix_recompute`);
this module chooses the counts to solve for and keeps the best plan. It knows a layer only by the
per-strategy figures the solver hands it (``parts``: per root, the bytes a layer keeps and the bytes
recompute frees), never the graph.

>>> freed_bytes(3, 4, saved=10.0, kept=25.0)  # three of four layers keep only their outputs
30.0
>>> freed_bytes(4, 4, saved=10.0, kept=25.0)  # all four: one layer is whole again while it reruns
15.0
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["freed_bytes", "all_but_one", "least_bytes", "candidates", "search"]

Counts = Mapping[int, int]  # chain index -> layers that recompute


def freed_bytes(k: int, n_layers: int, saved: float, kept: float) -> float:
    """What ``k`` of a stack's ``n_layers`` recomputing frees: ``k`` times what a layer need not keep
    (``saved``: its activations but those read outside it), less one whole layer (``kept``) live again
    in its backward when every layer recomputes."""
    if not k:
        return 0.0
    return k * saved - (kept if k == n_layers else 0.0)


def all_but_one(lengths: Mapping[int, int]) -> dict[int, int]:
    """The counts that free the most: recomputing the last layer too frees what it keeps but brings
    one whole layer back while it runs again, never less."""
    return {g: n - 1 for g, n in lengths.items()}


def least_bytes(mem: Mapping[str, Sequence[float]], parts: Mapping[int, tuple], lengths: Mapping[int, int],
                counts: Counts) -> float:
    """The least memory any plan needs with ``counts`` (each root at its smallest strategy: a bound the
    choices reach). ``mem``: bytes per root and strategy; ``parts[g]``: chain ``g``'s ``(_, kept,
    saved)`` per root and strategy."""
    total = 0.0
    for r, per_strategy in mem.items():
        best = []
        for s, m in enumerate(per_strategy):
            for g, k in counts.items():
                _, kept, saved = parts[g]
                if r in kept:
                    m -= freed_bytes(k, lengths[g], saved[r][s], kept[r][s])
            best.append(m)
        total += min(best)
    return total


def candidates(lengths: Mapping[int, int], fits: Callable[[Counts], bool]) -> list[dict[int, int]]:
    """Counts to try, fewest first: the least that can fit (``fits``: the memory bound allows it; every
    chain the same share of its layers, at most all but one), then 1, 2, 4, ... layers more."""
    longest = max(lengths.values())

    def share(k: int) -> dict[int, int]:
        return {g: min(n - 1, -(-k * n // longest)) for g, n in lengths.items()}

    least = next((k for k in range(longest) if fits(share(k))), None)
    if least is None:
        return [all_but_one(lengths)] if fits(all_but_one(lengths)) else []
    counts = [least] + [least + step for step in (1, 2, 4, 8, 16, 32, 64) if least + step < longest]
    return list({tuple(sorted(share(k).items())): share(k) for k in counts}.values())


def search(tries: Sequence[Counts], solve_at: Callable[[Counts], tuple], floor_s: Callable[[Counts], float],
           deadline: float, failures: tuple) -> tuple[Optional[tuple], Optional[Exception], int]:
    """The best of ``solve_at(counts)`` (a tuple whose third item is its seconds) over ``tries`` in order,
    the last failure (one of ``failures`` raised by a solve), and how many tries the deadline left
    unsolved that neither rule below had ruled out (0: the search ran its course). Stops where
    ``floor_s(counts)``, a bound from below, cannot beat the best found, once two counts in a row did
    worse than the one before them, or past ``deadline`` with a plan in hand."""
    best, worse, failure = None, 0, None
    for i, counts in enumerate(tries):
        if best is not None and (floor_s(counts) >= best[2] or worse >= 2):
            break
        if best is not None and time.perf_counter() >= deadline:
            return best, failure, len(tries) - i
        try:
            found = solve_at(counts)
        except failures as err:  # none fits at this count, or none found in time
            failure = err
            continue
        if best is None or found[2] < best[2] * (1 - 1e-9):
            best, worse = found, 0
        else:
            worse += 1
    return best, failure, 0
