"""``generate``'s prefill: the prompt's graph (the one that fills the cache from position 0) has its
mask proven a description.

References: the mask the model computes (:class:`~autotp.masks.MaskSpec`, and a hand-written
graph's output).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.masks import MaskSpec
from autotp.runtime.static_cache import with_static_cache
from tests.runtime.test_attention_masks import _attention, _model


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
