"""Typed op arguments, the op families and the user's own rules.

A custom op autotp does not know (an expert matmul, as MoE code writes with a grouped matmul)
runs replicated with a warning naming it; once the user registers a rule, the planner splits its
weights and the parallel model computes what one process does. ``check_rule`` catches a rule
that is not exact.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.placement import P, R, S
from autotp.planning.choices.check import RuleNotExact, check_rule
from autotp.tracing.graph import OpArgs, SizeArg, TensorArg
from examples.custom_op import Experts
from tests.helpers.exactness import assert_step_matches_one_process

OP = "demo.expert_mm.default"  # examples/custom_op.py defines the op and the model
OP_FN = torch.ops.demo.expert_mm.default

# the rule an expert writes for it: split the experts, the output features, or the contraction
EXPERT_RULE = [((S(0), S(0)), S(0)), ((R, S(2)), S(2)), ((S(2), S(1)), P)]


@pytest.fixture()
def expert_rule():
    autotp.register_rule(OP_FN, EXPERT_RULE)
    yield
    autotp.unregister_rule(OP)


def _plan(graph):
    from autotp.planning.planner import plan_graph

    try:
        return plan_graph(graph, (2,), "cpu-gloo", "train", 1.0, recompute=False)
    except autotp.MemoryBudgetError as err:
        return plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.02) + 1, recompute=False)


def test_op_arguments_are_typed_and_named_by_the_schema():
    class M(nn.Module):
        def forward(self, x):
            return x.transpose(0, -1).sum([0], keepdim=True).softmax(-1)

    g = autotp.capture(M(), (torch.randn(2, 3, 4),))
    args = {n.target: n.args for n in g.ops()}
    assert args["aten.transpose.int"] == OpArgs(("self", "dim0", "dim1"), (TensorArg(0), 0, -1))
    assert args["aten.sum.dim_IntList"]["dim"] == (0,) and args["aten.sum.dim_IntList"]["keepdim"] is True
    assert args["aten.sum.dim_IntList"].get("dtype", "absent") is None  # defaults filled in
    assert args["aten.softmax.int"].int("dim", 3) == 2
    with pytest.raises(KeyError, match="no argument 'dims'"):
        args["aten.transpose.int"]["dims"]


def test_symbolic_sizes_are_size_arguments():
    class M(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0] * x.shape[1], -1)

    g = autotp.capture(M(), (torch.randn(4, 6, 8),), dynamic_dims=None)
    view = next(n for n in g.ops() if n.target in ("aten.view.default", "aten.reshape.default"))
    size = (view.args.get("size") or view.args.get("shape"))[0]
    assert isinstance(size, SizeArg) and size.hint == 24 and "s" in size.expression


def test_a_registered_rule_is_checked_exact_on_data(expert_rule):
    x, w = torch.randn(4, 6, 8), torch.randn(4, 8, 10)
    assert [str(s) for s in check_rule(OP_FN, (x, w))] == [
        "(R, R) -> R", "(S(0), S(0)) -> S(0)", "(R, S(2)) -> S(2)", "(S(2), S(1)) -> P"]


def test_a_wrong_rule_is_caught_by_the_check():
    # the contraction leaves a sum on each rank: neither a split nor a whole value
    autotp.register_rule(OP, [((S(0), S(0)), S(0)), ((S(2), S(1)), S(2)), ((S(2), S(1)), R)])
    try:
        with pytest.raises(RuleNotExact, match=r"(?s)2 of 4 strategies .*\(S\(2\), S\(1\)\) -> S\(2\): .*shape"
                                               r".*\(S\(2\), S\(1\)\) -> R: .*different value"):
            check_rule(OP_FN, (torch.randn(4, 6, 8), torch.randn(4, 8, 10)))
    finally:
        autotp.unregister_rule(OP)


def test_without_a_rule_the_op_runs_replicated_with_a_warning(caplog):
    model = Experts()
    graph = autotp.capture(model, (torch.randn(2, 4, 32),))
    with caplog.at_level(logging.WARNING, logger="autotp.planning.choices.strategies"):
        plan = _plan(graph)
    assert any(OP in r.getMessage() and "runs replicated" in r.getMessage() for r in caplog.records)
    assert all(plan.strategy(n.name).inputs == ((R,), (R,)) for n in graph.ops() if n.target == OP)


def test_with_a_rule_the_experts_are_split_and_exact(expert_rule):
    model = Experts()
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    plan = _plan(graph)
    assert {"up", "down"} <= {k for k, v in plan.parameter_placements.items() if "S" in v}
    assert_step_matches_one_process(graph, plan, model, x)


@pytest.mark.parametrize("op, rule, message", [
    (torch.ops.demo.expert_mm, EXPERT_RULE, "overload packet; pass one overload"),
    ("expert_mm", EXPERT_RULE, "expected an op overload name"),
    (3, EXPERT_RULE, "expected a torch op overload"),
    (OP, [((S(0),), "Q")], "expected a pair"),
])
def test_bad_registrations_say_what_was_expected(op, rule, message):
    with pytest.raises((ValueError, TypeError), match=message):
        autotp.register_rule(op, rule)


@pytest.mark.parametrize("rule, message", [
    ([((S(0),), S(0))], "gave 1 input placements"),
    ([((S(3), S(0)), S(0))], "splits dim 3 of input 0"),
])
def test_a_rule_that_does_not_fit_the_node_is_refused_at_planning(rule, message):
    autotp.register_rule(OP, rule)
    try:
        graph = autotp.capture(Experts(), (torch.randn(2, 4, 32),))
        with pytest.raises(ValueError, match=message):
            _plan(graph)
    finally:
        autotp.unregister_rule(OP)
    assert OP not in autotp.planning.rules.registered_rules()


def test_the_custom_op_example_runs(capsys):
    from examples import custom_op

    try:
        custom_op.main()
    finally:
        for op in ("demo.expert_mm.default", "demo.expert_sum.default"):
            if op in autotp.planning.rules.registered_rules():
                autotp.unregister_rule(op)
    printed = capsys.readouterr().out
    assert "exact on local pieces: (R, R) -> R, (S(0), S(0)) -> S(0)" in printed
    assert "largest difference from one process on 2 ranks" in printed
    assert "expert_sum split as (R, S(0), R, R) -> P" in printed  # its local execution runs each rank's experts
    assert "expert_sum: largest difference from one process on 2 ranks" in printed


class FullWidthNorm(nn.Module):
    """A norm over the whole projected width (OLMoE's q_norm): its mean reduces the split dim."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(32, 256)
        self.out = nn.Linear(256, 32)

    def forward(self, x):  # (B, T, 32)
        h = self.proj(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(h)


def test_a_mean_over_a_split_dim_is_a_partial_and_exact():
    from autotp.planning.planner import plan_graph

    model, x = FullWidthNorm(), torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    # Megatron's layout pinned: h is split by features; its mean is a partial sum of (B, T, 1) and
    # not a gather of h
    plan = plan_graph(graph, (2,), "h100-sxm", "train", pin={"proj.weight": "S(0)", "out.weight": "S(1)"},
                      recompute=False)
    (mean,) = [n for n in graph.ops() if n.target == "aten.mean.dim"]
    assert str(plan.strategy(mean.name)) == "(S(2)) -> P", plan.strategy(mean.name)
    h_bytes = 2 * 8 * 256 * 4
    assert not [c for c in plan.collectives() if c.phase == "forward" and c.bytes >= h_bytes / 2]  # h stays split
    assert_step_matches_one_process(graph, plan, model, x)


def test_a_registered_rule_cannot_claim_a_blocked_split():
    with pytest.raises(ValueError, match="blocked split"):
        autotp.register_rule(OP, [(("S(0)[2]", R), "S(0)")])
    assert OP not in autotp.planning.rules.registered_rules()


def test_check_rule_takes_low_precision_rounding_into_account():
    """bfloat16 sums round at 3 digits: an exact rule is not refused for that, a wrong one still is."""
    a, b = torch.randn(8, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    assert len(check_rule(torch.ops.aten.mm.default, (a, b))) >= 5
    autotp.register_rule("aten.mm.default", [((S(1), S(0)), R)])  # the contraction is a sum, not whole
    try:
        with pytest.raises(RuleNotExact):
            check_rule(torch.ops.aten.mm.default, (a, b))
    finally:
        autotp.unregister_rule("aten.mm.default")


class _RotaryBlock(nn.Module):
    """A Llama-like block whose rotary is GPT-J's (strided slices, stack, flatten) or Meta's (complex)."""

    def __init__(self, dim: int, heads: int, style: str) -> None:
        super().__init__()
        self.heads, self.style = heads, style
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def rotate(self, x, angles):  # x (B, T, H, hd); angles (T, hd / 2)
        if self.style == "complex":
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
            return torch.view_as_real(turned).flatten(3)
        even, odd = x[..., 0::2], x[..., 1::2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)

    def forward(self, x, angles):  # (B, T, dim)
        b, t, d = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = (p(h).view(b, t, self.heads, -1) for p in (self.q, self.k, self.v))
        q, k = self.rotate(q, angles), self.rotate(k, angles)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.down(F.silu(self.up(h)))


class _RotaryModel(nn.Module):
    def __init__(self, dim: int, heads: int, style: str, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RotaryBlock(dim, heads, style) for _ in range(layers))

    def forward(self, x, angles):
        for layer in self.layers:
            x = layer(x, angles)
        return x


@pytest.mark.parametrize("style", ["gptj", "complex"])
def test_rotary_written_with_stack_or_complex_numbers_keeps_heads_split(style):
    """At a real width on (8,), neither rotary costs a gather: a block forward has Megatron's
    count of activation collectives (2 all-reduces, or 2 gathers and 2 reduce-scatters)."""
    dim, heads, seq = 4096, 32, 2048
    with torch.device("meta"):
        model = _RotaryModel(dim, heads, style)
        inputs = (torch.empty(1, seq, dim), torch.empty(seq, dim // heads // 2))
    plan = autotp.plan(model, (8,), inputs, hardware="h100-sxm", mode="train")
    # the whole forward: 4 per block; where a layer's last collective is counted (in it, or in the
    # next one reading its output) depends on the layout, so the two layers are counted together
    large = [c for c in plan.collectives() if c.phase == "forward" and c.bytes >= seq * dim * 4 / 2]
    assert len(large) <= 4 * 2, [str(c) for c in large]
    assert {plan.parameter_placements[f"layers.0.{m}.weight"] for m in "qkv"} == {"S(0)"}


def test_fill_splits_like_its_tensor_and_is_never_a_partial_sum():
    """``x[:, 0] = start`` (BART's shift of its input ids) writes the value into each rank's piece;
    check_rule runs every choice on pieces against the whole op."""
    for op, args in ((torch.ops.aten.fill_.Tensor, (torch.randn(4, 6), torch.tensor(3.0))),
                     (torch.ops.aten.fill_.Scalar, (torch.randn(4, 6), 2.0))):
        checked = [str(s) for s in check_rule(op, args)]
        assert {"(S(0)) -> S(0)", "(S(0), R) -> S(0)"} & set(checked) and not any("P" in s for s in checked), checked


class Extrema(torch.nn.Module):
    """argmax/argmin over a dim (CLIP pools its text at the end token: ``input_ids.argmax(-1)``), and
    over the flattened tensor."""

    def forward(self, x):  # (4, 6, 8)
        return x.argmax(-1), x.argmin(1, keepdim=True), x.argmax()


def test_argmax_and_argmin_split_the_kept_dims_only_and_are_exact():
    from autotp.planning.choices.strategies import node_strategies
    from tests.helpers.local_exactness import capture_graph, check_every_strategy, full_values, strategy_texts

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    g = capture_graph(Extrema(), (x,))
    over_dim, flat = [n for n in g.ops() if n.target == "aten.argmax.default"]
    assert set(strategy_texts(g, over_dim, (2,))) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"}
    assert strategy_texts(g, flat, (2,)) == ["(R) -> R"]  # the flattened tensor's index: whole
    for node in g.ops():  # a reduced dim is never split, nor anything partial
        for st in node_strategies(g, node, (2,)):
            assert not any(p.is_partial for pl in (*st.inputs, st.output) if pl for p in pl), (node.name, str(st))
    checked = check_every_strategy(g, full_values(g, (x,)), (2,), {"aten.argmax.default", "aten.argmin.default"})
    assert checked >= 4, checked


@pytest.mark.parametrize("op, args", [
    (torch.ops.aten.mean.dim, (torch.randn(4, 6), [1])),  # a mean over a split dim: each rank divides by the pieces
    (torch.ops.aten.view.default, (torch.randn(4, 6), [4, 2, 3])),  # its shape argument made the rank's
    (torch.ops.aten.embedding.default, (torch.randn(8, 4), torch.randint(0, 8, (5,)))),  # a masked lookup
    (torch.ops.aten.repeat.default, (torch.randn(3, 4), [2, 1])),  # the rank's copies
])
def test_check_rule_runs_each_rank_as_the_rewrite_does(op, args):
    """autotp's own strategies whose op needs local code on a rank's pieces are exact when checked:
    check_rule runs the op's local executions (they had been left out, and these strategies reported
    not exact). Each check compares the pieces with the op on the whole inputs."""
    splits = [s for s in check_rule(op, args) if any(p.is_shard or p.is_partial for p in s.output)]
    assert any(any(p.is_shard for q in s.inputs if q for p in q) for s in splits), [str(s) for s in splits]


def test_one_hot_splits_the_dims_of_its_indices_not_its_classes():
    """GShard-style dispatch masks (``F.one_hot(top_ids, E)``): each index's row of classes is its
    own, so any dim of the indices splits; the classes' dim stays whole. Each strategy is exact."""
    ids = torch.randint(0, 5, (4, 6), generator=torch.Generator().manual_seed(0))
    assert [str(s) for s in check_rule(torch.ops.aten.one_hot.default, (ids, 5))] == [
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"]
