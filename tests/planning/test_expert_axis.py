"""The expert axis in the layout search: a Mixture-of-Experts model's layouts pp x dp x ep, priced
from a plan on (ep,) with the routed experts split by expert and their tokens sent by all-to-all;
a stack of dense and MoE layers priced from one layer of each kind."""

import re

import pytest
import torch

import autotp
from autotp.mesh import MeshSpec
from autotp.planning.costs.costing import CostModel
from autotp.planning.errors import PlanError
from autotp.planning.planner import plan_graph
from autotp.planning.search.expert_axis import routed_expert_weights
from autotp.planning.search.layer_kinds import find_kind_stack
from autotp.planning.search.pipeline_search import Candidate, layouts, price_layout, units_of_plan
from autotp.tracing.graph import PARAMETER
from examples.ranks import run_threads

transformers = pytest.importorskip("transformers")


def _qwen3_moe(layers: int = 4):
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def moe_on_ep():
    model, inputs = _qwen3_moe()
    return model, inputs, autotp.plan(model, 4, inputs, hardware="h100-sxm", pipeline={"ep": 2, "pp": 2, "micro_batch_size": 2, "schedule": "gpipe",
                                                                                  "recompute": False})


def test_only_a_model_with_routed_experts_gets_expert_axes():
    assert {c.ep for c in layouts(8, 8, 4, 8)} == {1}
    assert {c.ep for c in layouts(8, 8, 4, 8, experts=4)} == {1, 2, 4}  # dividing the experts
    assert {c.tp for c in layouts(8, 8, 4, 8, experts=4) if c.ep > 1} == {1}
    # each rank of the expert axis its own rows of a replica's batch
    assert all(c.dp * c.ep * c.micro_batches * c.micro_batch_size == 8 for c in layouts(8, 8, 4, 8, experts=4))


def test_a_layout_with_an_expert_axis_plans_the_experts_whole_on_its_ranks(moe_on_ep):
    model, inputs, plan = moe_on_ep
    chosen = plan.pipeline.chosen
    assert (chosen.pp, chosen.dp, chosen.ep, chosen.tp) == (2, 1, 2, 1) and chosen.step_s > 0
    assert plan.mesh.shape == (2,) and plan.mesh.axis_names == ("ep",)
    assert str(plan.pipeline.layout) == "pp 2 x dp 1 x ep 2 x tp 1" and dict(plan.pipeline.links)["expert"]
    grouped = [n for n in plan.nodes if "grouped_mm" in n.target]
    assert grouped and all(", S(0), " in n.strategy for n in grouped)  # each rank its experts' weights
    # the micro-batch is ep ranks' rows: the graph the plan was made on has 2 x the rows per rank
    assert plan.inputs[0].shape[0] == chosen.ep * chosen.micro_batch_size


def test_the_weights_the_expert_axis_replicates_sum_their_gradients_in_each_micro_batch():
    """The plan on (ep,) sums the replicated weights' gradients over ep in each backward, where it reads
    the weights, and the runtime runs the plan so in each micro-batch: the pipeline prices them so, in
    the backward of every micro-batch, with nothing added once a step
    (tests/runtime/test_expert_axis_runtime.py counts the collectives a step runs)."""
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                                         moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    with torch.device("meta"):  # at widths where the weights' gradients are worth summing over ep
        model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.zeros(2, 1024, dtype=torch.long, device="meta")
    graph = autotp.capture(model, {"input_ids": ids, "labels": ids})
    pins = {fqn: "S(0)" for fqn in routed_expert_weights(graph)}
    plan = plan_graph(graph, MeshSpec((2,), ("ep",)), "h100-sxm", "train", 1e18, pin=pins, recompute=False,
                      explainable=False)
    units = units_of_plan(plan, graph, [f"model.layers.{i}" for i in range(4)])
    cost = CostModel(plan.mesh, plan.hardware, "train", plan.optimizer, graph)
    sums = sum(cost.collective_s(c.kind, 0, c.bytes) for c in plan.collectives()
               if c.kind == "all_reduce" and c.phase == "backward" and graph[c.at].role == PARAMETER)
    backward = sum(cost.collective_s(c.kind, 0, c.bytes) for c in plan.collectives() if c.phase == "backward")
    assert sums > 0 and sum(u.backward_comm_s for u in units.units) >= backward - 1e-12
    steps = [price_layout(Candidate(1, 1, 1, "none", 1, m, 1, 0, False, ep=2), units, plan.hardware, 1e18)[0].step_s
             for m in (1, 2)]
    per_micro_batch = sum(u.forward_s + u.backward_s for u in units.units)
    assert steps[1] - steps[0] == pytest.approx(per_micro_batch)
    assert steps[0] == pytest.approx(per_micro_batch)


def _refused(rank, world, model, inputs, plan):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        autotp.parallelize(model, mesh, inputs, plan=plan)
        return None, False
    except PlanError as err:
        return str(err), all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_stack_of_dense_then_moe_layers_is_priced_from_one_layer_of_each_kind():
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=5,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).train()
    stack = find_kind_stack(model)
    assert stack.path == "model.layers" and stack.runs == ((0, 2), (2, 3))
    ids = torch.randint(0, 64, (4, 8))
    names = [n for n, _ in model.named_parameters()]
    plan = autotp.plan(model, 2, {"input_ids": ids, "labels": ids}, hardware="h100-sxm", pipeline={"pp": 2})
    assert [n for n, _ in model.named_parameters()] == names  # the model's layers put back
    choice = plan.pipeline
    assert choice.layers == 5 and choice.kinds == ((0, 2), (2, 3))
    assert [(s.first_layer, s.end_layer) for s in choice.stages][-1][1] == 5
    message, untouched = run_threads(_refused, 1, model, {"input_ids": ids, "labels": ids}, plan)[0]
    assert untouched and re.search(r"layers of 2 kinds.*priced from the first layer of each kind", message), message
