"""The five collectives the profile times, their buffers, their bus factors and their checks.

A collective of kind ``kind`` on ``count`` float32 elements ("the full buffer", as
nccl-tests counts it) is prepared once per message size by :func:`prepare`, then run many
times by calling ``call.run()``. Buffer shapes, per rank of a group of ``n``::

    all_reduce      buf (count,)               in place
    all_gather      in (count/n,)  out (count,)
    reduce_scatter  in (count,)    out (count/n,)
    all_to_all      in (count,)    out (count,)   chunk k of rank g goes to rank k
    broadcast       buf (count,)               from the group's first rank

``bus_factor`` is nccl-tests' busbw/algbw ratio: ``busbw = size / time * bus_factor``.

For ``--check`` every input is filled with small integers that depend on the rank and the
position (exact in float32), and :func:`count_wrong` compares the output with the value
each element must have. Timed iterations run on zero-filled buffers so repeated in-place
reductions never change the values' range.

If the backend has no tensor reduce-scatter (``reduce_scatter_single`` raises), it is
emulated by an all-reduce of the whole buffer followed by a copy of the rank's chunk;
:func:`probe_reduce_scatter` finds out which, and the command prints a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DTYPE = torch.float32
DTYPE_NAME = "float"  # as nccl-tests prints it
DTYPE_BYTES = 4


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests' busbw factor for ``kind`` over ``group_size`` ranks."""
    n = group_size
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")


def element_count(size_bytes: int, group_size: int) -> int:
    """Elements of the full buffer: ``size_bytes`` of float32, rounded down to a multiple of
    ``group_size`` so that every rank's shard is whole (at least one element per rank)."""
    count = size_bytes // DTYPE_BYTES
    return max(group_size, count - count % group_size)


@dataclass(frozen=True)
class CollectiveCall:
    """One prepared collective: ``run()`` performs it on ``input`` into ``output``."""

    kind: str
    count: int
    group_rank: int
    group_size: int
    input: torch.Tensor
    output: torch.Tensor
    run: Callable[[], None]

    @property
    def size_bytes(self) -> int:
        return self.count * DTYPE_BYTES


def _reduce_scatter_native(output: torch.Tensor, input: torch.Tensor, group) -> None:
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op(output, input, group=group)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    op(output, input, group=group)


def probe_reduce_scatter(device: torch.device, group=None) -> bool:
    """True if the backend runs a tensor reduce-scatter natively, False if it must be emulated.

    All ranks must call this together. Every rank tries a tiny reduce-scatter; a backend
    that lacks it raises on every rank before communicating. The ranks then agree (MIN) so
    that they all take the same path afterwards.
    """
    world = dist.get_world_size(group)
    try:
        out = torch.zeros(1, dtype=DTYPE, device=device)
        _reduce_scatter_native(out, torch.ones(world, dtype=DTYPE, device=device), group)
        native = bool(out.item() == world)
    except (RuntimeError, NotImplementedError, ValueError):
        native = False
    flag = torch.tensor([1 if native else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def prepare(
    kind: str,
    size_bytes: int,
    group,
    group_ranks: tuple[int, ...],
    rank: int,
    device: torch.device,
    reduce_scatter_native: bool = True,
) -> CollectiveCall:
    """Buffers and a ``run`` closure for ``kind`` on ``size_bytes`` (full buffer) in ``group``.

    ``group`` is the process group handle (``None`` for the default group) and
    ``group_ranks`` its global ranks in order; ``rank`` is this process's global rank.
    """
    n = len(group_ranks)
    g = group_ranks.index(rank)
    count = element_count(size_bytes, n)
    shard = count // n

    def zeros(numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=DTYPE, device=device)

    if kind == "all_reduce":
        buf = zeros(count)
        inp, out = buf, buf
        run = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
    elif kind == "all_gather":
        inp, out = zeros(shard), zeros(count)
        run = lambda: _all_gather(out, inp, group)  # noqa: E731
    elif kind == "reduce_scatter":
        inp, out = zeros(count), zeros(shard)
        if reduce_scatter_native:
            run = lambda: _reduce_scatter_native(out, inp, group)  # noqa: E731
        else:

            def run() -> None:
                dist.all_reduce(inp, group=group)
                out.copy_(inp[g * shard : (g + 1) * shard])

    elif kind == "all_to_all":
        inp, out = zeros(count), zeros(count)
        run = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
    elif kind == "broadcast":
        buf = zeros(count)
        inp, out = buf, buf
        run = lambda: dist.broadcast(buf, src=group_ranks[0], group=group)  # noqa: E731
    else:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")
    return CollectiveCall(kind=kind, count=count, group_rank=g, group_size=n, input=inp, output=out, run=run)


def _pattern(numel: int, modulus: int, offset: int, device: torch.device) -> torch.Tensor:
    """``offset + i % modulus`` for i in range(numel), as float32 (exact integers)."""
    return (torch.arange(numel, device=device) % modulus).to(DTYPE).add_(offset)


def fill_for_check(call: CollectiveCall) -> None:
    """Rank- and position-dependent inputs whose correct outputs :func:`expected` knows."""
    g, device = call.group_rank, call.input.device
    if call.kind == "all_to_all":
        call.input.copy_(_pattern(call.input.numel(), 97, 100 * g, device))
    else:
        call.input.copy_(_pattern(call.input.numel(), 13, g + 1, device))
    if call.output is not call.input:
        call.output.fill_(-1.0)


def expected(call: CollectiveCall) -> torch.Tensor:
    """What ``call.output`` must hold after one run on inputs from :func:`fill_for_check`."""
    n, g, count, device = call.group_size, call.group_rank, call.count, call.output.device
    shard = count // n
    idx = torch.arange(count, device=device)
    if call.kind == "all_reduce":
        return ((idx % 13) * n + n * (n + 1) // 2).to(DTYPE)
    if call.kind == "all_gather":
        return ((idx % shard) % 13 + idx // shard + 1).to(DTYPE)
    if call.kind == "reduce_scatter":
        mine = idx[g * shard : (g + 1) * shard]
        return ((mine % 13) * n + n * (n + 1) // 2).to(DTYPE)
    if call.kind == "all_to_all":
        source = idx // shard  # chunk k of the output came from rank k ...
        position = g * shard + idx % shard  # ... out of its chunk addressed to rank g
        return (100 * source + position % 97).to(DTYPE)
    if call.kind == "broadcast":
        return (idx % 13 + 1).to(DTYPE)
    raise ValueError(f"unknown collective kind {call.kind!r}")


def count_wrong(call: CollectiveCall) -> int:
    """Elements of ``call.output`` that differ from :func:`expected`."""
    return int((call.output != expected(call)).sum().item())


def reset(call: CollectiveCall) -> None:
    """Zero the buffers again (after a check run) so timed runs see a stable value range."""
    call.input.zero_()
    if call.output is not call.input:
        call.output.zero_()
