"""Attention masks found from the graph: an ``(S_q, S_k)`` mask proven to be positions compared
(causal, a sliding window) and a per-key padding vector is replaced by its description.

A traced Hugging Face decoder builds its mask in the graph from position aranges (``k_pos <=
q_pos``; for a sliding window ``k_pos > q_pos - w``), the padding ``attention_mask`` looked up per
key and, without one, a packed-sequence index that is the same for every token; the mask then
reaches ``scaled_dot_product_attention`` as a ``(B, 1, S_q, S_k)`` boolean tensor: 16 GiB a
sequence at 128k tokens, an explicit mask that rules out the flash kernel, every masked score
priced and computed. :func:`describe_masks` evaluates the subgraph that makes each such mask
**symbolically**: every tensor is an expression of its own element's indices (``sympy``), each op
mapped to what it does to them (an arange is its index, an unsqueeze renames indices, a lookup in
the padding input is an opaque atom ``pad(b, j)``, a comparison a relation, ``&`` a conjunction, a
``copy_`` into a buffer its source, where every read of its result comes before the buffer's next
write: a static cache's position counter, :func:`_read_before_overwritten`).
The mask's expression must then read the batch index only through ``pad(b, j)``, and the query
row ``i`` and key column ``j`` only through ``d = i - j`` in relations linear in it. Whether such
a formula is causal / windowed is decided exactly, not by sampling: each relation changes value
only next to its root, so the formula's truth is constant between consecutive roots, and it is
read off one ``d`` in each piece, for the padding atom true and false. It must allow an interval
of ``d`` (a lower end: causal; an upper end too: a window) where the key is not padding, and
nothing where it is.

Each call so proven is replaced: by ``scaled_dot_product_attention(q, k, v, is_causal=True)``
where the mask is exactly causal (no padding, ``S_q == S_k``, queries and keys from the same
position), else by :data:`autotp.masks.MASKED_ATTENTION` holding the description
(:class:`~autotp.masks.MaskSpec`) and the padding vector. The mask's subgraph, unread
then, is removed, so no ``(S_q, S_k)`` tensor is left in the graph, the plan or its memory. Left
as they are (a tensor mask, priced as one): additive (float) masks, masks read from other inputs
(a ``cache_position`` or ``position_ids`` given to the model, as ``generate``'s decode steps do;
its prompt's graph makes its positions in the graph, :func:`autotp.runtime.static_cache.with_static_cache`),
attention with dropout, and any op the evaluation does not know. In-place writes stay in the graph
when the mask's subgraph is removed.

>>> import torch, autotp
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...     num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
>>> g = autotp.capture(model, (torch.zeros(1, 8, dtype=torch.long),))
>>> [n.args.get("is_causal") for n in g.ops() if "attention" in n.target]
[True]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
import torch.fx
from sympy.logic.boolalg import BooleanFunction

from autotp.masks import MASKED_ATTENTION, MaskSpec
from autotp.tracing.dynamic import size_hint

__all__ = ["describe_masks", "MaskFound"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_IDX = tuple(sympy.Symbol(f"x{k}", integer=True) for k in range(8))  # a tensor's own element indices
_D = sympy.Symbol("d", integer=True)
_PAD = sympy.Symbol("pad")


class Lookup(BooleanFunction):
    """``pad(k, b, j)``: element ``(b, j)`` of the ``k``-th boolean padding vector: an opaque atom."""

    @classmethod
    def eval(cls, *args: Any) -> None:
        return None


class _Unknown(Exception):
    """An op, or a use of one, the evaluation does not model: the mask is left as it is."""


@dataclass(frozen=True)
class MaskFound:
    """What :func:`describe_masks` did to one attention call: its node's name, the description,
    whether a padding vector is read, and what the call became (``"is_causal"``, ``"described"``)."""

    node: str
    spec: MaskSpec
    padded: bool
    became: str


def _shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise _Unknown(f"{node} has no tensor value")
    return tuple(size_hint(s) for s in val.shape)


def _is_bool(node: torch.fx.Node) -> bool:
    return node.meta["val"].dtype is torch.bool


class _Evaluator:
    """Each node's value as a sympy expression of its element's indices ``x0 .. x{ndim-1}``."""

    def __init__(self) -> None:
        self.memo: dict[torch.fx.Node, Any] = {}
        self.pads: list[torch.fx.Node] = []  # the boolean (B, S) nodes Lookup's first argument numbers
        self.visited: set[torch.fx.Node] = set()

    def __call__(self, value: Any, out_shape: tuple[int, ...]) -> Any:
        """``value`` (a node or a Python scalar) broadcast to ``out_shape``, as an expression of its indices."""
        if not isinstance(value, torch.fx.Node):
            if isinstance(value, bool):
                return sympy.true if value else sympy.false
            if isinstance(value, (int, float)):
                return sympy.Integer(value) if isinstance(value, int) or float(value).is_integer() else sympy.Float(value)
            raise _Unknown(f"argument {value!r}")
        if value not in self.memo:
            self.memo[value] = self._node(value)
        return _broadcast(self.memo[value], _shape(value), out_shape)

    def _node(self, node: torch.fx.Node) -> Any:
        self.visited.add(node)
        shape = _shape(node)
        if node.op == "placeholder":
            if _is_bool(node) and len(shape) == 2:
                return self._lookup(node)
            raise _Unknown(f"input {node.name}")
        if node.op != "call_function":
            raise _Unknown(node.op)
        name = str(node.target)
        op = name.split(".")[1] if name.startswith("aten.") else name
        args, kw = node.args, node.kwargs
        if op == "arange":
            if name == "aten.arange.default":
                return _IDX[0]
            start = args[0]
            step = args[2] if len(args) > 2 else kw.get("step", 1)
            if not isinstance(start, int) or not isinstance(step, int):
                raise _Unknown("an arange from a size not constant")
            return start + step * _IDX[0]
        if op in ("to", "_to_copy", "clone", "alias", "contiguous", "lift_fresh_copy"):
            src = args[0]
            if _is_bool(node) and not _is_bool(src):
                if src.op == "placeholder" and len(shape) == 2 and not src.meta["val"].is_floating_point():
                    return self._lookup(node)  # the padding attention_mask made boolean: an atom
                raise _Unknown("a cast to bool")
            if not _is_bool(node) and _is_bool(src):
                raise _Unknown("a cast from bool")
            return self(src, shape)
        if op in ("add", "sub", "mul"):
            a, b = self(args[0], shape), self(args[1], shape)
            alpha = kw.get("alpha", 1)
            return {"add": a + alpha * b, "sub": a - alpha * b, "mul": a * b}[op]
        if op in ("le", "lt", "ge", "gt", "eq", "ne"):
            a, b = self(args[0], shape), self(args[1], shape)
            if _truth(a) or _truth(b):
                raise _Unknown("a comparison of booleans")
            return {"le": sympy.Le, "lt": sympy.Lt, "ge": sympy.Ge, "gt": sympy.Gt, "eq": sympy.Eq,
                    "ne": sympy.Ne}[op](a, b)
        if op in ("__and__", "bitwise_and", "logical_and", "__or__", "bitwise_or", "logical_or"):
            if not (_is_bool(node) and all(not isinstance(a, torch.fx.Node) or _is_bool(a) for a in args[:2])):
                raise _Unknown("a bitwise op on integers")
            a, b = self(args[0], shape), self(args[1], shape)
            return sympy.And(a, b) if "and" in op else sympy.Or(a, b)
        if op in ("bitwise_not", "logical_not") and _is_bool(args[0]):
            return sympy.Not(self(args[0], shape))
        if op in ("new_ones", "new_zeros", "ones", "zeros"):
            one = "ones" in op
            return (sympy.true if one else sympy.false) if _is_bool(node) else sympy.Integer(int(one))
        if op in ("unsqueeze", "expand", "squeeze", "view", "reshape", "_unsafe_view"):
            return self._reshaped(node, shape)
        if op == "slice" and name == "aten.slice.Tensor":
            src_shape = _shape(args[0])
            dim = (args[1] if len(args) > 1 else 0) % len(src_shape)
            start = args[2] if len(args) > 2 else 0
            step = args[4] if len(args) > 4 else 1
            start = 0 if start is None else start
            if not isinstance(start, int) or start < 0 or not isinstance(step, int):
                raise _Unknown("a slice from a negative or symbolic start")
            src = self(args[0], src_shape)
            return src.xreplace({_IDX[dim]: start + step * _IDX[dim]})
        if op == "index" and name == "aten.index.Tensor":
            src_shape, indices = _shape(args[0]), args[1]
            if len(indices) != len(src_shape) or any(i is None for i in indices):
                raise _Unknown("an index with Nones or fewer indices than dims")
            src = self(args[0], src_shape)
            return src.xreplace({_IDX[k]: self(ix, shape) for k, ix in enumerate(indices)})
        if op == "diff" and name == "aten.diff.default":
            return self._diff(node, shape)
        if op == "select" and name == "aten.select.int":
            src_shape = _shape(args[0])
            dim, index = args[1] % len(src_shape), args[2]
            if not isinstance(index, int) or index < 0:
                raise _Unknown("a select at a negative or symbolic index")
            # the output's indices are the source's with ``dim`` dropped (xreplace is simultaneous)
            mapping = {_IDX[k]: (_IDX[k] if k < dim else sympy.Integer(index) if k == dim else _IDX[k - 1])
                       for k in range(len(src_shape))}
            return self(args[0], src_shape).xreplace(mapping)
        if op == "copy_" and name == "aten.copy_.default":
            _read_before_overwritten(node)
            return self(args[1], shape)  # the tensor written, as its readers see it: the source's values
        if op == "cumsum":
            dim = args[1] % len(shape)
            src = self(args[0], shape)
            if src in (sympy.false, sympy.Integer(0)):
                return sympy.Integer(0)
            raise _Unknown("a cumulative sum of a value not all zero")
        raise _Unknown(name)

    def _lookup(self, node: torch.fx.Node) -> Any:
        if node not in self.pads:
            self.pads.append(node)
        return Lookup(sympy.Integer(self.pads.index(node)), _IDX[0], _IDX[1])

    def _reshaped(self, node: torch.fx.Node, shape: tuple[int, ...]) -> Any:
        """A view that only adds, drops or broadcasts dims of one element (no dim's size changes but to or from 1)."""
        src_shape = _shape(node.args[0])
        src = self(node.args[0], src_shape)
        if str(node.target) == "aten.expand.default":
            return _broadcast(src, src_shape, shape)
        kept_in = [k for k, s in enumerate(src_shape) if s != 1]
        kept_out = [k for k, s in enumerate(shape) if s != 1]
        if [src_shape[k] for k in kept_in] != [shape[k] for k in kept_out]:
            raise _Unknown("a view that moves elements")
        mapping = {_IDX[k]: sympy.Integer(0) for k, s in enumerate(src_shape) if s == 1}
        mapping.update({_IDX[a]: _IDX[b] for a, b in zip(kept_in, kept_out)})
        return src.xreplace(mapping)

    def _diff(self, node: torch.fx.Node, shape: tuple[int, ...]) -> Any:
        """``diff(x, 1, dim, prepend)``: equal to one expression where ``x[t] - x[t - 1]`` is the
        same for every ``t`` and the first difference (against ``prepend``'s last) is too."""
        args = node.args
        n = args[1] if len(args) > 1 else 1
        dim = (args[2] if len(args) > 2 else -1) % len(shape)
        prepend = args[3] if len(args) > 3 else None
        append = args[4] if len(args) > 4 else None
        if n != 1 or prepend is None or append is not None:
            raise _Unknown("a diff other than one step with a prepended value")
        x = self(args[0], _shape(args[0]))
        before = self(prepend, _shape(prepend))
        t = _IDX[dim]
        step = sympy.simplify(x - x.xreplace({t: t - 1}))
        first = sympy.simplify(x.xreplace({t: 0}) - before.xreplace({t: _shape(prepend)[dim] - 1}))
        if step.free_symbols & {t} or sympy.simplify(step - first) != 0:
            raise _Unknown("a diff that is not the same everywhere")
        return step


def _written(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node``'s op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    given = dict(zip([a.name for a in schema.arguments], node.args))
    given.update(node.kwargs)
    return [given.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _aliases(start: torch.fx.Node) -> set[torch.fx.Node]:
    """``start`` and every node whose output may be a view of it, transitively (an op whose schema's
    result aliases an argument: a view, a ``to`` that may return its input, an in-place op's result)."""
    found, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is not None and schema.returns and schema.returns[0].alias_info is not None:
                todo.append(user)
    return found


def _read_before_overwritten(copy: torch.fx.Node) -> None:
    """``copy_(dest, src)`` is read as ``src``'s values only where every op that reads its result (or
    a view of it) runs before any later in-place write to ``dest`` (or a view of it): a cache's
    position counter, set from the cache positions then advanced by each layer's update, is read
    by the mask between the two."""
    order = {n: k for k, n in enumerate(copy.graph.nodes)}
    written = _aliases(copy.args[0])
    writes = [order[u] for a in written for u in a.users if u is not copy and order[u] > order[copy]
              and any(w is a for w in _written(u))]
    first_write = min(writes, default=len(order))
    readers = {u for a in _aliases(copy) for u in a.users}
    late = sorted((r.name for r in readers if order[r] > first_write), key=str)
    if late:
        raise _Unknown(f"{copy.name}'s tensor is written again before {late} read it")


def _truth(expr: Any) -> bool:
    """Whether ``expr`` is a truth value (a symbol is not: sympy's symbols are both)."""
    return isinstance(expr, (sympy.logic.boolalg.BooleanAtom, BooleanFunction, sympy.core.relational.Relational))


def _broadcast(expr: Any, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Any:
    """An expression of a tensor's indices as one of the indices of its broadcast to ``out_shape``."""
    lead = len(out_shape) - len(shape)
    if lead < 0:
        raise _Unknown("a broadcast to fewer dims")
    mapping = {_IDX[k]: (sympy.Integer(0) if s == 1 and out_shape[k + lead] != 1 else _IDX[k + lead])
               for k, s in enumerate(shape)}
    return expr.xreplace(mapping) if mapping else expr


def _in_d(relation: Any, i: Any, j: Any) -> tuple[Any, float]:
    """A relation linear in ``i - j`` alone, as one of ``d``, with the ``d`` where its sides meet."""
    diff = sympy.expand(relation.lhs - relation.rhs)
    if not diff.free_symbols <= {i, j}:
        raise _Unknown("a relation of other indices")
    poly = sympy.Poly(diff, i, j)
    if poly.total_degree() > 1:
        raise _Unknown("a relation not linear")
    a, b = poly.coeff_monomial(i), poly.coeff_monomial(j)
    if a != -b or a == 0:
        raise _Unknown("a relation not of i - j")
    root = -poly.coeff_monomial(1) / a
    return relation.xreplace({i: _D, j: sympy.Integer(0)}), float(root)


def _prove(expr: Any, ndim: int) -> tuple[Optional[MaskSpec], bool, int]:
    """The description of a mask of ``ndim`` dims whose element ``(.., i, j)`` is ``expr``: (the
    :class:`MaskSpec`, or None where no position is compared; whether the padding atom is read; its
    number). Raises :class:`_Unknown` where ``expr`` is not of that form."""
    i, j, batch = _IDX[ndim - 2], _IDX[ndim - 1], _IDX[0] if ndim >= 3 else None
    lookups = expr.atoms(Lookup)
    if len({atom.args[0] for atom in lookups}) > 1:
        raise _Unknown("two padding vectors")
    for atom in lookups:
        if atom.args[2] != j or atom.args[1] not in (batch, sympy.Integer(0)):
            raise _Unknown("a padding vector read at other than (batch, key)")
    number = int(next(iter(lookups)).args[0]) if lookups else -1
    formula = expr.xreplace({atom: _PAD for atom in lookups})
    if formula.free_symbols - {i, j, _PAD}:
        raise _Unknown("a mask that reads the batch or head index")
    relations, roots = {}, []
    for relation in formula.atoms(sympy.core.relational.Relational):
        relations[relation], root = _in_d(relation, i, j)
        roots.append(root)
    formula = formula.xreplace(relations)
    # the truth is constant between consecutive points next to a root: one d per piece decides it
    points = sorted({p for r in roots for p in range(math.floor(r) - 1, math.ceil(r) + 2)}) or [0]
    points = sorted({*points, *(a + 1 for a, b in zip(points, points[1:]) if b - a > 1)})
    lowest, highest = points[0] - 1, points[-1] + 1  # stand for all below / above

    def allowed(d: int, pad: bool) -> bool:
        value = formula.xreplace({_D: sympy.Integer(d), _PAD: sympy.true if pad else sympy.false})
        if value not in (sympy.true, sympy.false):
            raise _Unknown(f"a mask formula left undecided: {value}")
        return bool(value)

    grid = [lowest, *points, highest]
    if lookups and any(allowed(d, False) for d in grid):
        raise _Unknown("a mask that allows a padding key")
    on = [d for d in grid if allowed(d, True)]
    if not on:
        raise _Unknown("a mask that allows nothing")
    if any(not allowed(d, True) for d in grid if on[0] <= d <= on[-1]):
        raise _Unknown("a mask whose allowed offsets are not one interval")
    low = None if on[0] == lowest else on[0]
    high = None if on[-1] == highest else on[-1]
    if low is None and high is not None:
        raise _Unknown("a window without a causal bound")
    if low is None:
        return None, bool(lookups), number
    window = None if high is None else high - low + 1
    return MaskSpec(causal=True, window=window, diagonal=-low), bool(lookups), number


def _attention_arguments(node: torch.fx.Node) -> dict[str, Any]:
    names = [a.name for a in _SDPA._schema.arguments]
    found = dict(zip(names, node.args))
    found.update(node.kwargs)
    return found


def describe_masks(gm: torch.fx.GraphModule) -> list[MaskFound]:
    """Replace, in ``gm``'s graph in place, the mask of each attention call proven a description
    (module doc), and remove the mask's subgraph where nothing else reads it. Returns what was done."""
    graph = gm.graph
    found: list[MaskFound] = []
    evaluator = _Evaluator()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        args = _attention_arguments(node)
        mask = args.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or not _is_bool(mask) or args.get("is_causal") \
                or (args.get("dropout_p") or 0.0) > 0.0:
            continue
        q, k = _shape(args["query"]), _shape(args["key"])
        out = _shape(node)
        try:
            expr = evaluator(mask, out[:-1] + (k[-2],))
            spec, padded, number = _prove(expr, len(out))
        except (_Unknown, TypeError, ValueError, sympy.PolynomialError):
            continue  # left as it is: a tensor mask
        pad = evaluator.pads[number] if padded else None
        if pad is not None and (_shape(pad)[1] != k[-2] or _shape(pad)[0] not in (1, q[0])):
            continue
        # the call changed in place: it keeps its name, as the trace gave it (the unroll names layers
        # by fx's counts, autotp/tracing/repeats.py)
        kw = {"scale": args.get("scale"), "enable_gqa": bool(args.get("enable_gqa", False))}
        qkv = (args["query"], args["key"], args["value"])
        if spec is not None and pad is None and spec == MaskSpec() and q[-2] == k[-2]:
            node.args, node.kwargs, became = qkv, {"is_causal": True, **kw}, "is_causal"
        elif spec is None and pad is None:  # every key allowed: no mask at all
            node.args, node.kwargs, became = qkv, kw, "unmasked"
        else:
            spec = spec or MaskSpec(causal=False)
            node.target = MASKED_ATTENTION
            node.args, node.kwargs = qkv + (pad, spec.causal, spec.window, spec.diagonal), kw
            became = "described"
        found.append(MaskFound(node.name, spec or MaskSpec(causal=False), pad is not None, became))
    if found:
        gm.meta.setdefault(ERASED, []).extend(_remove_unread(graph, evaluator.visited))
        gm.recompile()
    return found


_CHECKS = (aten._assert_tensor_metadata.default,)
ERASED = "autotp_erased"  # the graph module's meta: the op nodes erased here (_remove_unread), in graph order


def _remove_unread(graph: torch.fx.Graph, candidates: set[torch.fx.Node]) -> list[tuple[str, Optional[str]]]:
    """Erase the nodes of ``candidates`` nothing reads any more (but the checks on their own metadata);
    their names in graph order, each with the name of the op kept after it (``OpGraph.erased``)."""
    order = [n.name for n in graph.nodes if n.op == "call_function"]
    erased = []
    for node in reversed(list(graph.nodes)):
        if node not in candidates or node.op != "call_function" or _written(node):
            continue  # an in-place write (a cache's position counter set) stays
        if all(u.op == "call_function" and u.target in _CHECKS for u in node.users):
            for check in list(node.users):
                erased.append(check.name)
                graph.erase_node(check)
            erased.append(node.name)
            graph.erase_node(node)
    gone, result, following = set(erased), [], None
    for name in reversed(order):  # each erased op with the op kept after it
        if name in gone:
            result.append((name, following))
        else:
            following = name
    return result[::-1]

