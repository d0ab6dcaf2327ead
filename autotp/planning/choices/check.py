"""Check a rule on data: does running the op on each rank's pieces give the pieces of its output?

:func:`check_rule` traces one call of an op on example arguments, takes the strategies autotp
would offer for it on an axis of ``n`` ranks (a registered rule, autotp's own or DTensor's), and
for each one cuts the full inputs into every rank's pieces (``R``: the whole tensor, ``S(d)``:
the rank's even slice, ``P``: random summands), runs the op on each rank's pieces alone, puts the
outputs back together (``S``: concatenate, ``R``: every rank must hold the whole, ``P``: sum) and
compares with the op on the full inputs. Each rank runs the op as the rewrite would: through the
op's local executions (:func:`autotp.planning.rules.local_executions`: the one a user registered
with ``register_rule(op, rule, local=...)``, then its family's: a grouped convolution with its
share of the groups, a shape argument made local, a grouped matmul split by experts on its
experts' rows...), run at once on the pieces instead of emitted into a graph. A ``Pd`` output
must have disjoint support (no element nonzero on two ranks). The strategies of an op that runs collectives inside itself (a loss on split classes, batch
norm on a split batch: :mod:`autotp.planning.rules.inner`) are left out: that op does not run on its
pieces alone (the runtime's tests check those).

>>> import torch
>>> from autotp.planning.choices.check import check_rule
>>> [str(s) for s in check_rule(torch.ops.aten.mm.default, (torch.randn(4, 6), torch.randn(6, 8)))]
['(R, R) -> R', '(P, R) -> P', '(R, P) -> P', '(S(0), R) -> S(0)', '(R, S(1)) -> S(1)', '(S(1), S(0)) -> P']
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from autotp.local.site import EagerEmitter, LocalSite, run_locally
from autotp.placement import Placement, Strategy
from autotp.planning.rules import local_executions

__all__ = ["check_rule", "RuleNotExact"]


class RuleNotExact(AssertionError):
    """A strategy whose local execution does not give the op's output."""


class _Call(torch.nn.Module):
    def __init__(self, op: Any, template: tuple) -> None:
        super().__init__()
        self.op, self.template = op, template

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        return self.op(*(next(it) if isinstance(a, torch.Tensor) else a for a in self.template))


def check_rule(op: Any, example_args: Sequence[Any], n: int = 2, seed: int = 0) -> list[Strategy]:
    """Check every strategy autotp offers ``op`` on ``example_args`` on an axis of ``n`` ranks.

    ``example_args`` are the op's positional arguments (tensors and plain values). Returns the
    strategies checked; raises :class:`RuleNotExact` naming each one whose pieces do not give the
    op's output (or whose pieces the op refuses), with the error."""
    from autotp.planning.choices.strategies import node_strategies
    from autotp.planning.rules.inner import inner_collectives
    from autotp.tracing.export import capture

    args = tuple(example_args)
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if not tensors:
        raise ValueError(f"example_args of {op} hold no tensor; expected the op's arguments with example tensors")
    graph = capture(_Call(op, args), tensors)
    target = str(op)
    nodes = [node for node in graph.ops() if node.target == target]
    if len(nodes) != 1:
        raise ValueError(f"tracing {op} on the example arguments gave {[x.target for x in graph.ops()]}, "
                         f"not one call of {target}")
    node = nodes[0]
    full = op(*args)
    full_out = full[0] if isinstance(full, (tuple, list)) else full
    strategies = [s for s in node_strategies(graph, node, (n,)) if not inner_collectives(node, s, (n,))]
    failures = []
    for strategy in strategies:
        try:
            _check(op, args, node, strategy, full_out, n, seed)
        except Exception as err:  # noqa: BLE001 - every failing strategy is reported
            failures.append(f"{strategy}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    if failures:
        raise RuleNotExact(f"{len(failures)} of {len(strategies)} strategies of {target} on {n} ranks are not exact "
                           "on these arguments:\n  " + "\n  ".join(failures))
    return strategies


def _low_precision(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)


def _pieces(full: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if p.is_shard:
        return list(torch.chunk(full, n, dim=p.dim))
    if p.is_partial:
        if _low_precision(full):  # random summands would lose most of the value's bits: equal shares
            return [full / n] * n
        parts = [torch.randn(full.shape, generator=gen, dtype=full.dtype) for _ in range(n - 1)]
        return [full - sum(parts)] + parts if parts else [full]
    return [full] * n


def _site(op: Any, node: Any, strategy: Strategy, n: int, rank: int, local: tuple) -> LocalSite:
    """``rank``'s place as the rewrite would hand it to a local execution, its arguments its pieces."""
    reads = tuple(q if q is not None else (Placement("R"),) for q in strategy.inputs)
    return LocalSite(node=node, strategy=strategy, reads=reads, mesh_shape=(n,), coordinate=(rank,), groups=(None,),
                     axis_names=("check",), target=op, args=local, kwargs={}, emitter=EagerEmitter((n,), (rank,)))


def _check(op: Any, args: tuple, node: Any, strategy: Strategy, full: torch.Tensor, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    pieces = {}
    for k, i in enumerate(positions):
        placement = strategy.inputs[k][0] if strategy.inputs[k] is not None else Placement("R")
        pieces[i] = _pieces(args[i], placement, n, gen)
    outs = []
    for rank in range(n):
        local = tuple(pieces[i][rank] if i in pieces else a for i, a in enumerate(args))
        out = run_locally(_site(op, node, strategy, n, rank, local), local_executions(node.target))
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    p = strategy.output[0]
    if p.is_shard:
        got = torch.cat(outs, dim=p.dim)
    elif p.is_partial:
        got = sum(outs[1:], outs[0])
        if p.disjoint and n > 1 and (torch.stack(outs) != 0).sum(0).max() > 1:
            raise RuntimeError("the parts of a sum of disjoint parts (Pd) overlap: an element is nonzero on two ranks")
    else:
        for rank, out in enumerate(outs[1:], 1):
            if out.shape != outs[0].shape or not torch.allclose(out, outs[0]):
                raise RuntimeError(f"rank {rank} holds a different value than rank 0 for a replicated output")
        got = outs[0]
    if got.shape != full.shape:
        raise RuntimeError(f"the pieces assemble to shape {list(got.shape)}, the op gives {list(full.shape)}")
    scale = full.abs().max().item() if full.is_floating_point() and full.numel() else 1.0
    rtol, atol = (2e-2, 1e-2) if _low_precision(full) else (1e-4, 1e-5)  # sums in another order round
    torch.testing.assert_close(got, full, rtol=rtol, atol=atol * max(scale, 1.0))
