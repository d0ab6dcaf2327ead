"""Writes in place that later reads see through another name: what the plan must keep in one storage.

A captured graph keeps the model's in-place ops. Where a model writes through a view into a tensor
it reads again afterwards by its first name, as DeepSeek's attention builds its keys::

    keys = kv.new_empty(b, h, t, d_nope + d_rope)
    keys[..., :d_nope].copy_(k_nope)   # slice -> copy_: the write lands in ``keys``
    keys[..., d_nope:].copy_(k_rope)
    attention(q, keys, v)              # reads ``keys``, not the copy_ nodes

the later read sees the writes only if each rank's write lands in the storage of its local
``keys``. A redistribution on the way (``keys`` replicated, the slice read split, or a gradient
reduction there) makes a new tensor, and the write would land in it and be lost. So every read on
the way from the tensor to the write, the write's own first input and the views between, is
*pinned*: it must read its producer's local value as it is (:func:`pinned_reads`; the planner
allows no redistribution there); so is every read on the way to a view made before the write and
read after it. A view is an op in ``autotp.ops.VIEW`` or any ATen op whose schema returns its
first argument's storage (``narrow``, ``diagonal``, ``view.dtype``).

Reads of one value with the same placements share one redistribution (:mod:`autotp.planning.costs.program`); a
read after a write into the value's storage must not reuse one made before it. :func:`read_versions`
counts, per read, the writes into its storage between the value and the read, and the reads that
share carry that count in their key.

A write whose tensor is seen afterwards only through the op's own output (``h += x``, then ``h``
means the ``add_`` node) needs neither: the rewrite writes into a copy of a redistributed input,
and the readers read that copy.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Mapping

import torch

from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["writes_first_argument", "written_elsewhere", "writes_in_place", "aliases_first_input", "storage_roots", "pinned_reads", "read_versions"]


@functools.lru_cache(maxsize=None)
def _schema(target: str):
    """The schema of the op ``target`` names (``aten.add_.Tensor``: namespace, op, overload), or None."""
    parts = target.split(".")
    if len(parts) != 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])._schema
    except (AttributeError, RuntimeError):
        return None


@functools.lru_cache(maxsize=None)
def writes_first_argument(target: str) -> bool:
    """Whether the op ``target`` writes into its first argument, by its schema (``add_(Tensor(a!) self,
    ...)``)."""
    schema = _schema(target)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def written_elsewhere(target: str) -> str | None:
    """The name of an argument the op ``target`` writes into that is not its first tensor (``out=``,
    a list of tensors as ``_foreach_mul_``'s), by its schema; None where there is none. Only a write
    into the first argument is followed by the planner (:func:`pinned_reads`)."""
    schema = _schema(target)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        alias = argument.alias_info
        if alias is not None and alias.is_write and (i > 0 or not isinstance(argument.type, torch.TensorType)):
            return argument.name
    return None


def writes_in_place(node: OpNode) -> bool:
    """An op that writes into its first input (``aten.add_.Tensor``, ``aten.copy_.default``)."""
    return bool(node.inputs) and not node.is_placeholder and writes_first_argument(node.target)


@functools.lru_cache(maxsize=None)
def _returns_first_argument(target: str) -> bool:
    """Whether the op ``target`` (``aten.narrow.default``) returns a view of its first argument, by
    its schema (``narrow(Tensor(a) self, ...) -> Tensor(a)``)."""
    schema = _schema(target)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    first, out = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and out is not None and bool(set(first.before_set) & set(out.before_set))


def aliases_first_input(node: OpNode) -> bool:
    """A view (``ops.VIEW``, or any op whose schema returns its first argument's storage) or an
    in-place op: its output is its first input's storage."""
    if node.is_placeholder or not node.inputs:
        return False
    return node.is_view or writes_in_place(node) or _returns_first_argument(node.target)


def storage_roots(graph: OpGraph) -> Mapping[str, str]:
    """Per node, the node whose storage its output is: a view's and an in-place op's are their
    first input's (transitively); any other node's is its own. Read-only, computed once per graph
    (the planner asks for it per layer)."""
    root = _ROOTS.get(graph)
    if root is None:
        found: dict[str, str] = {}
        for n in graph.nodes:
            found[n.name] = found[n.inputs[0]] if aliases_first_input(n) else n.name
        root = _ROOTS[graph] = types.MappingProxyType(found)
    return root


_ROOTS: "weakref.WeakKeyDictionary[OpGraph, Mapping[str, str]]" = weakref.WeakKeyDictionary()


def _writes(graph: OpGraph, root: Mapping[str, str]) -> dict[str, list[int]]:
    """Per storage root, the positions of the ops that write into it in place."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if writes_in_place(n):
            out.setdefault(root[n.name], []).append(i)
    return out


def pinned_reads(graph: OpGraph) -> frozenset[tuple[str, int]]:
    """``(consumer, input index)`` of the reads that must take their producer's local value as it
    is: the chain from a tensor to an in-place write into it (the write's first input and the
    views between), where the storage is seen after the write under another name: a node made
    before the write that aliases it is read after it or returned, or the storage is a placeholder's
    (a parameter, buffer or input: the caller sees it)."""
    root = storage_roots(graph)
    members: dict[str, list[str]] = {}
    for name, r in root.items():
        members.setdefault(r, []).append(name)
    outputs = set(graph.outputs)
    pinned: set[tuple[str, int]] = set()

    def pin_chain(name: str) -> None:  # each read from ``name`` back to its storage's own node
        node = graph[name]
        while node.name != root[name]:
            pinned.add((node.name, 0))
            node = graph[node.inputs[0]]

    for r, positions in _writes(graph, root).items():
        for at in positions:
            # the aliases made before the write and read after it (or returned): they must be views
            # of the storage the write lands in, as the write's own chain must
            later = [m for m in members[r] if graph.position(m) < at and (
                m in outputs or any(graph.position(c) > at for c in graph.consumers(m)))]
            if not later and not graph[r].is_placeholder:
                continue
            pin_chain(graph.nodes[at].name)
            for m in later:
                pin_chain(m)
    return frozenset(pinned)


def read_versions(graph: OpGraph, output: str = "<output>") -> dict[tuple[str, int], int]:
    """``(consumer, input index) -> n`` for the reads that come after ``n > 0`` in-place writes into
    their producer's storage made after the producer (reads with other counts see other values);
    the graph's outputs as ``(output, i)``, read after every node."""
    root = storage_roots(graph)
    writes = _writes(graph, root)
    if not writes:
        return {}
    reads = [(at, n.name, k, src) for at, n in enumerate(graph.nodes) for k, src in enumerate(n.inputs)]
    reads += [(len(graph.nodes), output, i, src) for i, src in enumerate(graph.outputs)]
    out: dict[tuple[str, int], int] = {}
    for at, consumer, k, src in reads:
        made = graph.position(src)
        count = sum(1 for w in writes.get(root[src], ()) if made < w < at)
        if count:
            out[(consumer, k)] = count
    return out
