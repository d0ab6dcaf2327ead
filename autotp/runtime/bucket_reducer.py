"""Gradients averaged over a data axis as PyTorch's DDP averages them: in buckets, during the backward.

:class:`BucketReducer` holds the parameters of a rank's pipeline stages under ZeRO 0. Their
buckets are :func:`autotp.planning.costs.buckets.assign_buckets`' (about 25 MiB each, the parameters in
reverse order of registration, one stage and dtype per bucket), the same the step's pricing reads.
A ``post_accumulate_grad_hook`` on each parameter counts its gradient's accumulations; under
``torch.distributed.pipelining`` each micro-batch's backward accumulates into ``.grad``, so a
parameter is done once it has been accumulated as many times as its stages run micro-batches, and
a bucket is ready once all its parameters are. Ready buckets are launched in order (every rank
launches the same buckets in the same order, as DDP's reducer does): the bucket's local
gradients (a DTensor's local shard) flattened into one buffer, divided by ``divide_by`` and
all-reduced with ``async_op=True`` while the backward goes on. :meth:`BucketReducer.finish`, at
the end of the step, launches what is left (a parameter the step gave no gradient: zeros), waits
for every bucket and copies the averages back into the gradients.

>>> # reducer = BucketReducer([params_of_stage_0, ...], group, accumulations=micro_batches,
>>> #                         divide_by=dp * micro_batches)
>>> # with reducer.step():   # arms the hooks
>>> #     ... the backward of every micro-batch ...
>>> # (leaving the block waits: every parameter's .grad is the average over the group)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from autotp.planning.costs.buckets import assign_buckets

__all__ = ["Bucket", "BucketReducer"]


@dataclass(frozen=True)
class Bucket:
    """One bucket: the indices of its parameters in the reducer's list (in the order the backward
    makes their gradients) and its bytes of gradient."""

    parameters: tuple[int, ...]
    size_bytes: int


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class BucketReducer:
    """The gradients of ``stages`` (one sequence of parameters per stage, in registration order)
    averaged over ``group`` in buckets of ``bucket_bytes`` (default
    :data:`autotp.planning.costs.buckets.BUCKET_BYTES`), each launched during the backward once
    its parameters have been accumulated ``accumulations`` times per stage holding them (module
    docstring). Each rank's gradients are divided by ``divide_by`` before they are summed over the
    group. ``launched_in_backward`` counts the last step's all-reduces launched during its backward
    (the rest, :meth:`finish` launched)."""

    def __init__(self, stages: Sequence[Sequence[torch.nn.Parameter]], group: Any, accumulations: int,
                 divide_by: float, bucket_bytes: Optional[int] = None) -> None:
        if accumulations < 1:
            raise ValueError(f"a parameter's gradient is accumulated at least once a step; given {accumulations}")
        self.group, self.divide_by = group, divide_by
        params: list[torch.nn.Parameter] = []
        keys: list[tuple] = []
        uses: dict[int, int] = {}  # id(param) -> accumulations a step
        for k, stage in enumerate(stages):
            for p in stage:
                if id(p) not in uses:
                    params.append(p)
                    keys.append((k, p.dtype, _local(p).device))
                uses[id(p)] = uses.get(id(p), 0) + accumulations
        self.parameters = tuple(params)
        self._uses = tuple(uses[id(p)] for p in params)
        sizes = [_local(p).numel() * p.element_size() for p in params]
        self.buckets = tuple(Bucket(b, sum(sizes[i] for i in b))
                             for b in assign_buckets(sizes, bucket_bytes, keys))
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b.parameters}
        self._armed = False
        self.launched_in_backward = 0  # of the last step: the all-reduces launched during its backward
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self._reset()

    def _reset(self) -> None:
        self._counts = [0] * len(self.parameters)
        self._missing = [len(b.parameters) for b in self.buckets]  # parameters not done yet, per bucket
        self._next = 0  # the next bucket to launch: in order, on every rank alike
        self._pending: list[tuple[Bucket, torch.Tensor, bool, Any]] = []
        self._late: list[int] = []

    def _hook(self, i: int) -> Any:
        def accumulated(p: torch.Tensor) -> None:
            if not self._armed:
                return
            self._counts[i] += 1
            if self._counts[i] == self._uses[i]:
                self._missing[self._bucket_of[i]] -= 1
                while self._next < len(self.buckets) and self._missing[self._next] == 0:
                    self._launch(self.buckets[self._next])
                    self.launched_in_backward += 1
            elif self._counts[i] > self._uses[i]:
                self._late.append(i)

        return accumulated

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """The bucket's gradients divided and all-reduced, not waited for: a bucket of one parameter in
        its gradient itself (no copy), a larger one flattened into one buffer."""
        grads = []
        for i in bucket.parameters:
            p = self.parameters[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        in_place = len(grads) == 1 and grads[0].is_contiguous()
        flat = grads[0].view(-1) if in_place else torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.divide_by)
        self._pending.append((bucket, flat, in_place, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Every bucket launched (in order, those left), waited for, and its averages copied back
        into the gradients."""
        late = sorted({tuple(self.parameters[i].shape) for i in self._late})
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket, flat, in_place, work in self._pending:
            work.wait()
            offset = 0
            for i in bucket.parameters if not in_place else ():
                local = _local(self.parameters[i].grad)
                local.copy_(flat[offset:offset + local.numel()].view_as(local))
                offset += local.numel()
        self._reset()
        if late:
            raise RuntimeError(f"gradients of parameters of shapes {late} were accumulated after their bucket's "
                               f"all-reduce was launched: more accumulations a step than the stages' micro-batches")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The hooks armed for the block; at its end :meth:`finish` (after an error: disarmed and reset,
        the all-reduces launched left to end on their own)."""
        self._reset()
        self.launched_in_backward = 0
        self._armed = True
        try:
            yield
        finally:
            self._armed = False
        self.finish()

    def remove(self) -> None:
        """The hooks removed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
