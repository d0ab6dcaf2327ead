"""Copies of a Hugging Face model whose KV cache is a set of buffers, so that a trace sees the cache.

``generate`` traces a model's forward with a static cache (``transformers``' ``StaticCache``): its
key and value tensors are registered as non-persistent buffers of a meta copy of the model, and the
copy's forward reads and writes those buffers in place. Traced, that is a graph like any other,
whose caches are buffers the planner may store split (by the kv heads its attention reads).

- :func:`with_static_cache`: a causal LM, ``(input_ids, cache_position, attention_mask,
  position_ids) -> logits`` over one cache of ``max_cache_len`` positions (the last position's
  logits only, where the model's forward takes ``logits_to_keep``, as Hugging Face's generate asks);
  or, ``from_start``, the prompt's ``(input_ids, attention_mask, position_ids) -> logits``, which fills
  the cache from position 0: its cache positions an ``arange`` made in the graph, so the trace's mask
  pass proves the prompt's mask causal (or windowed) and padded (:mod:`autotp.tracing.masks`), where
  positions given as an input would leave it a tensor.
  Sliding-window layers keep every position too, masked to their window by the model's own mask.
- :func:`with_encoder_decoder_cache`: an encoder-decoder (BART, T5, ...): three copies over the same
  buffers, the encoder's ``(input_ids, attention_mask) -> hidden states``, and two of the decoder's
  ``(decoder_input_ids, cache_position, decoder_attention_mask, encoder_hidden_states,
  encoder_attention_mask) -> logits``: the first step's, which computes the cross-attention keys
  and values from the encoder's states and stores them, and every later step's, which reads them.

Every cache buffer's name starts with :data:`CACHE_PREFIX`. Nothing here plans or runs a rank.
"""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["CACHE_PREFIX", "EncoderDecoderCopies", "check_key_value_cache", "with_static_cache",
           "with_encoder_decoder_cache"]

CACHE_PREFIX = "autotp_kv_"  # the cache buffers' names on the parallel module: autotp_kv_{layer}_{keys,values,...}


def _register(model: nn.Module, cache: Any, prefix: str, device: Any) -> list[tuple[Any, str, str]]:
    """Each tensor of each layer of ``cache`` as a non-persistent buffer ``{prefix}{layer}_{name}`` of
    ``model``; the positions the layers make say ``device``. Returns (layer, attribute, buffer name)."""
    slots = []
    for i, layer in enumerate(cache.layers):
        if isinstance(getattr(layer, "device", None), torch.device):
            layer.device = torch.device(device)
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                model.register_buffer(f"{prefix}{i}_{name}", value, persistent=False)
                slots.append((layer, name, f"{prefix}{i}_{name}"))
    return slots


def check_key_value_cache(skeleton: nn.Module) -> None:
    """Refuse (``NotImplementedError``) a causal LM whose cache holds more than attention keys and
    values: transformers' cache for its config has a layer of a convolution or recurrent state (a
    state-space model, linear attention, a short convolution: Mamba2, Jamba, LFM2, Qwen3-Next,
    Falcon-H1). :func:`with_static_cache` makes only key and value buffers, which the planner splits
    by heads; no graph of it could carry such a state from one token to the next. Reads the config
    only: nothing is traced, planned or communicated."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticCache

    config = _text_config(skeleton)
    layer_types = list(getattr(config, "layer_types", None) or [])
    cache = StaticCache(config=config, max_cache_len=1)
    stateful = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if stateful:
        named = ", ".join(f"{i} ({layer_types[i]})" if i < len(layer_types) else str(i) for i in stateful[:4])
        more = f" and {len(stateful) - 4} more" if len(stateful) > 4 else ""
        raise NotImplementedError(
            f"generate() of {type(skeleton).__name__}: its layers {named}{more} keep a convolution or recurrent "
            f"(state-space, linear-attention) state in transformers' cache, beside attention keys and values; "
            f"autotp's generate holds attention keys and values only (a static cache split by heads), so it does "
            f"not generate with this model (docs/serving.md#limits). The parallel module's forward is unaffected")


def _text_config(model: nn.Module) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _whole_length(cache: Any, max_cache_len: int) -> None:
    """Each sliding-window (or chunked) layer of ``cache`` made a plain static layer of ``max_cache_len``
    positions: the model's own mask keeps each query to its window (or chunk) of the cache's positions,
    as in the model's own generate. Transformers' sliding layer keeps only the window, rolled, and
    counts its tokens in a Python int: a graph traced once could not roll it, nor read the count."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache.layers = [StaticLayer(max_cache_len=max_cache_len) if isinstance(layer, StaticSlidingWindowLayer) else layer
                    for layer in cache.layers]


def _cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its cache by (``cache`` in recent transformers)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def with_static_cache(skeleton: nn.Module, batch: int, max_cache_len: int, device: Any,
                      from_start: bool = False) -> nn.Module:
    """A copy of the (meta) causal LM whose forward is ``(input_ids, cache_position, attention_mask,
    position_ids) -> logits`` over a static cache whose tensors are buffers of the copy, made on meta;
    the cache's own device says ``device``, the one the graph is traced for and runs on. ``from_start``:
    ``(input_ids, attention_mask, position_ids) -> logits``, the cache positions ``0 .. S - 1`` of the
    ``S`` ids (a prompt's, filling the cache from its start)."""
    from transformers.cache_utils import StaticCache

    model = copy.deepcopy(skeleton)
    config = _text_config(model)
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    _whole_length(cache, max_cache_len)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    key_dim = value_dim = head_dim
    if getattr(config, "kv_lora_rank", None):
        # multi-head latent attention (DeepSeek-V3) caches its latents, as one head: the compressed keys
        # and values (kv_lora_rank features) where keys go, the rotary part of the keys where values go
        heads, key_dim, value_dim = 1, config.kv_lora_rank, config.qk_rope_head_dim
    keys = torch.zeros((batch, heads, 0, key_dim), dtype=dtype, device="meta")
    values = torch.zeros((batch, heads, 0, value_dim), dtype=dtype, device="meta")
    for layer in cache.layers:
        if layer.supports_early_init and not layer.is_initialized:
            layer.lazy_initialization(keys, values)
    slots = _register(model, cache, CACHE_PREFIX, device)
    forward = type(model).forward
    cache_arg = _cache_argument(model)
    # the logits of the last position only, as Hugging Face's generate asks (the prompt's others are unread)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}

    def cached_forward(self: nn.Module, input_ids: torch.Tensor, cache_position: torch.Tensor,
                       attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # the cache reads the module's buffers as they are now: while torch.export traces, those are
        # its stand-ins, so the writes the trace records are writes into the buffers
        for layer, name, buffer in slots:
            setattr(layer, name, getattr(self, buffer))
        for layer in cache.layers:
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.copy_(cache_position[0])
        out = forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      cache_position=cache_position, use_cache=True, **{cache_arg: cache}, **last)
        return out.logits

    def prompt_forward(self: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # in the graph: proven from 0
        return cached_forward(self, input_ids, positions, attention_mask, position_ids)

    model.forward = types.MethodType(prompt_forward if from_start else cached_forward, model)
    return model


@dataclass(frozen=True)
class EncoderDecoderCopies:
    """What :func:`with_encoder_decoder_cache` makes: the three copies, and the encoder's states' last
    dim and dtype (what the decoder's steps are given, padded to the cache's length)."""

    encoder: nn.Module
    first_step: nn.Module
    later_step: nn.Module
    hidden_size: int
    dtype: torch.dtype


def with_encoder_decoder_cache(skeleton: nn.Module, batch: int, max_cache_len: int,
                               device: Any) -> EncoderDecoderCopies:
    """The encoder's copy, the decoder's first step's and a later step's (module docstring), made on
    meta. The decoder's self-attention cache holds ``max_cache_len`` decoded positions; its
    cross-attention cache ``max_cache_len`` encoder positions (the encoder's states padded to that
    length, the padding masked by ``encoder_attention_mask``). The caches' shapes are the ones the
    model's own attention makes: the copy runs one step on meta, which sizes them."""
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    encoder = copy.deepcopy(skeleton)

    def encode(self: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return self.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    encoder.forward = types.MethodType(encode, encoder)

    decoder = copy.deepcopy(skeleton)
    config = decoder.config
    cache = EncoderDecoderCache(StaticCache(config=config, max_cache_len=max_cache_len),
                                StaticCache(config=config, max_cache_len=max_cache_len))
    forward = type(decoder).forward
    cache_arg = _cache_argument(decoder)
    takes_position = "cache_position" in inspect.signature(forward).parameters
    layers = len(cache.self_attention_cache.layers)
    # one step on meta: each layer's cache gets the shape its attention writes (no masks: a mask's
    # values, which meta tensors do not have, decide only whether the model may skip it)
    with torch.no_grad():
        states = encode(decoder, torch.zeros(batch, 2, dtype=torch.int64, device="meta"), None)
        forward(decoder, decoder_input_ids=torch.zeros(batch, 1, dtype=torch.int64, device="meta"),
                encoder_outputs=(torch.zeros(batch, max_cache_len, states.shape[-1], dtype=states.dtype,
                                             device="meta"),), use_cache=True, **{cache_arg: cache})
    if not all(getattr(layer, "is_initialized", False) for layer in cache.cross_attention_cache.layers):
        raise NotImplementedError(f"{type(skeleton).__name__}: its decoder did not fill a cross-attention cache of "
                                  f"transformers' EncoderDecoderCache, which autotp's generate splits; this model "
                                  f"cannot generate with autotp (docs/serving.md#limits)")
    slots = (_register(decoder, cache.self_attention_cache, f"{CACHE_PREFIX}self_", device)
             + _register(decoder, cache.cross_attention_cache, f"{CACHE_PREFIX}cross_", device))

    def step(updated: bool) -> nn.Module:
        model = copy.copy(decoder)  # the same parameters and buffers; a forward of its own

        def decode(self: nn.Module, decoder_input_ids: torch.Tensor, cache_position: torch.Tensor,
                   decoder_attention_mask: torch.Tensor, encoder_hidden_states: torch.Tensor,
                   encoder_attention_mask: torch.Tensor) -> torch.Tensor:
            for layer, name, buffer in slots:  # as in with_static_cache: the trace's stand-ins
                setattr(layer, name, getattr(self, buffer))
            for layer in cache.self_attention_cache.layers:
                layer.cumulative_length.copy_(cache_position[0])
            for layer in cache.cross_attention_cache.layers:  # the first step writes from position 0
                layer.cumulative_length.zero_()
            # the first step computes the cross-attention keys and values; a later one reads them
            cache.is_updated = {i: updated for i in range(layers)}
            extra = {"cache_position": cache_position} if takes_position else {}
            out = forward(self, decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                          encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                          use_cache=True, **{cache_arg: cache}, **extra)
            return out.logits

        model.forward = types.MethodType(decode, model)
        return model

    return EncoderDecoderCopies(encoder, step(False), step(True), int(states.shape[-1]), states.dtype)
