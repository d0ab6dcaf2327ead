"""What autograd keeps for the backward: the activations a training step holds at its peak.

A forward in train mode keeps, for each op that needs a gradient, the tensors its backward formula
reads (ATen's derivatives): ``linear`` its input (for the weight's gradient), ``mul`` each operand
the other's gradient needs, ``silu`` and ``pow`` their input, ``rsqrt``, ``exp``, ``softmax`` and
``log_softmax`` their output, ``scaled_dot_product_attention`` its query, key, value, output and
log-sum-exp (:data:`SAVES`); ``add``, ``sum``, ``mean``, ``cat``, views and dtype casts keep
nothing (:data:`KEEPS_NOTHING`); an op in neither table keeps every floating input it reads, so
that an op autotp has not met is counted high rather than low. What is kept is a *storage*: a
view of a kept tensor keeps its base, so a tensor saved by two readers (attention's output,
saved by the attention and, through a reshape, by the output projection) counts once. A
parameter, buffer or input is alive anyway and counts nothing here. A ``reshape`` of an
``expand`` (grouped-query attention's repeated keys) copies, and is a storage of its own.

:func:`kept_storages` reads this off a graph once: the nodes whose output storage the backward
keeps, and the extra bytes an op keeps beside its inputs and output (the attention's log-sum-exp,
per output element). The cost model prices a node's activations as its output's local bytes at
its chosen placement when it is kept (:meth:`autotp.planning.costs.costing.CostModel.node_memory`), and
the backward's first gradients as twice each returned tensor (its gradient, and the one the first
backward op makes of the same size: a logits-sized pair where the loss is outside). A reader that
reads a kept input at another placement than its producer made keeps that copy too (a gathered
input): :attr:`KeptStorages.saved_reads` lists those reads, and the cost model counts the copy's
bytes beyond its source once per value and placement
(:meth:`autotp.planning.costs.costing.CostModel.copies_bytes`).

>>> import torch, autotp
>>> class MLP(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
...     def forward(self, x):
...         return self.down(torch.nn.functional.silu(self.up(x))) + x
>>> g = autotp.capture(MLP(), (torch.randn(4, 8),))
>>> sorted(g[n].target for n in kept_storages(g).kept)   # silu's input and down's input
['aten.linear.default', 'aten.silu.default']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from autotp.tracing.aliasing import storage_roots
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["KeptStorages", "SAVES", "kept_storages", "returned_outputs", "ForwardLiveness", "forward_liveness"]


def _grad(graph: OpGraph, node: OpNode, k: int) -> bool:
    return k < len(node.inputs) and graph[node.inputs[k]].requires_grad


def _product(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    """``a * b`` (``mm``, ``bmm``, ``linear``'s input and weight): each operand if the other needs a gradient."""
    return tuple(k for k, other in ((0, 1), (1, 0)) if _grad(graph, node, other))


def _addmm(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    return tuple(k for k, other in ((1, 2), (2, 1)) if _grad(graph, node, other))


def _divide(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    return (1,) + ((0,) if _grad(graph, node, 1) else ())


def _first(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    return (0,)


def _attention(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    return (0, 1, 2)


def _indices(k: int) -> Callable[[OpGraph, OpNode], tuple[int, ...]]:
    return lambda graph, node: (k,) if k < len(node.inputs) else ()


# op -> (the inputs its backward reads, whether it reads its own output)
SAVES: Mapping[str, tuple[Callable[[OpGraph, OpNode], tuple[int, ...]], bool]] = {
    "aten.linear.default": (_product, False),
    "aten.mm.default": (_product, False),
    "aten.bmm.default": (_product, False),
    "aten.matmul.default": (_product, False),
    "aten.addmm.default": (_addmm, False),
    "aten.mul.Tensor": (_product, False),
    "aten.div.Tensor": (_divide, False),
    "aten.pow.Tensor_Scalar": (_first, False),
    "aten.silu.default": (_first, False),
    "aten.gelu.default": (_first, False),
    "aten.log.default": (_first, False),
    "aten.sin.default": (_first, False),
    "aten.cos.default": (_first, False),
    "aten.native_layer_norm.default": (_first, False),
    "aten.layer_norm.default": (_first, False),
    "aten.rms_norm.default": (_first, False),
    "aten.group_norm.default": (_first, False),
    "aten.embedding.default": (_indices(1), False),
    "aten.gather.default": (_indices(2), False),
    "aten.index.Tensor": (_indices(1), False),
    "aten.where.self": (_indices(0), False),
    "aten.masked_fill.Scalar": (_indices(1), False),
    "aten.masked_fill.Tensor": (_indices(1), False),
    "aten.rsqrt.default": (lambda g, n: (), True),
    "aten.sqrt.default": (lambda g, n: (), True),
    "aten.exp.default": (lambda g, n: (), True),
    "aten.tanh.default": (lambda g, n: (), True),
    "aten.sigmoid.default": (lambda g, n: (), True),
    "aten.relu.default": (lambda g, n: (), True),
    "aten._softmax.default": (lambda g, n: (), True),
    "aten.softmax.int": (lambda g, n: (), True),
    "aten._log_softmax.default": (lambda g, n: (), True),
    "aten.log_softmax.int": (lambda g, n: (), True),
    "aten.scaled_dot_product_attention.default": (_attention, True),
    "autotp.masked_attention.default": (_attention, True),  # its masks rebuilt in the backward, not kept
    # log_softmax (kept, input-sized: _EXTRA_INPUT) and nll_loss (its targets)
    "aten.cross_entropy_loss.default": (_indices(1), False),
    "aten.nll_loss_forward.default": (_indices(1), False),
    "aten.nll_loss.default": (_indices(1), False),
    "aten.nll_loss_nd.default": (_indices(1), False),
}
# ops whose backward reads no tensor (sums, negation, joins, copies, casts): they keep nothing.
# An op in neither table keeps every floating input it reads, as if its backward read them all:
# an unknown op is counted high rather than low.
KEEPS_NOTHING = frozenset({
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.neg.default",
    "aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim",
    "aten.cat.default", "aten.stack.default", "aten.clone.default", "aten.contiguous.default",
    "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default",
    "aten.expand.default", "aten.repeat.default", "aten.flip.default", "aten.roll.default",
    "aten.pad.default", "aten.constant_pad_nd.default", "aten.fill_.Scalar", "aten.zeros_like.default",
    "aten.ones_like.default", "aten.full_like.default", "aten.alias.default", "aten.detach.default",
    "aten.copy_.default", "aten.index_select.default", "aten.scatter_add.default",
    "aten.dropout.default",  # its mask: _EXTRA
})
# bytes an op keeps beside its inputs and output, per element of its output: attention's
# log-sum-exp, one float32 per query row (the output's last dim is the head's); dropout's mask,
# one bool per element
_EXTRA = {"aten.scaled_dot_product_attention.default": lambda node: 4.0 / max(node.outputs[0].shape[-1], 1),
          "autotp.masked_attention.default": lambda node: 4.0 / max(node.outputs[0].shape[-1], 1),
          "aten.dropout.default": lambda node: 1.0 if node.args.get("p", 0.0) and node.args.get("train", True) else 0.0}
# ... and per element of its first input, in that input's dtype: cross-entropy keeps the
# log-softmax of its logits, the size of the logits (as the piece of the logits it computes on)
_EXTRA_INPUT = {"aten.cross_entropy_loss.default": 1.0}
# bytes the backward of an op allocates at once, per element of its first input (in its dtype):
# cross-entropy's backward makes the gradient of its log-softmax, then the logits' gradient from
# it, while the kept log-softmax is still alive; the loss's backward runs first, so this is the
# first peak of the backward
_TRANSIENT_INPUT = {"aten.cross_entropy_loss.default": 2.0}


@dataclass(frozen=True)
class KeptStorages:
    """What the backward of a graph keeps (module docstring): ``kept``, the nodes whose output
    storage is kept; ``extra_per_element``, per node, the bytes it keeps beside them per element of
    its output; ``copies``, the nodes the graph marks as views that make a new storage."""

    kept: frozenset[str]
    extra_per_element: Mapping[str, float]
    copies: frozenset[str]
    returned: frozenset[str] = frozenset()  # the outputs a backward starts from (floating, needing a gradient)
    # (reader, input index) whose input its backward keeps: where the reader computes on another
    # placement than its producer's, what is kept is the reader's copy (a gathered input)
    saved_reads: frozenset[tuple[str, int]] = frozenset()
    # per node, in elements of its first input: what it keeps beside its output (a loss's log-softmax)
    # and what its backward allocates at once (the loss's gradients)
    extra_per_input_element: Mapping[str, float] = None  # type: ignore[assignment]
    transient_per_input_element: Mapping[str, float] = None  # type: ignore[assignment]
    # outputs returned beside a scalar loss (a model's logits): no gradient flows from them, but the
    # caller holds them, whole, while the backward runs
    held: frozenset[str] = frozenset()


def _copies(graph: OpGraph) -> frozenset[str]:
    """``reshape`` (or ``view``-like ``_unsafe_view``) nodes of an ``expand`` (through views): the
    expanded tensor has zero strides, and the reshape materializes it."""
    out = set()
    for node in graph.nodes:
        if node.is_view and node.target in ("aten.reshape.default", "aten._unsafe_view.default") and node.inputs:
            source = graph[node.inputs[0]]
            while source.is_view and source.target != "aten.expand.default" and source.inputs:
                if source.target == "aten.reshape.default":
                    break
                source = graph[source.inputs[0]]
            if source.target == "aten.expand.default" and node.outputs[0].numel != _numel_before_expand(graph, source):
                out.add(node.name)
    return frozenset(out)


def _numel_before_expand(graph: OpGraph, expand: OpNode) -> int:
    return graph[expand.inputs[0]].outputs[0].numel if expand.inputs else 0


def returned_outputs(graph: OpGraph) -> frozenset[str]:
    """The graph's outputs a backward can start from: one floating tensor each that needs a gradient
    (the losses among them are those of one element)."""
    return frozenset(n for n in graph.outputs if n in graph and graph[n].requires_grad and not graph[n].is_placeholder
                     and len(graph[n].outputs) == 1 and graph[n].output.is_float)


def kept_storages(graph: OpGraph) -> KeptStorages:
    """The storages the backward of ``graph`` keeps (module docstring); found once per graph."""
    found = graph.__dict__.get("_autotp_kept_storages")
    if found is not None:
        return found
    copies = _copies(graph)
    root = dict(storage_roots(graph))
    for node in graph.nodes:  # in order: a copy's readers find the copy
        if node.name in copies:
            root[node.name] = node.name
        elif node.is_view and node.inputs and root[node.name] != node.name:
            root[node.name] = root[node.inputs[0]]
    kept: set[str] = set()
    extra: dict[str, float] = {}
    reads: set[tuple[str, int]] = set()

    def keep(name: str) -> None:
        r = graph[root[name]]
        if not r.is_placeholder:  # a parameter, buffer or input lives across the step anyway
            kept.add(r.name)

    for node in graph.ops():
        if not node.requires_grad or node.is_view:
            continue
        if node.target in SAVES:
            inputs_of, own = SAVES[node.target]
            which = inputs_of(graph, node)
        elif node.target in KEEPS_NOTHING:
            which, own = (), False
        else:  # unknown: every floating input it reads (KEEPS_NOTHING)
            which, own = tuple(k for k, info in enumerate(node.input_infos) if info.is_float), False
        for k in which:
            if k < len(node.inputs):
                keep(node.inputs[k])
                reads.add((node.name, k))
        if own:
            keep(node.name)
        if node.target in _EXTRA:
            extra[node.name] = _EXTRA[node.target](node)
    extra_in = {n.name: _EXTRA_INPUT[n.target] for n in graph.ops() if n.requires_grad and n.target in _EXTRA_INPUT}
    transient_in = {n.name: _TRANSIENT_INPUT[n.target] for n in graph.ops()
                    if n.requires_grad and n.target in _TRANSIENT_INPUT}
    returned = returned_outputs(graph)
    held: frozenset[str] = frozenset()
    losses = frozenset(n for n in returned if graph[n].output.numel == 1)
    if losses:  # a model that returns its loss: the backward starts there; the rest is held by the caller
        returned, held = losses, returned - losses - frozenset(graph.unread_outputs)
    found = KeptStorages(frozenset(kept), extra, copies, returned, frozenset(reads), extra_in, transient_in, held)
    object.__setattr__(graph, "_autotp_kept_storages", found)  # a frozen dataclass: a cache, not a field
    return found


@dataclass(frozen=True)
class ForwardLiveness:
    """The storages alive after each op of a forward without autograd (inference): an op's output
    lives from the op to its last reader (through views of it; a returned one to the end).
    ``steps[i]`` holds the storage roots alive after op ``i`` (placeholders: parameters, buffers
    and inputs, which live anyway, are not listed)."""

    steps: tuple[frozenset[str], ...]

    def peak(self, bytes_of: Callable[[str], float]) -> float:
        """The most bytes alive after any op, with ``bytes_of(root)`` each storage's bytes."""
        return max((sum(bytes_of(r) for r in alive) for alive in self.steps), default=0.0)

    def largest(self, bytes_of: Callable[[str], float], k: int) -> list[frozenset[str]]:
        """The ``k`` steps with the most bytes alive under ``bytes_of``, distinct, largest first."""
        ranked = sorted(set(self.steps), key=lambda alive: -sum(bytes_of(r) for r in alive))
        return ranked[:k]


def forward_liveness(graph: OpGraph) -> ForwardLiveness:
    """When each op's output storage lives in a forward without autograd (:class:`ForwardLiveness`)."""
    found = graph.__dict__.get("_autotp_forward_liveness")
    if found is not None:
        return found
    root = storage_roots(graph)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    end = len(graph.nodes)
    last: dict[str, int] = {}
    for n in graph.nodes:
        r = root[n.name]
        last[r] = max(last.get(r, order[n.name]), order[n.name])
        for u in n.inputs:
            ru = root[u]
            last[ru] = max(last.get(ru, order[n.name]), order[n.name])
    for o in graph.outputs:
        if o in order:
            last[root[o]] = end
    born = {n.name: order[n.name] for n in graph.nodes if root[n.name] == n.name and not n.is_placeholder}
    steps = []
    alive: set[str] = set()
    by_end: dict[int, list[str]] = {}
    for r, i in born.items():
        by_end.setdefault(last.get(r, i), []).append(r)
    for i, n in enumerate(graph.nodes):
        if n.name in born:
            alive.add(n.name)
        steps.append(frozenset(alive))
        for r in by_end.get(i, ()):
            alive.discard(r)
    found = ForwardLiveness(tuple(steps))
    object.__setattr__(graph, "_autotp_forward_liveness", found)
    return found
