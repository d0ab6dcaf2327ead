"""Expert x tensor parallelism on a (2, 2) mesh: the experts split over one axis and each expert's
features over the other (autotp/planning/rules/experts.py, routed.py). The first grouped matmul's
weight ``S(0)`` on the expert axis and by its output features on the other (``gate_up_proj``
``(E, 2f, d)``: ``S(1)[2]``, gate and up each split), the second's ``S(0)`` and by its input
features (``down_proj`` ``(E, d, f)``: ``S(2)``), a partial sum over the feature axis.

Both variants on the expert axis: every token on every rank (``Pd``) and the tokens sent to their
experts' ranks by all-to-all (the routed region, its rows split by features over the other axis).
Tiny Qwen3-MoE of 8 experts (2 a rank on the expert axis) on 4 threaded ranks: the loss and every
gradient equal one process's, each rank holds its experts' piece of their features, and the
collectives that run are the plan's, kind by kind and axis by axis.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.placement import P, Pd, Pt, R, S, Se, St, Strategy
from autotp.planning.planner import plan_graph
from autotp.planning.rules.routed import routed_collectives, routed_kept_bytes
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog, assert_as_planned, assert_kinds_as_planned
from tests.helpers.plans import without_pd
from tests.runtime.test_experts_all_to_all import fixed_routing
from tests.runtime.test_experts_on_ranks import expert_weights
from tests.runtime.test_experts_four_ranks import eight_experts

pytest.importorskip("transformers")

MESH = (2, 2)
AXES = ("dp", "tp")


def experts_by_features(model, expert_axis: int) -> dict[str, str]:
    """The pin: each stacked weight split by experts on ``expert_axis`` and by its features on the
    other (gate|up by output features in blocks, down by input features)."""
    pin = {}
    for name in expert_weights(model):
        features = "S(1)[2]" if name.endswith("gate_up_proj") else "S(2)"
        pin[name] = "S(0)" + features if expert_axis == 0 else features + "S(0)"
    return pin


def _loss(out):
    """A causal LM's loss, or for a block alone the sum of its output's squares."""
    return out.loss if hasattr(out, "loss") else out.pow(2).sum()


def _logged_step(rank, world, graph, plan, model, args, kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=AXES)
    pm = build_parallel_module(graph, plan, mesh, model)
    with CollectiveLog(mesh) as forward:
        loss = _loss(pm(*args, **kwargs))
    with CollectiveLog(mesh) as backward:
        loss.backward()
    local = {n: tuple(p.to_local().shape) for n, p in pm.named_parameters() if hasattr(p, "to_local")}
    grads = {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}
    return loss.detach(), grads, local, forward, backward


def check_step(graph, plan, model, args, kwargs, byte_for_byte: bool) -> None:
    """One training step on 4 threaded ranks: one process's loss and every gradient, each rank a
    quarter of every expert weight (half its experts, half their features), and the plan's
    collectives by kind and axis (byte for byte too where ``byte_for_byte``)."""
    reference = _loss(model(*args, **kwargs))
    reference.backward()
    weights = {n: p.shape for n, p in model.named_parameters() if p.ndim == 3}
    for loss, grads, local, forward, backward in run_threads(_logged_step, 4, graph, plan, model, args, kwargs):
        torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=n)
        for n, shape in weights.items():
            assert local[n][0] == shape[0] // 2 and torch.Size(local[n]).numel() == shape.numel() // 4, (n, local[n])
        for log, phase in ((forward, "forward"), (backward, "backward")):
            assert_kinds_as_planned(log, plan, phase)
            if byte_for_byte:
                assert_as_planned(log, plan, phase)
    model.zero_grad()


def grouped_strategies(graph, plan) -> list[str]:
    return [str(plan.strategy(n.name)) for n in plan.nodes if "grouped_mm" in graph[n.name].target]


@pytest.fixture(scope="module")
def qwen3_moe():
    """The tiny Qwen3-MoE of 8 experts (the load-balancing loss in its loss), routing balanced by
    construction (each rank's experts get the mean rows: the all-to-alls send what the plan states)."""
    model, inputs = eight_experts("qwen3_moe")
    fixed_routing(model)
    return model, inputs


def _captured(qwen3_moe, whole_model: bool):
    """``(module, args, kwargs, graph)``: the whole model on its example, or its embedding and first
    MoE block alone (a graph of ~50 nodes, planned on (2, 2) in under a second; the whole model's
    takes about ten)."""
    model, inputs = qwen3_moe
    if whole_model:
        return model, (), inputs, autotp.capture(model, inputs)
    block = torch.nn.Sequential(model.model.embed_tokens, model.model.layers[0].mlp)
    args = (inputs["input_ids"],)
    return block, args, {}, autotp.capture(block, args)


# (variant, expert axis, whole model): the MoE block by all-to-all with the experts on the first axis
# in the default run
CASES = [("routed", 0, False)] + [pytest.param(*case, marks=pytest.mark.slow) for case in
                                  [("pd", 0, False), ("routed", 0, True), ("routed", 1, True), ("pd", 0, True),
                                   ("pd", 1, True)]]


@pytest.mark.parametrize("variant,expert_axis,whole_model", CASES)
def test_experts_on_one_axis_and_features_on_the_other_equal_one_process(qwen3_moe, variant, expert_axis,
                                                                          whole_model):
    module, args, kwargs, graph = _captured(qwen3_moe, whole_model)
    pin = experts_by_features(module, expert_axis)
    if variant == "routed":
        with without_pd():
            plan = plan_graph(graph, MESH, "cpu-gloo", "train", pin=pin)
    else:
        plan = plan_graph(graph, MESH, "cpu-gloo", "train", pin=pin)

    def on(expert, feature):  # one tensor's placements: the expert axis's and the feature axis's
        return (expert, feature) if expert_axis == 0 else (feature, expert)

    # the rows in, the counts, the rows between the grouped matmuls, the rows out, on the expert axis
    rows, counts, between, out = (St, Pt, Se, St) if variant == "routed" else (R, R, Pd, Pd)
    # the first grouped matmul: each rank its experts' rows, its piece of their gate and up features;
    # the second: its experts' rows again, a partial sum over the features' axis
    assert grouped_strategies(graph, plan) == [
        str(Strategy((on(rows, R), on(S(0), S(2, 2)), on(counts, R)), on(between, S(1, 2)))),
        str(Strategy((on(between, S(1)), on(S(0), S(1)), on(counts, R)), on(out, P)))]
    grouped = {n.name for n in plan.nodes if "grouped_mm" in graph[n.name].target}
    moved = {c.mesh_axis for c in plan.collectives() if c.at in grouped and c.kind == "all_to_all"}
    assert moved == ({AXES[expert_axis]} if variant == "routed" else set()), moved
    check_step(graph, plan, module, args, kwargs, byte_for_byte=variant == "pd")


def test_routed_rows_split_by_features_move_a_rank_s_piece_of_each_row(qwen3_moe):
    """The dispatch of rows split by their features over the other axis sends each rank's piece of
    every row (the all-to-all's bytes and the rows kept for the backward over that axis's size); a
    partial sum over the other axis sends whole rows."""
    graph = _captured(qwen3_moe, whole_model=False)[3]
    first, second = [n for n in graph.nodes if "grouped_mm" in n.target]
    rows, hidden = first.input_infos[0].shape
    whole = Strategy(((St, R), (S(0), S(2)), (Pt, R)), (Se, S(1)))
    split = Strategy(((St, S(1)), (S(0), S(1)), (Pt, R)), (Se, P))
    by = {s: {(kind, phase): size for kind, phase, _, size in routed_collectives(first, s, MESH)
              if size > first.input_infos[1].shape[0] * 8} for s in (whole, split)}
    assert by[split] == {k: v / 2 for k, v in by[whole].items()} and by[whole], by
    assert routed_kept_bytes(first, split, MESH) == routed_kept_bytes(first, whole, MESH) / 2 > 0
    partial = Strategy(((Se, S(1)), (S(0), S(1)), (Pt, R)), (St, P))
    back = routed_collectives(second, partial, MESH)
    assert back and all(size > rows / 2 * hidden * 4 for _, _, _, size in back), back
