"""A layout with a context axis run (autotp/runtime/pipeline/module.py): every rank of ``cp`` given the
same micro-batch whole, the plan splitting its sequence there (autotp/planning/search/context_axis.py:
the inputs read split by sequence, every weight whole, no activation whole). A tiny Llama at 32
tokens: the loss and every gradient equal one process's, the sequence is split through the layers,
and each collective of the plan runs once per micro-batch, as the search prices it. ``pp 1 x cp 2``
on 2 threaded ranks in the default run; ``pp 1 x cp 2 x tp 2`` and ``pp 1 x dp 2 (ZeRO 1) x cp 2`` on
4 threaded ranks, ``pp 2 x cp 2`` on 4 gloo processes slow.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from examples.ranks import run_ranks
from tests.helpers.observed import assert_layout_step_exact, layout_step
from tests.helpers.turns import run_threads_tracing_in_turns

transformers = pytest.importorskip("transformers")

SEQUENCE = 32


def _llama():
    """4 layers (a pipeline needs a stack of 4), 4 heads of 8, 2 kv heads; 2 rows of 32 tokens."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _rank(rank, world, plan_json, built=None):
    """One rank's step. ``built``: the model and inputs, made once for threaded ranks (which share
    torch's random generator, so each building its own would race on it)."""
    model, inputs = copy.deepcopy(built) if built else _llama()
    return layout_step(plan_json, model, inputs)[1:]


def _check(plan, results) -> None:
    # the sequence split through the layers: every projection reads its activation split on cp
    split = {row.module: row for row in plan.modules if row.module.endswith(("q_proj", "down_proj"))}
    assert split and all("S(1)" in str(row.input) for row in split.values()), split
    assert_layout_step_exact(plan, *_llama(), results)


def _plan(layout: dict):
    model, inputs = _llama()
    devices = layout.get("pp", 1) * layout.get("dp", 1) * layout["cp"] * layout.get("tp", 1)
    return autotp.plan(model, devices, inputs, hardware="cpu-gloo", pipeline=layout)


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


@pytest.mark.slow  # 4 threaded ranks
def test_replicas_of_a_context_axis_under_zero_1_equal_one_process():
    """FSDP2 shards over the data axis alone: the weights are whole on every rank of the context axis."""
    plan = _plan({"cp": 2, "dp": 2, "pp": 1, "tp": 1, "zero": 1, "micro_batch_size": 1})
    assert plan.pipeline.layout.mesh_shape == (1, 2, 2, 1)
    model, inputs = _llama()
    _check(plan, run_threads_tracing_in_turns(_rank, 4, plan.to_json(), (model, inputs)))


@pytest.mark.slow  # 4 processes
def test_stages_on_a_context_axis_equal_one_process():
    plan = _plan({"cp": 2, "pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "micro_batch_size": 1})
    assert plan.pipeline.layout.mesh_shape == (2, 2, 1)
    _check(plan, run_ranks(_rank, 4, plan.to_json()))
