"""One ``generate`` call's choices, and the next token from the logits as Hugging Face's ``generate`` picks it.

The choices are the model's ``generation_config`` with the call's keyword arguments over it, as
Hugging Face merges them. The scores are processed by ``transformers``' own logits processors, built
by the model's own ``_get_logits_processor`` from that config: what a checkpoint's config asks for
(BART's forced end token, a repetition penalty, suppressed tokens, a minimum length) applies as it
does in the model's ``generate``, and sampling's temperature, top-k and top-p warpers come in the
order it applies them. What ``generate`` does that this does not (beam search, assisted decoding,
classifier-free guidance, stop strings) is refused by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["GenerateOptions"]

# generate() arguments autotp takes, and the values of Hugging Face's others that ask for nothing more
_PLAIN = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "assistant_model": None,
          "prompt_lookup_num_tokens": None, "penalty_alpha": None, "use_cache": True, "streamer": None,
          "return_dict_in_generate": False, "output_scores": False, "output_logits": False}

# the choices that shape the scores only (transformers' logits processors and warpers)
_SCORES = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
           "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
           "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "forced_bos_token_id",
           "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
           "begin_suppress_tokens", "sequence_bias", "renormalize_logits"}
# guidance_scale is taken to be refused by name unless it asks for nothing (None, 1.0), as the config's is
_TAKEN = {"max_new_tokens", "do_sample", "eos_token_id", "pad_token_id", "decoder_start_token_id",
          "guidance_scale"} | _SCORES
_LISTED = _TAKEN - {"guidance_scale"} | {"input_ids", "attention_mask", "max_cache_len", "generator", "compile"}


@dataclass(frozen=True)
class GenerateOptions:
    """One ``generate`` call's choices (module docstring); ``config`` is the merged ``GenerationConfig``."""

    max_new_tokens: int
    do_sample: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: Optional[int]
    decoder_start_token_id: Optional[int]
    config: Any

    @classmethod
    def of(cls, config: Any, prompt_len: int, **given: Any) -> "GenerateOptions":
        """``config`` (the model's ``generation_config``, or None) with the call's choices ``given``."""
        from transformers import GenerationConfig

        for name, plain in _PLAIN.items():
            if name in given and given.pop(name) != plain:
                raise NotImplementedError(f"generate({name}=...): autotp's generate runs greedy decoding or sampling, "
                                          f"one sequence per prompt; {name} other than {plain!r} is not supported "
                                          f"(docs/serving.md#limits)")
        unknown = sorted(set(given) - _TAKEN)
        if unknown:
            raise TypeError(f"generate() got {', '.join(unknown)}, which autotp's generate does not take; it takes "
                            f"{', '.join(sorted(_LISTED))}")
        merged = copy.deepcopy(config) if config is not None else GenerationConfig()
        merged.update(**given)
        if merged.guidance_scale not in (None, 1.0):
            where = "given" if "guidance_scale" in given else "the model's generation_config asks for it"
            raise NotImplementedError(f"guidance_scale={merged.guidance_scale} ({where}): classifier-free guidance "
                                      f"is not supported by autotp's generate (docs/serving.md#limits); leave it at "
                                      f"None")
        new = given.get("max_new_tokens")
        if new is None:
            new = merged.max_new_tokens if merged.max_new_tokens is not None else merged.max_length - prompt_len
        if new < 1:
            raise ValueError(f"max_new_tokens={new}: expected at least 1 token to generate")
        merged.max_new_tokens = int(new)
        eos = merged.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        pad = merged.pad_token_id
        return cls(int(new), bool(merged.do_sample), eos, pad if pad is not None else (eos[0] if eos else None),
                   merged.decoder_start_token_id, merged)

    def inferred_mask(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The attention mask Hugging Face's ``generate`` makes for a causal LM's prompts given without
        one, by ``model``'s own code (the meta copy: it reads only its config): ``input_ids !=
        pad_token_id`` where the pad token occurs in the prompts and is not an end token, else ones.
        Where it cannot tell padding from tokens (no pad token, or the pad token an end token) and the
        batch holds more than one prompt, it logs the warning Hugging Face's ``generate`` logs."""
        config = copy.deepcopy(self.config)
        model._prepare_special_tokens(config, False, input_ids.device, input_ids.shape[0])
        return model._prepare_attention_mask_for_generation(input_ids, config, {})

    def processors(self, model: nn.Module, tokens_len: int, encoder_ids: Optional[torch.Tensor],
                   attention_mask: Optional[torch.Tensor], device: Any) -> Any:
        """``transformers``' logits processors for this call, built by ``model`` (the meta copy of the
        model: it reads only its config) for sequences that start at ``tokens_len`` tokens (the prompt,
        or the decoder's start for an encoder-decoder), as its own ``generate`` builds them."""
        config = copy.deepcopy(self.config)
        config.max_length = tokens_len + self.max_new_tokens
        model._prepare_special_tokens(config, attention_mask is not None, device)
        mask_name = "decoder_attention_mask" if getattr(model.config, "is_encoder_decoder", False) else "attention_mask"
        return model._get_logits_processor(config, input_ids_seq_length=tokens_len, encoder_input_ids=encoder_ids,
                                           device=device, model_kwargs={mask_name: attention_mask})

    def choose(self, processors: Any, tokens: torch.Tensor, logits: torch.Tensor,
               generator: Optional[torch.Generator]) -> torch.Tensor:
        """The next token of each sequence from the last position's ``logits`` (batch, vocab), given the
        ``tokens`` so far, as Hugging Face's ``generate`` picks it."""
        scores = processors(tokens, logits.float())
        if not self.do_sample:
            return scores.argmax(-1)
        return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
