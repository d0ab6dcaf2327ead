"""Attention masks run as their description: found from the graph (no ``S x S`` tensor left),
priced at the pairs the kernel computes, exact against the model in one process on 1 and 2
threaded ranks, with the padding, the sliding window, the query rows split and the heads split
between projections split by sequence (Ulysses).

References: ``scaled_dot_product_attention`` with the whole mask (the kernel), the Hugging Face
model's own loss and gradients in one process (the models), ``torch.utils.flop_counter``'s count of
the whole square (the FLOPs), brute-force counts of the mask's pairs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import autotp
from autotp.masks import MaskSpec, masked_attention
from autotp.placement import R, S
from autotp.planning.planner import plan_graph
from examples.ranks import run_threads
from tests.helpers.observed import assert_kinds_as_planned, logged_step

SEQ = 12  # not any width of the models: a (SEQ, SEQ) shape is a mask


def _model(kind: str, window: int = 5, **widths):
    """A tiny model of ``kind`` (4 heads, 2 kv heads, one layer unless ``widths`` say otherwise)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    widths = dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=64), **widths)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**widths)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**widths)).eval()
    return MistralForCausalLM(MistralConfig(**widths, sliding_window=window)).eval()


def _inputs(padded: bool, given_mask: bool = True, seq: int = SEQ) -> dict:
    """Two sequences of ``seq`` tokens; padded: the first left-padded by 3, the second right-padded by
    4, labels -100 on the pads."""
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, seq, dtype=torch.long)
    if padded:
        mask[0, :3], mask[1, -4:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels, **({"attention_mask": mask} if given_mask else {})}


def _attention(graph):
    return [n for n in graph.ops() if n.target in ("autotp.masked_attention.default",
                                                   "aten.scaled_dot_product_attention.default")]


# -- the kernel: each chunk of rows against its keys equals the whole mask -------------------------

def test_pairs_count_what_the_mask_allows():
    for causal, window, diagonal, rows, cols, start in itertools.product(
            [True, False], [None, 1, 2, 5], [-3, 0, 2, 7], [1, 5, 9], [1, 6, 9], [0, 3]):
        if window is not None and not causal:
            continue
        spec = MaskSpec(causal, window, diagonal)
        assert spec.pairs(rows, cols, start) == int(spec.block((start, start + rows), (0, cols)).sum()), spec


def _block_by_differences(spec: MaskSpec, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """The mask's block from its definition: ``d = i - j + diagonal`` for every pair, compared."""
    d = torch.arange(*rows).unsqueeze(-1) - torch.arange(*cols) + spec.diagonal
    allowed = torch.ones(d.shape, dtype=torch.bool)
    if spec.causal:
        allowed &= d >= 0
    if spec.window is not None:
        allowed &= d < spec.window
    return allowed


def test_a_block_is_the_mask_s_definition_and_one_boolean_tensor():
    """Every block (causal, windows, a diagonal either way, rows and columns offset, blocks wholly
    allowed or wholly masked) equals the mask compared pair by pair; building one allocates only
    the block itself, a byte a pair (no integer tensor of the block's size)."""
    from benchmarks.memory import LiveBytes

    for causal, window, diagonal, rows, cols in itertools.product(
            [True, False], [None, 1, 3, 7], [-4, 0, 3], [(0, 6), (5, 9), (20, 23)], [(0, 7), (4, 11), (30, 33)]):
        if window is not None and not causal:
            continue
        spec = MaskSpec(causal, window, diagonal)
        assert torch.equal(spec.block(rows, cols), _block_by_differences(spec, rows, cols)), (spec, rows, cols)
    meter = LiveBytes()
    with meter:
        block = MaskSpec(window=300).block((3072, 4096), (0, 4096))
    assert meter.peak == block.numel() == 1024 * 4096


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(window=3), MaskSpec(causal=False), MaskSpec(window=2, diagonal=2)],
                         ids=str)
@pytest.mark.parametrize("offsets", [(0, 0), (3, 2)])
def test_chunks_of_rows_equal_the_whole_mask_forward_and_backward(spec, offsets):
    """Any block of rows and columns (a rank's rows, a later sequence split's keys), any chunking,
    with padding that leaves a row no key: the output and gradients of sdpa under the whole block
    of the mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, d, dtype=torch.float64, generator=g).requires_grad_() for d in (4, 4, 5))
    pad = torch.rand(2, 7, generator=g) > 0.3
    pad[0, :5] = False
    rows, cols = offsets
    whole = spec.block((rows, rows + 7), (cols, cols + 7)) & pad[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=whole)
    grad = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for chunk in (1, 3, 100):
        out = masked_attention(q, k, v, pad, spec, rows, cols, chunk_rows=chunk)
        torch.testing.assert_close(out, ref)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["masked", "causal"])
def test_query_rows_split_run_exactly_through_their_local_execution(op):
    """Every strategy of the described op and of ``is_causal`` attention, the query rows' included,
    on 2 ranks' pieces through the local executions the rewrite runs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    if op == "masked":
        pad = torch.rand(2, 8, generator=g) > 0.3
        strategies = autotp.check_rule(torch.ops.autotp.masked_attention.default, (q, k, v, pad, True, 3, 0))
    else:
        strategies = autotp.check_rule(torch.ops.aten.scaled_dot_product_attention.default,
                                       (q, k, v, None, 0.0, True))
    assert any(str(s.inputs[0][0]) == "S(2)" for s in strategies), [str(s) for s in strategies]


# -- found from the graph ----------------------------------------------------------------------

@pytest.mark.parametrize("kind, given, padded, became", [
    ("llama", False, False, MaskSpec()), ("llama", True, True, MaskSpec()),
    ("qwen2", True, False, MaskSpec()), ("mistral", False, False, MaskSpec(window=5)),
    ("mistral", True, True, MaskSpec(window=5))])
def test_the_mask_is_described_and_no_square_tensor_is_left(kind, given, padded, became):
    model = _model(kind)
    graph = autotp.capture(model, {k: v for k, v in _inputs(padded, given).items() if k != "labels"})
    (attention,) = _attention(graph)
    if became == MaskSpec() and not (given and padded) and kind != "qwen2":
        assert attention.target == "aten.scaled_dot_product_attention.default" and attention.args["is_causal"]
        assert attention.args.get("attn_mask") is None
    else:
        assert attention.target == "autotp.masked_attention.default"
        assert MaskSpec(attention.args["causal"], attention.args["window"], attention.args["diagonal"]) == became
        assert (len(attention.inputs) == 4) == given  # the padding vector, where attention_mask is given
    square = [n.name for n in graph.nodes for o in n.outputs if tuple(o.shape[-2:]) == (SEQ, SEQ)]
    assert square == [], square


def test_flops_are_the_pairs_the_kernel_computes():
    """Causal: S (S + 1) / 2 of the S x S pairs; a window of 5: what it allows."""
    for kind, spec in [("llama", MaskSpec()), ("mistral", MaskSpec(window=5))]:
        graph = autotp.capture(_model(kind), {"input_ids": _inputs(False)["input_ids"]})
        (attention,) = _attention(graph)
        q, k, v = attention.input_infos[:3]
        from torch.utils.flop_counter import sdpa_flop_count

        square = sdpa_flop_count(q.shape, k.shape, v.shape)
        assert attention.flops == pytest.approx(square * spec.pairs(SEQ, SEQ) / SEQ ** 2)
    assert MaskSpec().pairs(SEQ, SEQ) == SEQ * (SEQ + 1) // 2


# -- exact on ranks ----------------------------------------------------------------------------

def _check_exact(model, inputs, world, rows_only=None, variant="", keep=None):
    """The plan of ``model`` on ``inputs`` for ``world`` ranks (a count, or a mesh's shape) run on
    threaded ranks: the loss and every gradient as in one process. ``rows_only`` (a monkeypatch):
    the attention offered its query-rows split alone, and of it the strategies of ``variant`` alone
    (the plain split's, or the balanced rows'); or, with ``keep(graph, node, strategy)``, every node
    offered the strategies ``keep`` allows. Returns the graph, the plan and each rank's collectives
    run in the forward and in the backward."""
    graph = autotp.capture(model, inputs)
    if rows_only is not None:  # the attention offered its query-rows split alone: its rows' local execution runs
        from autotp.planning.choices import strategies

        others, offered = strategies.user_choices, strategies.node_strategies
        if keep is None:
            rows_only.setattr(strategies, "user_choices", lambda node, n: [
                ((S(2), R, R) + (R,) * (len(node.inputs) - 3), S(2))] if node in _attention(graph) else others(node, n))
            keep = lambda graph_, node, s: node not in _attention(graph_) or s.variant == variant  # noqa: E731
        rows_only.setattr(strategies, "node_strategies", lambda graph_, node, *a: [
            s for s in offered(graph_, node, *a) if keep(graph_, node, s)])
    shape = tuple(world) if isinstance(world, tuple) else (world,)
    plan = plan_graph(graph, shape, "cpu-gloo", "train")
    out = model(**inputs)
    out.loss.backward()
    logs = []
    for loss, grads, *phases in run_threads(logged_step, math.prod(shape), graph, plan, model, inputs):
        logs.append(phases)
        torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(), msg=n)
    model.zero_grad()
    return graph, plan, logs


@pytest.mark.parametrize("kind, padded, given", [("llama", True, True), ("mistral", True, True),
                                                 ("mistral", False, False), ("qwen2", True, True)])
@pytest.mark.parametrize("world", [1, 2])
def test_loss_and_gradients_equal_one_process(kind, padded, given, world):
    _check_exact(_model(kind), _inputs(padded, given), world)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_query_rows_split_over_two_ranks_equal_one_process(kind, monkeypatch):
    """The attention pinned to its query-rows split: each rank builds its rows' mask (causal, and
    the window smaller than the sequence) and the padded rows come out as in one process."""
    graph, plan, _ = _check_exact(_model(kind), _inputs(True, True), 2, rows_only=monkeypatch)
    (attention,) = _attention(graph)
    assert str(plan.strategy(attention.name).inputs[0][0]) == "S(2)", str(plan.strategy(attention.name))


@pytest.mark.parametrize("given", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_balanced_rows_over_two_ranks_equal_one_process(given, monkeypatch):
    """Causal attention pinned to balanced rows on 2 ranks, 16 tokens: each rank computes chunks
    r and 3 - r of 4 (queries and outputs exchanged by all-to-all), the loss and every gradient as
    in one process; with a padded mask (the described op) and without one (``is_causal``)."""
    graph, plan, _ = _check_exact(_model("llama"), _inputs(given, given, seq=16), 2, rows_only=monkeypatch,
                               variant="balanced")
    (attention,) = _attention(graph)
    assert str(plan.strategy(attention.name)).endswith("-> S(2) balanced"), str(plan.strategy(attention.name))


def _upstream(graph, name: str) -> set[str]:
    """``name`` and the ops it is computed from, back to (and with) the linear layers."""
    found, todo = set(), [name]
    while todo:
        node = graph[todo.pop()]
        if node.name in found or node not in graph.ops():
            continue
        found.add(node.name)
        if node.target != "aten.linear.default":
            todo.extend(node.inputs)
    return found


def _downstream(graph, name: str) -> set[str]:
    """``name`` and the ops computed from it, up to (and with) the linear layers."""
    found, todo = set(), [name]
    while todo:
        node = graph[todo.pop()]
        if node.name in found:
            continue
        found.add(node.name)
        if node.target != "aten.linear.default" or node.name == name:
            todo.extend(graph.consumers(node.name))
    return found


def ulysses(seq_split: tuple, heads_split: tuple):
    """A ``keep`` for :func:`_check_exact`: the attention offered the strategies whose output is
    ``heads_split`` (its placements of ``(batch, heads, seq, head_dim)``, one per mesh axis) alone, and
    the q, k, v and output projections those whose output is ``seq_split`` (of ``(batch, seq,
    features)``) with their weights whole; every other node as the planner offers it."""
    projections = {}  # the graph's: the linear layers into the attention's q, k, v and out of it

    def keep(graph, node, strategy):
        (attention,) = _attention(graph)
        if node is attention:
            return strategy.output == heads_split and strategy.variant == ""
        if graph not in projections:
            around = set().union(_downstream(graph, attention.name),
                                 *(_upstream(graph, i) for i in attention.inputs[:3]))
            projections[graph] = {n for n in around if graph[n].target == "aten.linear.default"}
        whole = (R,) * len(seq_split)
        return node.name not in projections[graph] or (strategy.output == seq_split and strategy.inputs[1] == whole)

    return keep


def test_ulysses_heads_between_sequence_splits_equal_one_process(monkeypatch):
    """Ulysses on 2 ranks: a tiny Llama (4 heads, 2 kv heads, 16 tokens, padded) with its q, k, v
    and output projections offered their sequence split alone (their weights whole) and the
    attention its heads split alone. The plan redistributes q, k and v from sequence to heads and
    the attention's output back, one all-to-all each way and each phase; the loss and every gradient
    equal one process, and the collectives each rank runs are the plan's by kind and axis."""
    graph, plan, logs = _check_exact(_model("llama"), _inputs(True, True, seq=16), 2, rows_only=monkeypatch,
                                     keep=ulysses((S(1),), (S(1),)))
    (attention,) = _attention(graph)
    assert str(plan.strategy(attention.name)).startswith("(S(1), S(1), S(1)"), str(plan.strategy(attention.name))
    q, k, v = (_upstream(graph, i) for i in attention.inputs[:3])
    side = {"q": q - k - v, "k": k - q - v, "v": v - q - k, "out": _downstream(graph, attention.name)}
    for phase in ("forward", "backward"):
        moved = sorted(name for c in plan.collectives() if c.phase == phase and c.kind == "all_to_all"
                       for name, nodes in side.items() if c.at in nodes)
        assert moved == ["k", "out", "q", "v"], (phase, [str(c) for c in plan.collectives()])
    for rank_logs in logs:
        for log, phase in zip(rank_logs, ("forward", "backward")):
            assert_kinds_as_planned(log, plan, phase)
            assert log.kind_counts()["all_to_all"] == 4, (phase, log.kind_counts())


def test_balanced_rows_are_priced_at_the_mean():
    """The rows split in order price the last rank's pairs (7/4 of the mean on 2 ranks of a causal
    16 x 16, 100 of its 136 pairs), and so does the ring (the last rank's rows read every key
    chunk); balanced rows and the balanced ring, every rank's 68: the mean. On 8 ranks the last
    rank's 31 pairs against the balanced 17 (rows r and 15 - r). The balanced ring's collectives:
    its q, k, v out together and its output back around the ring's shifts, each way."""
    from autotp.planning.choices.strategies import node_strategies
    from autotp.planning.rules.attention import attention_collectives, attention_work_divisor

    graph = autotp.capture(_model("llama"), {"input_ids": _inputs(False, seq=16)["input_ids"]})
    (attention,) = _attention(graph)
    rows = [s for s in node_strategies(graph, attention, (2,)) if _attention_rows(s)]
    # the rings pass the keys and values as the model had them before repeating them (2 heads of 4)
    assert sorted(s.variant for s in rows) == ["", "balanced", "ring/kv2", "ring_balanced/kv2"], [str(s) for s in rows]
    divisor = {s.variant: attention_work_divisor(attention, s, 0, 2) for s in rows}
    assert divisor == {"": 136 / 100, "balanced": 2.0, "ring/kv2": 136 / 100, "ring_balanced/kv2": 2.0}
    divisor = {s.variant: attention_work_divisor(attention, s, 0, 8)
               for s in node_strategies(graph, attention, (8,)) if _attention_rows(s)}
    assert divisor == {"": 136 / 31, "balanced": 8.0, "ring/kv2": 136 / 31, "ring_balanced/kv2": 8.0}
    q_bytes = attention.input_infos[0].nbytes / 2
    assert attention_collectives(attention, next(s for s in rows if s.variant == "balanced"), (2,)) == [
        ("all_to_all", phase, 0, q_bytes) for phase in ("forward", "backward") for _ in range(2)]
    # a rank's half of k and v as the model had them before repeating them for the query heads (2 of
    # 4 heads), float32: gradients as large
    kv_bytes = sum(info.nbytes for info in attention.input_infos[1:3]) / 2 / 2
    around = [("all_to_all", "", 0, q_bytes + kv_bytes), ("all_to_all", "", 0, attention.outputs[0].nbytes / 2)]
    shifts = [("all_to_all", phase, 0, kv_bytes * 2) for phase in ("forward", "backward", "backward", "backward")]
    assert attention_collectives(attention, next(s for s in rows if s.variant == "ring_balanced/kv2"), (2,)) == [
        (kind, "forward", a, b) for kind, _, a, b in around] + shifts + [(k, "backward", a, b) for k, _, a, b in around]
    # 18 rows do not cut into 4 chunks: the plain split and the ring alone; with as many kv heads as
    # query heads, nothing is repeated and the ring passes the keys and values as they are
    graph = autotp.capture(_model("llama", num_key_value_heads=4), {"input_ids": _inputs(False, seq=18)["input_ids"]})
    (attention,) = _attention(graph)
    assert [s.variant for s in node_strategies(graph, attention, (2,)) if _attention_rows(s)] == ["", "ring"]


def _attention_rows(strategy) -> bool:
    return str(strategy.inputs[0][0]) == "S(2)"


# -- generate: the prompt's and the decode steps' graphs -----------------------------------------

def _prompt():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def _generate_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids, mask = _prompt()
    model = _model("mistral", window=4)
    pm = autotp.parallelize(model, mesh, (ids,), mode="inference", hardware="cpu-gloo")
    return pm.generate(ids, attention_mask=mask, max_new_tokens=6).tolist()


@pytest.mark.slow
def test_generate_with_a_sliding_window_returns_the_model_s_own_tokens():
    """A window of 4 under a prompt of 8 and 6 new tokens, one prompt left-padded: the prompt's
    graph and the one-token steps (queries one row against the cache) give the model's tokens."""
    from examples.ranks import run_ranks

    ids, mask = _prompt()
    expected = _model("mistral", window=4).generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert run_ranks(_generate_rank, 2) == [expected.tolist()] * 2


# -- a long sequence, planned only --------------------------------------------------------------

def _llama_8b_layer(seq: int):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaModel(config)  # no head: the logits' 64 GiB would be the peak, past the mask
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "attention_mask": torch.ones(1, seq, dtype=torch.long, device="meta")}


@pytest.mark.slow
def test_at_128k_tokens_the_plan_holds_no_square_mask(monkeypatch):
    """Llama 3 8B's widths, one layer, 1 x 131072 tokens with a padding mask, planned for 8 ranks
    on meta: no node of the graph is (S, S) (the same model traced with its mask kept has them),
    and the plan's whole memory per rank is less than the (S, S) boolean mask alone (16 GiB)."""
    from autotp.tracing import export

    seq = 131072
    model, inputs = _llama_8b_layer(seq)
    graph = autotp.capture(model, inputs)
    assert not [n.name for n in graph.nodes for o in n.outputs if tuple(o.shape[-2:]) == (seq, seq)]
    described = plan_graph(graph, (8,), "h100-sxm", "inference", memory_budget="1 TiB")
    monkeypatch.setattr(export, "describe_masks", lambda gm: [])
    kept = autotp.capture(model, inputs)
    assert [n.name for n in kept.nodes for o in n.outputs if tuple(o.shape[-2:]) == (seq, seq)]
    assert described.memory.peak_bytes < seq * seq, described.memory


@pytest.mark.slow
def test_at_128k_tokens_the_planner_balances_the_causal_rows():
    """Llama 3 8B's widths, one layer, 1 x 131072 tokens (padding mask given), trained on 8 ranks,
    planned on meta: the attention takes the balanced ring, its compute priced at the mean of the
    whole work (its compute over 8) with its shifts hidden under it, as balanced rows' (which read
    the keys and values gathered), where the rows in order and the plain ring price the last rank's
    15/8 of it."""
    from autotp.mesh import MeshSpec
    from autotp.planning.choices.strategies import node_strategies
    from autotp.planning.costs.costing import CostModel
    from autotp.planning.rules.attention import overlapped_collectives
    from cost_models import resolve_hardware

    model, inputs = _llama_8b_layer(131072)
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, (8,), "h100-sxm", "train", memory_budget="1 TiB")
    (attention,) = _attention(graph)
    chosen = plan.strategy(attention.name)
    assert chosen.variant == "ring_balanced/kv4" and _attention_rows(chosen), str(chosen)
    cost = CostModel(MeshSpec((8,), ("tp",)), resolve_hardware("h100-sxm"), "train", graph=graph)

    def compute_s(strategy):  # the op's seconds less its collectives, those hidden under its work given back
        hidden_s = sum(cost.collective_s(kind, a, size) for kind, _, a, size in
                       overlapped_collectives(attention, strategy, (8,)))
        assert hidden_s < cost.node_compute_s(attention, strategy) / 10
        return cost.node_compute_s(attention, strategy) - cost.inner_collectives_s(attention, strategy) + hidden_s

    strategies = node_strategies(graph, attention, (8,))
    whole = compute_s(next(s for s in strategies if not s.sharded_on(0)))
    rows = {s.variant: compute_s(s) for s in strategies if _attention_rows(s)}
    assert rows == {"": pytest.approx(whole / 8 * 15 / 8, rel=0.02), "balanced": pytest.approx(whole / 8, rel=0.02),
                    "ring/kv4": pytest.approx(whole / 8 * 15 / 8, rel=0.02),
                    "ring_balanced/kv4": pytest.approx(whole / 8, rel=0.02)}
    assert cost.node_compute_s(attention, chosen) < rows["ring/kv4"]


# -- the ring: keys and values split along the sequence, passed around -----------------------------

@pytest.mark.parametrize("kind, given, variant", [
    ("llama", True, "ring/kv2"), pytest.param("llama", False, "ring/kv2", marks=pytest.mark.slow),
    pytest.param("mistral", True, "ring/kv2", marks=pytest.mark.slow), ("llama", True, "ring_balanced/kv2"),
    ("llama4heads", True, "ring")])
def test_ring_over_two_ranks_equals_one_process(kind, given, variant, monkeypatch):
    """Attention of a tiny Llama (4 heads, 2 kv heads, 16 tokens, padded, labels -100 on the pads;
    or unpadded, ``is_causal``; or 4 kv heads, none repeated) or Mistral (a window of 5) pinned to the
    ring on 2 ranks: queries, keys and values split by sequence, the key/value chunk passed on once
    forward (the 2 kv heads as the model had them before repeating them for the 4 query heads); the
    loss and every gradient as in one process, and the all-to-alls each rank runs are the plan's,
    none sending more than the plan's bytes (one shift forward; backward one shift, its gradients
    and their return home). Pinned to the balanced ring (chunks r and 3 - r of 4 of q, k and v
    exchanged in, the output out), the same, with the two exchanges around the shifts each way."""
    model = _model("llama", num_key_value_heads=4) if kind == "llama4heads" else _model(kind)
    graph, plan, logs = _check_exact(model, _inputs(given, given, seq=16), 2, rows_only=monkeypatch, variant=variant)
    (attention,) = _attention(graph)
    assert str(plan.strategy(attention.name)).startswith("(S(2), S(2), S(2)") and \
        str(plan.strategy(attention.name)).endswith(f"-> S(2) {variant}"), str(plan.strategy(attention.name))
    counts = (1, 3) if not variant.startswith("ring_balanced") else (3, 5)
    for rank_logs in logs:
        for log, phase, count in zip(rank_logs, ("forward", "backward"), counts):
            assert_kinds_as_planned(log, plan, phase)
            assert sum(c.kind == "all_to_all" and c.at == attention.name for c in plan.collectives()
                       if c.phase == phase) == count


def _ring_rank(rank, world, q, k, v, padding, spec, grad, balanced):
    from torch import distributed as dist

    from autotp.local.ring import RingAttention

    rows = q.shape[-2] // world
    ring = RingAttention(spec, None, q.shape[-2], world, rank, dist.group.WORLD, "tp", chunk_rows=3, balanced=balanced)
    mine = [t[..., rank * rows:(rank + 1) * rows, :].detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring(*mine, padding)
    out.backward(grad[..., rank * rows:(rank + 1) * rows, :])
    return out.detach(), *(t.grad for t in mine)


@pytest.mark.parametrize("spec, world, balanced", [(MaskSpec(), 3, False), (MaskSpec(window=5), 3, False),
                                                   (MaskSpec(causal=False), 2, False), (MaskSpec(), 3, True)], ids=str)
def test_ring_chunks_equal_the_whole_mask_forward_and_backward(spec, world, balanced, monkeypatch):
    """The ring's module on threaded ranks, each holding a chunk of the rows of q, k and v (query heads
    grouped over key heads, rows in chunks of 3, padding that leaves a row no key): the output and
    the gradients of q, k and v equal sdpa under the whole mask; under the window of 5 over chunks of
    4 rows the ring shifts once, not twice. Balanced over 3 ranks: each rank's two chunks of 2 rows
    exchanged for chunks r and 5 - r of 6, the ring run on those, the output and gradients sent back;
    every rank scores as many pairs (the rows in order: the last rank the most)."""
    import collections
    import threading

    from autotp.local import ring

    scored, scores = collections.Counter(), ring._Blocks.scores

    def counted(self, q, k, mask):
        scored[threading.current_thread().name] += q.shape[-2] * k.shape[-2]
        return scores(self, q, k, mask)

    monkeypatch.setattr(ring._Blocks, "scores", counted)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 5, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 12, d, dtype=torch.float64, generator=g) for d in (5, 6))
    pad = torch.rand(2, 12, generator=g) > 0.3
    pad[0, :5] = False
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, attn_mask=spec.block((0, 12), (0, 12)) & pad[:, None, None, :],
                                              enable_gqa=True).nan_to_num()  # a row of no key: zeros
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=g)
    expected.backward(grad)
    got = [torch.cat(parts, -2) for parts in zip(*run_threads(_ring_rank, world, q, k, v, pad, spec, grad, balanced))]
    for name, a, b in zip(("out", "q", "k", "v"), got, (expected, *(t.grad for t in whole))):
        torch.testing.assert_close(a, b.nan_to_num(), msg=name)
    assert ring.ring_steps(spec, 12, world, balanced) == (1 if spec.window else world - 1)
    if spec == MaskSpec():
        per_rank = [scored[f"rank{r}"] for r in range(world)]
        assert (len(set(per_rank)) == 1) == balanced and per_rank[-1] >= per_rank[0], per_rank


@pytest.mark.slow
def test_at_128k_tokens_the_ring_keeps_chunks_of_the_keys_where_the_row_split_keeps_them_whole(monkeypatch):
    """Llama 3 8B's widths, one layer, 1 x 131072 tokens, trained on 8 ranks, planned on meta. The
    planner takes the balanced ring: the ring computes as the rows in order do (the last rank reads
    every key chunk: 15/8 of the mean), its shifts hidden under that work. Pinned to the ring, the
    plan keeps 7/8 less of the keys and values the attention reads (float32, repeated for the 32
    query heads: 2 GiB each whole) than pinned to the row split, which gathers them whole; but its
    backward holds a block's float32 scores, four per head (1024 rows x a chunk of 16384 keys x 32
    heads), beside the block's two boolean masks and its key and value chunks in flight with their
    gradients (2.1 GB): 10.8 GB at once, above what the row split saves. The balanced ring keeps
    what the ring keeps, and its blocks are half as wide (chunks of 8192 keys)."""
    from autotp.mesh import MeshSpec
    from autotp.planning.choices import strategies
    from autotp.planning.costs.costing import CostModel
    from cost_models import resolve_hardware

    model, inputs = _llama_8b_layer(131072)
    graph = autotp.capture(model, inputs)
    (attention,) = _attention(graph)
    assert plan_graph(graph, (8,), "h100-sxm", "train", memory_budget="1 TiB").strategy(attention.name).variant == \
        "ring_balanced/kv4"
    offered, plans = strategies.node_strategies, {}
    for variant in ("", "ring/kv4", "ring_balanced/kv4"):
        monkeypatch.setattr(strategies, "node_strategies", lambda graph_, node, *a, v=variant: [
            s for s in offered(graph_, node, *a) if node is not attention or (s.variant == v and _attention_rows(s))])
        plans[variant] = plan_graph(graph, (8,), "h100-sxm", "train", memory_budget="1 TiB")
    ring = plans["ring/kv4"].strategy(attention.name)
    assert str(ring).endswith("ring/kv4"), str(ring)
    k, v = attention.input_infos[1:3]
    assert plans[""].memory.activations_bytes - plans["ring/kv4"].memory.activations_bytes == \
        (k.nbytes + v.nbytes) * 7 / 8
    # its key and value chunk and the arriving one, with their gradients; the 8 kv heads the model
    # repeated for its 32 query heads, as they were before
    in_flight = 2 * (k.nbytes + v.nbytes) / 8 / 4 * 2
    assert plans["ring/kv4"].memory.transient_bytes == 1024 * 16384 * (32 * 4 * 4 + 2) + in_flight
    assert plans["ring/kv4"].memory.peak_bytes > plans[""].memory.peak_bytes
    assert plans["ring_balanced/kv4"].memory.activations_bytes == plans["ring/kv4"].memory.activations_bytes
    assert plans["ring_balanced/kv4"].memory.transient_bytes < plans["ring/kv4"].memory.transient_bytes
    cost = CostModel(MeshSpec((8,), ("tp",)), resolve_hardware("h100-sxm"), "train", graph=graph)
    rows = plans[""].strategy(attention.name)
    assert cost.node_compute_s(attention, ring) == pytest.approx(cost.node_compute_s(attention, rows), rel=1e-3)
    assert 0 < cost.inner_collectives_s(attention, ring) < cost.node_compute_s(attention, ring) / 10
    assert cost.working_bytes(attention, plans["ring_balanced/kv4"].strategy(attention.name)) == \
        1024 * 8192 * (32 * 4 * 4 + 2) + in_flight


@pytest.mark.slow
def test_at_128k_tokens_on_64_ranks_the_balanced_ring_passes_the_kv_heads_unrepeated():
    """Llama 3 8B's widths, one layer, 1 x 131072 tokens, trained on 64 ranks (more than its 32
    heads: no heads split), planned on meta, with room and within 4 GiB a device: the balanced
    ring, passing its 8 key/value heads as the model has them before repeating them for the 32
    query heads. Its 63 shifts then carry a quarter of the bytes of the repeated chunks and hide
    under its work; passed repeated, they would outlast it (which made the plain ring, with no
    exchanges on top, the choice within 4 GiB)."""
    from autotp.mesh import MeshSpec
    from autotp.planning.costs.costing import CostModel
    from autotp.planning.rules.attention import overlapped_collectives
    from cost_models import resolve_hardware

    model, inputs = _llama_8b_layer(131072)
    graph = autotp.capture(model, inputs)
    (attention,) = _attention(graph)
    roomy = plan_graph(graph, (64,), "h100-sxm", "train", memory_budget="1 TiB")
    short = plan_graph(graph, (64,), "h100-sxm", "train", memory_budget="4 GiB")
    chosen = roomy.strategy(attention.name)
    assert chosen.variant == short.strategy(attention.name).variant == "ring_balanced/kv4", str(chosen)
    assert short.memory.peak_bytes <= 4 * 2**30
    cost = CostModel(MeshSpec((64,), ("tp",)), resolve_hardware("h100-sxm"), "train", graph=graph)

    def shifts_s(strategy):
        return sum(cost.collective_s(kind, a, size) for kind, _, a, size in overlapped_collectives(attention, strategy,
                                                                                                   (64,)))

    repeated = dataclasses.replace(chosen, variant="ring_balanced")
    sizes = [(c[3], r[3]) for c, r in zip(overlapped_collectives(attention, chosen, (64,)),
                                          overlapped_collectives(attention, repeated, (64,)))]
    assert len(sizes) == 63 + 63 + 64 and all(r == 4 * c for c, r in sizes)
    work_s = cost.node_compute_s(attention, chosen) - cost.inner_collectives_s(attention, chosen) + shifts_s(chosen)
    assert shifts_s(chosen) < work_s < shifts_s(repeated)
