"""Experts placed whole on ranks: with the stacked expert weights split on the expert dim, each rank
computes the rows of the sorted tokens its experts own (the others zero), the ops between the two
grouped matmuls run on those rows, and the combine leaves a partial sum that one all-reduce
completes (autotp/planning/rules/experts.py).

Tiny Hugging Face MoE models built from configs, their experts pinned ``S(0)``, on 2 threaded ranks:
the loss and every gradient equal one process's, and the experts' weights are never gathered. The
models: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 (grouped top-k routing, a shared expert, latent
attention) and gpt-oss (experts with biases, split with the weights); the load-balancing loss in the
model's loss; and ``generate`` with the experts on ranks gives the model's own tokens.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autotp
from autotp.planning.planner import plan_graph
from autotp.runtime.module import build_parallel_module
from autotp.runtime.shards import placements_of
from autotp.weights.checkpoint import full_tensor
from examples.ranks import run_threads
from tests.helpers.turns import run_threads_tracing_in_turns

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 6
TOKENS = (2, 12)  # 24 tokens x top 2 over 4 experts: every expert gets rows (checked)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2)
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=4)),
    # 8 routed experts in 2 groups, each token's top 2 from its best group; one shared expert; a
    # low-rank query and latent keys and values (no head_dim: the query/key dims are its own)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(head_dim=None, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                         n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # experts with a bias per expert on each projection (gathered per row by expert id)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
}


def tiny_moe(name: str, **config):
    config_name, model_name, extra = MODELS[name]
    torch.manual_seed(0)
    kwargs = {k: v for k, v in {**COMMON, **extra, **config}.items() if v is not None}
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).float()
    with torch.no_grad():  # the experts' biases drawn (models start them at zero, which would test nothing)
        for module in experts_of(model):
            for p in module.parameters(recurse=False):
                if p.ndim == 2:
                    p.normal_(0, 0.2)
    return model


def experts_of(model) -> list[torch.nn.Module]:
    """The modules that hold stacked expert weights (3-d parameters: experts x features x features)."""
    return [m for m in model.modules() if any(p.ndim == 3 for p in m.parameters(recurse=False))]


def _experts_count(module) -> int:
    return next(p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3)


def expert_weights(model) -> list[str]:
    """The stacked expert weights (3-d parameters: experts x features x features)."""
    return [n for n, p in model.named_parameters() if p.ndim == 3]


def expert_tensors(model) -> list[str]:
    """Every parameter of the expert modules: their stacked weights and any biases (experts x features)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for m in experts_of(model) for p in m.parameters(recurse=False)]


def inputs_for(model, tokens=TOKENS):
    ids = torch.randint(0, model.config.vocab_size, tokens, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _step(rank, world, graph, plan, model, inputs, mesh_shape=None):
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(mesh_shape or (world,))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("tp",) if len(shape) == 1 else ("dp", "tp"))
    pm = build_parallel_module(graph, plan, mesh, model)
    loss = pm(**inputs).loss
    loss.backward()
    local = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for n, p in pm.named_parameters()}
    return loss.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}, local


def experts_split_plan(model, inputs, world: int = 2):
    graph = autotp.capture(model, inputs)
    pin = {name: "S(0)" for name in expert_tensors(model)}
    return graph, plan_graph(graph, (world,), "cpu-gloo", "train", pin=pin)


def every_expert_routed(model, inputs) -> bool:
    """The router's top-k over the example reaches every expert of every layer."""
    seen = []  # each expert module's (number of experts, the ids it was given)
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((_experts_count(m), args[1])))
             for m in experts_of(model)]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return bool(seen) and all(torch.bincount(ids.flatten(), minlength=e).min() > 0 for e, ids in seen)


# forward all-reduces in an MoE block with its experts placed whole: one (the combine), and for
# gpt-oss one more, of the rows between the grouped matmuls (its gate, sigmoid(x) and x + 1, does
# not keep zero zero, so the rows are made whole before it)
FORWARD_REDUCES = {"gpt_oss": 2}


def check_split_whole(model, inputs, forward_reduces: int = 1):
    """The model with its experts pinned S(0) on 2 threaded ranks: the grouped matmuls compute their
    experts' rows (Pd), nothing gathers the experts' tensors, and the loss and every gradient equal
    one process's."""
    assert every_expert_routed(model, inputs)
    graph, plan = experts_split_plan(model, inputs)
    assert len(expert_weights(model)) == 2, expert_weights(model)
    grouped = [n for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    assert len(grouped) == 2 and all(str(plan.strategy(n.name).output[0]) == "Pd" for n in grouped), \
        [str(plan.strategy(n.name)) for n in grouped]
    assert not [c for c in plan.collectives() if c.kind == "all_gather"], [str(c) for c in plan.collectives()]
    forward = [c for c in plan.collectives() if c.phase == "forward" and "mlp" in (graph[c.at].module_path or "")]
    assert len(forward) == forward_reduces and {c.kind for c in forward} == {"all_reduce"}, [str(c) for c in forward]
    check_exact(graph, plan, model, inputs, whole=expert_tensors(model))


def check_exact(graph, plan, model, inputs, whole=(), mesh_shape=(2,), pieces=None):
    """The plan on threaded ranks of ``mesh_shape`` gives one process's loss and every gradient; the
    tensors ``whole`` hold ``1 / pieces`` of their experts on each rank (every rank a piece of its
    own where ``pieces`` is not given)."""
    world = math.prod(mesh_shape)
    pieces = pieces or world
    out = model(**inputs)
    out.loss.backward()
    for loss, grads, local in run_threads(_step, world, graph, plan, model, inputs, tuple(mesh_shape)):
        torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=n)
        for n in whole:  # whole experts on each rank, a piece of them
            shape = dict(model.named_parameters())[n].shape
            assert local[n] == (shape[0] // pieces, *shape[1:]), (n, local[n])
    model.zero_grad()


# Qwen3-MoE and gpt-oss in the default run (the grouped matmuls' rules and local code are the same
# for each; gpt-oss adds the biases); the others in the slow suite
@pytest.mark.parametrize("name", [n if n in ("qwen3_moe", "gpt_oss") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(MODELS)])
def test_experts_split_whole_over_two_ranks_equal_one_process(name):
    model = tiny_moe(name)
    check_split_whole(model, inputs_for(model), FORWARD_REDUCES.get(name, 1))


def test_batched_experts_cannot_be_split_whole_and_say_where():
    """``batched_mm`` experts gather each row's expert weight by its id (``weight[ids]``): no whole
    expert per rank there. Pinned S(0), the plan is refused naming the op; unpinned, the experts are
    split by features or kept whole, as before."""
    model = tiny_moe("qwen3_moe")
    model.config._experts_implementation = "batched_mm"
    inputs = inputs_for(model)
    graph = autotp.capture(model, inputs)
    assert not [n for n in graph.nodes if "grouped_mm" in n.target]
    with pytest.raises(ValueError, match=r"S\(0\) cannot be read by aten.index.Tensor at model.layers.0.mlp.experts"):
        plan_graph(graph, (2,), "cpu-gloo", "train", pin={name: "S(0)" for name in expert_weights(model)})
    plan = plan_graph(graph, (2,), "cpu-gloo", "train")
    assert "Pd" not in {str(p) for n in plan.nodes for p in plan.strategy(n.name).output}


@pytest.mark.slow
def test_deepseek_v3_grouped_routing_captures_and_plain_plan_is_exact():
    """DeepSeek-V3's router picks each token's best group of experts (a view of the scores by group,
    a top-k over groups, a mask scattered back over the experts): it captures, and its free plan on 2
    ranks equals one process."""
    model = tiny_moe("deepseek_v3")
    assert model.config.n_group == 2 and model.config.topk_group == 1
    inputs = inputs_for(model)
    graph = autotp.capture(model, inputs)
    assert any(n.target == "aten.masked_fill.Scalar" for n in graph.nodes)  # the experts of the other group masked
    check_exact(graph, plan_graph(graph, (2,), "cpu-gloo", "train"), model, inputs)


@pytest.mark.parametrize("name", [n if n == "qwen3_moe" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("qwen3_moe", "mixtral", "olmoe")])
def test_the_load_balancing_loss_with_experts_on_ranks_equals_one_process(name):
    """``output_router_logits=True``: the model's loss adds the router's load-balancing loss (every
    layer's router logits over the whole batch); with the experts placed whole, the loss and every
    gradient (the router's from both terms) equal one process's."""
    model = tiny_moe(name, output_router_logits=True, router_aux_loss_coef=0.5)
    inputs = inputs_for(model)
    with torch.no_grad():
        out, plain = model(**inputs), tiny_moe(name)(**inputs)  # the same weights, without the term
    assert out.aux_loss > 0
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * out.aux_loss)
    check_split_whole(model, inputs)


def _generate_rank(rank, world, built, prompt):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = copy.deepcopy(built)
    pin = {n: "S(0)" for n in expert_tensors(model)}
    plan = autotp.plan(model, mesh, (prompt,), hardware="cpu-gloo", mode="inference", pin=pin)
    pm = autotp.parallelize(model, mesh, (prompt,), plan=plan)
    tokens = pm.generate(prompt, max_new_tokens=NEW_TOKENS).tolist()
    graphs = next(iter(pm._autotp_generation.values()))
    grouped = {kind: [str(p.strategy(n.name).output[0]) for n in p.nodes if "grouped_mm" in n.name]
               for kind, p in graphs.plans.items()}
    return tokens, grouped, {n: tuple(p.to_local().shape) for n, p in pm.named_parameters() if n in pin}


@pytest.mark.slow
def test_generate_with_experts_on_ranks_gives_the_model_s_own_tokens():
    """``generate``'s prompt and decode graphs keep the weights where the parallel module stores them
    (the experts whole on ranks): each grouped matmul computes its experts' rows, and the greedy
    tokens are the model's own."""
    model = tiny_moe("qwen3_moe").eval()
    prompt = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    for tokens, grouped, local in run_threads_tracing_in_turns(_generate_rank, 2, model, prompt):
        assert grouped == {"prompt": ["Pd", "Pd"], "token": ["Pd", "Pd"]}, grouped
        assert all(shape[0] == 2 for shape in local.values()), local  # 2 of the 4 experts on each rank
        assert tokens == expected
