"""Whole experts with the tokens split (autotp/planning/rules/routed.py): each rank routes its own
tokens, sends each routed row to the rank holding its expert and gets the results back (two
all-to-alls per MoE layer), its tokens staying split.

Tiny Hugging Face MoE models built from configs, their experts pinned ``S(0)`` and planned under the
least memory any plan needs: the planner splits the tokens and moves them by all-to-all (the
activations between the grouped matmuls are the rank's share, not every token's). On 2 threaded
ranks the loss and every gradient equal one process's.
"""

from __future__ import annotations

import math

import pytest
import torch

import autotp
from autotp.placement import P, Pt, S, Se, St, parse_placements
from autotp.planning.costs.redistribute import is_convertible
from autotp.planning.planner import plan_graph
from autotp.planning.rules.routed import routed_region
from examples.ranks import run_threads
from tests.helpers.observed import assert_as_planned, assert_kinds_as_planned, logged_step
from tests.helpers.plans import solver_objective, without_pd
from tests.runtime.test_experts_on_ranks import (_experts_count, check_exact, every_expert_routed, expert_tensors,
                                                 expert_weights, experts_of, inputs_for, tiny_moe)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def captured():
    """The tiny Qwen3-MoE, its example and its graph (captured once for this module's tests)."""
    model = tiny_moe("qwen3_moe")
    inputs = inputs_for(model)
    return model, inputs, autotp.capture(model, inputs)


@pytest.fixture(scope="module")
def routed_plan(captured):
    """The tiny Qwen3-MoE's plan with its experts pinned ``S(0)`` under the least memory, and the
    solver's objective for it."""
    with solver_objective() as objective:
        plan = tightest_plan(captured[2], {n: "S(0)" for n in expert_weights(captured[0])})
    return plan, objective["s"]


def tightest_plan(graph, pin):
    """The plan under the least memory any plan with ``pin`` needs."""
    try:
        plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin, memory_budget=1)
    except autotp.MemoryBudgetError as err:
        return plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin, memory_budget=int(err.minimum_bytes))
    raise AssertionError("a budget of one byte was met")


# the models the all-to-all variant is tested on; Qwen3-MoE and gpt-oss (its experts' biases: the
# first looked up on the experts' ranks for the rows they received, the second, added once the rows
# are back, on the tokens' ranks from the whole table) in the default run
ROUTED = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen3_moe")
# planned with Pd withheld (one solve, no search for the least memory): DeepSeek-V3's least-memory
# plan keeps every token on every rank (Pd needs about the memory of the all-to-all variant at this
# size, and is priced faster); gpt-oss's picks the all-to-all variant as the others', in two solves
WITHOUT_PD = ("deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("name", [n if n in ("qwen3_moe", "gpt_oss") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ROUTED])
def test_tokens_sent_to_their_experts_by_all_to_all_equal_one_process(name, request):
    if name == "qwen3_moe":
        model, inputs, graph = request.getfixturevalue("captured")
        plan = request.getfixturevalue("routed_plan")[0]
    else:
        model = tiny_moe(name)
        inputs = inputs_for(model)
        graph = autotp.capture(model, inputs)
        pin = {n: "S(0)" for n in expert_weights(model)}
        if name in WITHOUT_PD:
            with without_pd():
                plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)
        else:
            plan = tightest_plan(graph, pin)
    assert every_expert_routed(model, inputs)
    grouped = [n.name for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    assert [str(plan.strategy(n)) for n in grouped] == ["(St, S(0), Pt) -> Se", "(Se, S(0), Pt) -> St"]
    experts = [c for c in plan.collectives() if c.at in grouped]
    kinds = sorted((c.phase, c.kind, c.at == grouped[0]) for c in experts)
    # forward: the counts and the rows out at the first grouped matmul, the rows back at the second;
    # backward: the gradients' way back, once each
    assert kinds == sorted([("forward", "all_to_all", True)] * 2 + [("forward", "all_to_all", False)]
                           + [("backward", "all_to_all", True), ("backward", "all_to_all", False)]), kinds
    block = [c for c in plan.collectives() if "mlp.experts" in (graph[c.at].module_path or "")]
    assert {c.kind for c in block} == {"all_to_all"}, [str(c) for c in block]

    check_exact(graph, plan, model, inputs, whole=expert_weights(model))


def test_the_region_is_found_from_the_graph_and_nothing_else_reads_as_routed_rows(captured):
    graph = captured[2]
    roles = routed_region(graph)
    grouped = [n.name for n in graph.nodes if "grouped_mm" in n.target]
    assert [roles[g][0] for g in grouped] == ["e", "t"]  # the first grouped matmul's rows go to the experts
    exits = [n for n, (role, _, _) in roles.items() if role == "x"]
    assert len(exits) == 1 and graph[exits[0]].target == "aten.sum.dim_IntList"
    assert roles[exits[0]][1:] == (24 * 2, 24)  # 24 tokens, top 2
    # routed rows stay in their region: a piece of the whole tensor is not a rank's own rows
    for a, b in [(S(0), St), (St, S(0)), (Se, St), (P, Pt), (Pt, P)]:
        assert not is_convertible((a,), (b,)), (a, b)
    assert parse_placements("StSePt") == (St, Se, Pt)


def test_batched_experts_have_no_routed_region():
    model = tiny_moe("qwen3_moe")
    model.config._experts_implementation = "batched_mm"
    assert routed_region(autotp.capture(model, inputs_for(model))) == {}


def test_a_grouped_matmul_is_priced_at_its_matmuls_flops(captured):
    """Each routed row goes through its expert's matrix: the grouped matmul's FLOPs are those of one
    matmul per expert on its rows (counted by FlopCounterMode), not zero."""
    from torch.utils.flop_counter import FlopCounterMode

    graph = captured[2]
    grouped = [n for n in graph.nodes if "grouped_mm" in n.target]
    assert len(grouped) == 2
    for node in grouped:
        (rows, k), (experts, _, n) = node.input_infos[0].shape, node.input_infos[1].shape
        sizes = [rows // experts + (e < rows % experts) for e in range(experts)]  # any split of the rows
        with FlopCounterMode(display=False) as counter:
            for size in sizes:
                torch.mm(torch.zeros(size, k), torch.zeros(k, n))
        assert node.flops == counter.get_total_flops() > 0, (node.name, node.flops)


def test_the_predicted_step_counts_the_all_to_alls_once(captured, routed_plan):
    """The all-to-alls a grouped matmul runs inside itself are in the plan's collectives and in the
    solver's objective with the op: the plan's predicted step is the objective, each counted once."""
    graph = captured[2]
    plan, objective_s = routed_plan
    assert any(c.kind == "all_to_all" and "grouped_mm" in graph[c.at].target for c in plan.collectives())
    assert objective_s == pytest.approx(plan.predicted_time().total_s, rel=1e-9)


def test_a_plan_with_routed_rows_saves_and_loads(routed_plan):
    from autotp.planning.result.plan import Plan

    plan = routed_plan[0]
    loaded = Plan.from_json(plan.to_json())
    assert [str(loaded.strategy(n.name)) for n in loaded.nodes] == [str(plan.strategy(n.name)) for n in plan.nodes]
    assert {"St", "Se", "Pt"} <= {str(p) for n in loaded.nodes for p in loaded.strategy(n.name).output}
    assert loaded.collectives() == plan.collectives()  # the all-to-alls' bytes a rank sends among them


def fixed_routing(model, skewed: bool = False) -> None:
    """Each experts module of ``model`` gets its ``k`` experts per token by construction, whatever the
    router chose (the router's weights are kept): balanced, token ``t``'s ``j``-th is ``(t k + j) mod
    E``, so every rank sends every other rank as many rows as it keeps and each rank's experts
    receive the mean; skewed, every token's are experts ``0 .. k-1``, all on the first rank."""
    def fixed(module, args):
        x, ids, weights = args
        tokens, k = ids.shape
        order = torch.arange(k, device=ids.device).repeat(tokens, 1) if skewed else \
            torch.arange(tokens * k, device=ids.device).view(tokens, k)
        return x, order % _experts_count(module), weights

    for module in experts_of(model):
        module.register_forward_pre_hook(fixed)


@pytest.mark.parametrize("variant,routing", [("routed", "balanced"), ("pd", "balanced"),
                                             pytest.param("routed", "skewed", marks=pytest.mark.slow)])
def test_the_collectives_of_a_step_are_the_plan_s_and_all_to_alls_send_within_its_bound(variant, routing):
    """One training step on 2 threaded ranks: the collectives that run are the plan's, kind by kind
    and axis by axis (for ``Pd``, byte for byte too). With routing balanced by construction, each
    all-to-all a rank runs sends at most what the plan states for it (``rank_sent_bytes``: the routed
    rows' at the busiest rank's rows, the counts' ``E`` integers). Skewed past that (every row to
    the first rank's experts), the step is still exact, and the first rank sends more than priced
    (a price, not a cap)."""
    model = tiny_moe("qwen3_moe")
    fixed_routing(model, skewed=routing == "skewed")
    inputs = inputs_for(model)
    graph = autotp.capture(model, inputs)
    if variant == "routed":
        with without_pd():
            plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin={n: "S(0)" for n in expert_weights(model)})
        grouped = [n.name for n in plan.nodes if "grouped_mm" in graph[n.name].target]
        rows, hidden = graph[grouped[0]].input_infos[0].shape  # 24 tokens x top 2, the hidden size
        experts = graph[grouped[0]].input_infos[1].shape[0]
        bounds = sorted(c.rank_sent_bytes for c in plan.collectives() if c.at in grouped and c.phase == "forward")
        # per rank: the counts (E int64), then the rows out and back at the busiest rank's rows
        assert bounds == pytest.approx([experts * 8] + [(rows / 2 + 3 * math.sqrt(rows / 2)) * hidden * 4] * 2)
    else:
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin={n: "S(0)" for n in expert_tensors(model)})
        assert not [c for c in plan.collectives() if c.kind == "all_to_all"]
    out = model(**inputs)
    for rank, (loss, _, forward, backward) in enumerate(run_threads(logged_step, 2, graph, plan, model, inputs)):
        torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
        assert any(s.kind == "all_to_all" for s in forward.seen) == (variant == "routed")
        for log, phase in ((forward, "forward"), (backward, "backward")):
            if routing == "skewed" and rank == 0:  # the combine's rows back, and the dispatch's gradients
                with pytest.raises(AssertionError, match="sent more than planned"):
                    assert_kinds_as_planned(log, plan, phase)
                continue
            assert_kinds_as_planned(log, plan, phase)
            if variant == "pd":
                assert_as_planned(log, plan, phase)
