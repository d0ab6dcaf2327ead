"""Pinned parameters: the plan keeps the pinned layout, and bad pins are refused clearly."""

from __future__ import annotations

import pytest

import autotp
from examples import models


@pytest.fixture(scope="module")
def gpt():
    return models.tiny_gpt(device="meta")


def test_pins_fix_the_layout_and_the_solver_does_the_rest(gpt):
    model, inputs = gpt
    pins = {"layers.0.mlp.up_proj.weight": "S(0)", "layers.0.mlp.down_proj.weight": "S(1)"}
    plan = autotp.plan(model, (2,), inputs, hardware="h100-sxm", pin=pins)
    assert plan.parameter_placements["layers.0.mlp.up_proj.weight"] == "S(0)"
    assert plan.parameter_placements["layers.0.mlp.down_proj.weight"] == "S(1)"
    styles = plan.module_styles()
    assert styles["layers.0.mlp.up_proj"] == "colwise" and styles["layers.0.mlp.down_proj"] == "rowwise"
    # unpinned on this tiny model, the solver replicates (kernel overheads dominate): the pin changed the plan
    free = autotp.plan(model, (2,), inputs, hardware="h100-sxm")
    assert free.module_styles()["layers.0.mlp.up_proj"] == "replicate"
    # the pinned plan costs at least as much as the free one: the free one is the optimum
    assert plan.predicted_time().total_s >= free.predicted_time().total_s


def test_replicated_pins_give_no_collectives_in_inference(gpt):
    model, inputs = gpt
    names = [n for n, _ in model.named_parameters()]
    plan = autotp.plan(model, (4,), inputs, hardware="h100-sxm", mode="inference", pin={n: "R" for n in names})
    assert set(plan.parameter_placements.values()) == {"R"}
    assert plan.collectives() == [], [str(c) for c in plan.collectives()]
    assert plan.predicted_time().communication_s == 0.0
    # the control: under a tight budget the same model, unpinned, shards and communicates
    tight = autotp.plan(model, (4,), inputs, hardware="h100-sxm", mode="inference",
                        memory_budget=plan.memory_per_device().total_bytes * 0.5)
    assert tight.collectives(), "a plan under half the replicated memory must communicate"


@pytest.mark.parametrize("pin, fragment", [
    ({"no.such.weight": "R"}, "no parameter 'no.such.weight'"),
    ({"layers.0.mlp.up_proj.weight": "S(7)"}, "can take"),
    ({"layers.0.mlp.up_proj.weight": "RR"}, "has 1 axes"),
    ({"layers.0.mlp.up_proj.weight": "Q"}, "expected placements"),
    ({"layers.0.mlp.up_proj.weight": "S(0)", "layers.1.mlp.up_proj.weight": "S(1)"}, "structurally identical"),
])
def test_bad_pins_are_refused(gpt, pin, fragment):
    model, inputs = gpt
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        autotp.plan(model, (2,), inputs, hardware="h100-sxm", pin=pin)
