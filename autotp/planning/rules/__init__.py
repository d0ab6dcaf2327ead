"""Op families: for each op, the placements that are exact on one mesh axis of ``n`` ranks, and how
a node runs on a rank's local pieces under the strategy chosen.

A rule is a function ``rule(node, n) -> list of (input placements, output placement)``, one
placement per tensor input of the :class:`~autotp.tracing.graph.OpNode` in ``node.inputs`` order.
Each choice must be exact when the op runs on each rank's local pieces: ``R`` the whole tensor,
``S(d)`` the rank's even slice of dim ``d``, ``P`` a summand of a partial sum. Most ops run on their
pieces as they are; where one needs its arguments made local (a shape, a cut's sizes, the number
of groups) or runs as something else (a masked lookup, a loss or batch norm with collectives
inside, a seeded dropout), its family registers a **local execution** beside its rules: a function
``execute(site)`` of a :class:`~autotp.local.site.LocalSite`, the interface
:mod:`autotp.local.site` defines, which the rewrite calls for each node of the op.

Each family module holds both: ``RULES`` (op name -> rule) and ``LOCAL`` (op name -> local
execution). :data:`BUILTIN` and :data:`BUILTIN_LOCAL` gather them; where two families run the same
op (``aten.slice.Tensor``: a cut into blocks, else a strided slice), their local executions are
tried in the order of :data:`FAMILIES`, the first that applies wins. The user adds a rule for an op
autotp does not know, and its local execution if its pieces need one, with :func:`register_rule`,
and checks them on data with :func:`autotp.check_rule`
(:func:`autotp.planning.choices.check.check_rule`).

Modules:

- ``views``, ``pointwise``, ``reductions``, ``joins``, ``contractions``, ``indexing``: the op families
- ``factories``  ops that make a tensor from sizes alone: whole, or split where every element is alike
- ``randomness`` dropout and the random draws, each from a stream of its own on a rank
- ``convolutions`` convolutions (grouped, transposed), pooling, upsampling, pixel shuffles
- ``norms``      batch norm (synchronized over a split batch in training), group and instance norm
- ``experts``    grouped matmuls of routed tokens: experts split by features, or whole experts on
                 ranks (each rank its experts' rows, a sum of disjoint parts ``Pd`` carried to the combine)
- ``routed``     whole experts with the tokens split: routed rows sent to their experts' ranks and back
                 by all-to-all (a region of the graph: ``St``, ``Se``)
- ``attention``  attention under a described mask (causal, a window, a padding vector) and causal
                 attention split by query rows: each rank builds its rows' mask
- ``attention_working``  the working memory one masked attention call holds (a chunk's masks, the
                 ring's block scores), priced at the backward's start
- ``attention_kv``  keys and values repeated for the query heads in the graph: the rings that pass
                 them unrepeated (``ring/kv<g>``)
- ``blocks``     blocked splits: a fused projection cut into its parts, each part split
- ``uneven``     uneven splits: units (heads, vocabulary rows) the ranks do not divide
- ``gradients``  the ``Rg`` variants: replicated ops that pass a partial gradient on
- ``losses``     cross-entropy on split classes: its op does not run on its pieces as it is (its local
                 execution runs it with two all-reduces inside), nor does batch norm's on a split batch
- ``inner``      the collectives those two ops run inside themselves
- ``common``     what every family shares: a single-axis choice, the evenness test

>>> import torch, autotp
>>> from autotp.placement import R, S
>>> autotp.register_rule("mylib.twice.default", [((S(0),), S(0))])
>>> [f.__name__ for f in local_executions("aten.slice.Tensor")]
['local_cut', 'local_strided_slice']
>>> "mylib.twice.default" in registered_rules()
True
>>> autotp.unregister_rule("mylib.twice.default")
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence, Union

from autotp.local.site import LocalCall, LocalExecution, LocalSite
from autotp.placement import Placement, R, parse_placements
from autotp.planning.rules import (
    attention,
    blocks,
    contractions,
    convolutions,
    experts,
    factories,
    indexing,
    joins,
    losses,
    norms,
    pointwise,
    randomness,
    reductions,
    routed,
    views,
)
from autotp.planning.rules.common import AxisChoice
from autotp.tracing.graph import OpNode
from autotp.words import with_article

__all__ = ["AxisChoice", "Rule", "Local", "BUILTIN", "BUILTIN_LOCAL", "FAMILIES", "register_rule", "unregister_rule",
           "registered_rules", "user_choices", "local_executions", "op_name"]

Rule = Callable[[OpNode, int], Iterable[tuple[Sequence[Any], Any]]]
Local = Callable[[LocalSite], Optional[Callable[..., Any]]]  # the user's: the callable to run on the pieces, or None

# autotp's own rules by op name (a rule returning None leaves the node to the ones after); views,
# pointwise ops, splits and factories are found by kind (autotp.planning.choices.strategies), every other op in
# DTensor's registry (autotp.planning.choices.dtensor_rules).
BUILTIN: dict[str, Callable[[OpNode, int], Optional[list[AxisChoice]]]] = {
    **contractions.RULES, **pointwise.RULES, **randomness.RULES, **reductions.RULES, **joins.RULES, **indexing.RULES,
    **losses.RULES, **convolutions.RULES, **norms.RULES, **experts.RULES, **attention.RULES,
}

# the families with local executions, in the order they are tried where two run the same op
FAMILIES = (blocks, reductions, views, joins, factories, randomness, contractions, attention, routed, experts, losses,
            norms, convolutions)


def _by_op(families) -> dict[str, tuple[LocalExecution, ...]]:
    found: dict[str, tuple[LocalExecution, ...]] = {}
    for family in families:
        for name, execute in family.LOCAL.items():
            found[name] = found.get(name, ()) + (execute,)
    return found


# autotp's own local executions by op name, each op's in the order of FAMILIES
BUILTIN_LOCAL: dict[str, tuple[LocalExecution, ...]] = _by_op(FAMILIES)

_USER: dict[str, Rule] = {}
_USER_LOCAL: dict[str, Local] = {}


def op_name(op: Any) -> str:
    """An op as OpNode.target names it: ``torch.ops.mylib.foo.default`` or ``"mylib.foo.default"``
    (``"mylib::foo"`` means its default overload)."""
    if isinstance(op, str):
        name = op.replace("::", ".")
        if name.count(".") == 1:
            name += ".default"
        if name.count(".") != 2 or not all(name.split(".")):
            raise ValueError(f"op {op!r}: expected an op overload name such as 'mylib.foo.default' "
                             "(namespace.op.overload), 'mylib::foo', or the op itself (torch.ops.mylib.foo.default)")
        return name
    if type(op).__name__ == "OpOverloadPacket":
        raise ValueError(f"op {op} is an overload packet; pass one overload, e.g. {op}.default")
    if type(op).__name__ == "OpOverload":
        return str(op)
    raise TypeError(f"op is {with_article(type(op).__name__)}; expected a torch op overload (torch.ops.ns.op.overload) "
                    "or its name as a string")


def register_rule(op: Any, rule: Union[Rule, Sequence[tuple[Sequence[Any], Any]]], local: Optional[Local] = None) -> None:
    """Tell autotp how ``op`` may be split on one mesh axis, and how it runs on a rank's pieces.

    ``rule`` is either a list of ``(input placements, output placement)`` pairs that hold for any
    shapes, or a function ``rule(node, n)`` returning such pairs for one node (its shapes are in
    ``node.input_infos`` and ``node.output``, its arguments in ``node.args``) on an axis of ``n``
    ranks. Placements are :data:`~autotp.placement.R`, :data:`~autotp.placement.P` and
    :func:`~autotp.placement.S` (or the strings ``"R"``, ``"P"``, ``"S(1)"``), one per tensor
    argument in the order the op takes them. The replicated choice is always added; a choice that
    splits a dim unevenly is dropped. A registered rule replaces autotp's own and DTensor's for
    that op, in every later plan of this process. Check one on data with
    :func:`autotp.check_rule`: a rule that is not exact gives wrong numbers.

    Without ``local`` each rank runs ``op`` itself on its pieces, its other arguments unchanged.
    Where the pieces need other code (a routed op whose expert ids index a table split by experts),
    ``local(site)`` says what runs instead: it is called when a rank's graph is built, once per
    node of ``op``, with a :class:`~autotp.local.site.LocalSite`: ``site.strategy`` (the placements
    chosen, one per mesh axis), ``site.piece(k, dim)`` (this rank's ``(start, stop)`` of dim
    ``dim`` of tensor argument ``k``), ``site.node`` (the whole shapes), ``site.mesh_shape`` and
    ``site.coordinate``. It returns the callable the rank runs on its pieces in place of ``op``,
    with the op's arguments (tensors as the rank holds them), or ``None`` to run ``op`` as it is.
    :func:`autotp.check_rule` runs it too. ``local`` is tried before autotp's own local code for the op.
    """
    name = op_name(op)
    if local is not None and not callable(local):
        raise TypeError(f"local= for {name} is {with_article(type(local).__name__)}; expected a function "
                        "local(site) returning the callable to run on a rank's pieces in place of the op, or None "
                        "to run the op as it is")
    if not callable(rule):
        pairs = [_parse_choice(name, c, None) for c in rule]
        _USER[name] = lambda node, n: pairs
    else:
        _USER[name] = rule
    if local is None:
        _USER_LOCAL.pop(name, None)
    else:
        _USER_LOCAL[name] = local


def unregister_rule(op: Any) -> None:
    """Forget the rule registered for ``op``, and its local execution (a KeyError if there is none)."""
    name = op_name(op)
    if name not in _USER:
        raise KeyError(f"no rule is registered for {name}; registered: {sorted(_USER)}")
    del _USER[name]
    _USER_LOCAL.pop(name, None)


def registered_rules() -> tuple[str, ...]:
    """The ops with a user rule, by name."""
    return tuple(sorted(_USER))


def local_executions(op: str) -> tuple[LocalExecution, ...]:
    """The local executions of the op named ``op``, in the order they are tried: the user's
    (:func:`register_rule`), then autotp's own (:data:`BUILTIN_LOCAL`)."""
    user = () if op not in _USER_LOCAL else (lambda site: _run_user_local(site, op),)
    return user + BUILTIN_LOCAL.get(op, ())


def user_local(op: str, site: LocalSite) -> Optional[Callable[..., Any]]:
    """What the ``local`` registered for the op named ``op`` runs at ``site``: a callable, or None
    (the op as it is; also where no ``local`` is registered). A TypeError if it returns anything else."""
    local = _USER_LOCAL.get(op)
    run = local(site) if local is not None else None
    if run is not None and not callable(run):
        raise TypeError(f"local= registered for {op} returned {with_article(type(run).__name__)} at node "
                        f"{site.node.name} ({site.strategy}); expected the callable to run on the rank's pieces, "
                        "or None to run the op as it is")
    return run


def _run_user_local(site: LocalSite, op: str) -> Any:
    run = user_local(op, site)
    return None if run is None else site.call_module(LocalCall(run, op), "local", site.args, site.kwargs)


def user_choices(node: OpNode, n: int) -> Optional[list[AxisChoice]]:
    """The choices of the user's rule for ``node``, checked, or None if no rule is registered."""
    rule = _USER.get(node.target)
    if rule is None:
        return None
    choices: list[AxisChoice] = [((R,) * len(node.inputs), R)]
    for raw in rule(node, n):
        choice = _parse_choice(node.target, raw, node)
        if choice not in choices:
            choices.append(choice)
    return choices


def _placement(value: Any) -> Placement:
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        (p,) = parse_placements(value)
        return p
    raise TypeError(f"{value!r} is {with_article(type(value).__name__)}")


def _parse_choice(name: str, raw: Any, node: Optional[OpNode]) -> AxisChoice:
    """One (inputs, output) pair as placements, checked against the node when there is one."""
    where = f"the rule registered for {name}" + (f" (node {node.name})" if node is not None else "")
    try:
        ins, out = raw
        inputs = tuple(_placement(p) for p in ins)
        output = _placement(out)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} gave {raw!r}; expected a pair (input placements, output placement) "
                         f"of R, P, S(d) or their names ({err})") from None
    if any(p.is_blocked or p.is_uneven for p in (*inputs, output)):
        raise ValueError(f"{where} gave {raw!r}: a blocked split S(d)[k] or an uneven split S(d)~g is "
                         "autotp's own (it finds where a fused output is cut into blocks, and where heads do not "
                         "divide); give plain R, P and S(d)")
    if node is None:
        return inputs, output
    if len(inputs) != len(node.inputs):
        raise ValueError(f"{where} gave {len(inputs)} input placements {list(map(str, inputs))}; the node has "
                         f"{len(node.inputs)} tensor arguments ({[str(i) for i in node.input_infos]})")
    for p, info, what in [*zip(inputs, node.input_infos, (f"input {k}" for k in range(len(inputs)))),
                          (output, node.outputs[0], "the output")]:
        if p.is_shard and p.dim >= info.ndim:
            raise ValueError(f"{where} splits dim {p.dim} of {what}, {with_article(f'{info.ndim}-dim')} tensor {info}")
        if p.is_partial and not info.is_float:
            raise ValueError(f"{where} makes {what} ({info}) a partial sum; only floating tensors can be summed")
    return inputs, output
