"""``generate()`` as Hugging Face's on what the plain case leaves out: prompts padded without a mask,
sliding-window attention, and the models it refuses (a cache of more than keys and values, a
forward that does not trace over a static cache).

References: the model's own ``generate`` in one process, with the same arguments (greedy tokens),
and the warnings transformers logs. The ranks are 2 threads over a real group, each parallelizing
its own copy of a model built once here (``tests/helpers/turns.py``); the refusals read a model's
config alone, or run on a fake process group of 2 ranks (nothing is computed across ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.runtime.static_cache import check_key_value_cache
from tests.helpers.turns import run_threads_tracing_in_turns

NEW_TOKENS = 6
PAD, EOS = 1, 2


def _qwen2(sliding: bool = True):
    """Qwen2 whose second layer attends to a window of 4 positions (prompts of 8, 6 new tokens: the
    window drops positions), or the same weights without the window; weights drawn wide enough that
    the window and the pads change the tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, eos_token_id=EOS,
                         use_sliding_window=sliding, sliding_window=4, max_window_layers=1, initializer_range=0.2)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _prompts(pad: int) -> torch.Tensor:
    """Two prompts of 8 and 5 tokens, the second left-padded with ``pad`` (no token is a pad or an end)."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[1, :3] = pad
    return ids


def _greedy(model, ids, **kwargs) -> list:
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs).tolist()


def _qwen2_rank(rank, world, built):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = copy.deepcopy(built)
    prompt = _prompts(PAD)
    budget = 0.7 * sum(p.numel() * p.element_size() for p in model.parameters())  # the blocks split
    pm = autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo", memory_budget=budget)
    return {"unpadded": pm.generate(_prompts(7), max_new_tokens=NEW_TOKENS).tolist(),
            "pad_given": pm.generate(prompt, max_new_tokens=NEW_TOKENS, pad_token_id=PAD).tolist(),
            "pad_is_eos": pm.generate(_prompts(EOS), max_new_tokens=NEW_TOKENS).tolist(),
            "split": sorted(set(pm.plan.module_styles().values()))}


@pytest.fixture(scope="module")
def qwen2_ranks():
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    model = _qwen2()
    verbosity = logging.get_verbosity()
    logging.set_verbosity_warning()  # the level a user has, whatever another test in this process set
    try:
        with CaptureLogger(logging.get_logger("transformers.generation.utils")) as logged:
            ranks = run_threads_tracing_in_turns(_qwen2_rank, 2, model)
    finally:
        logging.set_verbosity(verbosity)
    return model, ranks, logged.out


def test_a_sliding_window_generates_the_model_s_own_tokens(qwen2_ranks):
    model, ranks, _ = qwen2_ranks
    expected = _greedy(model, _prompts(7))
    unwindowed = _qwen2(sliding=False)
    unwindowed.load_state_dict(model.state_dict())
    assert expected != _greedy(unwindowed, _prompts(7)), "the window must change the tokens, or it proves nothing"
    assert {"colwise", "rowwise"} <= set(ranks[0]["split"])
    assert [r["unpadded"] for r in ranks] == [expected, expected]


def test_padded_prompts_without_a_mask_are_masked_from_the_pad_token_as_hugging_face_does(qwen2_ranks):
    model, ranks, _ = qwen2_ranks
    ids = _prompts(PAD)
    expected = _greedy(model, ids, pad_token_id=PAD)
    assert expected == _greedy(model, ids, pad_token_id=PAD, attention_mask=(ids != PAD).long())
    assert expected != _greedy(model, ids, pad_token_id=PAD, attention_mask=torch.ones_like(ids)), \
        "the pads read as tokens must change the tokens, or this proves nothing"
    assert [r["pad_given"] for r in ranks] == [expected, expected]


def test_a_pad_token_that_is_the_end_token_is_read_as_a_token_with_hugging_face_s_warning(qwen2_ranks):
    model, ranks, logged = qwen2_ranks
    ids = _prompts(EOS)  # no pad token set: Hugging Face pads with the end token, so it cannot infer a mask
    expected = _greedy(model, ids)
    assert expected == _greedy(model, ids, attention_mask=torch.ones_like(ids))
    assert [r["pad_is_eos"] for r in ranks] == [expected, expected]
    assert "The attention mask and the pad token id were not set" in logged


def _sliding(name: str):
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, eos_token_id=EOS)
    if name == "mistral":  # the default config's window (4096), longer than the cache
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
    if name == "gemma2":  # sliding and full layers alternate; logits soft-capped
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8, sliding_window=4)).eval()
    # weights drawn wider: at the default scale its few logits settle on two tokens
    return transformers.Cohere2ForCausalLM(transformers.Cohere2Config(**common, sliding_window=4,
                                                                      initializer_range=0.2)).eval()


def _sliding_rank(rank, world, built):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = copy.deepcopy(built)
    budget = 0.7 * sum(p.numel() * p.element_size() for p in model.parameters())
    pm = autotp.parallelize(model, mesh, (_prompts(7),), mode="inference", hardware="cpu-gloo", memory_budget=budget)
    return pm.generate(_prompts(7), max_new_tokens=NEW_TOKENS).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2", "cohere2"])
def test_sliding_window_families_generate_the_model_s_own_tokens(name):
    model = _sliding(name)
    expected = _greedy(model, _prompts(7))
    assert len({t for row in expected for t in row[8:]}) > 2, "a degenerate reference would prove little"
    assert run_threads_tracing_in_turns(_sliding_rank, 2, model) == [expected, expected]


def _stateful(name: str):
    """Tiny models whose transformers cache keeps a convolution or recurrent state (on meta: only
    their configs are read)."""
    import transformers as t

    attention = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        if name == "mamba2":
            return t.Mamba2ForCausalLM(t.Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, n_groups=1,
                                                      state_size=8, num_hidden_layers=2, vocab_size=64))
        if name == "lfm2":
            return t.Lfm2ForCausalLM(t.Lfm2Config(**attention, layer_types=["conv", "full_attention"]))
        if name == "jamba":
            return t.JambaForCausalLM(t.JambaConfig(**attention, attn_layer_period=2, attn_layer_offset=1,
                                                    num_experts=2, mamba_d_state=8, mamba_dt_rank=8,
                                                    use_mamba_kernels=False))
        if name == "qwen3_next":
            return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
                **attention, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]))
        return t.FalconH1ForCausalLM(t.FalconH1Config(**attention, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                                      mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8))


@pytest.mark.parametrize("name, layers", [("mamba2", "0 (linear_attention), 1 (linear_attention)"),
                                          ("lfm2", "0 (conv)"), ("jamba", "0 (linear_attention)"),
                                          ("qwen3_next", "0 (linear_attention)"),
                                          ("falcon_h1", "0 (hybrid), 1 (hybrid)")])
def test_a_cache_of_convolution_or_recurrent_states_is_refused_by_its_layers(name, layers):
    model = _stateful(name)
    with pytest.raises(NotImplementedError) as err:
        check_key_value_cache(model)
    message = str(err.value)
    assert f"{type(model).__name__}: its layers {layers} keep a convolution or recurrent" in message, message
    assert "autotp's generate holds attention keys and values only" in message and "docs/serving.md#limits" in message


def test_a_cache_of_keys_and_values_alone_is_not_refused():
    for model in (_qwen2(), _sliding("gemma2")):
        check_key_value_cache(model)


@pytest.fixture
def two_fake_ranks():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _parallel(model, prompt):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo")


@pytest.mark.slow
def test_generate_refuses_a_recurrent_state_at_the_call_and_makes_no_cache(two_fake_ranks):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    model = Mamba2ForCausalLM(Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, n_groups=1, state_size=8,
                                           num_hidden_layers=1, vocab_size=64, use_cache=False)).eval()
    prompt = _prompts(7)
    pm = _parallel(model, prompt)
    with pytest.raises(NotImplementedError, match="its layers 0 .linear_attention. keep a convolution or recurrent"):
        pm.generate(prompt, max_new_tokens=2)
    assert not [n for n, _ in pm.named_buffers() if n.startswith("autotp_kv_")]
    assert not pm.generation_plans


@pytest.mark.slow
def test_generate_refuses_a_forward_sized_by_the_cache_s_count_naming_autotp_s_limit(two_fake_ranks):
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    # ALiBi: the attention slices its bias by the count of tokens the cache holds
    model = MptForCausalLM(MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=32,
                                     use_cache=False)).eval()
    prompt = _prompts(7)
    pm = _parallel(model, prompt)
    with pytest.raises(NotImplementedError) as err:
        pm.generate(prompt, max_new_tokens=2, max_cache_len=16)
    message = str(err.value)
    assert "MptForCausalLM: autotp could not trace its forward over a static KV cache" in message, message
    assert "computes a tensor's size from a value held in a tensor" in message
    assert "autotp's generate does not support this model" in message and "check the example inputs" not in message
    assert not [n for n, _ in pm.named_buffers() if n.startswith("autotp_kv_")]
