"""Experts placed whole on ranks: with the stacked expert weights split on the expert dim, each rank
computes the rows of the sorted tokens its experts own (the others zero), the ops between the two
grouped matmuls run on those rows, and the combine leaves a partial sum that one all-reduce
completes (autotp/planning/rules/experts.py).

Tiny Hugging Face MoE models built from configs, their experts pinned ``S(0)``, on 2 threaded ranks:
the loss and every gradient equal one process's, and the experts' weights are never gathered.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.planning.planner import plan_graph
from autotp.runtime.module import build_parallel_module
from autotp.runtime.shards import placements_of
from autotp.weights.checkpoint import full_tensor
from examples.ranks import run_threads

transformers = pytest.importorskip("transformers")

TOKENS = (2, 12)  # 24 tokens x top 2 over 4 experts: every expert gets rows (checked)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2)
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16, num_experts=4)),
}


def tiny_moe(name: str):
    config_name, model_name, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    return getattr(transformers, model_name)(config).float()


def expert_weights(model) -> list[str]:
    """The stacked expert weights (3-d parameters: experts x features x features)."""
    return [n for n, p in model.named_parameters() if p.ndim == 3]


def inputs_for(model):
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _step(rank, world, graph, plan, model, inputs):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    loss = pm(**inputs).loss
    loss.backward()
    local = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for n, p in pm.named_parameters()}
    return loss.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}, local


def experts_split_plan(model, inputs, world: int = 2):
    graph = autotp.capture(model, inputs)
    pin = {name: "S(0)" for name in expert_weights(model)}
    return graph, plan_graph(graph, (world,), "cpu-gloo", "train", pin=pin)


def assert_whole_experts_equal_one_process(graph, plan, model, inputs) -> None:
    """On 2 threaded ranks the loss and every gradient equal one process's, each rank holding half
    of the experts, whole."""
    out = model(**inputs)
    out.loss.backward()
    for loss, grads, local in run_threads(_step, 2, graph, plan, model, inputs):
        torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=n)
        for n in expert_weights(model):
            shape = dict(model.named_parameters())[n].shape
            assert local[n] == (shape[0] // 2, *shape[1:]), (n, local[n])


def every_expert_routed(model, inputs) -> bool:
    """The router's top-k over the example reaches every expert of every layer."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    for out in seen:
        logits = out[0] if isinstance(out, tuple) else out
        experts = logits.shape[-1]
        if isinstance(out, tuple) and len(out) == 3:  # (logits, scores, indices)
            chosen = out[2]
        else:
            chosen = logits.topk(k, dim=-1).indices
        if torch.bincount(chosen.flatten(), minlength=experts).min() == 0:
            return False
    return bool(seen)


# one model in the default run (the expert block's rules and local code are the same for each);
# the others in the slow suite
@pytest.mark.parametrize("name", [n if n == "qwen3_moe" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)])
def test_experts_split_whole_over_two_ranks_equal_one_process(name):
    model = tiny_moe(name)
    inputs = inputs_for(model)
    assert every_expert_routed(model, inputs)
    graph, plan = experts_split_plan(model, inputs)
    weights = expert_weights(model)
    assert len(weights) == 2, weights
    # each grouped matmul computes its experts' rows (Pd), and nothing gathers the experts' weights
    grouped = [n for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    assert len(grouped) == 2 and all(str(plan.strategy(n.name).output[0]) == "Pd" for n in grouped), \
        [str(plan.strategy(n.name)) for n in grouped]
    assert not [c for c in plan.collectives() if c.kind == "all_gather"], [str(c) for c in plan.collectives()]
    forward = [c for c in plan.collectives() if c.phase == "forward" and "mlp" in (graph[c.at].module_path or "")]
    assert len(forward) == 1 and forward[0].kind == "all_reduce", [str(c) for c in forward]

    assert_whole_experts_equal_one_process(graph, plan, model, inputs)


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
