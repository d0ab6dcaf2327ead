"""A layout with an expert axis run (autotp/runtime/pipeline/module.py): the routed experts split by
expert over ``ep``, every rank of the axis given the same micro-batch of ``ep`` ranks' rows, which the
plan splits and sends to the experts' ranks by all-to-all (the variant forced with ``Pd`` withheld,
:func:`tests.helpers.plans.without_pd`, so the test runs it whatever the cost model prefers at this
size). A tiny Qwen3-MoE of 8 experts whose router reaches every one: the loss and every gradient
equal one process's, and each collective of the plan runs once per micro-batch, as the search
prices it. ``pp 1 x ep 2`` on 2 threaded ranks in the default run; ``pp 2 x ep 2`` on 4 gloo
processes slow.

The head is pinned split by vocabulary, so the logits are split: a step reads the loss alone
(autotp/planning/search/step_reads.py), so the plan lists no collective for the logits and the
step runs none (the plan's collectives, exactly); ``forward`` returns them whole, equal to the
model's, and a step with a ``loss_fn`` of its own reads them whole too.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import autotp
from examples.ranks import run_ranks
from tests.helpers.observed import assert_layout_step_exact, layout_step
from tests.helpers.plans import without_pd
from tests.helpers.turns import run_threads_tracing_in_turns
from tests.runtime.test_experts_on_ranks import every_expert_routed

transformers = pytest.importorskip("transformers")


def _moe():
    """4 layers (a pipeline needs a stack of 4), 8 experts, top 2: 48 tokens reach every expert."""
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).train()
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _rank(rank, world, plan_json, built=None):
    """One rank's step. ``built``: the model and inputs, made once for threaded ranks (which share
    torch's random generator, so each building its own would race on it)."""
    model, inputs = copy.deepcopy(built) if built else _moe()
    pm, loss, grads, seen = layout_step(plan_json, model, inputs)
    # the step returns the loss alone: no micro-batch's output (its logits) outlives it
    assert all(not s.output_chunks for s in pm._pipeline_stages)
    experts = {n: tuple(p.to_local().shape) for n, p in pm.named_parameters() if p.ndim == 3}
    for p in pm.parameters():
        p.grad = None
    own = pm.step(**inputs, target=inputs["labels"], loss_fn=_shifted_loss)  # reads the logits whole
    with torch.no_grad():  # no dropout in this model: its forward as it is, no trace of the other mode
        out = pm(**inputs)
    return loss, grads, seen, experts, None if own is None else own.item(), None if out is None else out.logits


def _shifted_loss(out, target):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())


def _check(plan, results) -> None:
    model, inputs = _moe()
    assert every_expert_routed(model, inputs)
    planned = assert_layout_step_exact(plan, model, inputs, [r[:3] for r in results])
    assert planned[("all_to_all", "ep")] > 0, planned
    c = plan.pipeline.chosen
    with torch.no_grad():
        logits = model(**inputs).logits
    for *_, experts, own, whole in results:
        assert all(shape[0] == 8 // c.ep for shape in experts.values()) and experts  # each rank its experts
        assert own is None or own == pytest.approx(_shifted_loss(SimpleNamespace(logits=logits),
                                                                 inputs["labels"]).item(), rel=1e-5)
        assert (whole is None) == (own is None)
        if whole is not None:
            torch.testing.assert_close(whole, logits, rtol=1e-5, atol=1e-5)


def _plan(layout: dict):
    model, inputs = _moe()
    with without_pd():  # the head split by vocabulary: the logits split, which a step leaves so
        plan = autotp.plan(model, layout.get("pp", 1) * layout["ep"], inputs, hardware="cpu-gloo", pipeline=layout,
                           pin={"lm_head.weight": "S(0)"})
    (logits,) = plan.unread_outputs
    assert plan.strategy(logits).output[0].is_shard and not [c for c in plan.collectives() if c.at == logits]
    return plan


def test_an_expert_axis_runs_and_equals_one_process():
    plan = _plan({"ep": 2, "pp": 1, "micro_batch_size": 1})
    c = plan.pipeline.chosen
    assert (c.pp, c.dp, c.ep, c.tp, c.micro_batches) == (1, 1, 2, 1, 2)
    assert plan.pipeline.layout.mesh_shape == (1, 2, 1) and plan.mesh.axis_names == ("ep",)
    _check(plan, run_threads_tracing_in_turns(_rank, 2, plan.to_json(), _moe()))


@pytest.mark.slow  # 4 processes
def test_stages_on_an_expert_axis_equal_one_process():
    plan = _plan({"ep": 2, "pp": 2, "micro_batch_size": 1, "schedule": "gpipe"})
    assert plan.pipeline.layout.mesh_shape == (2, 2, 1)
    _check(plan, run_ranks(_rank, 4, plan.to_json()))
