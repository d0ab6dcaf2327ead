"""DTensor's op-strategy registry behind ``autotp/planning/choices/dtensor_rules.py``.

What the adapter must do (autotp/planning/choices/strategies.py, autotp/planning/choices/dtensor_rules.py docstrings):

- an op no own rule covers gets the registry's strategies, filtered to those exact on local shards,
  and every one of them passes the check of tests/planning/test_strategies.py ("local execution is exact":
  cut random full inputs into pieces, run the op per rank, reassemble, compare);
- for ops both know, the two lists agree except for a small documented set (a torch upgrade that
  changes the registry changes the set, and this test says so);
- an op neither knows runs replicated, with one warning per op kind;
- the parallel module runs a registry strategy on real ranks and matches one process.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp.placement import R, Strategy
from autotp.planning.choices import dtensor_rules
from autotp.planning.choices.strategies import all_strategies, axis_choices, node_strategies
from examples import models as M
from examples.ranks import run_ranks
from tests.helpers.local_exactness import (
    Ops,
    SelfAttention,
    check_every_strategy,
    check_strategy,
    full_values,
    strategy_tensors,
)


def test_the_registry_is_usable_with_the_pinned_torch():
    """Without it the adapter only warns and ops fall back to replicated; a torch upgrade that moves
    DTensor's internals must fail here, loudly, not skip the tests below."""
    assert dtensor_rules.available()


def strategy_texts(graph, node, mesh) -> list[str]:
    return [str(s) for s in node_strategies(graph, node, mesh)]


def _choice_str(choice) -> str:
    return str(Strategy(tuple((p,) for p in choice[0]), (choice[1],)))


def _fx(graph, node):
    return next(n for n in graph.exported.graph.nodes if n.name == node.name)


# ------------------------------------------------------------------------------------------------
# ops only the registry knows


class RegistryOps(nn.Module):
    """Ops that neither autotp's own rules nor the reference models use; DTensor's registry covers
    each through a single-mesh-dim rule, an op strategy or a decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x, idx):  # x (4, 8, 8), idx (4,) int64 in [0, 8)
        h = self.lin(x)  # (4, 8, 16)
        values, _ = torch.max(h, dim=-1)
        top, _ = torch.topk(h, 2, dim=-1)
        ordered, _ = torch.sort(h, dim=1)
        return (torch.amax(h, dim=-2), torch.logsumexp(h, dim=-1), ordered, values, top, torch.flip(h, [1]),
                torch.roll(h, 1, 2), torch.index_select(h, 1, idx), torch.narrow(h, -1, 4, 8), F.pad(h, (1, 1)),
                torch.std(h, dim=1), torch.floor(h))


# target -> (strategies a correct rule must offer on 2 ranks, input-0 dims it must never split,
#            whether a partial sum may pass through). Read off the math of each op, not off a run.
EXPECTED = {
    "aten.amax.default": ({"(S(0)) -> S(0)", "(S(2)) -> S(1)"}, {1}, False),
    "aten.logsumexp.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)"}, {2}, False),
    "aten.sort.default": ({"(S(0)) -> S(0)", "(S(2)) -> S(2)"}, {1}, False),
    "aten.max.dim": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)"}, {2}, False),
    "aten.topk.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)"}, {2}, False),
    "aten.flip.default": ({"(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"}, {1}, True),
    "aten.roll.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"}, {2}, True),
    "aten.index_select.default": ({"(S(0), R) -> S(0)", "(S(2), R) -> S(2)", "(R, S(0)) -> S(1)", "(P, R) -> P"},
                                  {1}, True),
    "aten.narrow.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"}, {2}, True),
    "aten.pad.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"}, {2}, True),
    "aten.std.correction": ({"(S(0)) -> S(0)", "(S(2)) -> S(1)"}, {1}, False),
    "aten.std.dim": ({"(S(0)) -> S(0)", "(S(2)) -> S(1)"}, {1}, False),
    "aten.floor.default": ({"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}, set(), False),
}


@pytest.fixture(scope="module")
def registry_graph():
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8, 8), torch.tensor([5, 0, 7, 2]))
    graph = autotp.capture(RegistryOps(), inputs)
    return graph, full_values(graph, inputs)


def _registry_ops(graph):
    found = [n for n in graph.ops() if n.target in EXPECTED]
    assert len({n.target for n in found}) == len(EXPECTED) - 1, (  # std exports as one of its two overloads
        f"the module exports {sorted({n.target for n in graph.ops()})}")
    return found


def test_ops_without_own_rules_take_the_registry_strategies(registry_graph, caplog):
    g, _ = registry_graph
    with caplog.at_level(logging.WARNING, logger="autotp"):
        all_strategies(g, (2,))
    assert not [r for r in caplog.records if "no sharding rule" in r.getMessage()], caplog.text
    sources = set()
    for node in _registry_ops(g):
        own = axis_choices(node, 2)  # without the graph: own rules only, which do not know the op
        assert own == [((R,) * len(node.inputs), R)], f"{node.target}: own rules know it: {own}"
        registry = dtensor_rules.registry_axis_choices(g, node, 2)
        assert registry is not None and len(registry) > 1, f"{node.target}: the registry gives {registry}"
        assert axis_choices(node, 2, graph=g) == registry
        assert strategy_texts(g, node, (2,)) == [_choice_str(c) for c in registry]
        sources.add(dtensor_rules.registry_source(_fx(g, node).target))
    assert sources == {"single_dim", "strategy", "decomp"}  # every path of the adapter is exercised


def test_registry_strategies_are_what_the_math_allows(registry_graph):
    g, _ = registry_graph
    for node in _registry_ops(g):
        must, never_split, partial_ok = EXPECTED[node.target]
        got = set(strategy_texts(g, node, (2,)))
        assert must <= got, f"{node.target}: missing {sorted(must - got)} in {sorted(got)}"
        for s in node_strategies(g, node, (2,)):
            (p,) = s.inputs[0]
            assert not (p.is_shard and p.dim in never_split), f"{node.target}: {s} splits dim {p.dim}"
            assert partial_ok or not any(pl is not None and pl[0].is_partial for pl, _ in strategy_tensors(node, s)), (
                f"{node.target}: {s} passes a partial sum through an op that is not linear")


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_local_execution_is_exact_for_every_registry_strategy(registry_graph, mesh):
    g, values = registry_graph
    targets = {n.target for n in _registry_ops(g)}
    checked = check_every_strategy(g, values, mesh, targets)
    assert checked >= 3 * len(targets)


@pytest.mark.parametrize("n", [3, 5])
def test_registry_strategies_never_split_unevenly(registry_graph, n):
    """DTensor allows uneven shards (pointwise ops, for instance); autotp's runtime does not. No dim
    of these tensors (4, 8, 16) splits over 3 or 5 ranks: only replicated and partial remain."""
    g, _ = registry_graph
    for node in _registry_ops(g):
        choices = dtensor_rules.registry_axis_choices(g, node, n)
        assert choices is not None, node.target
        for inputs, output in choices:
            assert not any(p.is_shard for p in (*inputs, output)), f"{node.target}: {_choice_str((inputs, output))}"


class Scans(nn.Module):
    def forward(self, x):  # (4, 8)
        return torch.cumsum(x, -1), torch.cumprod(x, dim=1), torch.cumsum(x, 0)


def test_negative_dims_reach_the_registry_normalized():
    """torch 2.13's scan strategy compares a negative dim with shard dims as given: asked with
    ``cumsum(x, -1)`` it keeps ``S(1)``, which is wrong. The adapter asks with dim 1."""
    x = torch.randn(4, 8)
    g = autotp.capture(Scans(), (x,))
    offered = {(n.target, n.args["dim"]): strategy_texts(g, n, (2,)) for n in g.ops()}
    assert offered == {  # a scan keeps every dim but its own split
        ("aten.cumsum.default", -1): ["(R) -> R", "(S(0)) -> S(0)"],
        ("aten.cumprod.default", 1): ["(R) -> R", "(S(0)) -> S(0)"],
        ("aten.cumsum.default", 0): ["(R) -> R", "(S(1)) -> S(1)"],
    }
    assert check_every_strategy(g, full_values(g, (x,)), (2,)) == 6
    scan = next(n for n in g.ops() if n.args["dim"] == -1)
    with pytest.raises(AssertionError):  # and the check sees why S(1) through cumsum(x, -1) is wrong
        check_strategy(g, _fx(g, scan), scan, Strategy.parse("(S(1)) -> S(1)"), full_values(g, (x,)), (2,))


class Triangles(nn.Module):
    def forward(self, x):  # (4, 8, 8)
        return torch.tril(x * 2), torch.triu(x, 1)


def test_tril_and_triu_read_their_input():
    """They were listed as factories (input placement "*": read for dtype and device only), so a
    split input would have been masked piece by piece. The registry knows them (replicated only)."""
    x = torch.randn(4, 8, 8)
    g = autotp.capture(Triangles(), (x,))
    for node in g.ops():
        if node.target in ("aten.tril.default", "aten.triu.default"):
            assert strategy_texts(g, node, (2,)) == ["(R) -> R"], node.target
    assert check_every_strategy(g, full_values(g, (x,)), (2,)) >= 5


# ------------------------------------------------------------------------------------------------
# what the adapter leaves out


class Declined(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):  # (4, 8)
        e = self.emb(ids)  # (4, 8, 8)
        return e.view(4, 64), e.expand(2, 4, 8, 8), torch.argmax(e, -1), e.mean(-1), torch.flip(ids, [1])


def test_what_the_adapter_filters_or_declines(caplog):
    ids = torch.randint(0, 16, (4, 8))
    g = autotp.capture(Declined(), (ids,))
    node = {n.target: n for n in g.ops()}
    # shape arguments DTensor rewrites to local shapes before running the op: not asked
    assert dtensor_rules.registry_axis_choices(g, node["aten.view.default"], 2) is None
    assert dtensor_rules.registry_axis_choices(g, node["aten.expand.default"], 2) is None
    # a custom dispatch handler (argmax gathers candidates across ranks): not asked, so unknown to the
    # registry; own rules split its kept dims (autotp.planning.rules.reductions.extremum_choices)
    assert dtensor_rules.registry_axis_choices(g, node["aten.argmax.default"], 2) is None
    with caplog.at_level(logging.WARNING, logger="autotp"):
        all_strategies(g, (2,))
    assert not [r.getMessage() for r in caplog.records if "aten.argmax.default" in r.getMessage()]
    # random ops: DTensor offsets the generator per shard
    assert dtensor_rules.registry_source(torch.ops.aten.native_dropout.default) is None
    # the row-split embedding is a _MaskPartial in DTensor: filtered (own rules do it as a masked lookup)
    emb_choices = dtensor_rules.registry_axis_choices(g, node["aten.embedding.default"], 2)
    emb = [_choice_str(c) for c in emb_choices]
    assert "(S(1), R) -> S(2)" in emb and "(S(0), R) -> P" not in emb
    # integer indices are never partial (the registry would pass a sum through flip, exact for floats)
    assert not any(inputs[1].is_partial for inputs, _ in emb_choices), emb
    flip = [_choice_str(c) for c in dtensor_rules.registry_axis_choices(g, node["aten.flip.default"], 2)]
    assert flip == ["(R) -> R", "(S(0)) -> S(0)"], flip
    # a mean over a split dim is a Partial("avg") in DTensor: filtered
    mean = [_choice_str(c) for c in dtensor_rules.registry_axis_choices(g, node["aten.mean.dim"], 2)]
    assert "(S(0)) -> S(0)" in mean and not any(s.endswith("-> P") for s in mean), mean


# ------------------------------------------------------------------------------------------------
# own rules vs the registry, for the ops both know


# Exact strategies the registry offers and own rules leave out, with why.
ONLY_REGISTRY = {
    # a partial weight (and bias): exact, but a parameter is never partial in autotp (placeholders
    # are R or S) and no op in front of a weight makes one
    ("aten.linear.default", "(R, P, P) -> P"),
    ("aten.linear.default", "(R, P) -> P"),
    # non-causal attention: v's head_dim split, v partial (attention is linear in v). Own rules offer
    # batch, heads and the query rows (tests/planning/test_strategies.py pins that).
    ("aten.scaled_dot_product_attention.default", "(R, R, S(3)) -> S(3)"),
    ("aten.scaled_dot_product_attention.default", "(R, R, P) -> P"),
}
# Strategies own rules offer and the registry (after filtering) does not, with why.
ONLY_OWN = {
    # DTensor splits the vocabulary with a _MaskPartial (filtered); autotp's rewrite does the masked lookup
    ("aten.embedding.default", "(S(0), R) -> P"),
    # mean is linear; DTensor's mean strategy replicates a pending sum before reducing
    ("aten.mean.dim", "(P) -> P"),
    # a mean over a split dim: DTensor's Partial("avg") (filtered); autotp's rewrite divides by the pieces
    ("aten.mean.dim", "(S(0)) -> P"), ("aten.mean.dim", "(S(1)) -> P"), ("aten.mean.dim", "(S(2)) -> P"),
}
# Own-rule ops the registry gives no answer for, with why.
NO_ANSWER = {
    "aten.view.default", "aten.reshape.default", "aten.expand.default",  # shape arguments (rewritten)
    "aten.arange.default", "aten.arange.start_step",  # no tensor input: factories
    "aten.scaled_dot_product_attention.default",  # causal: the decomposition builds its mask by a factory op
}


def _cross_check_graphs():
    torch.manual_seed(0)
    ops_inputs = (torch.randint(0, 32, (4, 8)), torch.randn(4, 8, 64))
    attn_inputs = (torch.randn(2, 4, 8, 32),)
    llama, llama_inputs = M.tiny_llama()
    return [(autotp.capture(Ops(), ops_inputs), ops_inputs),
            (autotp.capture(SelfAttention(), attn_inputs), attn_inputs),
            (autotp.capture(llama, llama_inputs), llama_inputs)]


def test_own_rules_and_registry_agree_but_for_a_documented_set():
    only_registry, only_own, no_answer = set(), set(), set()
    compared = set()
    for g, inputs in _cross_check_graphs():
        values = full_values(g, inputs)
        for node in g.ops():
            if node.target == "getitem":
                continue
            registry = dtensor_rules.registry_axis_choices(g, node, 2)
            if registry is None:
                no_answer.add(node.target)
                continue
            own = axis_choices(node, 2)
            compared.add(node.target)
            for c in registry:
                if c not in own:
                    only_registry.add((node.target, _choice_str(c)))
                    strategy = Strategy(tuple((p,) for p in c[0]), (c[1],))
                    check_strategy(g, _fx(g, node), node, strategy, values, (2,))  # exact, just not offered
            only_own |= {(node.target, _choice_str(c)) for c in own if c not in registry}
    assert {"aten.linear.default", "aten.add.Tensor", "aten.mul.Tensor", "aten.softmax.int", "aten.bmm.default",
            "aten.matmul.default", "aten.sum.dim_IntList", "aten.layer_norm.default", "aten.cat.default",
            "aten.transpose.int", "aten.embedding.default"} <= compared
    assert only_registry == ONLY_REGISTRY
    assert only_own == ONLY_OWN
    assert no_answer == NO_ANSWER


# ------------------------------------------------------------------------------------------------
# an op nobody knows


@torch.library.custom_op("autotp_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1) * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("autotp_test::enigma", mutates_args=())
def enigma(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0)


@enigma.register_fake
def _(x):
    return torch.empty_like(x)


class Unknown(nn.Module):
    def forward(self, x):
        return enigma(mystery(mystery(x) + 1))


def test_an_op_nobody_knows_runs_replicated_with_one_warning_per_kind(caplog):
    g = autotp.capture(Unknown(), (torch.randn(4, 8),))
    unknown = [n for n in g.ops() if n.target.startswith("autotp_test.")]
    assert len(unknown) == 3
    for node in unknown:
        assert dtensor_rules.registry_axis_choices(g, node, 2) is None
    with caplog.at_level(logging.WARNING, logger="autotp"):
        strategies = all_strategies(g, (2, 2))
    warnings = [r.getMessage() for r in caplog.records if "no sharding rule" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert any("autotp_test.mystery.default" in w for w in warnings)
    assert any("autotp_test.enigma.default" in w for w in warnings)
    for node in unknown:
        assert [str(s) for s in strategies[node.name]] == ["(RR) -> RR"]


class Counter(nn.Module):
    """A position counter advanced in place (a static cache's ``cumulative_length``) beside a matmul."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.count.add_(x.shape[0])
        return x @ x.T + mystery(x).sum() * self.count


def test_an_op_on_scalars_alone_runs_replicated_without_a_warning(caplog):
    """By a symbolic size (the batch's here, a prompt's length in generate's cache graphs), the
    registry has no rule for the in-place add, and every generate() warned of it."""
    g = autotp.capture(Counter(), (torch.randn(4, 8),), dynamic_dims={"x": (0,)})
    scalar = [n for n in g.ops() if n.target == "aten.add_.Tensor"]
    assert scalar and all(n.outputs[0].numel == 1 for n in scalar)
    with caplog.at_level(logging.WARNING, logger="autotp"):
        strategies = all_strategies(g, (2,))
    warnings = [r.getMessage() for r in caplog.records if "no sharding rule" in r.getMessage()]
    assert warnings and all("aten.add_" not in w for w in warnings), warnings  # the unknown op on (4, 8) still warns
    assert [str(s) for s in strategies[scalar[0].name]] == ["(R) -> R"]


# ------------------------------------------------------------------------------------------------
# the runtime runs a registry strategy


class TokenShift(nn.Module):
    """An MLP whose hidden activation is shifted one token along the sequence (``roll``: the
    registry's rule, not autotp's)."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):  # (B, T, dim)
        return self.down(F.gelu(torch.roll(self.up(x), shifts=1, dims=1)))


def _token_shift():
    torch.manual_seed(0)
    return TokenShift(), (torch.randn(2, 8, 32),)


def _budget(mode: str) -> int:
    """A memory budget a little above the minimum: the plan must shard the weights."""
    model, inputs = _token_shift()
    try:
        autotp.plan(model, (2,), inputs, hardware="cpu-gloo", mode=mode, memory_budget=1)
    except autotp.MemoryBudgetError as err:
        return int(err.minimum_bytes * 1.05) + 1
    raise AssertionError("a budget of one byte was met")


def _run_token_shift(rank, world, mode, budget):
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = _token_shift()
    ref, _ = _token_shift()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = autotp.parallelize(model, mesh, inputs, hardware="cpu-gloo", mode=mode, memory_budget=budget)
    roll = next(n for n in pm.plan.nodes if n.target == "aten.roll.default")
    out, expected = pm(*inputs), ref(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    if mode == "train":
        out.square().mean().backward()
        expected.square().mean().backward()
        for name, p in pm.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, ref.get_parameter(name).grad, rtol=1e-4, atol=1e-6)
    return {"roll": roll.strategy, "styles": pm.plan.module_styles()}


@pytest.mark.slow  # two spawned processes: 12-16 s
@pytest.mark.timeout(300)
def test_two_ranks_run_a_registry_strategy():
    mode = "train"
    results = run_ranks(_run_token_shift, 2, mode, _budget(mode))
    assert results[0] == results[1]
    assert results[0]["styles"] == {"up": "colwise", "down": "rowwise"}, results[0]
    assert results[0]["roll"] == "(S(2)) -> S(2)", results[0]  # the hidden dim stays split through roll
