"""autotp on a zoo of Hugging Face architectures: one row per architecture.

This zoo holds language models (causal, mixture-of-experts, encoders, encoder-decoders): its
columns count a transformer block's weight matrices and activation collectives and compare with
Megatron's layout. Convnets, vision and audio transformers, a state-space model and diffusion
models have their own zoo, ``benchmarks/zoo_vision.py``, whose references are data parallelism and
each family's hand layout instead.

Each architecture is built by ``transformers`` from its config class at the widths of a well-known
checkpoint (written out below; nothing comes from the hub), on the meta device, and planned for a
(8,) mesh of ``h100-sxm`` in train mode (float32, the device's memory as the budget). Per row:

* ``status``: "planned", the error's type and first line, or "skipped" where this ``transformers``
  lacks the classes;
* ``block W sharded``: the weight matrices of one block that the plan shards / all of that block's
  weight matrices (parameters of 2 or more dims whose name has a layer index, from the 4-layer plan
  minus the 2-layer one, halved; for an encoder-decoder one encoder block plus one decoder block;
  norm weights and biases are left out: Megatron keeps them whole too); where Megatron's layout
  (below) keeps some of them whole too (Mixtral's ``(8, 4096)`` router), how many it splits;
* ``fwd act coll/block``: forward collectives per block that move an activation-sized tensor (at
  least half of batch x seq x hidden x dtype bytes; a gather of a weight's stored shard does not
  count), from the same difference;
* ``t autotp/Megatron``: the predicted step of autotp's 4-layer plan / that of the same graph with the Megatron
  layout pinned: the config's ``base_model_tp_plan`` where ``transformers`` defines one, else the
  ``hand_tp`` table of its entry below (q/k/v or fused qkv and up/gate colwise, attention output and down
  rowwise), mapped onto the parameters (an ``nn.Linear`` weight colwise ``S(0)`` / rowwise ``S(1)``,
  a GPT-2 ``Conv1D`` weight the other way round, a colwise bias ``S(0)``, a stacked experts weight
  ``(E, out, in)`` colwise ``S(1)`` / rowwise ``S(2)``; ``packed_colwise``, a fused gate|up, as the
  blocked split ``S(d)[2]``; an entry's ``hand_pin`` where a layout's styles would map wrong, as
  gpt-oss's experts stored ``(E, in, out)``); goal <= 1.0. Other fused weights a layout calls colwise are pinned
  as contiguous pieces, as the layout says. The cell also says how many parameters the pin fixes;
* ``2 ranks``: the same architecture at tiny widths (hidden 64, 4 heads, ffn 128, vocab 128,
  2 layers, batch 2 x 16 tokens, float32, seeded), captured and planned for 2 ``cpu-gloo`` ranks
  under a budget 5% above the least one without recompute (so the plan must shard), run on 2
  threaded ranks (``examples.ranks.run_threads``): the output and every parameter's gradient of
  ``(output - target).pow(2).mean()`` (a fixed random target) against one process, rtol 1e-4 and
  atol 1e-5 x the largest reference output (gradient); with how many parameters that plan shards.

A row is Megatron-quality when every block weight matrix that Megatron's layout splits is sharded
(all of them, but for MoE routers and gates Megatron keeps whole) and a block has at most 4 forward
activation collectives (an encoder-decoder's encoder + decoder block: 10, as Megatron's layout with
sequence parallelism has). The goal is every row Megatron-quality and exact.

MoE models run ``transformers``' default experts implementation (``grouped_mm``; on CPU its
``transformers::grouped_mm_fallback`` custom op). Progress goes to stderr, the table to stdout.

    .venv/bin/python -m benchmarks.zoo [--archs llama,gpt2,...] [--no-exact] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import time
from typing import Callable, Optional

import torch

from examples.models import output_tensor
from examples.ranks import run_threads

MESH = (8,)
HARDWARE = "h100-sxm"
DTYPE = torch.float32
TINY = dict(batch=2, seq=16, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
TINY_BUDGET_SCALE = 1.05
# forward activation collectives per block in Megatron's layout with sequence parallelism: a gather
# and a reduce-scatter around attention and around the MLP; an encoder-decoder's "block" is one
# encoder block (4) and one decoder block with cross-attention (6)
MAX_ACTIVATION_COLLECTIVES = {"enc-dec": 10}
DEFAULT_MAX_ACTIVATION_COLLECTIVES = 4


# ------------------------------------------------------------------------------- architectures

def _layers(*keys: str) -> Callable[[int], dict]:
    """Config kwargs setting the number of layers under every name in ``keys``."""
    return lambda n: dict.fromkeys(keys, n)


def _gpt_neo_layers(n: int) -> dict:
    # GPT-Neo alternates global and local attention; attention_types must cover num_layers
    return {"num_layers": n, "attention_types": [[["global", "local"], n // 2]]}


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str  # the --archs key
    checkpoint: str  # whose widths `real` are
    kind: str  # causal, encoder, enc-dec, MoE
    config: str  # transformers' config class
    model: str  # transformers' model class
    real: dict  # config kwargs at the checkpoint's widths (layers aside)
    tiny: dict  # config kwargs of the exactness check (layers aside)
    layers: Callable[[int], dict] = _layers("num_hidden_layers")
    seq: int = 2048  # tokens of the real-width example (per input for an encoder-decoder)
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    hand_tp: Optional[dict] = None  # Megatron layout where the config has no base_model_tp_plan
    extra_tp: Optional[dict] = None  # added to base_model_tp_plan (modules it does not name)
    # Megatron's placements of parameters no style above maps right ({name pattern: placement}), as
    # gpt-oss's stacked experts, stored (E, in, out) rather than (E, out, in)
    hand_pin: Optional[dict] = None
    attn: str = "sdpa"  # "eager" where transformers offers no sdpa for the model


def _tiny_decoder(**kw) -> dict:
    """Llama-style config kwargs at tiny widths."""
    return dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
                num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"]) | kw


_GPT2_STYLE = {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
_BERT_STYLE = {"layer.*.attention.self.query": "colwise", "layer.*.attention.self.key": "colwise",
               "layer.*.attention.self.value": "colwise", "layer.*.attention.output.dense": "rowwise",
               "layer.*.intermediate.dense": "colwise", "layer.*.output.dense": "rowwise"}
_FUSED_QKV = {"self_attention.query_key_value": "colwise", "self_attention.dense": "rowwise",
              "mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"}
_QKVO = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}

ARCHS: tuple[Arch, ...] = (
    Arch("llama", "Llama-2-7B", "causal", "LlamaConfig", "LlamaForCausalLM",
         dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
              num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5),
         _tiny_decoder()),
    Arch("mistral", "Mistral-7B-v0.1", "causal", "MistralConfig", "MistralForCausalLM",
         dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
              num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5),
         _tiny_decoder(sliding_window=8)),
    Arch("qwen2", "Qwen2-7B", "causal", "Qwen2Config", "Qwen2ForCausalLM",
         dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
              num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=False),
         _tiny_decoder()),
    Arch("gemma", "Gemma-7B", "causal", "GemmaConfig", "GemmaForCausalLM",
         dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_attention_heads=16,
              num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
              hidden_activation="gelu_pytorch_tanh"),
         _tiny_decoder(head_dim=16)),
    Arch("phi", "Phi-2", "causal", "PhiConfig", "PhiForCausalLM",
         dict(vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_attention_heads=32,
              num_key_value_heads=32, partial_rotary_factor=0.4, max_position_embeddings=2048,
              layer_norm_eps=1e-5),
         _tiny_decoder(partial_rotary_factor=0.5)),
    Arch("phi3", "Phi-3-mini-4k", "causal", "Phi3Config", "Phi3ForCausalLM",
         dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
              num_key_value_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096,
              sliding_window=2047, pad_token_id=32000, bos_token_id=1, eos_token_id=32000),
         _tiny_decoder(sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Arch("gpt_neox", "Pythia-6.9B", "causal", "GPTNeoXConfig", "GPTNeoXForCausalLM",
         dict(vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_attention_heads=32,
              rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
              num_attention_heads=TINY["heads"], rotary_pct=0.25, bos_token_id=0, eos_token_id=0)),
    Arch("bloom", "BLOOM-7B1", "causal", "BloomConfig", "BloomForCausalLM",
         dict(vocab_size=250880, hidden_size=4096, n_head=32),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], n_head=TINY["heads"],
              bos_token_id=1, eos_token_id=2, pad_token_id=3),
         layers=_layers("n_layer"), hand_tp=_FUSED_QKV, attn="eager"),
    Arch("opt", "OPT-6.7B", "causal", "OPTConfig", "OPTForCausalLM",
         dict(vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_attention_heads=32,
              max_position_embeddings=2048, word_embed_proj_dim=4096),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], ffn_dim=TINY["ffn"],
              num_attention_heads=TINY["heads"], word_embed_proj_dim=TINY["hidden"],
              pad_token_id=1, bos_token_id=2, eos_token_id=2),
         hand_tp={**{f"self_attn.{k}": v for k, v in _QKVO.items()}, "self_attn.out_proj": "rowwise",
                  "fc1": "colwise", "fc2": "rowwise"}),
    Arch("falcon", "Falcon-7B", "causal", "FalconConfig", "FalconForCausalLM",
         dict(vocab_size=65024, hidden_size=4544, num_attention_heads=71, multi_query=True,
              new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False,
              max_position_embeddings=2048),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], num_attention_heads=TINY["heads"],
              multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False,
              bos_token_id=1, eos_token_id=2),
         hand_tp=_FUSED_QKV),
    Arch("gpt2", "GPT-2 XL", "causal", "GPT2Config", "GPT2LMHeadModel",
         dict(vocab_size=50257, n_embd=1600, n_head=25, n_positions=1024),
         dict(vocab_size=TINY["vocab"], n_embd=TINY["hidden"], n_head=TINY["heads"], n_inner=TINY["ffn"],
              bos_token_id=None, eos_token_id=None),
         layers=_layers("n_layer"), seq=1024, hand_tp=_GPT2_STYLE),
    Arch("gptj", "GPT-J-6B", "causal", "GPTJConfig", "GPTJForCausalLM",
         dict(vocab_size=50400, n_embd=4096, n_head=16, rotary_dim=64, n_positions=2048),
         dict(vocab_size=TINY["vocab"], n_embd=TINY["hidden"], n_head=TINY["heads"], n_inner=TINY["ffn"],
              rotary_dim=8, bos_token_id=None, eos_token_id=None),
         layers=_layers("n_layer")),
    Arch("gpt_neo", "GPT-Neo-2.7B", "causal", "GPTNeoConfig", "GPTNeoForCausalLM",
         dict(vocab_size=50257, hidden_size=2560, num_heads=20, max_position_embeddings=2048, window_size=256),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], num_heads=TINY["heads"],
              intermediate_size=TINY["ffn"], window_size=8, bos_token_id=None, eos_token_id=None),
         layers=_gpt_neo_layers, attn="eager",
         hand_tp={**{f"attn.attention.{k}": v for k, v in _QKVO.items()}, "attn.attention.out_proj": "rowwise",
                  "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}),
    Arch("stablelm", "StableLM-3B-4E1T", "causal", "StableLmConfig", "StableLmForCausalLM",
         dict(vocab_size=50304, hidden_size=2560, intermediate_size=6912, num_attention_heads=32,
              num_key_value_heads=32, partial_rotary_factor=0.25, max_position_embeddings=4096,
              layer_norm_eps=1e-5),
         _tiny_decoder(partial_rotary_factor=0.25, bos_token_id=0, eos_token_id=0),
         hand_tp={**{f"self_attn.{k}": v for k, v in _QKVO.items()}, "self_attn.o_proj": "rowwise",
                  "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}),
    Arch("starcoder2", "Starcoder2-7B", "causal", "Starcoder2Config", "Starcoder2ForCausalLM",
         dict(vocab_size=49152, hidden_size=4608, intermediate_size=18432, num_attention_heads=36,
              num_key_value_heads=4, max_position_embeddings=16384, sliding_window=4096, rope_theta=1e6,
              use_bias=True),
         _tiny_decoder(sliding_window=8, bos_token_id=0, eos_token_id=0)),
    Arch("olmo", "OLMo-7B", "causal", "OlmoConfig", "OlmoForCausalLM",
         dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
              num_key_value_heads=32, max_position_embeddings=2048),
         _tiny_decoder(pad_token_id=1, bos_token_id=None, eos_token_id=0)),
    Arch("codegen", "CodeGen-2B", "causal", "CodeGenConfig", "CodeGenForCausalLM",
         dict(vocab_size=51200, n_embd=2560, n_head=32, rotary_dim=64, n_positions=2048, n_ctx=2048),
         dict(vocab_size=TINY["vocab"], n_embd=TINY["hidden"], n_head=TINY["heads"], n_inner=TINY["ffn"],
              rotary_dim=8, bos_token_id=None, eos_token_id=None),
         layers=_layers("n_layer")),
    Arch("gpt_bigcode", "StarCoder (15.5B)", "causal", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         dict(vocab_size=49152, n_embd=6144, n_head=48, n_inner=24576, n_positions=8192, multi_query=True),
         dict(vocab_size=TINY["vocab"], n_embd=TINY["hidden"], n_head=TINY["heads"], n_inner=TINY["ffn"],
              multi_query=True, bos_token_id=None, eos_token_id=None),
         layers=_layers("n_layer"), hand_tp=_GPT2_STYLE),
    Arch("mixtral", "Mixtral-8x7B", "MoE", "MixtralConfig", "MixtralForCausalLM",
         dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=32768, rope_theta=1e6),
         _tiny_decoder(num_local_experts=4, num_experts_per_tok=2)),
    Arch("qwen2_moe", "Qwen1.5-MoE-A2.7B", "MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
              shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
              tie_word_embeddings=False),
         _tiny_decoder(moe_intermediate_size=32, shared_expert_intermediate_size=TINY["ffn"], num_experts=4,
                       num_experts_per_tok=2, bos_token_id=None, eos_token_id=None),
         extra_tp={"layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
                   "layers.*.mlp.shared_expert.down_proj": "rowwise"}),
    Arch("olmoe", "OLMoE-1B-7B", "MoE", "OlmoeConfig", "OlmoeForCausalLM",
         dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
              num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096),
         _tiny_decoder(num_experts=4, num_experts_per_tok=2, pad_token_id=1, bos_token_id=None, eos_token_id=0)),
    Arch("qwen3", "Qwen3-8B", "causal", "Qwen3Config", "Qwen3ForCausalLM",
         dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=False),
         _tiny_decoder(head_dim=16)),
    Arch("gemma2", "Gemma-2-9B", "causal", "Gemma2Config", "Gemma2ForCausalLM",
         dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
              num_key_value_heads=8, head_dim=256, max_position_embeddings=8192, sliding_window=4096,
              query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
         _tiny_decoder(head_dim=16, sliding_window=8, query_pre_attn_scalar=16), attn="eager"),
    Arch("gemma3", "Gemma-3-12B (text)", "causal", "Gemma3TextConfig", "Gemma3ForCausalLM",
         dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
              num_key_value_heads=8, head_dim=256, max_position_embeddings=131072, sliding_window=1024,
              query_pre_attn_scalar=256),
         _tiny_decoder(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    Arch("granite", "Granite-3.0-8B", "causal", "GraniteConfig", "GraniteForCausalLM",
         dict(vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_attention_heads=32,
              num_key_value_heads=8, max_position_embeddings=4096, rope_theta=1e4, embedding_multiplier=12.0,
              residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0),
         _tiny_decoder(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                       logits_scaling=16.0)),
    Arch("olmo2", "OLMo-2-7B", "causal", "Olmo2Config", "Olmo2ForCausalLM",
         dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
              num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6),
         _tiny_decoder(pad_token_id=1, bos_token_id=None, eos_token_id=0)),
    Arch("cohere", "Command-R (35B)", "causal", "CohereConfig", "CohereForCausalLM",
         dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_attention_heads=64,
              num_key_value_heads=64, max_position_embeddings=8192, logit_scale=0.0625, rope_theta=8e6),
         _tiny_decoder(pad_token_id=0, bos_token_id=None, eos_token_id=1)),
    Arch("glm4", "GLM-4-9B-0414", "causal", "Glm4Config", "Glm4ForCausalLM",
         dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=32768, partial_rotary_factor=0.5),
         _tiny_decoder(head_dim=16, pad_token_id=0, bos_token_id=None, eos_token_id=1)),
    Arch("qwen3_moe", "Qwen3-30B-A3B", "MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
              num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
              head_dim=128, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False),
         _tiny_decoder(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    Arch("deepseek_v3", "Moonlight-16B-A3B", "MoE", "DeepseekV3Config", "DeepseekV3ForCausalLM",
         dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
              n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
              first_k_dense_replace=1, routed_scaling_factor=2.446, num_attention_heads=16, num_key_value_heads=16,
              q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              max_position_embeddings=8192, tie_word_embeddings=False),
         # a low-rank query (DeepSeek-V3's own q_lora_rank) at tiny widths: both query paths are checked
         _tiny_decoder(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                       n_group=2, topk_group=1, first_k_dense_replace=1, num_key_value_heads=TINY["heads"],
                       q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    Arch("llama4", "Llama-4-Scout-17B-16E (text)", "MoE", "Llama4TextConfig", "Llama4ForCausalLM",
         dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
              num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
              num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
              max_position_embeddings=10485760, rope_theta=5e5, tie_word_embeddings=False),
         _tiny_decoder(num_local_experts=4, num_experts_per_tok=1, head_dim=16, intermediate_size_mlp=128,
                       attention_chunk_size=8, interleave_moe_layer_step=1)),
    Arch("phimoe", "Phi-3.5-MoE", "MoE", "PhimoeConfig", "PhimoeForCausalLM",
         dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_attention_heads=32,
              num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=131072,
              attention_bias=True, lm_head_bias=True, tie_word_embeddings=False),
         # its router picks the experts under torch.no_grad() (autotp/tracing/regions.py)
         _tiny_decoder(num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True),
         extra_tp={**{f"self_attn.{k}": v for k, v in _QKVO.items()}, "self_attn.o_proj": "rowwise"}),
    Arch("gpt_oss", "gpt-oss-20b", "MoE", "GptOssConfig", "GptOssForCausalLM",
         dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
              num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
              sliding_window=128, max_position_embeddings=131072, rope_theta=150000.0,
              tie_word_embeddings=False),
         _tiny_decoder(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
         attn="eager", extra_tp={"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                                 "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"},
         # experts (E, in, out): gate|up (interleaved pairs) split along out, down along in
         hand_pin={"mlp.experts.gate_up_proj": "S(2)", "mlp.experts.gate_up_proj_bias": "S(1)",
                   "mlp.experts.down_proj": "S(1)"}),
    Arch("bert", "BERT-large", "encoder", "BertConfig", "BertModel",
         dict(vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
              max_position_embeddings=512),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
              num_attention_heads=TINY["heads"]),
         seq=512, model_kwargs={"add_pooling_layer": False}, hand_tp=_BERT_STYLE),
    Arch("roberta", "RoBERTa-large", "encoder", "RobertaConfig", "RobertaModel",
         dict(vocab_size=50265, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
              max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1),
         dict(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
              num_attention_heads=TINY["heads"], type_vocab_size=1, pad_token_id=1),
         seq=512, model_kwargs={"add_pooling_layer": False}, hand_tp=_BERT_STYLE),
    Arch("distilbert", "DistilBERT-base", "encoder", "DistilBertConfig", "DistilBertModel",
         dict(vocab_size=30522, dim=768, hidden_dim=3072, n_heads=12, max_position_embeddings=512),
         dict(vocab_size=TINY["vocab"], dim=TINY["hidden"], hidden_dim=TINY["ffn"], n_heads=TINY["heads"]),
         layers=_layers("n_layers"), seq=512,
         hand_tp={"attention.q_lin": "colwise", "attention.k_lin": "colwise", "attention.v_lin": "colwise",
                  "attention.out_lin": "rowwise", "ffn.lin1": "colwise", "ffn.lin2": "rowwise"}),
    Arch("t5", "T5-large", "enc-dec", "T5Config", "T5ForConditionalGeneration",
         dict(vocab_size=32128, d_model=1024, d_ff=4096, d_kv=64, num_heads=16),
         dict(vocab_size=TINY["vocab"], d_model=TINY["hidden"], d_ff=TINY["ffn"], d_kv=16, num_heads=TINY["heads"]),
         layers=_layers("num_layers", "num_decoder_layers"), seq=512,
         hand_tp={"SelfAttention.q": "colwise", "SelfAttention.k": "colwise", "SelfAttention.v": "colwise",
                  "SelfAttention.o": "rowwise", "EncDecAttention.q": "colwise", "EncDecAttention.k": "colwise",
                  "EncDecAttention.v": "colwise", "EncDecAttention.o": "rowwise",
                  "DenseReluDense.wi": "colwise", "DenseReluDense.wo": "rowwise"}),
    Arch("bart", "BART-large", "enc-dec", "BartConfig", "BartForConditionalGeneration",
         dict(vocab_size=50265, d_model=1024, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
              encoder_attention_heads=16, decoder_attention_heads=16, max_position_embeddings=1024),
         dict(vocab_size=TINY["vocab"], d_model=TINY["hidden"], encoder_ffn_dim=TINY["ffn"],
              decoder_ffn_dim=TINY["ffn"], encoder_attention_heads=TINY["heads"],
              decoder_attention_heads=TINY["heads"], forced_eos_token_id=None),
         layers=_layers("encoder_layers", "decoder_layers"), seq=512,
         hand_tp={**{f"self_attn.{k}": v for k, v in _QKVO.items()}, "self_attn.out_proj": "rowwise",
                  **{f"encoder_attn.{k}": v for k, v in _QKVO.items()}, "encoder_attn.out_proj": "rowwise",
                  "fc1": "colwise", "fc2": "rowwise"}),
)


# ------------------------------------------------------------------------------------ building

def missing(arch: Arch) -> Optional[str]:
    """The transformers class this installation lacks, if any."""
    import transformers

    return next((c for c in (arch.config, arch.model) if not hasattr(transformers, c)), None)


def build(arch: Arch, n_layer: int, tiny: bool, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """``(model, example kwargs)``: on meta at the checkpoint's widths, or seeded on CPU at tiny ones."""
    import transformers

    kwargs = (arch.tiny if tiny else arch.real) | arch.layers(n_layer)
    config = getattr(transformers, arch.config)(use_cache=False, attn_implementation=arch.attn, **kwargs)
    batch, seq = (TINY["batch"], TINY["seq"]) if tiny else (1, arch.seq)
    device = torch.device("cpu" if tiny else "meta")
    if tiny:
        torch.manual_seed(seed)
    with device:
        model = getattr(transformers, arch.model)(config, **arch.model_kwargs).to(DTYPE)
        gen = None if device.type == "meta" else torch.Generator().manual_seed(seed + 1)
        names = ("input_ids", "decoder_input_ids") if arch.kind == "enc-dec" else ("input_ids",)
        inputs = {name: torch.randint(0, config.vocab_size, (batch, seq), generator=gen) for name in names}
    if tiny:
        model.eval()  # dropout off: the check compares values
    return model, inputs


def hidden_size(model: torch.nn.Module) -> int:
    config = model.config
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__}: no hidden size found")


# ------------------------------------------------------------------------------ Megatron layout

def tp_layout(arch: Arch) -> dict[str, str]:
    """``{module pattern: style}``: transformers' own ``base_model_tp_plan``, else the hand table."""
    import transformers

    layout = dict(getattr(getattr(transformers, arch.config), "base_model_tp_plan", None) or {})
    if not layout:
        layout = dict(arch.hand_tp or {})
    return layout | (arch.extra_tp or {})


_STYLES = {"colwise": "colwise", "colwise_gather_output": "colwise", "packed_colwise": "colwise",
           "rowwise": "rowwise", "rowwise_split_input": "rowwise"}  # the others are not pinned


def _pattern(text: str) -> re.Pattern:
    """A tp-plan key (``layers.*.self_attn.q_proj``) matching a module or parameter name by suffix."""
    return re.compile(r"(^|\.)" + r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in text.split(".")) + "$")


def megatron_pin(arch: Arch, model: torch.nn.Module) -> dict[str, str]:
    """``{parameter fqn: placement}`` of the Megatron layout on a 1-axis mesh."""
    from transformers.pytorch_utils import Conv1D

    # "packed_colwise" (a fused gate|up) splits each of its two parts: the blocked split S(d)[2]
    rules = [(_pattern(k), _STYLES[v], "[2]" if v == "packed_colwise" else "")
             for k, v in tp_layout(arch).items() if v in _STYLES]
    pin: dict[str, str] = {}
    for fqn, param in model.named_parameters():  # canonical names: a tied weight once
        owner, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(owner)
        for rx, style, blocks in rules:
            if isinstance(module, (torch.nn.Linear, Conv1D)) and rx.search(owner):
                colwise = style == "colwise"
                if leaf == "weight":
                    out_dim = 1 if isinstance(module, Conv1D) else 0  # Conv1D stores (in, out)
                    pin[fqn] = f"S({out_dim if colwise else 1 - out_dim})" + (blocks if colwise else "")
                elif leaf == "bias" and colwise:
                    pin[fqn] = "S(0)" + blocks
                break
            if rx.search(fqn) and param.dim() >= 2:  # a stacked experts weight (E, out, in)
                pin[fqn] = f"S({param.dim() - 2})" + blocks if style == "colwise" else f"S({param.dim() - 1})"
                break
    for pattern, placement in (arch.hand_pin or {}).items():
        rx = _pattern(pattern)
        pin.update({fqn: placement for fqn, _ in model.named_parameters() if rx.search(fqn)})
    return pin


# ---------------------------------------------------------------------------------- real widths

_LAYER_INDEX = re.compile(r"\.\d+\.")


def block_weights(plan, graph) -> dict[str, str]:
    """``{fqn: placement}`` of the weight matrices (2 or more dims) that belong to a numbered layer:
    the weights Megatron's layout may split (it keeps norm weights and the biases of rowwise layers
    whole)."""
    ndim = {p.fqn: p.info.ndim for p in graph.parameters}
    return {fqn: str(p) for fqn, p in plan.parameter_placements.items()
            if _LAYER_INDEX.search(fqn) and ndim[fqn] >= 2}


def activation_collectives(plan, graph, threshold_bytes: float) -> int:
    """Forward collectives of at least ``threshold_bytes`` on activations (not on a weight: gathering
    a stored shard of a weight is the FSDP-like trade the planner may make, not an activation move),
    by the bytes the plan prices them at: an all_to_all's are one rank's buffer (each rank receives
    ``1/n`` of what an all_gather of the same tensor brings it), so an all-to-all between splits of
    an activation counts where its rank's piece reaches the threshold."""
    weights = {p.node for p in graph.parameters}
    return sum(1 for c in plan.collectives()
               if c.phase == "forward" and c.bytes >= threshold_bytes and c.at not in weights)


def _per_block(four: float, two: float) -> str:
    value = (four - two) / 2
    return f"{value:g}"


def short_error(err: BaseException, width: int = 90) -> str:
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= width else text[:width - 3] + "..."


def plan_real(arch: Arch, row: dict) -> None:
    """Fill ``row`` with the real-width columns: 2- and 4-layer plans, and the pinned 4-layer plan."""
    import autotp
    from autotp.planning.planner import plan_graph

    plans, graphs, models = {}, {}, {}
    for n in (2, 4):
        t0 = time.perf_counter()
        models[n], inputs = build(arch, n, tiny=False)
        graphs[n] = autotp.capture(models[n], inputs)
        plans[n] = plan_graph(graphs[n], MESH, HARDWARE, "train", capture_s=time.perf_counter() - t0)
        _progress(f"  {n} layers planned ({time.perf_counter() - t0:.1f} s)")
    row["status"] = "planned"
    blocks = {n: block_weights(plans[n], graphs[n]) for n in (2, 4)}
    # the block matrices Megatron's layout splits (it keeps a router whole): autotp must split each
    megatron = {n: {f for f in blocks[n] if megatron_pin(arch, models[n]).get(f, "R") != "R"} for n in (2, 4)}
    split = {n: {f for f, p in blocks[n].items() if p != "R"} for n in (2, 4)}
    s4, s2, t4, t2 = len(split[4]), len(split[2]), len(blocks[4]), len(blocks[2])
    row["block"] = f"{_per_block(s4, s2)}/{_per_block(t4, t2)}"
    if _per_block(len(megatron[4]), len(megatron[2])) != _per_block(t4, t2):
        row["block"] += f" (Megatron {_per_block(len(megatron[4]), len(megatron[2]))})"
    row["megatron_weights"] = megatron[4] <= split[4] and t4 > t2
    batch, seq = next(iter(inputs.values())).shape
    threshold = 0.5 * batch * seq * hidden_size(models[4]) * (torch.finfo(DTYPE).bits // 8)
    a4 = activation_collectives(plans[4], graphs[4], threshold)
    a2 = activation_collectives(plans[2], graphs[2], threshold)
    row["fwd_coll"] = _per_block(a4, a2)
    limit = MAX_ACTIVATION_COLLECTIVES.get(arch.kind, DEFAULT_MAX_ACTIVATION_COLLECTIVES)
    row["few_collectives"] = (a4 - a2) / 2 <= limit
    pin = megatron_pin(arch, models[4])
    try:
        pinned = plan_graph(graphs[4], MESH, HARDWARE, "train", pin=pin)
    except Exception as err:  # noqa: BLE001 - shown in the cell
        row["ratio"] = "pin: " + short_error(err, 60)
        return
    ratio = plans[4].predicted_time().total_s / pinned.predicted_time().total_s
    row["ratio"] = f"{ratio:.3f} ({len(pin)} pinned)"
    row["ratio_ok"] = ratio <= 1.0 + 1e-9


# ---------------------------------------------------------------------------------- exactness

def _step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and every parameter's full gradient of ``(output - target).pow(2).mean()``, the
    target a fixed random tensor (a model ending in a LayerNorm has next to no gradient of
    ``output.pow(2).mean()``, whose value the norm fixes)."""
    out = output_tensor(model(**inputs))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() - target).pow(2).mean().backward()
    return out.detach(), full_gradients(model)


def full_gradients(model: torch.nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """Every parameter's gradient whole, by name (a parallel module's gathered by autotp's placements:
    DTensor sizes a split of whole heads, or unequal blocks, otherwise)."""
    import autotp
    from autotp.runtime.shards import placements_of

    return {name: autotp.checkpoint.full_tensor(p.grad, placements_of(p)) if hasattr(p.grad, "placements")
            else p.grad for name, p in model.named_parameters()}


def _rank(rank: int, world: int, graph, plan, model, inputs) -> tuple[torch.Tensor, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return _step(build_parallel_module(graph, plan, mesh, model), inputs)


def compare(got: dict[str, Optional[torch.Tensor]], ref: dict[str, Optional[torch.Tensor]],
            scale: float) -> tuple[float, list[str]]:
    """(largest |got - ref| / scale, the names not within rtol 1e-4 and atol 1e-5 x scale)."""
    worst, wrong = 0.0, []
    for name, r in ref.items():
        g = got.get(name)
        if r is None or g is None:
            if (r is None) != (g is None):
                wrong.append(f"{name}: gradient {'missing' if g is None else 'unexpected'}")
            continue
        if g.shape != r.shape:
            wrong.append(f"{name}: shape {list(g.shape)}, expected {list(r.shape)}")
            continue
        diff = (g - r).abs().max().item() / scale
        worst = max(worst, diff)
        if not torch.allclose(g, r, rtol=1e-4, atol=1e-5 * scale):
            wrong.append(f"{name} (max diff {diff:.1e} of the largest)")
    return worst, wrong


def check_exact(arch: Arch, world: int = 2) -> str:
    """The tiny model on ``world`` threaded ranks under a budget that forces sharding, against one process."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, inputs = build(arch, 2, tiny=True)
    graph = autotp.capture(model, inputs)  # in this thread: torch.export must not trace beside the ranks
    try:
        plan_graph(graph, (world,), "cpu-gloo", "train", 1.0, recompute=False)
        budget = None  # fits in one byte: nothing to force
    except autotp.MemoryBudgetError as err:
        budget = int(err.minimum_bytes * TINY_BUDGET_SCALE) + 1
    plan = plan_graph(graph, (world,), "cpu-gloo", "train", budget, recompute=False)
    sharded = sum(p != "R" for p in plan.parameter_placements.values())
    what = f"{sharded}/{len(plan.parameter_placements)} sharded"
    ref_out, ref_grads = _step(copy.deepcopy(model), inputs)
    # tolerances scale with the largest output and the largest gradient (a gradient that is zero in
    # exact arithmetic, such as an attention key's bias, is rounding noise on both sides)
    out_scale = max(ref_out.abs().max().item(), 1e-30)
    grad_scale = max([g.abs().max().item() for g in ref_grads.values() if g is not None] + [1e-30])
    worst, wrong = 0.0, []
    for out, grads in run_threads(_rank, world, graph, plan, model, inputs):
        for got, ref, scale in (({"output": out}, {"output": ref_out}, out_scale), (grads, ref_grads, grad_scale)):
            diff, bad = compare(got, ref, scale)
            worst, wrong = max(worst, diff), wrong + bad
    if wrong:
        return f"WRONG {len(wrong)}: {wrong[0]}; {what}"
    return f"exact (max diff {worst:.1e} of the largest); {what}"


# ---------------------------------------------------------------------------------------- table

COLUMNS = (("arch", "architecture"), ("kind", "kind"), ("status", "status"), ("block", "block W sharded"),
           ("fwd_coll", "fwd act coll/block"), ("ratio", "t autotp/Megatron"), ("exact", "2 ranks"))


def run_arch(arch: Arch, exact: bool) -> dict:
    row = {"arch": f"{arch.name} ({arch.checkpoint})", "kind": arch.kind}
    lacking = missing(arch)
    if lacking:
        row["status"] = f"skipped: transformers has no {lacking}"
        return row
    t0 = time.perf_counter()
    try:
        plan_real(arch, row)
    except Exception as err:  # noqa: BLE001 - one row's failure is that row's cell
        row["status"] = short_error(err)
    if exact:
        try:
            row["exact"] = check_exact(arch)
        except Exception as err:  # noqa: BLE001
            row["exact"] = short_error(err)
        row["is_exact"] = row["exact"].startswith("exact")
    _progress(f"  {time.perf_counter() - t0:.1f} s")
    return row


def table(cells: list[list[str]], markdown: bool) -> str:
    """Rows of cells (the first the header) as a markdown table or aligned plain text."""
    if markdown:
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        lines.insert(1, "|" + "---|" * len(cells[0]))
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(rows: list[dict], markdown: bool, exact: bool) -> str:
    cols = [c for c in COLUMNS if exact or c[0] != "exact"]
    return table([[h for _, h in cols]] + [[str(r.get(k, "-")) for k, _ in cols] for r in rows], markdown)


def summary(rows: list[dict], exact: bool) -> str:
    megatron = sum(bool(r.get("megatron_weights") and r.get("few_collectives")) for r in rows)
    ratio = sum(bool(r.get("ratio_ok")) for r in rows)
    text = (f"{len(rows)} architectures: {megatron} Megatron-quality (every block weight matrix Megatron splits sharded, "
            f"<= {DEFAULT_MAX_ACTIVATION_COLLECTIVES} forward activation collectives per block, "
            f"<= {MAX_ACTIVATION_COLLECTIVES['enc-dec']} per encoder + decoder block), "
            f"{ratio} with autotp/Megatron <= 1.0")
    if exact:
        text += f", {sum(bool(r.get('is_exact')) for r in rows)} exact on 2 ranks"
    return text


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=None, help="comma-separated subset of: " + ",".join(a.name for a in ARCHS))
    parser.add_argument("--no-exact", action="store_true", help="skip the 2-rank exactness check")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    by_name = {a.name: a for a in ARCHS}
    names = args.archs.split(",") if args.archs else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(by_name)}")
    exact = not args.no_exact
    t0 = time.perf_counter()
    rows = []
    for name in names:
        _progress(f"{name} ...")
        rows.append(run_arch(by_name[name], exact))
    seqs = ", ".join(f"{a.name} {a.seq}" + (" per input" if a.kind == "enc-dec" else "")
                     for a in map(by_name.get, names) if a.seq != 2048)
    print(f"mesh {MESH} of {HARDWARE}, train, {str(DTYPE).removeprefix('torch.')}; batch 1 x 2048 tokens"
          + (f" ({seqs})" if seqs else "")
          + ("; exactness at tiny widths on 2 threaded cpu-gloo ranks" if exact else ""))
    print(render(rows, args.markdown, exact))
    print(summary(rows, exact))
    print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
