"""Gradient buckets over a data axis under ZeRO 0, made as PyTorch's DDP makes them, and what they add to a step.

A replica's gradients are all-reduced in buckets of about :data:`BUCKET_BYTES` (DDP's
``bucket_cap_mb`` default, 25 MiB): the parameters taken in reverse order of registration (the
backward makes the last layer's gradients first), each bucket closed once it holds that many bytes
or more, or where the next parameter belongs elsewhere (another stage or dtype). Each bucket's
all-reduce is launched as soon as its last gradient is made, during the backward, one after the
other. The runtime (:mod:`autotp.runtime.bucket_reducer`) and the pricing
(:mod:`autotp.planning.search.pipeline_search`) both read this module, so what is priced is what runs.

>>> assign_buckets([10, 10, 10, 10], bucket_bytes=20)
((3, 2), (1, 0))
>>> assign_buckets([10, 10, 10], bucket_bytes=20, keys=["a", "a", "b"])
((2,), (1, 0))
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

__all__ = ["BUCKET_BYTES", "assign_buckets", "exposed_all_reduce_s"]

BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket_cap_mb


def assign_buckets(sizes_bytes: Sequence[float], bucket_bytes: Optional[float] = None,
                   keys: Optional[Sequence[Hashable]] = None) -> tuple[tuple[int, ...], ...]:
    """The buckets of parameters given in registration order with their gradients' bytes: each a
    tuple of the parameters' indices, in the order the backward makes them (the reverse of
    registration), the buckets in the order they become ready. A bucket is closed once it holds
    ``bucket_bytes`` or more (a parameter larger than that is a bucket of its own), and before a
    parameter of another key (``keys``, one per parameter: its stage and dtype). ``bucket_bytes``
    defaults to :data:`BUCKET_BYTES`."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    if bucket_bytes <= 0:
        raise ValueError(f"a gradient bucket holds a positive number of bytes; given {bucket_bytes}")
    if keys is not None and len(keys) != len(sizes_bytes):
        raise ValueError(f"one key per parameter: {len(sizes_bytes)} sizes, {len(keys)} keys")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0.0
    for i in reversed(range(len(sizes_bytes))):
        if current and keys is not None and keys[i] != keys[current[-1]]:
            buckets.append(tuple(current))
            current, held = [], 0.0
        current.append(i)
        held += sizes_bytes[i]
        if held >= bucket_bytes:
            buckets.append(tuple(current))
            current, held = [], 0.0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def exposed_all_reduce_s(buckets_bytes: Sequence[float], all_reduce_s: Callable[[float], float],
                         backward_s: float) -> float:
    """Seconds the buckets' all-reduces (``buckets_bytes`` in the order they become ready) run past
    the end of the backward they overlap (``backward_s`` of compute): a bucket is ready once the
    backward has made the gradient bytes up to its own (made at an even rate), and its all-reduce
    starts when it is ready and the one before has ended. The last bucket is ready only at the
    backward's end, so its all-reduce is never hidden."""
    total = float(sum(buckets_bytes))
    made, end = 0.0, 0.0
    for size in buckets_bytes:
        made += size
        ready = backward_s * made / total if total else backward_s
        end = max(end, ready) + all_reduce_s(size)
    return max(end - backward_s, 0.0)
