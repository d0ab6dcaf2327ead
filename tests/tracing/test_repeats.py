"""Stacks of alike layers traced at three layers and unrolled (autotp/tracing/repeats.py): the graph
equals a whole trace's, node for node; where it cannot, the model is traced whole; the model is
left as it was."""

import functools

import pytest
import torch
from torch import nn

import autotp
from autotp.planning.planner import plan_graph
from autotp.tracing.repeats import Stack, find_stacks
from examples import models as M

transformers = pytest.importorskip("transformers")


def same_graph(a: autotp.OpGraph, b: autotp.OpGraph) -> None:
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    for x, y in zip(a.nodes, b.nodes):
        assert x == y, (x, y)
    assert a.outputs == b.outputs
    assert a.parameters == b.parameters
    assert dict(a.alias_placeholders) == dict(b.alias_placeholders)
    assert (a.model_type, a.training) == (b.model_type, b.training)


def _hf(name: str, layers: int):
    T = transformers
    ids = torch.randint(0, 100, (2, 12))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                              bos_token_id=0, eos_token_id=0)), {"input_ids": ids}
    if name == "gemma":  # its MLP's activation is a functools.partial of its own in every layer
        return T.GemmaForCausalLM(T.GemmaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                                num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                                vocab_size=128)), {"input_ids": ids}
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128)), \
            {"input_ids": ids}
    return T.BertForMaskedLM(T.BertConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, vocab_size=128)), {"input_ids": ids}


@pytest.mark.parametrize("name,training", [("gpt2", True), ("qwen2", False), ("bert", True), ("gemma", True)])
def test_unrolled_graph_is_the_whole_trace(name, training):
    model, inputs = _hf(name, 5)
    model.train(training)
    whole = autotp.capture(model, inputs)
    unrolled = autotp.capture(model, inputs, unroll=True)
    assert unrolled.exported is None and unrolled.unrolled  # it was unrolled, not traced whole
    same_graph(unrolled, whole)
    assert len(model.get_submodule(find_stacks(model)[0].path)) == 5  # the model keeps its layers


def test_a_plan_made_on_the_unrolled_graph_is_the_whole_graphs_and_runs():
    model, inputs = M.tiny_llama(n_layer=5)
    plan = autotp.plan(model, (2,), inputs)
    assert plan.stats.unrolled == ("layers (5 layers)",)
    assert "traced at 3 layers and unrolled: layers (5 layers)" in plan.report()
    whole = plan_graph(autotp.capture(model, inputs), (2,), "h100-sxm")
    assert plan.nodes == whole.nodes and plan.parameter_placements == whole.parameter_placements
    assert plan.predicted_time() == whole.predicted_time()
    assert plan.memory.peak_bytes == whole.memory.peak_bytes
    plan.check_matches(autotp.capture(model, inputs), plan.mesh)  # what parallelize(plan=) checks


class Block(nn.Module):
    def __init__(self, index: int, scale: float = 1.0, first_differs: bool = False) -> None:
        super().__init__()
        self.index, self.scale, self.first_differs = index, scale, first_differs
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.fc(x)) * self.scale
        if self.first_differs and self.index == 0:  # the first layer computes differently
            y = y * 2
        return x + y


class Stacked(nn.Module):
    def __init__(self, scales=(1.0,) * 5, first_differs: bool = False, by_index: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(i, s, first_differs) for i, s in enumerate(scales))
        self.by_index = by_index

    def forward(self, x):
        if self.by_index:  # reads layers by their index: the cut stack does not hold layer 2
            for i in range(5):
                x = self.layers[i](x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_that_are_not_alike_are_traced_whole():
    x = torch.randn(2, 8)
    plain = Stacked()
    assert find_stacks(plain) == [Stack("layers", 5)]
    unrolled = autotp.capture(plain, (x,), unroll=True)
    assert unrolled.unrolled == ("layers (5 layers)",)
    same_graph(unrolled, autotp.capture(plain, (x,)))
    assert find_stacks(Stacked(scales=(1.0, 1.0, 0.5, 1.0, 1.0))) == []  # an attribute of its own
    # an activation bound per layer (functools.partial): alike where it binds the same function alike
    bound = Stacked()
    for layer in bound.layers:
        layer.act = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    assert find_stacks(bound) == [Stack("layers", 5)]
    bound.layers[3].act = functools.partial(torch.nn.functional.gelu, approximate="none")
    assert find_stacks(bound) == []
    # alike modules, but the first layer's ops differ (it branches on its index): traced whole
    model = Stacked(first_differs=True)
    assert find_stacks(model) == [Stack("layers", 5)]
    graph = autotp.capture(model, (x,), unroll=True)
    assert graph.exported is not None and not graph.unrolled
    same_graph(graph, autotp.capture(model, (x,)))


def test_a_model_the_cut_stack_cannot_run_is_traced_whole_and_left_as_it_was():
    model = Stacked(by_index=True)
    x = torch.randn(2, 8)
    before = model(x)
    graph = autotp.capture(model, (x,), unroll=True)  # layers[2] is not in the cut stack: traced whole
    assert graph.exported is not None
    same_graph(graph, autotp.capture(model, (x,)))
    assert list(model.layers._modules) == [str(i) for i in range(5)]
    torch.testing.assert_close(model(x), before)


def test_unrolled_capture_time_does_not_grow_with_depth():
    # node counts: the unrolled trace runs export on three layers whatever the depth
    calls = []
    real = torch.export.export

    def counting(model, *a, **k):
        calls.append(sum(1 for _ in model.modules()))
        return real(model, *a, **k)

    model, inputs = M.tiny_llama(n_layer=6)
    torch.export.export = counting
    try:
        graph = autotp.capture(model, inputs, unroll=True)
    finally:
        torch.export.export = real
    assert len(calls) == 1 and graph.unrolled
    three, _ = M.tiny_llama(n_layer=3)
    assert calls[0] == sum(1 for _ in three.modules())  # the module traced held three layers
    same_graph(graph, autotp.capture(model, inputs))


class MiddleDiffers(nn.Module):
    """Layer 2 of 5 branches on its index: the three traced layers cannot show it
    (docs/training.md#ops-and-constructs-capture-refuses-or-does-not-know)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if layer.index == 2:
                x = torch.tanh(x)
        return x


def test_a_layer_between_unlike_the_traced_ones_is_refused_where_the_plan_is_used():
    model, x = MiddleDiffers(), torch.randn(2, 8)
    plan = autotp.plan(model, (2,), (x,))
    assert plan.stats.unrolled  # planned as if layer 2 were layer 1
    with pytest.raises(autotp.PlanError, match="another model"):
        plan.check_matches(autotp.capture(model, (x,)), plan.mesh)  # what parallelize(plan=) runs first
