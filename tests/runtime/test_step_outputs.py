"""A pipeline's step reads the loss alone (autotp/planning/search/step_reads.py): the outputs beside it
are left as the plan holds them, unpriced and never gathered in a step, and gathered whole only by a
call that returns them. A tiny Qwen3-MoE on ``pp 1 x ep 2`` (2 threaded ranks) with its head pinned by
vocabulary, so its logits are split: the plan lists no collective for them; a step runs exactly the
plan's collectives (none gathers the logits) and its loss and every gradient equal one process's;
``forward`` returns the whole logits, equal to the model's; a step with a ``loss_fn`` of its own
reads them whole too. A plain layout (``pp 1 x dp 1 x tp 2``) runs as one parallel module, whose
forward returns every output whole: its plan gathers them and prices so.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import autotp
from examples import models as M
from tests.helpers.plans import without_pd
from tests.helpers.turns import run_threads_tracing_in_turns
from tests.runtime.test_expert_axis_runtime import _moe

LAYOUT = {"pp": 1, "ep": 2, "micro_batch_size": 1}


def _rank(rank, world, plan_json, built):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.observed import CollectiveLog

    model, inputs = copy.deepcopy(built)
    plan = autotp.Plan.from_json(plan_json)
    layout = plan.pipeline.layout
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.axis_names)
    pm = autotp.parallelize(model, mesh, inputs, plan=plan)
    with CollectiveLog(pm.tp_mesh) as log:
        loss = pm.step(**inputs)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in pm.named_parameters()}
    for p in pm.parameters():
        p.grad = None

    def loss_fn(out, target):  # reads the logits
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    own = pm.step(input_ids=inputs["input_ids"], labels=inputs["labels"], target=inputs["labels"], loss_fn=loss_fn)
    pm.eval()
    with torch.no_grad():
        logits = pm(**inputs).logits
    return loss.item(), grads, Counter((c.kind, c.mesh_axis) for c in log.seen), own.item(), logits


def test_a_plain_layout_returns_every_output_whole():
    model, (ids,) = M.hf_llama(n_layer=4)
    inputs = {"input_ids": ids, "labels": ids}
    plan = autotp.plan(model.train(), 2, inputs, hardware="cpu-gloo", pipeline={"pp": 1, "dp": 1, "tp": 2},
                       pin={"lm_head.weight": "S(0)"})
    assert plan.pipeline.layout.plain and not plan.unread_outputs
    logits = next(o for o in plan.nodes if o.target == "aten.linear.default" and o.module == "lm_head").name
    assert [c.kind for c in plan.collectives() if c.at == logits or c.at.startswith("to")], "gathered whole"


def test_a_step_leaves_the_logits_as_the_plan_holds_them():
    model, inputs = _moe()
    with without_pd():
        plan = autotp.plan(model, 2, inputs, hardware="cpu-gloo", pipeline=LAYOUT, pin={"lm_head.weight": "S(0)"})
    (logits,) = plan.unread_outputs
    assert plan.strategy(logits).output[0].is_shard  # split by vocabulary: gathering it would cost
    assert not [c for c in plan.collectives() if c.at == logits]
    results = run_threads_tracing_in_turns(_rank, 2, plan.to_json(), _moe())
    loss = model(**inputs).loss
    loss.backward()
    planned = Counter()
    for c in plan.collectives():  # once per micro-batch
        planned[(c.kind, c.mesh_axis)] += plan.pipeline.chosen.micro_batches
    for got, grads, seen, own, whole in results:
        assert got == pytest.approx(loss.item(), rel=1e-5)
        assert seen == planned, (seen, planned)  # nothing gathers the logits
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
        with torch.no_grad():
            reference = model.eval()(**inputs).logits
            model.train()
        torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-5)
        shifted = F.cross_entropy(reference[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten())
        assert own == pytest.approx(shifted.item(), rel=1e-5)
