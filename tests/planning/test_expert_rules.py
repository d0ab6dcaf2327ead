"""The rules that take or give a sum of disjoint parts (``Pd``, autotp/planning/rules/experts.py),
each checked on data: on a tiny Qwen3-MoE's own graph, every strategy of every node with a ``Pd``
runs on each rank's pieces alone, and the parts sum to the node's value, with no element nonzero on
two ranks, each rank's part the one its experts alone give.

A rank's parts are what the model computes with only that rank's experts (the other experts'
weights zero): a value of the rows a grouped matmul split by experts computes is zero outside the
rank's rows, and the parts of every value made from them are found the same way."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.local.experts import ExpertRows
from autotp.placement import Pd
from autotp.planning.choices.check import check_rule
from autotp.planning.choices.strategies import node_strategies
from autotp.planning.rules.experts import GROUPED_MM, busiest_rows, row_owners
from tests.helpers.local_exactness import full_values

transformers = pytest.importorskip("transformers")
import transformers.integrations.moe  # noqa: E402,F401 - registers transformers::grouped_mm_fallback


def tiny_qwen3_moe():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    return transformers.Qwen3MoeForCausalLM(config)


def _values_with_experts(graph, inputs, first: int, last: int) -> dict:
    """Every node's value with only experts [first, last) kept (the others' weights zero)."""
    ep = graph.exported
    saved = {}
    for name, t in ep.state_dict.items():
        if t.ndim == 3:  # the stacked expert weights
            saved[name] = t
            kept = torch.zeros_like(t)
            kept[first:last] = t[first:last]
            ep.state_dict[name] = kept
    try:
        return full_values(graph, inputs)
    finally:
        ep.state_dict.update(saved)


def _run(fx_node, values):
    def value(a):
        return values[a.name] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(fx_node.args, value)
    kwargs = torch.fx.node.map_aggregate(fx_node.kwargs, value)
    return fx_node.target(*args, **kwargs)


def _tensors(v):
    return list(v) if isinstance(v, (tuple, list)) else [v]


def test_every_rule_with_a_disjoint_sum_is_exact_on_data():
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, {"input_ids": ids})
    full = full_values(graph, (ids,))
    n, experts = 2, 4
    parts = [_values_with_experts(graph, (ids,), r * experts // n, (r + 1) * experts // n) for r in range(n)]
    fx = {node.name: node for node in graph.exported.graph_module.graph.nodes}
    checked = set()
    for name in row_owners(graph):
        node = graph[name]
        for strategy in node_strategies(graph, node, (n,)):
            if Pd not in (*(q[0] for q in strategy.inputs if q is not None), strategy.output[0]):
                continue
            outs = []
            for r in range(n):
                local = dict(full)
                for src, q in zip(node.inputs, strategy.inputs):
                    if q[0] == Pd:
                        local[src] = parts[r][src]
                    elif q[0].is_shard:
                        local[src] = torch.chunk(full[src], n, dim=q[0].dim)[r]
                if node.target in GROUPED_MM:
                    x, w, offs = (local[i] for i in node.inputs)
                    out = ExpertRows(fx[name].target, r * experts // n, (r + 1) * experts // n)(x, w, offs)
                else:
                    out = _run(fx[name], local)
                outs.append(_tensors(out))
            for k, whole in enumerate(_tensors(full[name])):
                got = [o[k] for o in outs]
                torch.testing.assert_close(sum(got[1:], got[0]), whole, rtol=1e-5, atol=1e-6, msg=f"{name} {strategy}")
                if strategy.output[0] == Pd:
                    assert (torch.stack(got) != 0).sum(0).max() <= 1, f"{name} {strategy}: the parts overlap"
                    for r in range(n):
                        torch.testing.assert_close(got[r], _tensors(parts[r][name])[k], msg=f"{name} rank {r}")
            checked.add(node.target)
    assert {"transformers.grouped_mm_fallback.default", "aten.silu.default", "aten.mul.Tensor", "aten.chunk.default",
            "aten.index.Tensor", "aten.view.default", "getitem", "aten.to.dtype"} <= checked, checked


def test_check_rule_runs_the_expert_split_on_each_ranks_experts():
    x, w = torch.randn(12, 8), torch.randn(4, 8, 6)
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # expert 1 gets no rows
    checked = check_rule(torch.ops.transformers.grouped_mm_fallback.default, (x, w, offs))
    assert "(R, S(0), R) -> Pd" in [str(s) for s in checked]


def test_a_rank_whose_experts_get_no_rows_holds_zeros():
    x, w = torch.randn(6, 8), torch.randn(4, 8, 5)
    offs = torch.tensor([3, 6, 6, 6], dtype=torch.int32)
    op = torch.ops.transformers.grouped_mm_fallback.default
    assert ExpertRows(op, 2, 4)(x, w[2:], offs).abs().max() == 0
    torch.testing.assert_close(ExpertRows(op, 0, 2)(x, w[:2], offs), op(x, w, offs))


def test_the_busiest_rank_is_priced_above_the_mean():
    assert busiest_rows(8 * 4096 * 8, 8) == pytest.approx(1.1 * 4096 * 8)  # a tenth over the mean
    assert busiest_rows(64, 8) == pytest.approx(8 + 3 * 8 ** 0.5)  # few rows: the spread of uniform routing
    assert busiest_rows(4, 2) == 4  # never more than every row


class _BiasedExperts(torch.nn.Module):
    """A grouped matmul of tokens sorted by expert, with a bias per expert gathered twice: by the
    sorted ids (row i is expert ids[i]'s, as the grouped matmul's row i is) and by the ids unsorted."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 8, 6, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(4, 6, generator=g))

    def forward(self, x, ids):
        ids_sorted, perm = torch.sort(ids)
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=4, min=0, max=3), dim=0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(x[perm], self.weight, offs)
        return out + self.bias[ids_sorted], self.bias[ids]


def test_a_bias_gathered_by_the_sorted_ids_holds_the_rows_of_the_grouped_matmul():
    """Only the gather by the sorted ids whose counts are the offsets is offered Pd, and there each
    rank's nonzero rows (its experts' biases, MaskedEmbedding) are the rows its experts compute."""
    from autotp.local.collectives import MaskedEmbedding
    from autotp.planning.rules.experts import expert_table_gathers

    model = _BiasedExperts()
    x, ids = torch.randn(12, 8), torch.tensor([3, 0, 2, 2, 1, 3, 0, 0, 2, 3, 1, 2])
    graph = autotp.capture(model, (x, ids))
    gathers = [n for n in graph.nodes if n.target == "aten.index.Tensor" and n.input_infos[0].ndim == 2
               and n.input_infos[0].shape == (4, 6)]
    assert len(gathers) == 2
    by_sorted = [n.name for n in gathers if graph[n.inputs[1]].target == "getitem"]
    assert list(expert_table_gathers(graph)) == by_sorted, expert_table_gathers(graph)
    ids_sorted, perm = torch.sort(ids)
    offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=4, min=0, max=3), dim=0, dtype=torch.int32)
    op = torch.ops.transformers.grouped_mm_fallback.default
    total = 0
    for first, last in ((0, 2), (2, 4)):
        rows = ExpertRows(op, first, last)(x[perm], model.weight[first:last].detach(), offs)
        bias = MaskedEmbedding(first, last - first)(model.bias[first:last].detach(), ids_sorted)
        assert torch.equal(rows.abs().sum(1) != 0, bias.abs().sum(1) != 0)
        total = total + bias
    torch.testing.assert_close(total, model.bias.detach()[ids_sorted])
