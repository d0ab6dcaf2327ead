"""The report says where a plan put its routed experts and prices the other placements
(autotp/planning/result/expert_choice.py): plan-only, on a mesh shape, tiny models on the meta device."""

from __future__ import annotations

import contextlib

import pytest
import torch

import autotp
from autotp.placement import Pd, Se
from autotp.planning.choices.expert_placements import moe_layers
from autotp.planning.planner import plan_graph
from tests.helpers.plans import without_pd, without_routed

transformers = pytest.importorskip("transformers")


def _qwen3_moe(layers: int = 2):
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def moe_plan():
    model, inputs = _qwen3_moe()
    graph = autotp.capture(model, inputs)
    return graph, plan_graph(graph, (2,), "h100-sxm")


def _grouped(plan):
    return [plan.strategy(n.name) for n in plan.nodes if "grouped_mm" in n.target]


def test_the_report_names_the_chosen_placement_and_prices_each_other_one(moe_plan):
    """One kind of 2 layers of 4 experts; the chosen row is the plan's own step and how its grouped
    matmuls place the experts; each other placement's step is that of the plan made with its expert
    weights pinned through the public ``pin`` (``autotp.plan``'s, on the captured graph; the routed
    variant with Pd withheld, Pd with the routed region withheld), and costs at least the chosen
    (the plan is the optimum over all of them)."""
    graph, plan = moe_plan
    (choice,) = plan.expert_choices()
    assert (choice.layers, choice.experts, choice.rows) == (2, 4, 4 * 8 * 2)
    chosen = choice.chosen
    assert chosen.step_s == plan.predicted_time().total_s
    assert {p.placement for p in choice.prices} >= {"features", "whole", "routed"}
    strategies = _grouped(plan)
    weights = [strategy.inputs[1][0] for strategy in strategies]
    if chosen.placement == "replicated":
        assert all(w.kind == "R" for w in weights)
    else:
        assert chosen.placement in ("features", "whole", "routed")
    others = {p.placement: p for p in choice.prices if not p.chosen}
    assert all(not p.refused and p.step_s >= chosen.step_s * (1 - 1e-9) for p in others.values())
    # each row is the plan a user gets by pinning the expert weights as that row's plan stores them
    for placement, helper in (("features", None), ("whole", without_routed), ("routed", without_pd)):
        row = others[placement]
        assert set(row.weights) == {fqn for layer in moe_layers(graph) for fqn in layer.weights}
        with helper() if helper else contextlib.nullcontext():
            pinned = plan_graph(graph, (2,), "h100-sxm", pin=row.weights, explainable=False)
        assert row.step_s == pytest.approx(pinned.predicted_time().total_s, rel=1e-9), placement
        grouped = _grouped(pinned)
        outputs = {s.output[0] for s in grouped}
        assert {"features": not ({Pd, Se} & outputs) and all(s.inputs[1][0].dim in (1, 2) for s in grouped),
                "whole": outputs == {Pd}, "routed": Se in outputs}[placement]
    # the terms add up to the step: the grouped matmuls, the other ops, the collectives, the copies
    for p in choice.prices:
        total = p.grouped_mm_s + p.other_compute_s + sum(s for _, _, s in p.collectives) + p.copies_s
        assert total == pytest.approx(p.step_s, rel=1e-9)
    text = plan.report()
    section = text[text.index("Experts (routed MoE layers"):]
    assert f"chosen {chosen.words}, step {chosen.step_s * 1e3:.2f} ms" in section
    for p in others.values():
        assert f"{p.words} {p.step_s * 1e3:.2f} ms ({p.step_s / chosen.step_s:.2f}x)" in section
    assert "busiest rank 1." in section and "all_to_all" in section


def test_a_loaded_plan_says_what_it_chose_and_a_dense_plan_says_nothing(moe_plan):
    _, plan = moe_plan
    loaded = autotp.Plan.from_json(plan.to_json())
    (choice,) = loaded.expert_choices()
    assert choice.chosen.words == plan.expert_choices()[0].chosen.words and choice.chosen.step_s is None
    assert "the other placements are priced for a plan made in this process" in loaded.report()
    dense = autotp.plan(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)), (2,),
                        (torch.randn(8, 32),), hardware="h100-sxm")
    assert dense.expert_choices() == () and "Experts" not in dense.report()


def test_placing_experts_a_way_the_mesh_cannot_is_refused_saying_how_it_can(moe_plan):
    """4 experts do not divide over 3 ranks: whole experts are refused naming the layer and what it can do;
    an unknown placement names the ones there are; the report says the alternative has no plan."""
    graph, _ = moe_plan
    layer = moe_layers(graph)[0]
    with pytest.raises(ValueError, match=r"cannot place its experts whole on ranks.*it can place them: replicated"):
        plan_graph(graph, (3,), "h100-sxm", experts={layer.grouped[0]: "whole"})
    with pytest.raises(ValueError, match=r"'by_rows'; expected one of features, whole, routed, replicated"):
        plan_graph(graph, (2,), "h100-sxm", experts={layer.grouped[0]: "by_rows"})
    plan = plan_graph(graph, (3,), "h100-sxm")
    (choice,) = plan.expert_choices()
    assert choice.price("whole").refused and choice.price("routed").refused
    assert "whole on ranks, every token on every rank: no plan (" in plan.report()
