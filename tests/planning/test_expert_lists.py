"""Experts written as a list of alike modules, stacked (examples/own_experts.py's ListExperts): the
plan warns once that they are planned each as its own module and names the batched form; layers
with a batched parameter, and models whose alike modules are not joined (q/k/v of attention), get
no such warning."""

from __future__ import annotations

import logging

import pytest

import autotp
from autotp.planning.choices.expert_lists import expert_lists, warn_expert_lists
from autotp.planning.planner import plan_graph
from examples import models
from examples.own_experts import own_moe


def test_a_list_of_experts_stacked_is_named_once_per_graph(caplog):
    model, inputs = own_moe("list", experts=4)
    graph = autotp.capture(model, inputs)
    with caplog.at_level(logging.WARNING, logger="autotp.planning.choices.expert_lists"):
        plan_graph(graph, (2,), "cpu-gloo", "train")
        warn_expert_lists(graph)  # once per graph, however many plans
    found = [r.getMessage() for r in caplog.records if r.name == "autotp.planning.choices.expert_lists"]
    assert len(found) == 1, found
    assert "4 alike modules (moe.experts.0, moe.experts.1, ... moe.experts.3) run on one input and joined" in found[0]
    assert "never whole on ranks" in found[0] and "Experts of your own" in found[0]


@pytest.mark.parametrize("form", ["dense", "grouped"])
def test_batched_experts_are_not_named(form):
    model, inputs = own_moe(form)
    assert expert_lists(autotp.capture(model, inputs)) == []


def test_alike_modules_not_joined_are_not_named():
    """A Llama's q, k and v projections (alike where heads equal kv heads) read one input but are
    not stacked; its MLP's gate and up projections are multiplied."""
    model, inputs = models.tiny_llama(n_layer=1)
    assert expert_lists(autotp.capture(model, inputs)) == []
