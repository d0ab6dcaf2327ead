"""Long-sequence attention on 4 threaded ranks, exact: the loss and every gradient of tiny Llama
(grouped kv heads), Qwen2 and Mistral (a sliding window of 5, smaller than the sequence) equal one
process's, on a batch of two sequences, the first left-padded and the second right-padded, their
padding labelled -100, with the attention split along the sequence:

- as the planner chooses it at 2048 tokens (where it splits the query rows of a causal attention:
  balanced rows);
- forced: the query rows in order, the balanced rows (rank ``r`` computes chunks ``r`` and
  ``7 - r`` of 8), and Ulysses (q, k, v and output projections split by sequence, the attention by
  heads between them, where the heads cut into 4);
- on a ``(2, 2)`` mesh: the query rows on one axis, the heads on the other;
- traced with the sequence dynamic and called at another length (the forward's logits).

The reference is the Hugging Face model's own loss and gradients in one process; the collectives
each rank runs are the plan's by kind and axis. One case runs in the default suite, the others are
slow.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.placement import R, S
from tests.helpers.observed import assert_kinds_as_planned
from tests.runtime.test_attention_masks import _attention, _check_exact, _inputs, _model, ulysses

ROWS, HEADS = S(2), S(1)  # of the attention's (batch, heads, seq, head_dim)


def _attention_as(q_placements: tuple, variant: str = ""):
    """A ``keep`` for :func:`_check_exact`: the attention offered the strategies whose queries are
    ``q_placements`` (one per mesh axis), keys and values whole on each axis that splits the rows,
    of ``variant``; every other node as the planner offers it."""
    def keep(graph, node, strategy):
        if node not in _attention(graph):
            return True
        q, k, v = strategy.inputs[:3]
        rows_whole = all(k[a] == R and v[a] == R for a, p in enumerate(q_placements) if p == ROWS)
        return tuple(q) == q_placements and rows_whole and strategy.variant == variant

    return keep


def _exact(model, inputs, mesh_shape, monkeypatch=None, keep=None):
    graph, plan, logs = _check_exact(model, inputs, mesh_shape, rows_only=monkeypatch, keep=keep)
    for rank_logs in logs:
        for log, phase in zip(rank_logs, ("forward", "backward")):
            assert_kinds_as_planned(log, plan, phase)
    (attention,) = _attention(graph)
    return plan.strategy(attention.name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_planner_s_own_split_at_2048_tokens_equals_one_process(kind):
    """At 2048 tokens the planner splits the causal attention's queries by the sequence itself (at
    this width the ring, whose shifts hide under its work, prices below the balanced variants'
    exchanges; which one is the cost model's call), and the plan equals one process."""
    chosen = _exact(_model(kind, max_position_embeddings=2048), _inputs(True, True, seq=2048), 4)
    assert chosen.inputs[0] == (ROWS,) and chosen.variant in ("", "balanced", "ring/kv2", "ring_balanced/kv2"), \
        str(chosen)


# (model, mesh, queries' placements, variant): the cheapest in the default run, the others slow
FORCED = [("llama", (4,), (ROWS,), "balanced")] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("llama", (4,), (ROWS,), ""), ("qwen2", (4,), (ROWS,), ""), ("qwen2", (4,), (ROWS,), "balanced"),
        ("mistral", (4,), (ROWS,), ""),
        ("llama", (2, 2), (ROWS, HEADS), ""), ("llama", (2, 2), (HEADS, ROWS), "balanced"),
        ("qwen2", (2, 2), (ROWS, HEADS), "balanced"), ("mistral", (2, 2), (HEADS, ROWS), "")]]


@pytest.mark.parametrize("kind, mesh_shape, q_placements, variant", FORCED,
                         ids=lambda v: "".join(map(str, v)) if isinstance(v, tuple) else (v or "in_order"))
def test_query_rows_split_on_four_ranks_equal_one_process(kind, mesh_shape, q_placements, variant, monkeypatch):
    """16 tokens, the attention pinned to its query rows split over 4 (or 2, the heads over the
    other 2): each rank builds its rows' mask (causal, or the window) and the padded rows come out
    as in one process."""
    chosen = _exact(_model(kind), _inputs(True, True, seq=16), mesh_shape, monkeypatch,
                    _attention_as(q_placements, variant))
    assert tuple(chosen.inputs[0]) == q_placements and chosen.variant == variant, str(chosen)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_ulysses_on_four_ranks_equals_one_process(kind, monkeypatch):
    """Ulysses over 4: 8 heads and 4 kv heads (each rank 2 and 1), the projections split by
    sequence, the attention by heads between them."""
    model = _model(kind, num_attention_heads=8, num_key_value_heads=4)
    chosen = _exact(model, _inputs(True, True, seq=16), 4, monkeypatch, ulysses((S(1),), (S(1),)))
    assert chosen.output == (HEADS,), str(chosen)


def _forward_rank(rank, world, graph, plan, model, inputs):
    """One rank's forward of ``plan`` (logits whole), or the message of the ``ValueError`` it raises."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", tuple(plan.mesh.shape), mesh_dim_names=tuple(plan.mesh.axis_names))
    pm = build_parallel_module(graph, plan, mesh, model)
    try:
        with torch.no_grad():
            return pm(**inputs).logits
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("variant, length", [("", 8), pytest.param("balanced", 8, marks=pytest.mark.slow),
                                             pytest.param("balanced", 12, marks=pytest.mark.slow)])
def test_rows_split_at_a_length_other_than_the_traced_one(variant, length, monkeypatch):
    """Traced with the sequence dynamic at 16 tokens and planned with the rows split over 4, then
    called with the first ``length`` tokens: each rank's rows start where its piece of that length
    does (not of 16), so the logits are one process's; balanced rows at 12 (3 rows a rank, not two
    equal chunks) are refused, saying so."""
    from autotp.planning.choices import strategies
    from autotp.planning.planner import plan_graph
    from examples.ranks import run_threads

    model = _model("llama", num_hidden_layers=2)
    inputs = {k: v for k, v in _inputs(True, True, seq=16).items() if k != "labels"}
    graph = autotp.capture(model, inputs, dynamic_dims=None)
    keep, offered = _attention_as((ROWS,), variant), strategies.node_strategies
    monkeypatch.setattr(strategies, "node_strategies",
                        lambda graph_, node, *a: [s for s in offered(graph_, node, *a) if keep(graph_, node, s)])
    plan = plan_graph(graph, (4,), "cpu-gloo", "inference")
    short = {k: v[:, :length] for k, v in inputs.items()}
    with torch.no_grad():
        expected = model(**short).logits
    for got in run_threads(_forward_rank, 4, graph, plan, model, short):
        if length % 8:
            assert "do not cut into its 2 chunks" in got, got
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
