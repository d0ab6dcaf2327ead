"""Whole experts on 4 ranks, both ways (autotp/planning/rules/experts.py, routed.py): with every token
on every rank (``Pd``, one reduction) and with the tokens split and sent to their experts' ranks by
all-to-all (the routed region). Tiny Hugging Face MoE models of 8 experts, the load-balancing loss
in the model's loss where the model has one, threaded ranks of one process on a mesh ``(4,)`` (2
experts a rank) and, for Qwen3-MoE, ``(2, 2)`` (the experts over the second axis, 4 a rank; the
first holds every expert and every token): the loss and every gradient equal one process's.

The variant is chosen for the test: ``Pd`` with the default plan of the experts pinned ``S(0)``, and
the all-to-all variant with ``Pd`` withheld from the planner (:func:`tests.helpers.plans.without_pd`),
so that each case runs the variant it names whatever the cost model prefers at this size.
"""

from __future__ import annotations

import pytest

import autotp
from autotp.planning.planner import plan_graph
from tests.helpers.plans import without_pd
from tests.runtime.test_experts_on_ranks import (MODELS, check_exact, every_expert_routed, expert_tensors,
                                                 expert_weights, inputs_for, tiny_moe)

transformers = pytest.importorskip("transformers")

EXPERTS = 8  # 2 a rank on 4 ranks
# 24 tokens x top 2 reach every one of the 8 experts (checked), 6 tokens a rank; gpt-oss's router
# needs 48 to reach all
TOKENS = {"gpt_oss": (4, 12)}
# each model's name for its number of experts; DeepSeek-V3's tiny config has 8 already (2 groups)
EXPERTS_KEY = {"qwen3_moe": "num_experts", "olmoe": "num_experts", "mixtral": "num_local_experts",
               "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}


def eight_experts(name: str):
    """The model's tiny config with 8 experts and, where the model has one, its load-balancing loss in
    the loss (a coefficient of 0.5, large enough to move every gradient of the router)."""
    config_class = getattr(transformers, MODELS[name][0])
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5} \
        if "router_aux_loss_coef" in config_class().to_dict() else {}
    model = tiny_moe(name, **{EXPERTS_KEY[name]: EXPERTS}, **aux)
    inputs = inputs_for(model, TOKENS.get(name, (2, 12)))
    assert every_expert_routed(model, inputs)
    if aux:
        assert model(**inputs).aux_loss > 0
    return model, inputs


# (variant, model, mesh): the cheapest in the default run, the others slow
CASES = [("routed", "qwen3_moe", (4,))] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in
    [("routed", name, (4,)) for name in ("mixtral", "olmoe", "deepseek_v3", "gpt_oss")]
    + [("pd", name, (4,)) for name in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")]
    + [("pd", "qwen3_moe", (2, 2)), ("routed", "qwen3_moe", (2, 2))]]


@pytest.mark.parametrize("variant,name,mesh_shape", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_experts_on_four_ranks_equal_one_process(variant, name, mesh_shape):
    model, inputs = eight_experts(name)
    graph = autotp.capture(model, inputs)
    split = "R" * (len(mesh_shape) - 1) + "S(0)"  # the experts over the last axis
    whole = "R" * (len(mesh_shape) - 1)  # the other axis: every expert and every token
    if variant == "pd":
        pin = {n: split for n in expert_tensors(model)}
        plan = plan_graph(graph, mesh_shape, "cpu-gloo", "train", pin=pin)
        want = [whole + "Pd"] * 2
    else:
        with without_pd():
            plan = plan_graph(graph, mesh_shape, "cpu-gloo", "train", pin={n: split for n in expert_weights(model)})
        want = [whole + "Se", whole + "St"]
    grouped = [n.name for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    assert ["".join(map(str, plan.strategy(n).output)) for n in grouped] == want, \
        [str(plan.strategy(n)) for n in grouped]
    check_exact(graph, plan, model, inputs, whole=expert_weights(model), mesh_shape=mesh_shape, pieces=mesh_shape[-1])
