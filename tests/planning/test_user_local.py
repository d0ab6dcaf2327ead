"""A user's op whose split runs its own code on a rank's pieces: its rule and its local execution in
one registration (``autotp.register_rule(op, rule, local=...)``).

``demo::expert_sum`` (examples/custom_op.py) routes each token to experts by id. With the experts
split, the op as it is reads a rank's local experts under the global ids (wrong); the registered
``local`` shifts the ids to the rank's experts, and each rank's sum is a partial sum.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.planning.choices.check import RuleNotExact, check_rule
from autotp.planning.planner import plan_graph
from examples.custom_op import EXPERT_SUM_RULE, Routed, expert_sum_local
from tests.helpers.exactness import assert_step_matches_one_process

OP = "demo.expert_sum.default"
OP_FN = torch.ops.demo.expert_sum.default
SPLIT_EXPERTS = "(R, S(0), R, R) -> P"


def _example() -> tuple:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(6, 8, generator=gen), torch.randn(4, 8, 5, generator=gen),
            torch.randint(0, 4, (6, 2), generator=gen), torch.rand(6, 2, generator=gen))


@pytest.fixture()
def unregister():
    yield
    if OP in autotp.planning.rules.registered_rules():
        autotp.unregister_rule(OP)


def _routed_plan():
    model = Routed()
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin={"w": "S(0)"}, recompute=False)
    (node,) = [n for n in graph.ops() if n.target == OP]
    assert str(plan.strategy(node.name)) == SPLIT_EXPERTS
    return graph, plan, model, x


def test_without_its_local_execution_the_expert_split_is_wrong(unregister):
    """The rule alone: check_rule catches the split experts, and the step on 2 ranks differs from one process."""
    autotp.register_rule(OP_FN, EXPERT_SUM_RULE)
    with pytest.raises(RuleNotExact, match=r"1 of 3 strategies .*\n  \(R, S\(0\), R, R\) -> P: AssertionError"):
        check_rule(OP_FN, _example())
    with pytest.raises(AssertionError, match="not close"):
        assert_step_matches_one_process(*_routed_plan())


def test_with_its_local_execution_each_rank_runs_its_experts_exactly(unregister):
    """The rule and its local code: every strategy exact on pieces, and a training step with the experts
    split over 2 threaded ranks gives one process's output and gradients."""
    autotp.register_rule(OP_FN, EXPERT_SUM_RULE, local=expert_sum_local)
    assert [str(s) for s in check_rule(OP_FN, _example())] == [
        "(R, R, R, R) -> R", SPLIT_EXPERTS, "(S(0), R, S(0), S(0)) -> S(0)"]
    assert_step_matches_one_process(*_routed_plan())


def test_a_local_that_is_not_a_function_is_refused_and_the_registration_kept(unregister):
    autotp.register_rule(OP_FN, EXPERT_SUM_RULE, local=expert_sum_local)
    with pytest.raises(TypeError, match=r"local= for demo.expert_sum.default is an int; expected a function "
                                        r"local\(site\) returning the callable"):
        autotp.register_rule(OP_FN, [(("R", "S(0)", "R", "R"), "P")], local=3)
    assert len(check_rule(OP_FN, _example())) == 3  # the earlier rule and its local code, as they were


def test_a_local_that_returns_no_callable_names_what_it_returned(unregister):
    autotp.register_rule(OP_FN, EXPERT_SUM_RULE, local=lambda site: "shift the ids")
    with pytest.raises(RuleNotExact, match=r"local= registered for demo.expert_sum.default returned a str at node "
                                           r"expert_sum \(\(R, S\(0\), R, R\) -> P\); expected the callable"):
        check_rule(OP_FN, _example())


def test_unregister_forgets_the_local_execution(unregister):
    from autotp.planning.rules import local_executions

    autotp.register_rule(OP_FN, EXPERT_SUM_RULE, local=expert_sum_local)
    assert len(local_executions(OP)) == 1
    autotp.unregister_rule(OP)
    assert local_executions(OP) == ()
