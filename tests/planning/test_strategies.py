"""Strategies: the placements each op may take, and the property the runtime relies on.

The lists must hold the Megatron options and never shard a dim unevenly or twice. The real check
is "local execution is exact": for EVERY strategy of an op, cutting full random inputs into each
rank's pieces (R: the whole tensor, S(d): the rank's chunk, P: random summands), running the op on
each rank's pieces alone and putting the outputs back together (S: concatenate, R: every rank must
hold the full result, P: sum) gives what the op gives on the full inputs. The reference is the op
itself on full tensors; nothing of autotp's runtime is used to run the pieces.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autotp
from autotp import ops
from autotp.placement import R, S, Strategy
from autotp.planning.choices.strategies import node_strategies
from examples import models as M
from tests.helpers.local_exactness import (
    Ops,
    SelfAttention,
    capture_graph,
    check_every_strategy,
    check_strategy,
    full_values,
    nodes_of,
    partial_bool,
    strategy_tensors,
    strategy_texts,
)

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# helpers


# ------------------------------------------------------------------------------------------------
# a module with the ops of a transformer, each once


@pytest.fixture(scope="module")
def ops_graph():
    torch.manual_seed(0)
    model = Ops()
    inputs = (torch.randint(0, 32, (4, 8)), torch.randn(4, 8, 64))
    graph = capture_graph(model, inputs)
    return graph, full_values(graph, inputs)


class RotaryOps(nn.Module):
    """Rotary embeddings as GPT-J (strided slices and stack) and Meta's Llama (complex numbers) write
    them, and an attention mask built with where(mask, x, -inf)."""

    def forward(self, q, freqs, mask):  # q (2, 4, 8, 16): batch, heads, tokens, head dim; freqs (8, 8)
        even, odd = q[..., 0::2], q[..., 1::2]  # (2, 4, 8, 8)
        cos, sin = freqs.cos(), freqs.sin()
        gptj = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        pairs = torch.view_as_complex(q.float().reshape(2, 4, 8, 8, 2))
        meta = torch.view_as_real(pairs * torch.polar(torch.ones_like(freqs), freqs)).flatten(3)
        scores = torch.where(mask, gptj @ meta.transpose(-1, -2), float("-inf"))  # where.ScalarOther
        return scores.softmax(-1), torch.stack([q, gptj], dim=1)


@pytest.fixture(scope="module")
def rotary_graph():
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 4, 8, 16, generator=gen), torch.randn(8, 8, generator=gen),
              torch.ones(8, 8, dtype=torch.bool).tril())
    graph = capture_graph(RotaryOps(), inputs)
    return graph, full_values(graph, inputs)


@pytest.mark.parametrize("target", ["aten.stack.default", "aten.slice.Tensor", "aten.view_as_complex.default",
                                    "aten.view_as_real.default", "aten.where.ScalarOther", "aten.polar.default"])
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_rotary_ops_keep_heads_split_and_are_exact(rotary_graph, target, mesh):
    """Each op keeps the batch and heads split (what the GPT-J and Llama rotaries need to stay local);
    every strategy of each is exact on local pieces."""
    g, values = rotary_graph
    nodes = [n for n in g.ops() if n.target == target]
    assert nodes, f"{target} no longer appears in the export"
    for node in nodes:
        outs = {str(s.output) for s in node_strategies(g, node, (2,))}
        if node.output.ndim == 4 and node.output.shape[:2] == (2, 4):
            assert {"(S(0),)", "(S(1),)"} <= outs, (node.name, outs)
    assert check_every_strategy(g, values, mesh, {target}) > 0


def test_a_strided_slice_keeps_its_own_dim_split_when_the_step_divides_each_piece(rotary_graph):
    g, values = rotary_graph
    odd = next(n for n in g.ops() if n.target == "aten.slice.Tensor" and n.args.get("start") == 1)
    assert "(S(3)) -> S(3)" in strategy_texts(g, odd, (2,))  # 16 -> pieces of 8, each [1::2]: 4 of the 8 outputs
    assert "(S(3)) -> S(3)" in strategy_texts(g, odd, (8,))  # pieces of 2, each [1::2]: one output each
    assert "(S(3)) -> S(3)" not in strategy_texts(g, odd, (16,))  # 8 outputs do not split in 16
    assert check_every_strategy(g, values, (8,), {"aten.slice.Tensor"}) > 0


@pytest.fixture(scope="module")
def linear_graph():
    model = nn.Linear(64, 128)
    return capture_graph(model, (torch.randn(2, 16, 64),))


# ------------------------------------------------------------------------------------------------
# what the lists hold


def test_linear_has_megatron_strategies(linear_graph):
    (lin,) = nodes_of(linear_graph, "aten.linear.default")
    got = strategy_texts(linear_graph, lin, (2,))
    assert "(R, S(0), S(0)) -> S(2)" in got  # colwise: weight rows split, bias split with them
    assert "(S(2), S(1), P) -> P" in got  # rowwise: input last dim and weight columns split, bias added once
    assert "(R, R, R) -> R" in got
    assert "(S(0), R, R) -> S(0)" in got  # batch
    assert "(S(1), R, R) -> S(1)" in got  # sequence


def test_linear_without_bias_has_megatron_strategies():
    g = capture_graph(nn.Linear(64, 128, bias=False), (torch.randn(8, 64),))
    (lin,) = nodes_of(g, "aten.linear.default")
    got = strategy_texts(g, lin, (4,))
    assert "(R, S(0)) -> S(1)" in got and "(S(1), S(1)) -> P" in got


def test_embedding_strategies(ops_graph):
    g, _ = ops_graph
    (emb,) = nodes_of(g, "aten.embedding.default")
    got = strategy_texts(g, emb, (2,))
    assert "(S(1), R) -> S(2)" in got  # colwise: embedding dim split
    assert "(S(0), R) -> P" in got  # rowwise: vocabulary split, partial sums
    assert "(R, S(0)) -> S(0)" in got  # batch


def test_causal_sdpa_strategies_split_batch_heads_or_query_rows_never_keys(ops_graph):
    g, _ = ops_graph
    (sdpa,) = nodes_of(g, "aten.scaled_dot_product_attention.default")
    got = set(strategy_texts(g, sdpa, (2,)))
    assert {"(S(1), S(1), S(1)) -> S(1)", "(S(0), S(0), S(0)) -> S(0)", "(R, R, R) -> R"} <= got
    # splitting the keys' sequence or the head_dim would not be exact (softmax over keys, dot
    # products) run as the op; the query rows split under ``is_causal`` with keys and values whole,
    # each rank's mask then offset by its first row (autotp/planning/rules/attention.py's local
    # execution), and the keys' sequence split with them only as the ring, which passes them around
    assert "(S(2), R, R) -> S(2)" in got and "(S(2), S(2), S(2)) -> S(2) ring" in got
    for s in node_strategies(g, sdpa, (2,)):
        (q, k, v, out) = [pl[0] for pl, _info in strategy_tensors(sdpa, s)]
        assert not any(p.is_partial or (p.is_shard and p.dim == 3) for p in (q, k, v, out)), str(s)
        assert s.variant in ("ring", "ring_balanced") or not any(p.is_shard and p.dim == 2 for p in (k, v)), str(s)
        assert (q.is_shard and q.dim == 2) == (out.is_shard and out.dim == 2), str(s)


class RepeatedKV(nn.Module):
    """Causal attention of 4 query heads over 2 key/value heads repeated as Hugging Face's
    ``repeat_kv`` does; ``reuse``: the repeated keys read again after the attention."""

    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.reuse = reuse

    def forward(self, q, k, v):  # (2, 4, 8, 16), (2, 2, 8, 16) x2
        b, h, s, d = k.shape
        k, v = (t[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out + k if self.reuse else out


@pytest.mark.parametrize("reuse", [False, True])
def test_the_ring_passes_repeated_keys_unrepeated_only_where_the_attention_alone_reads_them(reuse):
    """The repeat found (2 query heads to a key/value head): the rings are ``ring/kv2`` and
    ``ring_balanced/kv2`` (run exactly on ranks in tests/runtime/test_attention_masks.py); with the
    repeated keys read again, they would stay alive beside the ring's copies, past the memory
    counted, so the rings pass them as they are."""
    from autotp.planning.rules.attention_kv import kv_repeat

    torch.manual_seed(0)
    inputs = (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))
    g = capture_graph(RepeatedKV(reuse), inputs)
    (sdpa,) = nodes_of(g, "aten.scaled_dot_product_attention.default")
    assert kv_repeat(g, sdpa) == (1 if reuse else 2)
    rings = sorted(s.variant for s in node_strategies(g, sdpa, (2,)) if s.variant.startswith("ring"))
    assert rings == (["ring", "ring_balanced"] if reuse else ["ring/kv2", "ring_balanced/kv2"])


class MaskedAttention(nn.Module):
    """Non-causal attention with an explicit (B, 1, Lq, Lk) mask."""

    def forward(self, q, k, v, mask):  # (2, 4, 8, 16) x3, (2, 1, 8, 8) bool
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_non_causal_sdpa_also_splits_the_query_rows_with_their_mask():
    """Each query row attends on its own: the rows split, keys and values whole, an explicit mask split
    with the rows."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16),
              torch.rand(2, 1, 8, 8) > 0.3)
    g = capture_graph(MaskedAttention(), inputs)
    (sdpa,) = nodes_of(g, "aten.scaled_dot_product_attention.default")
    got = set(strategy_texts(g, sdpa, (2,)))
    assert "(S(2), R, R, S(2)) -> S(2)" in got and not any("S(3)" in s for s in got), got
    assert check_every_strategy(g, full_values(g, inputs), (2,), {sdpa.target}) >= 4


def test_view_transpose_reshape_strategies(ops_graph):
    g, _ = ops_graph
    view = next(n for n in nodes_of(g, "aten.view.default") if n.output.shape == (4, 8, 4, 32))
    assert "(S(2)) -> S(2)" in strategy_texts(g, view, (2,))  # (4, 8, 128) split on 128 -> heads split
    transpose = nodes_of(g, "aten.transpose.int")[0]  # (4, 8, 4, 32) -> (4, 4, 8, 32)
    got = strategy_texts(g, transpose, (2,))
    assert "(S(2)) -> S(1)" in got and "(S(1)) -> S(2)" in got and "(P) -> P" in got
    reshape = nodes_of(g, "aten.reshape.default")[0]  # (4, 8, 4, 32) -> (4, 8, 128)
    assert "(S(2)) -> S(2)" in strategy_texts(g, reshape, (2,))


def test_layer_norm_never_splits_the_normalized_dim(ops_graph):
    g, _ = ops_graph
    (ln,) = nodes_of(g, "aten.layer_norm.default")
    strategies = node_strategies(g, ln, (2,))
    assert "(S(0), R, R) -> S(0)" in map(str, strategies) and "(S(1), R, R) -> S(1)" in map(str, strategies)
    for s in strategies:
        assert s.output[0] in (R, S(0), S(1)), str(s)  # never dim 2 (normalized) and never partial
        assert s.inputs[1] == (R,) and s.inputs[2] == (R,), str(s)


def test_reductions(ops_graph):
    g, _ = ops_graph
    sum_last = next(n for n in g.ops() if n.target == "aten.sum.dim_IntList" and n.output.shape == (4, 8))
    got = strategy_texts(g, sum_last, (2,))
    assert "(S(2)) -> P" in got and "(S(0)) -> S(0)" in got and "(P) -> P" in got
    (mean,) = nodes_of(g, "aten.mean.dim")
    got = strategy_texts(g, mean, (2,))
    assert "(S(2)) -> S(0)" in got
    # a mean over a split dim is a partial sum once each rank divides its local mean by the pieces
    # (the rewrite does; the exactness checks run it that way)
    assert "(S(0)) -> P" in got and "(S(1)) -> P" in got
    (total,) = nodes_of(g, "aten.sum.default")
    assert {"(S(0)) -> P", "(S(1)) -> P", "(S(2)) -> P"} <= set(strategy_texts(g, total, (2,)))


@pytest.mark.parametrize("mesh", [(3,), (5,), (3, 2), (2, 3)])
def test_no_uneven_split(ops_graph, mesh):
    """Mesh 3 on dim 64: no plain split cuts that dim; every plain split divides evenly, and an uneven
    one (``S(d)~g``, autotp.planning.rules.uneven) cuts whole units of its grain that the ranks do not divide."""
    g, _ = ops_graph
    for node in g.nodes:
        for s in node_strategies(g, node, mesh):
            for placements, info in strategy_tensors(node, s):
                if placements is None:
                    continue
                for p, n in zip(placements, mesh):
                    if p.is_uneven:
                        units = info.shape[p.dim] // p.grain
                        assert info.shape[p.dim] % p.grain == 0 and units % n, f"{node.name} {s}: {info}"
                for d in {p.dim for p in placements if p.is_shard and not p.is_uneven}:
                    ways = 1
                    for p, n in zip(placements, mesh):
                        if p.is_shard and p.dim == d:
                            ways *= n
                    assert info.shape[d] % ways == 0, f"{node.name} {s}: dim {d} of {info} over {ways}"
    lin = nodes_of(g, "aten.linear.default")[0]  # weight (128, 64): neither dim splits evenly over 3 or 5
    if mesh in ((3,), (5,)):
        even = [t for t in strategy_texts(g, lin, mesh) if "~" not in t]
        assert even == ["(R, R, R) -> R", "(P, R, P) -> P"]


@pytest.mark.parametrize("mesh", [(2, 2), (2, 4), (4, 2)])
def test_two_axis_meshes_never_split_a_dim_twice(ops_graph, mesh):
    g, _ = ops_graph
    n_strategies = 0
    for node in g.nodes:
        for s in node_strategies(g, node, mesh):
            n_strategies += 1
            assert len(s.output) == 2 and all(i is None or len(i) == 2 for i in s.inputs)
            for placements, info in strategy_tensors(node, s):
                if placements is None:
                    continue
                dims = [p.dim for p in placements if p.is_shard]
                assert len(dims) == len(set(dims)), f"{node.name} {s}: a dim split by both axes"
    assert n_strategies > 2 * len(g.nodes)
    # a 2-axis linear combines colwise on one axis with batch on the other
    lin = nodes_of(g, "aten.linear.default")[0]
    assert "(S(0)R, RS(0), RS(0)) -> S(0)S(2)" in strategy_texts(g, lin, mesh)


# ------------------------------------------------------------------------------------------------
# local execution is exact


@pytest.mark.parametrize("target", [
    "aten.linear.default", "aten.embedding.default", "aten.scaled_dot_product_attention.default",
    "aten.view.default", "aten.transpose.int", "aten.reshape.default", "aten.layer_norm.default",
    "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.softmax.int", "aten.matmul.default", "aten.bmm.default", "aten.cat.default", "aten.tanh.default",
])
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_local_execution_is_exact_for_every_strategy(ops_graph, target, mesh):
    g, values = ops_graph
    assert any(n.target == target for n in g.ops()), f"{target} no longer appears in the export of the module"
    assert check_every_strategy(g, values, mesh, {target}) > 0


@pytest.mark.parametrize("factory", ["mlp", "tiny_gpt", "tiny_llama", "tiny_bert", "hf_llama", "hf_gpt2", "hf_bert"])
def test_local_execution_is_exact_on_reference_models(factory):
    """Every strategy of every op of the reference models, on 2 ranks."""
    model, inputs = getattr(M, factory)()
    g = capture_graph(model, inputs)
    values = full_values(g, inputs)
    assert check_every_strategy(g, values, (2,)) > len(g.ops())


def test_full_values_match_the_model():
    """The reference run the checks above start from is the model's own forward."""
    model, inputs = M.tiny_llama()
    g = capture_graph(model, inputs)
    values = full_values(g, inputs)
    (out,) = g.outputs
    torch.testing.assert_close(values[out], model(*inputs).detach())


# ------------------------------------------------------------------------------------------------
# ops whose arguments repeat one tensor (these were bugs: capture kept one input per distinct tensor, so
# sdpa(h, h, h) raised IndexError in _sdpa_choices and h * h was offered (P) -> P)


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x):  # (8, 32)
        h = self.proj(x)
        return h * h


def test_sdpa_with_the_same_tensor_for_q_k_v():
    x = torch.randn(2, 4, 8, 32)
    g = capture_graph(SelfAttention(), (x,))
    (sdpa,) = nodes_of(g, "aten.scaled_dot_product_attention.default")
    assert len(sdpa.inputs) == 3  # one input per argument: the same tensor three times
    values = full_values(g, (x,))
    assert "(S(1), S(1), S(1)) -> S(1)" in strategy_texts(g, sdpa, (2,))
    assert check_every_strategy(g, values, (2,), {sdpa.target}) >= 3


def test_square_of_a_partial_sum_is_not_partial():
    """h * h reads h twice: one read may be partial while the other is whole (sum_i h_i * h = h * h),
    never both ((a + b)^2 != a^2 + b^2)."""
    x = torch.randn(8, 32)
    g = capture_graph(Square(), (x,))
    (mul,) = nodes_of(g, "aten.mul.Tensor")
    assert len(mul.inputs) == 2
    offered = strategy_texts(g, mul, (2,))
    assert "(P, P) -> P" not in offered and "(P) -> P" not in offered
    assert "(P, R) -> P" in offered
    values = full_values(g, (x,))
    assert check_every_strategy(g, values, (2,), {mul.target}) >= 3  # mixed reads included
    fx_node = next(n for n in g.exported.graph.nodes if n.name == mul.name)
    with pytest.raises(AssertionError):  # and the check sees why both partial would be wrong
        check_strategy(g, fx_node, mul, Strategy.parse("(P, P) -> P"), values, (2,))


class Cast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x):  # (8, 32)
        h = self.proj(x) * 4
        return h.to(torch.int64), h.to(torch.bool)


def test_cast_to_integer_of_a_partial_sum_is_not_partial():
    x = torch.randn(8, 32)
    g = capture_graph(Cast(), (x,))
    values = full_values(g, (x,))
    casts = [n for n in g.ops() if not n.output.is_float and n.input_infos[0].is_float]
    assert len(casts) == 2
    for op in casts:
        assert not any(str(s) == "(P) -> P" for s in node_strategies(g, op, (2,))), op.name
    assert check_every_strategy(g, values, (2,), {c.target for c in casts}) >= 2  # and what is offered is exact


def test_no_partial_bool_on_reference_models():
    """Booleans cannot be summed: a strategy holding a bool tensor as partial is never exact.

    Such strategies appear on views and casts of masks in the Hugging Face models (unreachable in
    practice: no op produces a partial mask), so this only counts them; see the report."""
    model, inputs = M.hf_llama()
    g = capture_graph(model, inputs)
    offenders = [f"{op.name} {s}" for op in g.ops() for s in node_strategies(g, op, (2,)) if partial_bool(op, s)]
    producers = [f"{op.name} {s}" for op in g.ops() for s in node_strategies(g, op, (2,))
                 if op.output.dtype == "bool" and s.output[0].is_partial
                 and all(i is None or not i[0].is_partial for i in s.inputs)]
    assert not producers, f"ops that turn non-partial inputs into a partial mask: {producers}"
    assert all(" (P) -> P" in o for o in offenders), offenders


@pytest.mark.parametrize("target, wrong", [
    ("aten.linear.default", "(S(2), S(1), R) -> P"),  # the bias added on every rank
    ("aten.linear.default", "(R, S(0), S(0)) -> S(1)"),  # colwise output is split on the last dim
    ("aten.softmax.int", "(S(2)) -> S(2)"),  # softmax over a split dim
    ("aten.mean.dim", "(S(2)) -> P"),  # a mean over a split dim is not a sum of local means
    ("aten.tanh.default", "(P) -> P"),  # tanh is not linear
    ("aten.layer_norm.default", "(S(2), S(0), S(0)) -> S(2)"),  # the normalized dim split
])
def test_the_exactness_check_rejects_wrong_strategies(ops_graph, target, wrong):
    """The check above has teeth: strategies that are not exact fail it."""
    g, values = ops_graph
    op = next(n for n in g.ops() if n.target == target)
    fx_node = next(n for n in g.exported.graph.nodes if n.name == op.name)
    strategy = Strategy.parse(wrong)
    assert wrong not in strategy_texts(g, op, (2,))
    with pytest.raises((AssertionError, RuntimeError)):  # wrong numbers, or local shapes that do not fit
        check_strategy(g, fx_node, op, strategy, values, (2,))


class Factories(nn.Module):
    """Tensors of one value made from sizes (``new_zeros`` and kin, ``torch.full``): each rank makes its piece."""

    def forward(self, x):  # (4, 8)
        made = (x.new_zeros(4, 8), x.new_ones(4, 8), x.new_full((4, 8), 2.0), torch.full((4, 8), 3.0),
                torch.ones(4, 8), torch.zeros(4, 8))
        return [x + m for m in made]


def test_a_factory_of_one_value_may_be_made_split():
    g = capture_graph(Factories(), (torch.randn(4, 8),))
    factories = {op.target for op in g.ops() if op.target in ops.UNIFORM_FACTORY}
    assert len(factories) >= 4, factories
    for op in g.ops():
        if op.target in factories:
            assert {str(s.output) for s in node_strategies(g, op, (2,))} >= {"(R,)", "(S(0),)", "(S(1),)"}, op
    values = full_values(g, (torch.randn(4, 8),))
    assert check_every_strategy(g, values, (2,), factories) >= 3 * len(factories)
    assert check_every_strategy(g, values, (2, 2), factories) > 0


class Unflatten(nn.Module):
    def forward(self, x):  # (4, 6, 32)
        return torch.relu(x.unflatten(-1, (4, 8))).flatten(-2) * 2.0


def test_unflatten_of_a_split_dim_runs_at_the_pieces_sizes():
    """``unflatten(-1, (4, 8))`` of a dim split in two: each rank's piece is ``(2, 8)``, and the op runs
    with those sizes (with the whole ones it refused the piece)."""
    x = torch.randn(4, 6, 32)
    g = capture_graph(Unflatten(), (x,))
    (op,) = nodes_of(g, "aten.unflatten.int")
    assert "(S(2)) -> S(2)" in strategy_texts(g, op, (2,))
    values = full_values(g, (x,))
    assert check_every_strategy(g, values, (2,), {op.target}) >= 3
    assert check_every_strategy(g, values, (2, 2), {op.target}) > 0


class _SplitThenUnflatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32, bias=False)
        self.o = nn.Linear(32, 16, bias=False)

    def forward(self, x):  # (B, T, 16)
        return self.o(torch.relu(self.a(x).unflatten(-1, (4, 8))).flatten(-2))


def test_a_module_that_unflattens_a_split_output_is_exact():
    from autotp.planning.planner import plan_graph
    from tests.helpers.exactness import assert_step_matches_one_process

    model, x = _SplitThenUnflatten(), torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", None, recompute=False,
                      pin={"a.weight": "S(0)", "o.weight": "S(1)"})
    (op,) = nodes_of(graph, "aten.unflatten.int")
    assert plan.strategy(op.name).output[0].is_shard, plan.strategy(op.name)
    assert_step_matches_one_process(graph, plan, model, x)


class Repeat(nn.Module):
    def forward(self, x):  # (4, 8)
        return x.repeat(4, 1) * 2.0, x.repeat(2, 2, 1), x.repeat(1, 4)


def test_repeat_splits_whole_copies_or_keeps_a_split_dim():
    """``repeat`` of a whole tensor may be split along a dim repeated a multiple of the ranks (each
    makes its share of the copies); a dim repeated once keeps its split; every such strategy exact."""
    x = torch.randn(4, 8)
    g = capture_graph(Repeat(), (x,))
    ops_ = nodes_of(g, "aten.repeat.default")
    assert len(ops_) == 3
    offered = [set(strategy_texts(g, op, (2,))) for op in ops_]
    assert "(R) -> S(0)" in offered[0] and "(S(1)) -> S(1)" in offered[0]  # x.repeat(4, 1)
    assert "(R) -> S(0)" in offered[1] and "(R) -> S(1)" in offered[1] and "(S(1)) -> S(2)" in offered[1]
    assert "(S(0)) -> S(0)" in offered[2] and "(R) -> S(1)" in offered[2]
    values = full_values(g, (x,))
    assert check_every_strategy(g, values, (2,), {"aten.repeat.default"}) >= 12
    assert check_every_strategy(g, values, (2, 2), {"aten.repeat.default"}) > 0


class MaskedWrites(nn.Module):
    def forward(self, x):  # (4, 6, 8)
        every, first_two, last_two, rows = x.clone(), x.clone(), x.clone(), x.clone()
        every[x > 0] = 0.0                  # a mask over every dim
        first_two[x.sum(-1) > 0] = 0.0      # over the first two
        last_two[:, x[0] > 0] = 0.0         # over the last two
        rows[torch.tensor([0, 2])] = 0.0    # integer indices: DTensor's rule
        pairs = x.clone()
        pairs[x[:, 0, 0] > 0, x[0, :, 0] > 0] = 0.0  # two masks: their positions pair up
        return every, first_two, last_two, rows, pairs


def test_a_boolean_mask_splits_only_with_the_dims_it_covers():
    """A mask at entry i of ``index_put`` covers as many dims as it has (DTensor's rule counts one,
    and splits ``x`` along dims the mask covers with the mask whole: the mask's shape then does not
    match the piece); the dims it covers split with it, the others with it whole; two masks (each
    a list of positions, paired up) keep the op whole. Every strategy exact on (2,) and (2, 2)."""
    x = torch.randn(4, 6, 8)
    g = capture_graph(MaskedWrites(), (x,))
    ops_ = nodes_of(g, "aten.index_put_.default")
    assert len(ops_) == 5
    every, first_two, last_two, rows, pairs = [set(strategy_texts(g, op, (2,))) for op in ops_]
    assert {"(S(0), S(0), R) -> S(0)", "(S(1), S(1), R) -> S(1)", "(S(2), S(2), R) -> S(2)"} <= every
    assert "(S(2), R, R) -> S(2)" not in every  # the mask whole against a piece of x: refused
    assert "(P, R, P) -> P" in every  # linear in x and the value together
    assert {"(S(1), S(1), R) -> S(1)", "(S(2), R, R) -> S(2)"} <= first_two
    assert {"(S(0), R, R) -> S(0)", "(S(2), S(1), R) -> S(2)"} <= last_two
    assert "(S(1), R, R) -> S(1)" in rows
    assert pairs == {"(R, R, R, R) -> R", "(P, R, R, P) -> P"}  # a rank's share of one list pairs with none
    values = full_values(g, (x,))
    assert check_every_strategy(g, values, (2,), {"aten.index_put_.default"}) >= 12
    assert check_every_strategy(g, values, (2, 2), {"aten.index_put_.default"}) > 0
