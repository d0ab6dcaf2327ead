"""The context axis in the layout search: layouts pp x dp x cp x tp for a model with attention at long
sequence, each priced from a plan on (cp,) or (cp, tp) with the inputs read split by sequence, every
weight whole and no activation of the sequence's length whole (autotp/planning/search/context_axis.py)."""

import pytest
import torch

import autotp
from autotp.mesh import MeshSpec
from autotp.planning.planner import plan_graph
from autotp.planning.search.context_axis import context_sequence
from autotp.planning.search.pipeline_search import CONTEXT_FROM_TOKENS, layouts
from examples import models
from tests.helpers.captures import captures_shared

transformers = pytest.importorskip("transformers")


def _llama(sequence: int = 32, batch: int = 1):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (batch, sequence), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


class _SummedFirst(torch.nn.Module):
    """Attention over a running sum along the sequence: its input cannot be read split by sequence."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x.cumsum(1)).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True).sum()


@pytest.fixture(scope="module")
def llama_graph():
    model, inputs = _llama()
    return autotp.capture(model, inputs)


def test_context_axes_are_offered_where_the_sequence_cuts_into_two_chunks_a_rank():
    assert {c.cp for c in layouts(8, 8, 4, 1)} == {1}  # no sequence given: none
    assert {c.cp for c in layouts(8, 8, 4, 1, sequence=20)} == {1, 2}  # 20 = 2 x 2 x 5, not 2 x 4 x 2.5
    offered = layouts(16, 8, 4, 8, sequence=64)
    # beside each cp, tp 1 or the largest tensor axis inside a node: a few more ILPs, not one per tp
    assert {(c.cp, c.tp) for c in offered if c.cp > 1} == {(2, 1), (2, 8), (4, 1), (4, 4), (8, 1), (8, 2), (16, 1)}
    assert all(c.pp * c.dp * c.cp * c.tp == 16 for c in offered)


def test_the_search_offers_a_context_axis_only_at_a_long_sequence():
    model, inputs = _llama()
    with captures_shared():
        short = autotp.plan(model, 2, inputs, hardware="h100-sxm", pipeline=True)
        asked = autotp.plan(model, 2, inputs, hardware="h100-sxm", pipeline={"cp": 2})
    assert 32 < CONTEXT_FROM_TOKENS and {c.cp for c in short.pipeline.candidates} == {1}
    assert str(asked.pipeline.layout) == "pp 1 x dp 1 x cp 2 x tp 1" and asked.mesh.axis_names == ("cp",)
    assert "cp 2" in asked.report() and "context" in dict(asked.pipeline.links)


def test_a_context_axis_splits_every_activation_by_sequence_and_keeps_the_weights_whole(llama_graph):
    alone = plan_graph(llama_graph, (1,), "h100-sxm", "train", explainable=False)
    split = plan_graph(llama_graph, MeshSpec((2,), ("cp",)), "h100-sxm", "train", explainable=False,
                       context="cp")
    assert set(split.parameter_placements.values()) == {"R"}
    # the activations kept for the backward: about half of one device's (the inputs and a few
    # sequence-free tensors are whole on each rank)
    ratio = split.memory.activations_bytes / alone.memory.activations_bytes
    assert 0.45 < ratio < 0.6, ratio
    # the weights' gradients are partial sums over the axis, summed in the backward
    assert any(c.kind == "all_reduce" and c.phase == "backward" for c in split.collectives())


def test_a_context_axis_is_refused_where_nothing_can_split_by_sequence(llama_graph):
    mlp, inputs = models.mlp()
    graph = autotp.capture(mlp, inputs)
    assert context_sequence(graph) == 0
    with pytest.raises(ValueError, match=r"context axis of 2 ranks .*the model has no attention op"):
        plan_graph(graph, MeshSpec((2,), ("cp",)), "h100-sxm", "train", context="cp")
    with pytest.raises(ValueError, match=r"context='sp': the mesh .* has no such axis; expected one of \('cp',\)"):
        plan_graph(llama_graph, MeshSpec((2,), ("cp",)), "h100-sxm", "train", context="sp")
    with pytest.raises(ValueError, match=r"splits the first input 'x' by sequence \(dim 1\), and an op reading it "
                                         r"\(aten.cumsum.default\) has no such split"):
        plan_graph(autotp.capture(_SummedFirst(), (torch.randn(1, 8, 4),)), MeshSpec((2,), ("cp",)), "h100-sxm",
                   "train", context="cp")
    model, inputs = _llama(sequence=36)  # 36 tokens cut into 2 x 2 chunks, not 2 x 4
    with pytest.raises(ValueError, match=r"pipeline=\{'cp': 4\}: no layout of 4 devices has them; the values that "
                                         r"occur: \{'cp': \[1, 2\]\}"):
        autotp.plan(model, 4, inputs, hardware="h100-sxm", pipeline={"cp": 4})
