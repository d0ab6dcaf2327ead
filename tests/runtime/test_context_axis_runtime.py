"""A layout with a context axis run (autotp/runtime/pipeline/module.py): every rank of ``cp`` given the
same micro-batch whole, the plan splitting its sequence there (autotp/planning/search/context_axis.py:
the inputs read split by sequence, every weight whole, no activation whole). A tiny Llama at 32
tokens: the loss and every gradient equal one process's, the sequence is split through the layers,
and each collective of the plan runs once per micro-batch, as the search prices it. ``pp 1 x cp 2``
on 2 threaded ranks in the default run; ``pp 1 x cp 2 x tp 2`` on 4 threaded ranks slow.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import autotp
from tests.helpers.turns import run_threads_tracing_in_turns

transformers = pytest.importorskip("transformers")

SEQUENCE = 32


def _llama():
    """4 layers (a pipeline needs a stack of 4), 4 heads of 8, 2 kv heads; 2 rows of 32 tokens."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _rank(rank, world, plan_json, built):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.observed import CollectiveLog

    model, inputs = copy.deepcopy(built)
    plan = autotp.Plan.from_json(plan_json)
    layout = plan.pipeline.layout
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.axis_names)
    pm = autotp.parallelize(model, mesh, inputs, plan=plan)
    with CollectiveLog(pm.tp_mesh) as log:  # the plan's mesh: the context axis (and the tensor axis)
        loss = pm.step(**inputs)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in pm.named_parameters()}
    return None if loss is None else loss.item(), grads, Counter((c.kind, c.mesh_axis) for c in log.seen)


def _check(plan, results) -> None:
    model, inputs = _llama()
    loss = model(**inputs).loss
    loss.backward()
    c = plan.pipeline.chosen
    # the sequence split through the layers: every projection reads its activation split on cp
    split = {row.module: row for row in plan.modules if row.module.endswith(("q_proj", "down_proj"))}
    assert split and all("S(1)" in str(row.input) for row in split.values()), split
    planned = Counter()
    for coll in plan.collectives():
        planned[(coll.kind, coll.mesh_axis)] += c.micro_batches
    for got, grads, seen in results:
        assert got == pytest.approx(loss.item(), rel=1e-5)
        assert set(grads) == {n for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
        assert seen == planned, (seen, planned)


def _plan(layout: dict):
    model, inputs = _llama()
    return autotp.plan(model, layout.get("cp", 1) * layout.get("tp", 1), inputs, hardware="cpu-gloo",
                       pipeline=layout)


def test_a_context_axis_runs_and_equals_one_process():
    plan = _plan({"cp": 2, "pp": 1, "tp": 1, "micro_batch_size": 1})
    c = plan.pipeline.chosen
    assert (c.pp, c.dp, c.cp, c.tp, c.micro_batches) == (1, 1, 2, 1, 2)
    assert plan.pipeline.layout.mesh_shape == (1, 2, 1) and plan.mesh.axis_names == ("cp",)
    assert set(plan.parameter_placements.values()) == {"R"}  # every weight whole on the context axis
    model, inputs = _llama()
    _check(plan, run_threads_tracing_in_turns(_rank, 2, plan.to_json(), (model, inputs)))


@pytest.mark.slow  # 4 threaded ranks, a two-axis plan
def test_a_context_and_a_tensor_axis_run_and_equal_one_process():
    plan = _plan({"cp": 2, "pp": 1, "tp": 2, "micro_batch_size": 1})
    assert plan.pipeline.layout.mesh_shape == (1, 2, 2) and plan.mesh.axis_names == ("cp", "tp")
    model, inputs = _llama()
    _check(plan, run_threads_tracing_in_turns(_rank, 4, plan.to_json(), (model, inputs)))
