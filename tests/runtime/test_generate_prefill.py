"""``generate``'s prefill split along the sequence: the prompt's graph (the one that fills the cache
from position 0) has its mask proven a description, so its attention may be split by query rows,
and the decode steps read the cache as the prompt's plan stored it.

References: the model's own greedy ``generate`` in one process (the tokens), the mask the model
computes (:class:`~autotp.masks.MaskSpec` found against the positions a hand-written graph gives).
Ranks are 2 gloo processes (``torch.export``, which ``generate`` runs on every rank, is not safe
on threads of one process).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.masks import MaskSpec
from autotp.placement import S
from autotp.runtime.static_cache import with_static_cache
from examples.ranks import run_ranks
from tests.runtime.test_attention_masks import _attention, _model

NEW_TOKENS = 4


def _prompt(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` prompts of ``length`` tokens, the last left-padded by 5 (its mask 0 there)."""
    ids = torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, length, dtype=torch.int64)
    ids[-1, :5], mask[-1, :5] = 0, 0
    return ids, mask


def _prefill_graph(kind: str, length: int, cache: int):
    with torch.device("meta"):
        skeleton = _model(kind, window=4, max_position_embeddings=cache)
    model = with_static_cache(skeleton, 2, cache, "cpu", from_start=True)
    meta = dict(dtype=torch.int64, device="meta")
    inputs = (torch.zeros(2, length, **meta), torch.ones(2, cache, **meta), torch.zeros(2, length, **meta))
    return autotp.capture(model, inputs, dynamic_dims={"input_ids": (1,), "position_ids": (1,)}, device="cpu")


@pytest.mark.parametrize("kind, spec", [("llama", MaskSpec()), ("mistral", MaskSpec(window=4))])
def test_the_prefill_s_mask_is_described_over_the_whole_cache(kind, spec):
    """The prompt of 12 tokens against a cache of 20: the attention is the described op (causal, the
    window of 4), the padding vector over the cache's 20 positions, and no (12, 20) tensor is left."""
    graph = _prefill_graph(kind, 12, 20)
    (attention,) = _attention(graph)
    assert attention.target == "autotp.masked_attention.default", attention.target
    assert MaskSpec(attention.args["causal"], attention.args["window"], attention.args["diagonal"]) == spec
    assert tuple(attention.input_infos[3].shape) == (2, 20)
    assert not [n.name for n in graph.nodes for o in n.outputs if tuple(o.shape[-2:]) == (12, 20)]
    # the caches' position counters are still set: the write stays though the mask no longer reads it
    assert [n for n in graph.ops() if n.target == "aten.copy_.default"]


class _Counter(nn.Module):
    """Attention whose query positions are ``arange(S)`` plus a counter set from the positions given
    (as transformers' static cache keeps its length), the counter advanced by ``advance`` before the
    mask reads it or not at all."""

    def __init__(self, advance: bool) -> None:
        super().__init__()
        self.advance = advance
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        seq = q.shape[-2]
        # a view of the buffer as the copy left it, read after the advance: it sees the advanced value
        count = self.count.copy_(torch.arange(seq)[0]).view(1)
        if self.advance:
            self.count.add_(1)
        rows = (torch.arange(seq) + count)[:, None]
        mask = torch.arange(seq)[None, :] <= rows
        return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("advance", [False, True])
def test_a_tensor_written_again_before_the_mask_reads_it_is_not_read_as_its_first_value(advance):
    """``copy_(count, 0)`` then the mask ``j <= i + count``: causal where nothing writes the counter
    in between; advanced by 1 first, the mask is ``j <= i + 1``, which reading the copy as 0 would
    call causal: the mask is left a tensor, and the graph computes the model's output."""
    q = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(0))
    model = _Counter(advance)
    graph = autotp.capture(model, (q,))
    (attention,) = _attention(graph)
    if advance:
        assert attention.target == "aten.scaled_dot_product_attention.default"
        assert "attn_mask" in attention.args and not attention.args.get("is_causal")
    else:
        assert attention.target == "aten.scaled_dot_product_attention.default" and attention.args["is_causal"]
    torch.testing.assert_close(graph.exported.module()(q), _Counter(advance)(q))


def _force_rows(variant: str) -> None:
    """Offer every attention of more than one query row its query-rows split of ``variant`` alone (in
    this rank's process): the prompt's graph is planned with its rows split whatever it costs."""
    from autotp.planning.choices import strategies
    from autotp.planning.rules.attention import attention_mask_of

    offered = strategies.node_strategies

    def rows(graph, node, *args):
        found = offered(graph, node, *args)
        if attention_mask_of(node) is None or node.input_infos[0].shape[-2] == 1:
            return found
        return [s for s in found if s.inputs[0] == (S(2),) and s.variant == variant]

    strategies.node_strategies = rows


def _prefill_logits(graphs, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last position's logits of the prompt's graph for ``ids``, run as ``generate`` runs it (the
    mask over the whole cache, each position counted from the sequence's first token), the caches
    zeroed first."""
    cache_mask = torch.zeros(ids.shape[0], graphs.max_cache_len, dtype=torch.int64)
    cache_mask[:, :ids.shape[1]] = mask
    graphs.reset()
    return graphs.prompt(ids.shape[1])(ids, cache_mask, _positions(mask))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _generate_rank(rank, world, kind, prompts, variant):
    """Each prompt generated in turn by one parallel module (the later ones reuse its cache); the
    tokens, the prompt graph's last logits of each prompt, and the strategy of the attention of
    each prompt graph planned."""
    from torch.distributed.device_mesh import init_device_mesh

    if variant is not None:
        _force_rows(variant)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cache = max(ids.shape[1] for ids, _ in prompts) + NEW_TOKENS
    model = _model(kind, window=4, max_position_embeddings=cache, num_hidden_layers=2)
    pm = autotp.parallelize(model, mesh, (prompts[0][0],), mode="inference", hardware="cpu-gloo")
    tokens = [pm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, max_cache_len=cache).tolist()
              for ids, mask in prompts]
    (graphs,) = pm._autotp_generation.values()
    logits = [_prefill_logits(graphs, ids, mask) for ids, mask in prompts]
    strategies = {kind: str(plan.strategy(name)) for kind, plan in graphs.plans.items()
                  for name in plan.strategies if "attention" in name}
    return tokens, logits, strategies, graphs.prompt_length


def _expected(kind, prompts):
    """The model's own greedy tokens and last logits of each prompt, in one process."""
    cache = max(ids.shape[1] for ids, _ in prompts) + NEW_TOKENS
    model = _model(kind, window=4, max_position_embeddings=cache, num_hidden_layers=2)
    with torch.no_grad():
        logits = [model(ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1:] for ids, mask in prompts]
    return [model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            for ids, mask in prompts], logits


@pytest.mark.slow  # two processes each tracing and planning three graphs: about 15-30 s a case
@pytest.mark.parametrize("kind, variant", [("llama", "balanced"), ("llama", ""), ("mistral", "")])
def test_a_prefill_split_by_rows_returns_the_model_s_own_tokens(kind, variant):
    """Two prompts of 16 tokens (the second left-padded), the prompt's attention pinned to its rows
    split (in order, balanced; Mistral's window of 4), then prompts of 12: the prompt's graph holds
    its traced length only, so the second call plans a graph of its own, the caches where the first
    stored them. Every token is the model's own, and the prompt graph's last logits the model's."""
    prompts = [_prompt(2, 16), _prompt(2, 12)]
    results = run_ranks(_generate_rank, 2, kind, prompts, variant)
    expected, expected_logits = _expected(kind, prompts)
    for tokens, logits, strategies, prompt_length in results:
        assert tokens == expected
        for got, want in zip(logits, expected_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert prompt_length == 16
        for name in ("prompt", "prompt of 12"):
            assert strategies[name].startswith("(S(2), R, R"), strategies
            assert strategies[name].endswith("balanced") == (variant == "balanced"), strategies


@pytest.mark.slow
def test_a_long_prompt_s_prefill_is_split_by_rows_as_the_planner_chooses():
    """One prompt of 1024 tokens, left-padded: the planner splits the prompt's attention by query
    rows itself (the keys whole: the cache as the plan stores it for the decode steps), and every
    token is the model's own."""
    prompts = [_prompt(1, 1024)]
    expected, expected_logits = _expected("llama", prompts)
    ((tokens, logits, strategies, prompt_length), other) = run_ranks(_generate_rank, 2, "llama", prompts, None)
    assert tokens == expected == other[0]
    torch.testing.assert_close(logits[0], expected_logits[0], rtol=1e-4, atol=1e-5)
    assert strategies["prompt"].startswith("(S(2), R, R"), strategies
    assert prompt_length == 1024
