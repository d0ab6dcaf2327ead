"""The interface of a local execution: how one op runs on a rank's pieces under the strategy the plan chose.

Most ops run on a rank's pieces as they are. For the others, the op family that offers the
strategies (:mod:`autotp.planning.rules`) registers a **local execution** beside them: a function
``execute(site)`` that the rewrite (:mod:`autotp.runtime.rewrite`) calls once per node of such an
op while it builds one rank's graph. It is handed a :class:`LocalSite`:

- ``node``: the :class:`~autotp.tracing.graph.OpNode`, with the whole shapes and typed arguments;
- ``strategy``: the chosen :class:`~autotp.placement.Strategy` (per tensor input and the output,
  one placement per mesh axis), and ``reads``: the placements each tensor input is read in (the
  strategy's, or where it reads any placement, its producer's);
- ``mesh_shape``, ``coordinate`` (this rank's on each mesh axis), ``groups`` and ``axis_names``
  (the process group and the name of each mesh axis), ``seed`` (the base seed of random draws);
- ``target``, ``args``, ``kwargs``: the op's call, its tensor arguments already read as local fx
  values in their planned placements and on the mesh's device;
- ``graph``: the :class:`~autotp.tracing.graph.OpGraph` the node is of (None where a node is run alone,
  as :func:`autotp.check_rule` runs it);

and the means to build: :meth:`LocalSite.call` and :meth:`LocalSite.call_module` emit a call (of a
function, or of a module the graph then holds), :meth:`LocalSite.local_sizes` a shape argument
made local, :meth:`LocalSite.new_stream` a fresh random stream for a dropout-like op; the values
:meth:`LocalSite.piece` and :meth:`LocalSite.piece_of` (this rank's part of a split dim) and
:meth:`LocalSite.shard_key` are computed from the placements alone; :meth:`LocalSite.value` is the
local value an earlier node of the graph left on this rank (an op whose local code needs a value it
does not read: a table gathered by rows that an earlier op routed).

It returns one of:

- ``None``: nothing to do for this node; the next local execution registered for the op is tried,
  and after the last the op runs as it is, on the site's arguments;
- a :class:`Call`: the call to run in place of the op (the op with rewritten arguments, or
  another function), which the rewrite emits;
- a value it emitted itself with :meth:`~LocalSite.call` or :meth:`~LocalSite.call_module`: the
  node's local value.

:func:`run_locally` applies a node's local executions in order, as the rewrite does (with an
:class:`EagerEmitter`, at once on tensors);
:class:`LocalCall` is the module a user's local code runs in (``autotp.register_rule(..., local=)``).

>>> import torch
>>> Call(torch.ops.aten.group_norm.default, ("x", 8, None, None), {}).with_argument("num_groups", 4).args
('x', 4, None, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from torch import nn

from autotp.placement import Placement, Strategy, local_shape, piece_range
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["Call", "Emitter", "EagerEmitter", "LocalSite", "LocalExecution", "LocalCall", "run_locally"]


@dataclass(frozen=True)
class Call:
    """A call to emit in place of the op: ``target(*args, **kwargs)`` on local values."""

    target: Any
    args: tuple
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def with_argument(self, name: str, value: Any) -> "Call":
        """The same call with the target's argument ``name`` (by its schema) set to ``value``:
        where it is given, positionally or by keyword, else as a keyword."""
        if name in self.kwargs:
            return Call(self.target, self.args, {**self.kwargs, name: value})
        position = [a.name for a in self.target._schema.arguments].index(name)
        if position < len(self.args):
            return Call(self.target, (*self.args[:position], value, *self.args[position + 1:]), self.kwargs)
        return Call(self.target, self.args, {**self.kwargs, name: value})


class Emitter(Protocol):
    """What builds the graph a site's calls go into (the rewrite, :class:`autotp.runtime.rewrite.GraphRewrite`)."""

    def call_function(self, target: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any: ...

    def call_module(self, module: nn.Module, kind: str, args: tuple, kwargs: Mapping[str, Any]) -> Any: ...

    def local_sizes(self, sizes: Any, node: OpNode, placements: tuple[Placement, ...]) -> list: ...

    def new_stream(self) -> int: ...

    def local_value(self, name: str) -> Any: ...


class EagerEmitter:
    """An :class:`Emitter` whose calls run at once on tensors (the rewrite's emit graph nodes instead):
    a rank's pieces put through the local executions as the rewrite would run them, to check them on
    data (:func:`autotp.planning.choices.check.check_rule`). Shapes are static."""

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.mesh_shape, self.coordinate, self.streams = tuple(mesh_shape), tuple(coordinate), 0

    def call_function(self, target: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        return target(*args, **kwargs)

    def call_module(self, module: nn.Module, kind: str, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        return module(*args, **kwargs)

    def local_sizes(self, sizes: Any, node: OpNode, placements: tuple[Placement, ...]) -> list:
        return list(local_shape(node.output.shape, placements, self.mesh_shape, self.coordinate))

    def new_stream(self) -> int:
        self.streams += 1
        return self.streams - 1

    def local_value(self, name: str) -> Any:
        raise LookupError(f"node {name}: an op run alone sees no other node's value")


@dataclass(frozen=True)
class LocalSite:
    """One node of one rank's graph as its local execution sees it (the module docstring lists the fields)."""

    node: OpNode
    strategy: Strategy
    reads: tuple[tuple[Placement, ...], ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    groups: tuple[Any, ...]
    axis_names: tuple[str, ...]
    target: Any
    args: tuple
    kwargs: Mapping[str, Any]
    seed: int = 0
    emitter: Optional[Emitter] = None
    graph: Optional[OpGraph] = None

    # -- values from the placements ---------------------------------------------------------

    def piece_of(self, size: int, placements: Sequence[Placement], axes: Sequence[int]) -> tuple[int, int]:
        """``(start, stop)`` of this rank's piece of a dim of ``size`` split over ``axes`` (in mesh
        order, each axis splitting the piece the ones before it left)."""
        start, length = 0, size
        for a in axes:
            lo, hi = piece_range(length, placements[a], self.mesh_shape[a], self.coordinate[a])
            start, length = start + lo, hi - lo
        return start, start + length

    def piece(self, k: int, dim: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's piece of dim ``dim`` of tensor input ``k`` as it is read:
        ``(0, size)`` where no mesh axis splits it."""
        placements = self.reads[k]
        axes = [a for a, p in enumerate(placements) if p.is_shard and p.dim == dim]
        return self.piece_of(self.node.input_infos[k].shape[dim], placements, axes)

    def shard_key(self, placements: Sequence[Placement]) -> tuple[int, ...]:
        """This rank's coordinates on the mesh axes that split a tensor placed ``placements``: equal
        on the ranks that hold the same piece."""
        return tuple(self.coordinate[a] for a, p in enumerate(placements) if p.is_shard)

    def called(self, args: Optional[tuple] = None, kwargs: Optional[Mapping[str, Any]] = None,
               target: Any = None) -> Call:
        """The op's own call, with ``args``, ``kwargs`` or ``target`` replaced where given."""
        return Call(self.target if target is None else target, self.args if args is None else args,
                    self.kwargs if kwargs is None else kwargs)

    # -- building the graph -----------------------------------------------------------------

    def _emitter(self) -> Emitter:
        if self.emitter is None:
            raise RuntimeError(f"node {self.node.name} ({self.node.target}): no graph is being built here; a "
                               "local execution that emits runs only inside the rewrite")
        return self.emitter

    def call(self, target: Any, args: tuple, kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        """Emit ``target(*args, **kwargs)`` into the graph; returns its value."""
        return self._emitter().call_function(target, args, dict(kwargs or {}))

    def call_module(self, module: nn.Module, kind: str, args: tuple,
                    kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        """Add ``module`` to the parallel module (named after ``kind``) and emit a call of it."""
        return self._emitter().call_module(module, kind, args, dict(kwargs or {}))

    def local_sizes(self, sizes: Any) -> list:
        """A shape argument of the op (its whole output's sizes) as this rank's piece's sizes; a
        dynamic size split over ``k`` pieces becomes its size ``// k``."""
        return self._emitter().local_sizes(sizes, self.node, self.strategy.output)

    def new_stream(self) -> int:
        """A random stream of its own for this node's draws (seeded with :attr:`seed`): numbered
        in the order the graph is built, the same on every rank."""
        return self._emitter().new_stream()

    def value(self, name: str) -> Any:
        """The local value node ``name`` of the graph (one built before this one) left on this rank,
        in its output's placements."""
        return self._emitter().local_value(name)


LocalExecution = Callable[[LocalSite], Union[None, Call, Any]]


def run_locally(site: LocalSite, executions: Sequence[LocalExecution]) -> Any:
    """The node's local value: the first of ``executions`` that applies (returns a :class:`Call`,
    emitted here, or a value it emitted), else the op as it is."""
    for execute in executions:
        result = execute(site)
        if result is None:
            continue
        return site.call(result.target, result.args, result.kwargs) if isinstance(result, Call) else result
    return site.call(site.target, site.args, site.kwargs)


class LocalCall(nn.Module):
    """The callable a user's ``local`` returned for one node, run on the rank's pieces in its place
    (``autotp.register_rule(op, rule, local=...)``). A module, so that any callable (a closure, a
    ``functools.partial``) can stand in the graph, which prints it by the op it replaces; the
    callable is held outside the module's tree (a module it may be adds no parameters)."""

    def __init__(self, run: Callable[..., Any], op: str) -> None:
        super().__init__()
        self.__dict__["run"] = run
        self.op = op

    def extra_repr(self) -> str:
        return f"{self.op}: {getattr(self.run, '__qualname__', type(self.run).__name__)}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)
