"""Routed experts: grouped matmuls of tokens sorted by expert, and experts placed whole on ranks.

A Mixture-of-Experts layer (Hugging Face's ``grouped_mm`` experts) sorts its ``T * k`` routed
tokens by expert, runs ``grouped_mm(x (S, K), weight (E, K, N), offs (E,))`` (expert ``e`` owns
rows ``[offs[e-1], offs[e])``), an activation, a second grouped matmul, weighs each row by its
routing weight, puts the rows back in token order and sums each token's ``k`` rows.

Two ways to split it on an axis of ``n`` ranks:

- **by features**, as Megatron splits one MLP: every expert's weight colwise (``S(2)``) then rowwise
  (``S(1)``, a partial sum ``P``);
- **by experts**: the weights split on the expert dim ``S(0)``, each rank computes the rows its
  experts own and leaves the others zero (:class:`autotp.local.experts.ExpertRows`). The output is
  a partial sum whose summands have disjoint support, ``Pd``: every element is nonzero on one rank
  at most. Such a sum passes exactly through what lies between the two grouped matmuls and the
  combine, so the layer needs one all-reduce, as with the feature split, with whole experts per rank.

Where a ``Pd`` passes (:func:`disjoint_choices`), for an element nonzero on rank ``r`` alone:

- ops that keep zero zero, of one tensor (``silu(0) = 0``, a cast, a view, a chunk, ``x * 2``):
  ``f(sum of parts) = f(part on r) = sum of f(parts)``;
- a product with a replicated tensor, and a product or sum of two ``Pd`` of the same rows (both
  made from one grouped matmul's offsets: the same rank owns the same element of both);
- a row gather by a replicated index (each output element is one input element);
- a per-expert table (a bias ``(E, N)``) split ``S(0)`` with the weights and gathered by the sorted
  expert ids the offsets count (:func:`expert_table_gathers`): row ``i`` of the gather is expert
  ``ids[i]``'s row, which the rank holding that expert looks up and every other rank leaves zero, as
  that rank owns row ``i`` of the grouped matmul (:class:`autotp.local.collectives.MaskedEmbedding`);
- the second grouped matmul, on the rows its own offsets give this rank (the same offsets).

Any other reader reads the ``Pd`` as ``P`` at no cost (a sum over ``k`` mixes rows: it is a plain
partial sum). The backward is exact too: off its support a part is zero whatever the weights (the
local matmul masks those rows), so the gradient a rank sends back there is discarded, and on its
support each local derivative is the whole one. A replicated input of any of these ops (the routing
weights, the sorted tokens) gets a partial gradient, summed as for any split op.

``Pd`` is offered only on values that come from a grouped matmul split by experts
(:func:`row_owners`), so no other model's plan changes.

The cost of the split: the busiest rank's rows (:func:`expert_work_divisor`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Mapping, Optional

from autotp import ops
from autotp.local.collectives import MaskedEmbedding
from autotp.local.experts import ExpertRows
from autotp.local.site import LocalSite
from autotp.placement import P, Pd, R, S, Strategy
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.planning.rules.views import SPLITS
from autotp.tracing.graph import OpGraph, OpNode

__all__ = ["GROUPED_MM", "SORTS", "expert_split", "ZERO_KEEPING", "IMBALANCE", "grouped_mm_choices", "row_owners", "disjoint_choices",
           "expert_work_divisor", "busiest_rows", "local_expert_rows", "expert_table_gathers",
           "local_expert_table", "RULES", "LOCAL"]

GROUPED_MM = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})

# one-tensor ops with f(0) = 0, elementwise: a sum of disjoint parts passes through them
ZERO_KEEPING = ops.UNARY_LINEAR | ops.SCALAR_SCALE | frozenset({
    "aten.silu.default", "aten.gelu.default", "aten.relu.default", "aten.tanh.default", "aten.square.default",
    "aten.abs.default", "aten.erf.default", "aten.sin.default",
})
_GATHERS = frozenset({"aten.index.Tensor", "aten.index_select.default"})

# the busiest rank's rows over the mean, at least (a router trained to balance its experts keeps
# within about a tenth; see expert_work_divisor)
IMBALANCE = 1.1


def expert_split(node: OpNode) -> bool:
    """A grouped matmul of 2-d tokens, 3-d expert weights and offsets, with nothing else."""
    return (node.target in GROUPED_MM and len(node.inputs) == 3 and node.input_infos[0].ndim == 2
            and node.input_infos[1].ndim == 3 and node.input_infos[2].ndim == 1)


def grouped_mm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """A grouped matmul of tokens sorted by expert, (S, K) x (E, K, N) -> (S, N), with the experts'
    offsets (``aten._grouped_mm``, Hugging Face's fallback op): every expert's weight split by its
    output features (colwise) or its input features (rowwise, a partial sum), as Megatron splits
    one MLP, or by experts (each rank the rows of its own experts: ``Pd``). The token dim stays
    whole: the offsets count tokens of the whole batch."""
    x, w = node.input_infos[0], node.input_infos[1]
    k_in = len(node.inputs)
    if x.ndim != 2 or w.ndim != 3 or k_in < 3:
        return [((R,) * k_in, R)]
    rest = (R,) * (k_in - 2)  # the offsets
    choices: list[AxisChoice] = [((R,) * k_in, R), ((P, R, *rest), P)]
    if divisible(w.shape[2], n):
        choices.append(((R, S(2), *rest), S(1)))
    if divisible(w.shape[1], n):
        choices.append(((S(1), S(1), *rest), P))
    if expert_split(node) and divisible(w.shape[0], n):
        choices.append(((R, S(0), R), Pd))
    return choices


_OWNERS: "weakref.WeakKeyDictionary[OpGraph, Mapping[str, str]]" = weakref.WeakKeyDictionary()


def row_owners(graph: OpGraph) -> Mapping[str, str]:
    """Node -> the offsets node of the grouped matmul whose rows it may hold as ``Pd`` (the same
    offsets, the same rank owns each element), for the nodes that may: a grouped matmul split by
    experts, and what passes its output on (see the module docstring)."""
    if graph in _OWNERS:
        return _OWNERS[graph]
    owners: dict[str, str] = {}
    tables = expert_table_gathers(graph)
    for node in graph.nodes:
        if node.is_placeholder or not node.inputs:
            continue
        found = [owners.get(i) for i in node.inputs]
        first = found[0]
        held = {o for o in found if o is not None}
        if expert_split(node):
            owners[node.name] = node.inputs[2]
        elif node.name in tables:
            owners[node.name] = tables[node.name]
        elif not held:
            continue
        elif len(node.inputs) == 1 and (node.is_view or node.target == "getitem" or node.target in ZERO_KEEPING
                                        or node.target in SPLITS):
            owners[node.name] = first
        elif node.target in _GATHERS and first is not None and len(held) == 1 and not any(found[1:]):
            owners[node.name] = first
        elif node.target == "aten.mul.Tensor" and len(node.inputs) == 2 and len(held) == 1:
            owners[node.name] = held.pop()  # by a replicated factor, or two parts of the same rows
        elif node.target in _ADDS and len(node.inputs) == 2 and found[0] == found[1]:
            owners[node.name] = first
    _OWNERS[graph] = owners
    return owners


_ADDS = frozenset({"aten.add.Tensor", "aten.add_.Tensor"})  # a bias added in place: out.add_(bias)


def _sorted_ids(graph: OpGraph, offsets: str) -> Optional[tuple[str, int]]:
    """The sorted expert ids an offsets node counts, and the number of experts: ``offsets =
    cumsum(histc(ids, bins=E, min=0, max=E - 1))`` (casts of ``ids`` and of the offsets between:
    ``counts.cumsum(0).to(torch.int32)``), ``ids`` the sorted values of ``sort``. None where the
    offsets are made otherwise."""
    node = graph[offsets]
    while node.target in ops.CASTS and len(node.inputs) == 1:
        node = graph[node.inputs[0]]
    if node.target != "aten.cumsum.default" or len(node.inputs) != 1:
        return None
    histc = graph[node.inputs[0]]
    experts = node.input_infos[0].shape[0] if node.input_infos[0].ndim == 1 else None
    if (histc.target != "aten.histc.default" or len(histc.inputs) != 1 or experts is None
            or (histc.args.get("bins"), histc.args.get("min"), histc.args.get("max")) != (experts, 0, experts - 1)):
        return None
    ids = graph[histc.inputs[0]]
    while ids.target in ops.CASTS and len(ids.inputs) == 1:
        ids = graph[ids.inputs[0]]
    made = graph[ids.inputs[0]] if ids.target == "getitem" and ids.inputs else None
    if made is None or made.target not in SORTS or ids.args.get("index", ids.args.get("idx")) != 0:
        return None
    return ids.name, experts


SORTS = frozenset({"aten.sort.default", "aten.sort.stable"})
_TABLES: "weakref.WeakKeyDictionary[OpGraph, Mapping[str, str]]" = weakref.WeakKeyDictionary()


def expert_table_gathers(graph: OpGraph) -> Mapping[str, str]:
    """Gathers of a per-expert table by the sorted expert ids whose counts are a grouped matmul's
    offsets (``bias[ids]``, ``bias`` ``(E, N)``), each to that offsets node: row ``i`` belongs to
    expert ``ids[i]``, as row ``i`` of the grouped matmul does (the ids are sorted)."""
    if graph in _TABLES:
        return _TABLES[graph]
    ids_of: dict[str, tuple[str, int]] = {}
    for node in graph.nodes:
        if expert_split(node) and node.inputs[2] not in ids_of:
            found = _sorted_ids(graph, node.inputs[2])
            if found is not None:
                ids_of[node.inputs[2]] = found
    by_ids = {ids: (offsets, experts) for offsets, (ids, experts) in ids_of.items()}
    gathers: dict[str, str] = {}
    for node in graph.nodes:
        if node.target != "aten.index.Tensor" or len(node.inputs) != 2 or node.inputs[1] not in by_ids:
            continue
        offsets, experts = by_ids[node.inputs[1]]
        table = node.input_infos[0]
        if table.ndim == 2 and table.shape[0] == experts and node.args.get("indices") is not None \
                and len(node.args["indices"]) == 1:
            gathers[node.name] = offsets
    _TABLES[graph] = gathers
    return gathers


def local_expert_table(site: LocalSite) -> Optional[Any]:
    """A per-expert table split by experts, gathered by the sorted expert ids
    (:func:`expert_table_gathers`): this rank's experts' rows, the others zero. None for any other
    gather."""
    table = site.strategy.inputs[0]
    if table is None or not any(p.is_shard and p.dim == 0 for p in table) or Pd not in site.strategy.output:
        return None
    first, last = site.piece(0, 0)
    weight, (ids,) = site.args[0], site.args[1]
    return site.call_module(MaskedEmbedding(first, last - first), "expert_table", (weight, ids), {})


# views autotp finds by their dim map, named here where they take one tensor (chunk and split give parts)


def disjoint_choices(node: OpNode, n: int, graph: OpGraph) -> list[AxisChoice]:
    """The ``Pd`` choices of ``node``: where it passes on the rows of a grouped matmul split by
    experts (:func:`row_owners`), its inputs of those rows read as ``Pd``, any other as ``R``."""
    owners = row_owners(graph)
    owner = owners.get(node.name)
    if owner is None or n == 1:
        return []
    if node.target in GROUPED_MM:
        if not divisible(node.input_infos[1].shape[0], n) or owners.get(node.inputs[0]) != owner:
            return []
        return [((Pd, S(0), R), Pd)]
    if node.target == "aten.index.Tensor" and node.name in expert_table_gathers(graph):
        return [((S(0), R), Pd)] if divisible(node.input_infos[0].shape[0], n) else []
    ins = tuple(Pd if owners.get(i) == owner else R for i in node.inputs)
    if node.target == "aten.mul.Tensor" and Pd not in ins:
        return []
    return [(ins, Pd)]


def busiest_rows(rows: int, n: int) -> float:
    """The rows the busiest of ``n`` ranks computes when ``rows`` routed rows go to experts split
    evenly over them: the mean ``rows / n`` plus the larger of a tenth of it (:data:`IMBALANCE`: a
    router trained with a load-balancing loss) and three standard deviations of uniform routing
    (``sqrt(rows / n)``, the binomial's for ``1/n``, a bound on the expected maximum of ``n`` ranks
    for ``n`` up to about 90), never more than ``rows``."""
    mean = rows / n
    return min(float(rows), mean + max((IMBALANCE - 1.0) * mean, 3.0 * math.sqrt(mean)))


def expert_work_divisor(node: OpNode, strategy: Strategy, axis: int, n: int) -> Optional[float]:
    """How many times less work than the whole the busiest rank does on ``axis`` where a grouped
    matmul's experts are split there (:func:`busiest_rows`); None for any other node or split."""
    if not expert_split(node):
        return None
    w = strategy.inputs[1]
    if w is None or not (w[axis].is_shard and w[axis].dim == 0):
        return None
    rows = node.input_infos[0].shape[0]
    return rows / busiest_rows(rows, n)


def local_expert_rows(site: LocalSite) -> Optional[Any]:
    """A grouped matmul split by experts: the rows of this rank's experts, the others zero. None for
    any other split (the op as it is)."""
    w = site.strategy.inputs[1]
    if (not expert_split(site.node) or w is None or not any(p.is_shard and p.dim == 0 for p in w)
            or Pd not in site.strategy.output):  # the routed variant's output is rows routed here (routed.py)
        return None
    first, last = site.piece(1, 0)
    return site.call_module(ExpertRows(site.target, first, last), "expert_rows", site.args, site.kwargs)


RULES = {name: grouped_mm_choices for name in sorted(GROUPED_MM)}
LOCAL = {**{name: local_expert_rows for name in sorted(GROUPED_MM)}, "aten.index.Tensor": local_expert_table}
