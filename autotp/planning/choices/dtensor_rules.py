"""Strategies from DTensor's own op-strategy registry, behind one adapter.

This is the only module of autotp that reads ``torch.distributed.tensor`` internals (the sharding
propagator, ``OpSchema``, ``OpStrategy``, ``DTensorSpec``, the single-mesh-dim strategy functions),
so a PyTorch upgrade that moves them touches this file alone. It answers one question for
:mod:`autotp.planning.choices.strategies`: which single-axis choices does DTensor know for this op node, on an
axis of ``n`` ranks?

How: the op's ``OpOverload`` is found from the node's target name, and its arguments are the
node's typed :class:`~autotp.tracing.graph.OpArgs`, each tensor a meta tensor of its shape and dtype
(contiguous). Every tensor input gets an ``OpStrategy`` holding each
candidate placement (``Replicate``, ``Shard(d)`` for every dim, ``Partial("sum")``) on a 1-D
``DeviceMesh`` of ``n`` ranks built without any process group (``_init_backend=False``), so a
group the user has is never touched. The registry is asked the way DTensor's propagator asks it:
a single-mesh-dim strategy function first (its rules listed directly), else an op strategy
function (its ``OpSpec`` list), else a decomposition (``DecompShardingStrategy``). Each rule
becomes an :data:`AxisChoice` (inputs' placements, output placement).

DTensor registers a strategy when the op "can be executed on the local tensors of its
arguments" and the outputs form valid DTensors: the same contract autotp's runtime relies on
(each aten op runs on local shards, only the plan's collectives move data). Where DTensor's
dispatcher does more than run the op locally, the registry's answer does not hold for autotp,
so it is filtered out:

* placements other than ``Replicate``, ``Shard`` and ``Partial("sum")`` (``_StridedShard``,
  ``_MaskPartial``, ``_NormPartial``, min/max/avg partials): their local values mean something
  autotp's collectives do not undo; the whole rule is dropped;
* a rule with several tensor outputs of different placements (autotp gives all outputs of a
  node one placement); a partial sum of an integer or ``bool`` tensor (autotp never sums
  indices or masks, as its own rules);
* a shard of a dim that does not split evenly over ``n`` (DTensor allows uneven shards, autotp's
  runtime does not);
* ops whose arguments DTensor rewrites from global to local before running them (shape and
  stride arguments of views and ``new_*`` factories, scalar shape arguments such as
  ``group_norm``'s, ``squeeze`` dims), ops with a custom dispatch handler (``argmax``,
  ``convolution``, ...) and random ops (DTensor offsets the generator per shard): the registry
  is not asked, :func:`registry_axis_choices` returns ``None``.

Two details of the asking: a negative ``dim`` of ``self`` is normalized first (torch 2.13's scan
strategy compares it with shard dims as given, see :func:`_normalized_dims`), and a
decomposition is traced once per combination of candidate input placements, so one with more
than :data:`MAX_DECOMP_COMBINATIONS` is not traced (None).

The answer for a given op, argument signature, input shapes and ``n`` is cached, so repeated
layers cost one registry call. Anything the registry cannot answer (no entry, an exception, an
argument this adapter cannot describe) is ``None``; the caller then uses its fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import types
from typing import Any, Optional

import torch

from autotp.placement import P, Placement, R, S
from autotp.tracing.graph import SizeArg, TensorArg

log = logging.getLogger(__name__)

__all__ = ["AxisChoice", "registry_axis_choices", "registry_source", "available"]

# One single-axis choice: input placements (None = input not read as a tensor) and the output placement.
AxisChoice = tuple[tuple[Optional[Placement], ...], Placement]

# Decompositions are traced once per combination of candidate input placements: above this many
# combinations (a 4-D, 3-input op has 216) the registry's decomposition path is not asked.
MAX_DECOMP_COMBINATIONS = 256


@functools.lru_cache(maxsize=1)
def _dtensor() -> Any:
    """The DTensor internals this adapter reads, imported once (None when torch has no distributed)."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
        from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    except ImportError as err:  # a torch whose internals moved: autotp's own rules still work
        log.warning("autotp: DTensor's op-strategy registry is not usable with torch %s (%s); "
                    "ops without an own rule run replicated", torch.__version__, err)
        return None

    ns = types.SimpleNamespace(
        DeviceMesh=DeviceMesh, DecompShardingStrategy=DecompShardingStrategy, DTensorSpec=DTensorSpec,
        TensorMeta=TensorMeta, OpSchema=OpSchema, OpSpec=OpSpec, OpStrategy=OpStrategy,
        TupleStrategy=TupleStrategy, ShardingPlaceholder=_ShardingPlaceholder, Partial=Partial,
        Replicate=Replicate, Shard=Shard,
    )
    dispatcher = DTensor._op_dispatcher
    ns.prop = dispatcher.sharding_propagator
    # Ops DTensor does not run as "the op on local tensors" (see the module docstring).
    ns.rewritten = (set(ns.prop.op_to_shape_and_stride_idx) | set(ns.prop.op_to_scalar_shape_adjuster)
                    | set(ns.prop.squeeze_op_to_dims_variant) | set(dispatcher._custom_op_handlers)
                    | set(dispatcher._random_ops))
    return ns


def available() -> bool:
    """Whether this torch's DTensor registry can be asked."""
    return _dtensor() is not None


@functools.lru_cache(maxsize=None)
def _mesh(n: int) -> Any:
    """A 1-D mesh of ``n`` ranks that starts no process group (rank 0's view)."""
    return _dtensor().DeviceMesh("cpu", list(range(n)), _init_backend=False, _rank=0)


# ---------------------------------------------------------------------------------------------
# the call an OpNode describes


@dataclasses.dataclass(frozen=True)
class _Call:
    """An op with its arguments as DTensor's propagator takes them: tensors as meta tensors."""

    op: Any
    args: tuple
    kwargs: dict
    outputs: tuple  # one meta tensor per output


def resolve_op(target: str) -> Optional[Any]:
    """The ``OpOverload`` a target name such as ``"aten.mm.default"`` names, or None."""
    parts = target.split(".")
    if len(parts) != 3:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def _meta(info: Any) -> torch.Tensor:
    return torch.empty(info.shape, dtype=getattr(torch, info.dtype), device="meta")


def _call(node: Any, op: Any) -> _Call:
    """The call of ``node``: its OpArgs laid out by the op's schema (positional, then keyword-only)."""
    tensors = [_meta(i) for i in node.input_infos]

    def value(v: Any) -> Any:
        if isinstance(v, TensorArg):
            return tensors[v.index]
        if isinstance(v, SizeArg):  # a symbolic size: DTensor would read it as the example's, fixing it
            raise _Unsupported(f"a symbolic size {v}")
        if isinstance(v, tuple):
            return [value(x) for x in v]
        return v

    args, kwargs = [], {}
    for a, (name, v) in zip(op._schema.arguments, node.args.items()):
        if a.kwarg_only:
            kwargs[name] = value(v)
        else:
            args.append(value(v))
    call = _Call(op, tuple(args), kwargs, tuple(_meta(o) for o in node.outputs))
    order = [next(k for k, t in enumerate(tensors) if t is a) for a in _tensor_args(call)]
    if order != list(range(len(tensors))):  # the registry's rules list tensors in the schema's order
        raise _Unsupported(f"tensor arguments in the order {order}, not the schema's")
    return call


def _tensor_val(a: Any) -> Optional[torch.Tensor]:
    return a if isinstance(a, torch.Tensor) else None


class _Unsupported(Exception):
    """The node's arguments cannot be put into an OpSchema."""


# ---------------------------------------------------------------------------------------------
# asking the registry


def registry_source(op: Any) -> Optional[str]:
    """Where DTensor's registry keeps ``op``'s strategy: "single_dim", "strategy", "decomp" or None.

    None also when the op is one whose registry answer autotp does not use (module docstring).
    """
    dt = _dtensor()
    if dt is None or not isinstance(op, torch._ops.OpOverload) or op in dt.rewritten:
        return None
    if op in dt.prop.op_single_dim_strategy_funcs:
        return "single_dim"
    if op in dt.prop.op_strategy_funcs:
        return "strategy"
    if dt.DecompShardingStrategy.has_decomp(op):
        return "decomp"
    return None


def registry_axis_choices(graph: Any, node: Any, n: int) -> Optional[list[AxisChoice]]:
    """The single-axis choices DTensor's registry gives ``node`` on an axis of ``n`` ranks.

    Only exact ones for autotp's runtime (module docstring); ``None`` when the registry has no
    entry for the op, raises, or the node's arguments cannot be described.
    """
    op = resolve_op(node.target)
    if op is None or registry_source(op) is None or len(node.args.names) != len(op._schema.arguments):
        return None
    key = (node.target, node.args, node.input_infos, node.outputs, n)
    choices = _cached_choices(key, node, op)
    if choices is None or len(choices[0][0]) != len(node.inputs):
        return None
    return list(choices)


# (op, arguments, shapes, n) -> choices: one registry call per distinct signature (repeated layers
# share it). The answer depends on nothing else, so it is kept for the life of the process.
_CACHE: dict[tuple, Optional[tuple[AxisChoice, ...]]] = {}


def _cached_choices(key: tuple, node: Any, op: Any) -> Optional[tuple[AxisChoice, ...]]:
    if key not in _CACHE:
        n = key[-1]
        try:
            _CACHE[key] = _ask(op, _call(node, op), n)
        except Exception as err:  # noqa: BLE001 - the registry raising means "no answer"
            log.debug("autotp: DTensor's registry has no answer for %s (%s: %s)", op, type(err).__name__, err)
            _CACHE[key] = None
    return _CACHE[key]


def _candidates(dt: Any, ndim: int) -> list[Any]:
    return [dt.Replicate(), *(dt.Shard(d) for d in range(ndim)), dt.Partial("sum")]


def _schema(dt: Any, op: Any, call: _Call, n: int, as_strategy: bool) -> tuple[Any, list[torch.Tensor]]:
    """The OpSchema of the node on a mesh of ``n``: each tensor an OpStrategy of every candidate
    placement (``as_strategy``) or a DTensorSpec (R, the decomposition path enumerates itself)."""
    mesh = _mesh(n)
    tensors: list[torch.Tensor] = []

    def convert(a: Any) -> Any:
        val = _tensor_val(a)
        if val is None:
            if isinstance(a, (list, tuple)):
                items = [convert(x) for x in a]
                if as_strategy and items and all(isinstance(x, dt.OpStrategy) for x in items):
                    return dt.TupleStrategy(items)
                return type(a)(items)
            return a
        tensors.append(val)
        meta = dt.TensorMeta(val.shape, val.stride(), val.dtype)
        if not as_strategy:
            return dt.DTensorSpec(mesh, (dt.Replicate(),), tensor_meta=meta)
        return dt.OpStrategy([dt.OpSpec(dt.DTensorSpec(mesh, (p,), tensor_meta=meta))
                              for p in _candidates(dt, val.ndim)])

    plain_args, plain_kwargs = _normalized_dims(op, call)
    args = tuple(convert(a) for a in plain_args)
    kwargs = {k: convert(v) for k, v in plain_kwargs.items()}
    schema = dt.OpSchema(op, args, kwargs)
    info = dt.prop.op_to_schema_info.get(op) or dt.prop.op_to_schema_info_for_single_dim_strategy.get(op)
    if info is not None:
        schema.schema_info = info
        schema._recompute_comparison_key()
    return schema, tensors


_DIM_ARGUMENTS = ("dim", "dims")


def _normalized_dims(op: Any, call: _Call) -> tuple[tuple, dict]:
    """The node's arguments with negative ``dim``/``dims`` of ``self`` made non-negative.

    Some strategy functions compare the dim argument with shard dims as given (torch 2.13's
    ``scan_strategy`` keeps ``Shard(1)`` through ``cumsum(x, -1)`` of a 2-D ``x``, which is not
    exact). To the op a negative dim means its normalized value, so the registry is asked with
    that. Only where ``dim`` indexes the dims of ``self``: the op's first argument is the tensor
    ``self`` and no output has more dims (``unsqueeze``'s dim counts the output's dims).
    """
    arguments = op._schema.arguments
    args, kwargs = call.args, call.kwargs
    self_val = _tensor_val(args[0]) if args else None
    if not arguments or arguments[0].name != "self" or self_val is None:
        return args, kwargs
    ndim = self_val.ndim
    if any(o.ndim > ndim for o in call.outputs):
        return args, kwargs

    def norm(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value + ndim if -ndim <= value < 0 else value
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return type(value)(norm(v) for v in value)
        return value

    names = [a.name for a in arguments]
    args = tuple(norm(a) if i < len(names) and names[i] in _DIM_ARGUMENTS else a for i, a in enumerate(args))
    kwargs = {k: norm(v) if k in _DIM_ARGUMENTS else v for k, v in kwargs.items()}
    return args, kwargs


def _ask(op: Any, call: _Call, n: int) -> Optional[tuple[AxisChoice, ...]]:
    dt = _dtensor()
    outputs = list(call.outputs)
    tensors = _tensor_args(call)
    if not outputs or not tensors:
        return None
    source = registry_source(op)
    if source == "single_dim":
        rules = _single_dim_rules(dt, op, call, n)
    elif source == "strategy":
        rules = _strategy_rules(dt, op, call, n)
    else:
        rules = _decomp_rules(dt, op, call, n, tensors)
    if rules is None:
        return None
    # Running the op on whole tensors is the op itself: the replicated choice, listed first as
    # autotp's own rules list it (DTensor adds it to single-dim rules too).
    choices: list[AxisChoice] = [((R,) * len(tensors), R)]
    for ins, outs in rules:
        if len(ins) != len(tensors) or len(outs) != len(outputs):
            raise _Unsupported(f"{op}: a rule of {len(ins)} inputs and {len(outs)} outputs for a node of "
                               f"{len(tensors)} tensor inputs and {len(outputs)} outputs")
        choice = _to_choice(dt, ins, outs, tensors, outputs, n)
        if choice is not None and choice not in choices:
            choices.append(choice)
    return tuple(choices)


def _tensor_args(call: _Call) -> list[torch.Tensor]:
    """The call's tensor arguments in the order of OpNode.inputs (positional, then keyword)."""
    leaves = torch.utils._pytree.tree_leaves((list(call.args), call.kwargs))
    return [a for a in leaves if isinstance(a, torch.Tensor)]


def _single_dim_rules(dt: Any, op: Any, call: _Call, n: int) -> list[tuple[list, list]]:
    """A single-mesh-dim strategy function: rules [outputs..., inputs...], a sharding placeholder
    standing for a plain Shard of its dim."""
    schema, tensors = _schema(dt, op, call, n, as_strategy=True)
    info = dt.prop.op_single_dim_strategy_funcs[op]
    out: list[tuple[list, list]] = []
    for rule in info.func(op, schema.args_meta, schema.kwargs_meta):
        rule = [dt.Shard(p.dim) if isinstance(p, dt.ShardingPlaceholder) else p for p in rule]
        k = len(rule) - len(tensors)
        out.append((rule[k:], rule[:k]))
    return out


def _spec_placement(spec: Any) -> Any:
    return None if spec is None else spec.placements[0]


def _strategy_rules(dt: Any, op: Any, call: _Call, n: int) -> Optional[list[tuple[list, list]]]:
    """An op strategy function: one rule per OpSpec it returns."""
    schema, tensors = _schema(dt, op, call, n, as_strategy=True)
    strategy = dt.prop.op_strategy_funcs[op](schema)
    if not isinstance(strategy, dt.OpStrategy):  # a TupleStrategy (foreach, List[Tensor] outputs): not used
        return None
    out: list[tuple[list, list]] = []
    for spec in strategy.strategies:
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        out_placements = [_spec_placement(s) for s in outs]
        if spec.input_specs is None:  # every input follows the (single) output
            ins = [out_placements[0]] * len(tensors)
        else:
            ins = [_spec_placement(s) for s in spec.input_specs]
        out.append((ins, out_placements))
    return out


def _decomp_rules(dt: Any, op: Any, call: _Call, n: int,
                  tensors: list[torch.Tensor]) -> Optional[list[tuple[list, list]]]:
    """A decomposition traced once per combination of candidate input placements, as DTensor's
    DecompShardingStrategy does (on its size-1 mesh: divisibility is checked afterwards)."""
    if math.prod(t.ndim + 2 for t in tensors) > MAX_DECOMP_COMBINATIONS:
        return None
    schema, _ = _schema(dt, op, call, n, as_strategy=False)
    decomp = dt.prop.decomp_strategy
    decomp.ensure_schema_info(op)
    fake_mesh = decomp._get_fake_mesh("cpu")
    # one placement per pytree leaf of the arguments (None for non-tensors), the order DTensor reads them
    leaves, _ = torch.utils._pytree.tree_flatten(list(schema.args_schema) + list(schema.kwargs_schema.values()))
    slots = [_candidates(dt, leaf.ndim) if isinstance(leaf, dt.DTensorSpec) else [None] for leaf in leaves]
    out: list[tuple[list, list]] = []
    for combo in itertools.product(*slots):
        try:
            result = decomp._propagate_through_decomp(schema, combo, fake_mesh)
        except NotImplementedError:  # an op of the decomposition has no strategy: no answer at all
            return None
        except (RuntimeError, KeyError, IndexError):  # this combination needs a redistribution
            continue
        outs = list(result) if isinstance(result, tuple) else [result]
        out.append(([p for p in combo if p is not None], outs))
    return out


def _to_placement(dt: Any, p: Any, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> Optional[Placement]:
    """autotp's placement for a DTensor placement of a tensor, or None when it is not exact here."""
    if type(p) is dt.Replicate:
        return R
    if type(p) is dt.Shard:
        d = p.dim + len(shape) if p.dim < 0 else p.dim
        if 0 <= d < len(shape) and shape[d] % n == 0 and shape[d] >= n:
            return S(d)
        return None
    if type(p) is dt.Partial and p.reduce_op == "sum" and (dtype.is_floating_point or dtype.is_complex):
        return P  # integers and booleans are never summed (autotp's own rules hold no partial index or mask)
    return None


def _to_choice(dt: Any, ins: list, outs: list, tensors: list[torch.Tensor],
               outputs: list[Optional[torch.Tensor]], n: int) -> Optional[AxisChoice]:
    in_placements: list[Placement] = []
    for p, t in zip(ins, tensors):
        q = _to_placement(dt, p, tuple(t.shape), t.dtype, n) if p is not None else None
        if q is None:
            return None
        in_placements.append(q)
    out_placements = set()
    for p, t in zip(outs, outputs):
        if t is None:
            continue
        q = _to_placement(dt, p, tuple(t.shape), t.dtype, n) if p is not None else None
        if q is None:
            return None
        out_placements.add(q)
    if len(out_placements) != 1:
        return None
    return tuple(in_placements), out_placements.pop()
