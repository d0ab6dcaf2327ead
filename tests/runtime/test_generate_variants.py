"""``generate()`` as Hugging Face's on what the plain case leaves out: prompts padded without a mask,
and sliding-window attention.

References: the model's own ``generate`` in one process, with the same arguments (greedy tokens),
and the warnings transformers logs. The ranks are 2 threads over a real group, each parallelizing
its own copy of a model built once here (``tests/helpers/turns.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
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
    with CaptureLogger(logging.get_logger("transformers.generation.utils")) as logged:
        ranks = run_threads_tracing_in_turns(_qwen2_rank, 2, model)
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
    return transformers.Cohere2ForCausalLM(transformers.Cohere2Config(**common, sliding_window=4)).eval()


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
