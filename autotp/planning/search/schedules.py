"""Pipeline schedules, as orders of work per rank, and their step simulated from stage times.

A pipeline of ``S`` stages over ``pp`` ranks runs ``m`` micro-batches. Each rank works through its
own list of actions, ``F`` (a stage's forward of one micro-batch) and ``B`` (its backward), in the
order its schedule fixes; an action starts once the rank is free and its input is there:

- ``F(s, i)`` after ``F(s - 1, i)`` ended and its activation was sent to this rank;
- ``B(s, i)`` after ``B(s + 1, i)`` ended and its gradient was sent back (the last stage after its
  own ``F(S - 1, i)``).

The schedules, as ``torch.distributed.pipelining`` names them:

- ``gpipe``: every forward, then every backward; each stage holds all ``m`` micro-batches'
  activations at the turn.
- ``1f1b``: rank ``r`` runs ``pp - r - 1`` forwards ahead (warm-up), then alternates one forward
  and one backward; it holds at most ``pp - r`` micro-batches' activations. The same bubble as
  GPipe, far less memory.
- ``interleaved_1f1b``: each rank holds ``v`` stages (``r``, ``r + pp``, ...: ``S = v * pp``);
  micro-batches go round in groups of ``pp``, and the warm-up is ``2 (pp - r - 1) + (v - 1) pp``
  forwards (Megatron-LM's order, which needs ``m`` to be a multiple of ``pp``). The bubble shrinks
  about ``v`` times; more activations are in flight and more sends cross.

:func:`simulate` replays the orders and gives the step's span, each rank's busy time and the most
activation bytes each rank holds at once. :func:`timeline` does the same for many micro-batches
without replaying them all: past the warm-up a schedule repeats, so two replays give the line the
rest follows.
Pure arithmetic: no torch, no processes.

>>> t = simulate(orders("1f1b", pp=2, m=4), forward_s=[1, 1], backward_s=[2, 2], send_s=[0.0])
>>> t.span_s, t.in_flight
(15.0, (2, 1))
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

__all__ = ["SCHEDULES", "Action", "Timeline", "orders", "stage_rank", "simulate", "timeline", "held_bytes"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """``F`` or ``B`` of ``stage`` on ``micro_batch``."""

    kind: str
    stage: int
    micro_batch: int


@dataclass(frozen=True)
class Timeline:
    """A simulated step: its span, each rank's busy seconds, the most micro-batches (per stage of
    the rank, summed) whose activations each rank held at once, and the most activation bytes."""

    span_s: float
    busy_s: tuple[float, ...]
    in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """The share of the busiest rank's span spent waiting."""
        return 1.0 - max(self.busy_s) / self.span_s if self.span_s > 0 else 0.0


def stage_rank(stage: int, pp: int) -> int:
    """The rank (pipeline coordinate) that runs ``stage``: stages go round the ranks."""
    return stage % pp


@lru_cache(maxsize=256)
def orders(schedule: str, pp: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions under ``schedule`` with ``pp`` ranks, ``m`` micro-batches and ``v`` stages
    per rank (``interleaved_1f1b`` only; the others hold one stage per rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp={pp}, m={m}, v={v}: expected positive counts")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"{schedule} runs one stage per rank (v={v} given)")
    if schedule == "gpipe":
        return tuple(tuple([Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)])
                     for r in range(pp))
    if v > 1 and m % pp:
        raise ValueError(f"interleaved_1f1b with {m} micro-batches on {pp} ranks: expected a multiple of {pp}")
    total = m * v
    out = []
    for r in range(pp):
        def forward(k: int) -> Action:
            group, within = divmod(k, pp * v)
            chunk, i = divmod(within, pp)
            return Action("F", chunk * pp + r, group * pp + i)

        def backward(k: int) -> Action:
            group, within = divmod(k, pp * v)
            chunk, i = divmod(within, pp)
            return Action("B", (v - 1 - chunk) * pp + r, group * pp + i)

        if v == 1:
            forward = lambda k, r=r: Action("F", r, k)  # noqa: E731 - micro-batches in order
            backward = lambda k, r=r: Action("B", r, k)  # noqa: E731
            warmup = min(pp - r - 1, total)
        else:
            warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        acts = [forward(k) for k in range(warmup)]
        f, b = warmup, 0
        while f < total:
            acts += [forward(f), backward(b)]
            f, b = f + 1, b + 1
        acts += [backward(k) for k in range(b, total)]
        out.append(tuple(acts))
    return tuple(out)


def simulate(rank_orders: Sequence[Sequence[Action]], forward_s: Sequence[float], backward_s: Sequence[float],
             send_s: Sequence[float], activation_bytes: Optional[Sequence[float]] = None) -> Timeline:
    """Replay ``rank_orders``: stage ``s`` takes ``forward_s[s]`` and ``backward_s[s]`` per
    micro-batch, the send from stage ``s`` to ``s + 1`` (and its gradient back) ``send_s[s]``;
    a stage keeps ``activation_bytes[s]`` per micro-batch from its forward to its backward."""
    stages = len(forward_s)
    if len(backward_s) != stages or len(send_s) != max(stages - 1, 0):
        raise ValueError(f"{stages} stages: expected {stages} backward times and {stages - 1} send times")
    act = list(activation_bytes) if activation_bytes is not None else [0.0] * stages
    pp = len(rank_orders)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    busy = [0.0] * pp
    held, held_bytes = [0] * pp, [0.0] * pp
    most = [0] * pp
    most_bytes = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in rank_orders)
    while remaining:
        moved = False
        for r, acts in enumerate(rank_orders):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s, i = a.stage, a.micro_batch
                if a.kind == "F":
                    dep = ("F", s - 1, i) if s > 0 else None
                    wait = send_s[s - 1] if s > 0 else 0.0
                else:
                    dep = ("B", s + 1, i) if s < stages - 1 else ("F", s, i)
                    wait = send_s[s] if s < stages - 1 else 0.0
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] + wait if dep is not None else 0.0)
                if a.kind == "F":
                    seconds = forward_s[s]
                    held[r] += 1
                    held_bytes[r] += act[s]
                    most[r] = max(most[r], held[r])
                    most_bytes[r] = max(most_bytes[r], held_bytes[r])
                else:
                    seconds = backward_s[s]
                    held[r] -= 1
                    held_bytes[r] -= act[s]
                free[r] = done[(a.kind, s, i)] = start + seconds
                busy[r] += seconds
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule's orders wait on each other: no rank can go on")
    return Timeline(max(free), tuple(busy), tuple(most), tuple(most_bytes))


def timeline(schedule: str, pp: int, m: int, v: int, forward_s: Sequence[float], backward_s: Sequence[float],
             send_s: Sequence[float], activation_bytes: Optional[Sequence[float]] = None,
             replay_up_to: int = 4) -> Timeline:
    """:func:`simulate` of ``schedule``'s orders with ``m`` micro-batches; past ``2 * replay_up_to * pp``
    of them, the step replayed at ``n = replay_up_to * pp`` and at ``2n`` micro-batches and carried on
    along the line through the two: past the warm-up a schedule repeats, each further micro-batch
    adding the same seconds, and GPipe's held activations one micro-batch's more (1F1B's stay)."""
    short = replay_up_to * pp
    if m <= 2 * short:
        return simulate(orders(schedule, pp, m, v), forward_s, backward_s, send_s, activation_bytes)
    a = simulate(orders(schedule, pp, short, v), forward_s, backward_s, send_s, activation_bytes)
    b = simulate(orders(schedule, pp, 2 * short, v), forward_s, backward_s, send_s, activation_bytes)
    k = (m - 2 * short) / short  # further micro-batches, in units of the replayed difference

    def on(x: float, y: float) -> float:
        return y + k * (y - x)

    return Timeline(on(a.span_s, b.span_s), tuple(on(x, y) for x, y in zip(a.busy_s, b.busy_s)),
                    tuple(round(on(x, y)) for x, y in zip(a.in_flight, b.in_flight)),
                    tuple(on(x, y) for x, y in zip(a.peak_activation_bytes, b.peak_activation_bytes)))


def held_bytes(schedule: str, pp: int, m: int, v: int, activation_bytes: Sequence[float],
               replay_up_to: int = 4) -> tuple[float, ...]:
    """The most activation bytes each rank holds at once under ``schedule``: each rank's own order
    decides it, not the seconds (a forward adds its stage's bytes, a backward frees them). Past the
    warm-up 1F1B's stay as they are; GPipe's grow by one micro-batch's with each micro-batch."""
    short = min(m, 2 * replay_up_to * pp)  # a multiple of pp where m is one: interleaving needs it
    out = []
    for r, patterns in enumerate(_fullest(schedule, pp, short, v)):
        most = max((sum(n * activation_bytes[k] for k, n in pattern) for pattern in patterns), default=0.0)
        if schedule == "gpipe":
            most += (m - short) * sum(activation_bytes[k] for k in range(len(activation_bytes)) if k % pp == r)
        out.append(most)
    return tuple(out)


@lru_cache(maxsize=512)
def _fullest(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """Per rank, each distinct holding where a run of forwards ends (where the rank holds most), as
    ``((stage, micro-batches held), ...)``: the bytes follow for any activation sizes."""
    out = []
    for acts in orders(schedule, pp, m, v):
        held: dict[int, int] = {}
        found = set()
        for j, a in enumerate(acts):
            held[a.stage] = held.get(a.stage, 0) + (1 if a.kind == "F" else -1)
            if a.kind == "F" and (j + 1 == len(acts) or acts[j + 1].kind == "B"):
                found.add(tuple(sorted((k, n) for k, n in held.items() if n)))
        out.append(tuple(found))
    return tuple(out)
