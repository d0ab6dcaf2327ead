"""Capture: a model and example inputs → OpGraph, checked against the model itself.

References: the model's own outputs (shapes), ``named_parameters`` (parameters, tying), PyTorch's
``FlopCounterMode`` (FLOPs) and the model's ``state_dict`` before capture (no side effects).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import autotp
from autotp.tracing.graph import PARAMETER

from examples import models as M

OWN = ["mlp", "tiny_gpt", "tiny_llama"]
HF = ["hf_llama", "hf_gpt2", "hf_bert"]


def _tensor_leaves(out) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _flops(fn, *args) -> int:
    # The math backend runs attention as matmuls that FlopCounterMode counts; the fused CPU kernel
    # (_scaled_dot_product_flash_attention_for_cpu) has no entry in its registry and counts 0.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        fn(*args)
    return counter.get_total_flops()


_CACHE: dict = {}


def _captured(factory: str, device: str):
    """(model, inputs, graph, state before capture), one capture per factory and device."""
    key = (factory, device)
    if key not in _CACHE:
        model, inputs = getattr(M, factory)(device=device)
        before = {k: (v.detach().clone(), v.dtype, v.device, v.shape) for k, v in model.state_dict().items()}
        ids_before = {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)}
        training = model.training
        graph = autotp.capture(model, inputs)
        _CACHE[key] = (model, inputs, graph, (before, ids_before, training))
    return _CACHE[key]


CASES = [(f, d) for f in OWN + HF for d in ("cpu", "meta")]


@pytest.fixture(params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def captured(request):
    return _captured(*request.param)


@pytest.mark.parametrize("factory, device", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_output_shapes_equal_the_model_outputs(factory, device):
    graph = _captured(factory, device)[2]
    cpu_model, cpu_inputs = _captured(factory, "cpu")[:2]  # on meta, the same config on CPU gives the shapes
    with torch.no_grad():
        expected = [(tuple(t.shape), t.dtype) for t in _tensor_leaves(cpu_model(*cpu_inputs))]
    got = [(graph[o].outputs[0].shape, graph[o].outputs[0].dtype) for o in graph.outputs]
    assert got == [(s, str(d).removeprefix("torch.")) for s, d in expected]


def test_every_parameter_appears_once_with_its_shape_and_dtype(captured):
    model, _, graph, _ = captured
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    assert len(graph.parameters) == len(groups)
    by_name = {}
    for info in graph.parameters:
        for n in (info.fqn, *info.aliases):
            assert n not in by_name, f"{n} appears twice"
            by_name[n] = info
    for pid, names in groups.items():
        info = by_name[names[0]]
        assert {info.fqn, *info.aliases} == set(names)  # tied names: one ParameterInfo, the rest aliases
        assert info.info.shape == tuple(tensors[pid].shape)
        assert info.info.dtype == str(tensors[pid].dtype).removeprefix("torch.")
        assert graph[info.node].role == PARAMETER and graph[info.node].param_fqn == info.fqn
    n_param_nodes = sum(1 for n in graph.nodes if n.role == PARAMETER)
    assert n_param_nodes == len(groups)


@pytest.mark.parametrize("factory, tied", [("tiny_gpt", ("embed_tokens.weight", "lm_head.weight")),
                                           ("hf_gpt2", ("transformer.wte.weight", "lm_head.weight"))])
def test_tied_embedding_is_one_parameter(factory, tied):
    model, _, graph, _ = _captured(factory, "meta")
    assert model.get_parameter(tied[0]) is model.get_parameter(tied[1])
    info = graph.parameter(tied[1])
    assert info is graph.parameter(tied[0])
    assert info.fqn == tied[0] and info.aliases == (tied[1],)
    # both the lookup and the output head read that one placeholder
    readers = {graph[c].target for c in graph.consumers(info.node)}
    assert {"aten.embedding.default", "aten.linear.default"} <= readers
    own = sum(p.numel() for p in model.parameters())  # each tensor once
    assert graph.parameter_numel() == own


def test_flops_equal_flop_counter_on_the_model(captured):
    model, inputs, graph, _ = captured
    device = next(model.parameters()).device.type
    if device == "meta" and type(model).__name__ in ("LlamaForCausalLM", "GPT2LMHeadModel", "BertModel"):
        # Hugging Face models call .item() in forward, which meta tensors refuse: count the exported program
        reference = _flops(graph.exported.module(), *inputs)
    else:
        reference = _flops(model, *inputs)
    assert reference > 0
    assert graph.total_flops() + _masked_square(graph) == pytest.approx(reference, rel=0.01)


def _masked_square(graph) -> float:
    """The attention FLOPs FlopCounterMode counts and autotp does not: it counts every attention at the
    whole square, autotp at the pairs its mask allows (causal: half and the diagonal, docs/design.md
    "Attention masks as their description")."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sum(sdpa_flop_count(*(i.shape for i in n.input_infos[:3])) - n.flops for n in graph.ops()
               if n.target in ("aten.scaled_dot_product_attention.default", "autotp.masked_attention.default"))


def test_flops_of_a_linear_by_hand():
    g = autotp.capture(nn.Linear(32, 48), (torch.randn(5, 7, 32),))
    assert g.total_flops() == 2 * 5 * 7 * 32 * 48
    (lin,) = [n for n in g.ops() if n.target == "aten.linear.default"]
    assert lin.bytes_read == 4 * (5 * 7 * 32 + 48 * 32 + 48) and lin.bytes_written == 4 * 5 * 7 * 48


def test_capture_does_not_change_the_model(captured):
    model, _, _, (before, ids_before, training) = captured
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in after.items():
        old, dtype, device, shape = before[k]
        assert (v.dtype, v.device, v.shape) == (dtype, device, shape), k
        if device.type != "meta":
            assert torch.equal(v, old), f"{k} changed"
    assert {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)} == ids_before
    assert model.training == training
    assert all(p.grad is None for p in model.parameters())


def test_capture_of_a_training_batchnorm_leaves_its_running_stats_alone():
    """Tracing runs forward on fake tensors: the buffers a training forward would update stay as they were,
    and the buffer updates are not counted as model outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).train()
    model[1].running_mean.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = autotp.capture(model, (torch.randn(16, 8),))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training
    assert [graph[o].outputs[0].shape for o in graph.outputs] == [(16, 4)]


def test_capture_on_cpu_and_meta_give_the_same_graph():
    # (Hugging Face code takes device-dependent paths, e.g. an extra .contiguous() on CPU: own models only)
    for factory in ("tiny_llama", "tiny_gpt"):
        g_cpu, g_meta = _captured(factory, "cpu")[2], _captured(factory, "meta")[2]
        assert [(n.name, n.target, n.outputs) for n in g_cpu.nodes] == [(n.name, n.target, n.outputs) for n in g_meta.nodes]
        assert g_cpu.total_flops() == g_meta.total_flops()


# ------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("bad, mentions", [
    ("not a tensor", "tuple of tensors"),
    ([torch.randn(2, 8), "x"], "torch.Tensor"),
    (np.zeros((2, 8), dtype=np.float32), "tuple of tensors"),
])
def test_wrong_kind_of_example_inputs_is_a_type_error(bad, mentions):
    with pytest.raises(TypeError) as info:
        autotp.capture(nn.Linear(8, 8), bad)
    message = str(info.value)
    assert "expected" in message and mentions in message
    assert type(bad).__name__ in message or "str" in message  # says what was given


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # branches on a tensor value
            return self.fc(x)
        return -self.fc(x)


def test_data_dependent_control_flow_is_a_capture_error():
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(DataDependent(), (torch.randn(2, 8),))
    message = str(info.value)
    assert "torch.export" in message
    assert "what to do" in message and ("torch.cond" in message or "control flow" in message)


def test_a_model_with_its_parameters_on_meta_is_traced_on_meta_wherever_the_inputs_are():
    model, (ids,) = M.tiny_llama(device="meta")
    on_cpu = autotp.capture(model, (torch.randint(0, 128, (2, 16)),))
    on_meta = autotp.capture(model, (ids,))
    assert [(n.name, n.target, n.outputs) for n in on_cpu.nodes] == [(n.name, n.target, n.outputs) for n in on_meta.nodes]


def test_a_model_spread_over_devices_is_a_capture_error_about_devices():
    model, inputs = M.mlp()
    up = model.layers[0].up_proj
    up.weight = torch.nn.Parameter(up.weight.detach().to("meta"))  # one parameter on meta, the rest on CPU
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(model, inputs)
    message = str(info.value)
    assert "spread over devices" in message and "meta" in message and "cpu" in message


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="nn.Module"):
        autotp.capture(lambda x: x, (torch.randn(2),))


# ------------------------------------------------------------------------------------------------
# Llama 3 8B shape (Hugging Face), on meta


LLAMA_8B = dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=2048, batch=1,
                device="meta")


def _llama_8b_flops_by_hand(n_layer: int) -> float:
    """2 x (matmul parameters) x tokens, plus attention's two products over the (query, key) pairs a
    causal kernel computes, T (T + 1) / 2 of them: 4 D a pair, per layer."""
    T, D, F, V, KV = 2048, 4096, 14336, 128256, 1024
    matmul_params = n_layer * (2 * D * D + 2 * D * KV + 3 * D * F) + D * V
    return 2 * matmul_params * T + n_layer * 4 * (T * (T + 1) // 2) * D


def test_llama_8b_layer_shapes_flops():
    """Two layers of the 8B shape: FLOPs against FlopCounterMode and against the formula."""
    model, inputs = M.hf_llama(**{**LLAMA_8B, "n_layer": 2})
    graph = autotp.capture(model, inputs)
    reference = _flops(graph.exported.module(), *inputs)  # every attention at the whole square
    assert graph.total_flops() + _masked_square(graph) == pytest.approx(reference, rel=0.01)
    assert graph.total_flops() == pytest.approx(_llama_8b_flops_by_hand(2), rel=0.01)


@pytest.mark.slow
def test_llama_8b_capture_time_and_flops():
    model, inputs = M.hf_llama(**LLAMA_8B)
    start = time.perf_counter()
    graph = autotp.capture(model, inputs)
    seconds = time.perf_counter() - start
    print(f"\ncapture of HF Llama 8B on meta: {seconds:.1f} s, {len(graph)} nodes")
    assert seconds < 120
    reference = _flops(graph.exported.module(), *inputs)  # every attention at the whole square
    assert graph.total_flops() + _masked_square(graph) == pytest.approx(reference, rel=0.01)
    assert graph.total_flops() == pytest.approx(_llama_8b_flops_by_hand(32), rel=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    assert graph.parameter_numel() == n_params


class _MaskedSelect(nn.Module):
    def forward(self, x):
        return x[x > 0].sum() * x  # x[mask]: as many elements as the mask selects


def test_a_size_that_depends_on_tensor_values_is_a_capture_error_naming_the_op():
    """The trace names such a size by a data-dependent symbol with no value: the op that makes it is
    refused with its module and what to do, not a TypeError from deep inside capture."""
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(_MaskedSelect(), (torch.randn(8, 4),))
    message = str(info.value)
    assert "aten.index.Tensor (node index) at _MaskedSelect.forward()" in message
    assert "depends on tensor values (u0" in message and "what to do: compute with tensors and with sizes fixed" in message


class _ItemScalar(nn.Module):
    def forward(self, x):
        return x * (x > 0).sum().item()  # a value read into Python: each rank's piece has its own


def test_a_value_read_from_a_tensor_into_python_is_a_capture_error_naming_the_op():
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(_ItemScalar(), (torch.randn(8, 4),))
    message = str(info.value)
    assert "at _ItemScalar.forward(): reads a tensor's value into Python (u0" in message and "what to do" in message


def test_a_capture_error_leads_with_what_to_do_and_keeps_exports_traceback_off_the_screen():
    """A Hugging Face model called with use_cache=True (traced with it off unless asked): the message's first line is what to
    do; the original error is the __cause__, printed as one line, its traceback kept as text. Each rank
    printed two chained tracebacks of about 100 lines before."""
    import traceback

    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long), "use_cache": True})
    err = info.value
    assert str(err).startswith("what to do: build the model with use_cache=False")
    assert isinstance(err.__cause__, Exception) and err.__cause__.__traceback__ is None
    assert "Traceback" in err.original_traceback and "DynamicCache" in err.original_traceback
    printed = "".join(traceback.format_exception(err))
    assert printed.count("Traceback (most recent call last)") == 1 and len(printed.splitlines()) < 40


def test_a_cache_asked_for_by_a_submodule_s_own_config_is_off_while_traced_and_on_after():
    """T5's decoder stack keeps a copy of the config, use_cache and all: with only the model's own
    config turned off, the trace met the decoder's cache object and failed."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, vocab_size=64,
                                                decoder_start_token_id=0))
    assert model.decoder.config is not model.config and model.decoder.config.use_cache
    ids = torch.zeros(1, 6, dtype=torch.long)
    graph = autotp.capture(model, {"input_ids": ids, "decoder_input_ids": ids[:, :3].clone()})
    assert graph.ops() and model.config.use_cache and model.decoder.config.use_cache  # put back


def test_an_encoder_decoder_traced_without_decoder_inputs_is_told_to_give_them():
    """Marian (like T5) makes no decoder inputs from input_ids; its own error named both ways of
    giving them, and autotp's first line said to make forward() traceable."""
    from transformers import MarianConfig, MarianMTModel

    model = MarianMTModel(MarianConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=16, pad_token_id=63,
                                       decoder_start_token_id=63))
    with pytest.raises(autotp.CaptureError) as info:
        autotp.capture(model, (torch.ones(1, 6, dtype=torch.long),))
    assert str(info.value).startswith("what to do: give the decoder's inputs in the example inputs")


def test_a_tensor_given_twice_is_traced_as_two_inputs():
    """``{"input_ids": ids, "labels": ids}``: torch.export traces one tensor given twice as one input
    (every use reads the same placeholder), so a module built from it, called with other labels,
    computed the loss against the input ids. Capture gives the second a copy: each input is read
    where the model reads it."""

    class Difference(torch.nn.Module):
        def forward(self, x, y):
            return x * 2 - y

    t = torch.randn(2, 4)
    graph = autotp.capture(Difference(), (t, t))
    ops = {str(n.target): n.args for n in graph.exported.graph.nodes if n.op == "call_function"}
    assert str(ops["aten.mul.Tensor"][0]) == "x" and str(ops["aten.sub.Tensor"][1]) == "y", ops
    program = graph.exported.module()
    other = torch.randn(2, 4)
    assert torch.equal(program(t, other), Difference()(t, other))


def test_a_model_on_meta_is_traced_for_the_device_it_will_run_on():
    """Code that branches on its tensors' device (Hugging Face's expert counts: a float histc on CPU,
    an integer one elsewhere) takes, traced on meta with ``device="cpu"``, the branch a CPU run
    takes; traced on meta alone, the other one, which a CPU run refuses."""

    class Counts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            ids = (x @ self.w).argmax(-1)
            ids = ids.float() if ids.device.type == "cpu" else ids.int()
            return torch.histc(ids, bins=4, min=0, max=3)

    with torch.device("meta"):
        model = Counts()
    x = torch.randn(8, 4, device="meta")
    on_cpu = autotp.capture(model, (x,), device="cpu")
    on_meta = autotp.capture(model, (x,))
    kinds = {g: [n.outputs[0].dtype for n in graph.nodes if n.target == "aten.histc.default"] for g, graph in
             (("cpu", on_cpu), ("meta", on_meta))}
    assert kinds == {"cpu": ["float32"], "meta": ["int32"]}, kinds
    assert all(p.is_meta for p in model.parameters()) and type(model.w) is torch.nn.Parameter  # put back
