"""What a run communicates, recorded per collective: kind, mesh axis and bytes.

``CollectiveLog`` is a ``TorchDispatchMode`` that sees every ``_c10d_functional`` collective the
code under it issues (autotp's runtime, DTensor's redistributions, ``parallelize_module``'s
plans) and records it as the plan states collectives, so the two compare per (kind, mesh axis,
bytes) and not by count alone:

- the mesh axis is named from the process group the op runs on (``mesh.get_group(axis)``);
- the bytes are those the profile prices the collective at, as
  :func:`autotp.planning.costs.program.collectives` counts them: an all_reduce's and a reduce_scatter's input,
  an all_gather's output, an all_to_all's input (one rank's buffer).

Dispatch modes are per thread, so each rank of ``examples.ranks.run_threads`` records its own
collectives (PyTorch's ``CommDebugMode`` tracks modules with process-wide hooks and is kept for
the multi-process runs, where the tests check that both see the same collectives).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

from examples.models import output_tensor as tensor_of  # noqa: F401 - the tests read outputs through it

# functional op name -> autotp kind; the kind whose plan bytes are the op's input times the axis size
_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
_TIMES_GROUP_SIZE = {"all_gather"}


@dataclass(frozen=True)
class Seen:
    """One collective run: ``bytes`` as the plan counts them (module docstring), ``sent_bytes`` the
    rank's own input (for an all_to_all, the sum of its send sizes)."""

    kind: str
    mesh_axis: str
    bytes: int
    sent_bytes: int = 0


class CollectiveLog(TorchDispatchMode):
    """Records every functional collective run under it; ``mesh`` names the axes."""

    def __init__(self, mesh) -> None:
        super().__init__()
        names = mesh.mesh_dim_names or tuple(f"axis{a}" for a in range(mesh.ndim))
        self.axis_of_group = {mesh.get_group(a).group_name: names[a] for a in range(mesh.ndim)}
        self.size_of_group = {mesh.get_group(a).group_name: mesh.size(a) for a in range(mesh.ndim)}
        self.seen: list[Seen] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _KINDS:
            kind, x, group = _KINDS[name], args[0], args[-1]
            if group not in self.axis_of_group:
                raise AssertionError(f"{kind} on process group {group!r}, which is no axis of the mesh "
                                     f"{self.axis_of_group}")
            sent = nbytes = x.numel() * x.element_size()
            if kind in _TIMES_GROUP_SIZE:
                nbytes *= self.size_of_group[group]
            self.seen.append(Seen(kind, self.axis_of_group[group], nbytes, sent))
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        """``{(kind, mesh_axis, bytes): count}``."""
        return Counter((s.kind, s.mesh_axis, s.bytes) for s in self.seen)

    def kind_counts(self) -> Counter:
        return Counter(s.kind for s in self.seen)


def _phases(phase: str) -> set[str]:
    return {phase, "recompute"} if phase == "backward" else {phase}


def planned(plan, phase: str) -> Counter:
    """``plan.collectives()`` of one phase as ``{(kind, mesh_axis, bytes): count}``; the backward's
    includes the forward collectives of recomputed layers, which run during it."""
    # a recomputed layer's forward collectives run in the backward
    return Counter((c.kind, c.mesh_axis, int(round(c.bytes))) for c in plan.collectives() if c.phase in _phases(phase))


def assert_kinds_as_planned(log: CollectiveLog, plan, phase: str) -> None:
    """What ran equals what the plan says by kind and mesh axis, collective by collective; and each
    all_to_all a rank ran sent no more than the plan's ``rank_sent_bytes`` (the collectives of a kind
    and axis matched largest to largest: if any one-to-one matching keeps every one within its bound,
    this one does)."""
    want = [c for c in plan.collectives() if c.phase in _phases(phase)]
    ran = Counter((s.kind, s.mesh_axis) for s in log.seen)
    planned_kinds = Counter((c.kind, c.mesh_axis) for c in want)
    if ran != planned_kinds:
        raise AssertionError(f"{phase}: the run and the plan differ by kind and axis.\n"
                             f"  ran, not planned: {dict(ran - planned_kinds)}\n"
                             f"  planned, not run: {dict(planned_kinds - ran)}")
    for kind, axis in ran:
        if kind != "all_to_all":
            continue
        sent = sorted(s.sent_bytes for s in log.seen if (s.kind, s.mesh_axis) == (kind, axis))
        bounds = sorted(c.rank_sent_bytes for c in want if (c.kind, c.mesh_axis) == (kind, axis))
        over = [(s, b) for s, b in zip(sent, bounds) if s > b]
        if over:
            raise AssertionError(f"{phase}: all_to_all over {axis} sent more than planned (sent, planned): {over}; "
                                 f"sent {sent}, planned {bounds}")


def assert_as_planned(log: CollectiveLog, plan, phase: str) -> None:
    """What ran equals what the plan says, collective by collective (kind, axis and size).

    Where a 2-axis plan splits a tensor unevenly, a collective over one axis moves a piece whose size
    depends on the rank's place on the other; the plan lists the largest. Then each collective that
    ran is matched to a planned one of the same kind and axis at least as large, one to one; and so
    is every all_to_all (a ring's shift sends one piece, priced as the even buffer that sends as much)."""
    seen, want = log.counts(), planned(plan, phase)
    if plan.mesh.ndim > 1 and any("~" in n.strategy for n in plan.nodes):
        _match_at_least(phase, seen, want)
        return
    # an all_to_all whose pieces are not even (a ring's shift: one piece, to one rank) is planned at
    # the even buffer the profile prices it as, which is larger than the shift's own
    _match_at_least(phase, Counter({c: k for c, k in seen.items() if c[0] == "all_to_all"}),
                    Counter({c: k for c, k in want.items() if c[0] == "all_to_all"}))
    seen, want = (Counter({c: k for c, k in x.items() if c[0] != "all_to_all"}) for x in (seen, want))
    if seen != want:
        raise AssertionError(f"{phase}: the run and the plan differ.\n"
                             f"  ran, not planned: {dict(seen - want)}\n"
                             f"  planned, not run: {dict(want - seen)}")


def _match_at_least(phase: str, seen: Counter, want: Counter) -> None:
    """Each collective that ran matched to a planned one of its kind and axis at least as large, one to
    one, none planned left over."""
    left = sorted(want.elements(), key=lambda c: c[2])
    for ran in sorted(seen.elements(), key=lambda c: c[2]):
        match = next((c for c in left if c[:2] == ran[:2] and c[2] >= ran[2]), None)
        if match is None:
            raise AssertionError(f"{phase}: {ran} ran, and no planned collective of its kind and axis is at "
                                 f"least as large; planned: {dict(want)}, ran: {dict(seen)}")
        left.remove(match)
    if left:
        raise AssertionError(f"{phase}: planned, not run: {left}; ran: {dict(seen)}")


def logged_step(rank, world, graph, plan, model, inputs: dict):
    """One rank's training step of ``plan`` on its mesh (``plan.mesh``'s shape and axis names, ``world``
    ranks; for ``examples.ranks.run_threads``): the loss, every parameter's gradient whole, and the
    collectives of the forward and of the backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    mesh = init_device_mesh("cpu", tuple(plan.mesh.shape), mesh_dim_names=tuple(plan.mesh.axis_names))
    pm = build_parallel_module(graph, plan, mesh, model)
    with CollectiveLog(mesh) as forward:
        loss = pm(**inputs).loss
    with CollectiveLog(mesh) as backward:
        loss.backward()
    grads = {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}
    return loss.detach(), grads, forward, backward


def layout_step(plan_json: str, model, inputs: dict):
    """One rank's training step of a layout plan (``pipeline=True``) on the layout's mesh, the
    parallel module built by ``autotp.parallelize``: ``(module, loss or None where the rank holds no
    last stage, every parameter's gradient whole, Counter of (kind, mesh axis) of the collectives the
    plan's mesh saw)``."""
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    plan = autotp.Plan.from_json(plan_json)
    layout = plan.pipeline.layout
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.axis_names)
    pm = autotp.parallelize(model, mesh, inputs, plan=plan)
    with CollectiveLog(pm.tp_mesh) as log:  # the plan's mesh: the planned axes of the layout
        loss = pm.step(**inputs)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in pm.named_parameters()}
    return pm, None if loss is None else loss.item(), grads, Counter((c.kind, c.mesh_axis) for c in log.seen)


def assert_layout_step_exact(plan, model, inputs: dict, results) -> Counter:
    """``results``, each rank's ``(loss, grads, seen)`` of :func:`layout_step`, against one process's
    step of ``model``: the last stage's ranks hold the loss, every gradient is held by some rank and
    equals one process's, and each rank's stages, with the same rank of the other pipeline ranks
    (ranks row-major, the pipeline axis outermost), run the plan's collectives once per micro-batch.
    Returns the collectives planned for the step."""
    import pytest
    import torch

    loss = model(**inputs).loss
    loss.backward()
    c = plan.pipeline.chosen
    planned: Counter = Counter()
    for coll in plan.collectives():
        planned[(coll.kind, coll.mesh_axis)] += c.micro_batches
    assert [r[0] is not None for r in results].count(True) == len(results) // c.pp  # the last stage's ranks
    held: dict = {}
    for got, grads, _ in results:
        assert got is None or got == pytest.approx(loss.item(), rel=1e-5)
        held.update(grads)
    assert set(held) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(held[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    stride = len(results) // c.pp
    for first in range(stride):
        seen = sum((results[first + k * stride][2] for k in range(c.pp)), Counter())
        assert seen == planned, (first, seen, planned)
    return planned
