"""Generation with a KV cache: ``ParallelModule.generate`` for Hugging Face causal language models.

The parallel module's own graph is the model's forward without a cache. To generate, a copy of the
model on the meta device gets a static cache (``transformers``' ``StaticCache``) of
``max_cache_len`` positions for the prompts' batch, its key and value tensors registered as
non-persistent buffers of the copy, and a forward that runs the tokens given at the cache positions
given. Traced, that is a graph like any other whose caches are buffers written in place, and the
planner stores each cache by the kv heads its attention reads (:mod:`autotp.planning.strategies`).
Two graphs are traced and planned, on the first call for a batch size and cache length: the
prompt's (any length of 2 or more) and one token's (``torch.export`` specializes a length of 1),
both with every weight kept where it is stored, the second with the caches where the first put
them. Each rank then holds its piece of each cache, zeroed, as a buffer of the parallel module.

The loop is Hugging Face's: greedy, or sampling through ``transformers``' own temperature, top-k
and top-p warpers from a generator seeded alike on every rank (the first rank's seed), so every rank
picks the same token; prompts of different lengths come left-padded with their ``attention_mask``;
a sequence that reaches an end token is padded after it, and the loop stops when every sequence
has. What it does not do (beam search, assisted or speculative decoding) is refused by name.
"""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
from torch import nn

from autotp.mesh import MeshSpec
from autotp.runtime.agreement import agreed_plan, dropout_seed, from_first_rank
from autotp.runtime.state import buffer_piece, build_graph, put
from autotp.tracing.export import capture
from autotp.tracing.graph import BUFFER

__all__ = ["CacheGraphs", "GenerateOptions", "generate"]

CACHE_PREFIX = "autotp_kv_"  # the cache buffers' names on the parallel module: autotp_kv_{layer}_{keys,values,...}

# generate() arguments autotp takes, and the values of Hugging Face's others that ask for nothing more
_PLAIN = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "assistant_model": None,
          "prompt_lookup_num_tokens": None, "penalty_alpha": None, "use_cache": True, "streamer": None,
          "return_dict_in_generate": False, "output_scores": False, "output_logits": False}


@dataclass(frozen=True)
class GenerateOptions:
    """One ``generate`` call's choices, with the model's ``generation_config`` filling what is not given."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    eos_token_ids: tuple[int, ...]
    pad_token_id: Optional[int]

    @classmethod
    def of(cls, config: Any, prompt_len: int, **given: Any) -> "GenerateOptions":
        for name, plain in _PLAIN.items():
            if name in given and given.pop(name) != plain:
                raise NotImplementedError(f"generate({name}=...): autotp's generate runs greedy decoding or sampling "
                                          f"with temperature, top_k and top_p, one sequence per prompt; {name} "
                                          f"other than {plain!r} is not supported (docs/limits.md)")
        known = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"generate() got {', '.join(unknown)}, which autotp's generate does not take; it takes "
                            f"{', '.join(sorted(known | {'input_ids', 'attention_mask', 'max_cache_len', 'generator'}))}")

        def pick(name: str, default: Any) -> Any:  # given, else the generation config's, else the default
            for value in (given.get(name), getattr(config, name, None)):
                if value is not None:
                    return value
            return default

        new = given.get("max_new_tokens")
        if new is None:
            new = config.max_new_tokens if getattr(config, "max_new_tokens", None) is not None else (
                getattr(config, "max_length", 20) - prompt_len)
        if new < 1:
            raise ValueError(f"max_new_tokens={new}: expected at least 1 token to generate")
        eos = pick("eos_token_id", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        pad = pick("pad_token_id", None)
        do_sample = bool(pick("do_sample", False))
        top_k = pick("top_k", None)
        top_p = pick("top_p", None)
        return cls(int(new), do_sample, float(pick("temperature", 1.0)), int(top_k) if top_k else None,
                   float(top_p) if top_p is not None and top_p < 1.0 else None, eos,
                   pad if pad is not None else (eos[0] if eos else None))

    def warpers(self) -> list:
        """``transformers``' own logit warpers for these choices, in the order its ``generate`` applies them."""
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)

        out = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None:
            out.append(TopPLogitsWarper(self.top_p))
        return out

    def choose(self, tokens: torch.Tensor, logits: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        """The next token of each sequence from the last position's ``logits`` (batch, vocab)."""
        if not self.do_sample:
            return logits.argmax(-1)
        scores = logits.float()
        for warp in self.warpers():
            scores = warp(tokens, scores)
        return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)


def _with_static_cache(skeleton: nn.Module, batch: int, max_cache_len: int, device: Any) -> nn.Module:
    """A copy of the (meta) model whose forward is ``(input_ids, cache_position, attention_mask,
    position_ids) -> logits`` over a static cache whose tensors are buffers of the copy, made on meta;
    the cache's own device says ``device``, the one the graph is traced for and runs on."""
    from transformers.cache_utils import StaticCache

    model = copy.deepcopy(skeleton)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache.early_initialization(batch, heads, head_dim, dtype, torch.device("meta"))
    for layer in cache.layers:  # the positions it makes are on the device the run is on
        if isinstance(getattr(layer, "device", None), torch.device):
            layer.device = torch.device(device)
    slots = []  # (layer, attribute, buffer name)
    for i, layer in enumerate(cache.layers):
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                model.register_buffer(f"{CACHE_PREFIX}{i}_{name}", value, persistent=False)
                slots.append((layer, name, f"{CACHE_PREFIX}{i}_{name}"))
    forward = type(model).forward
    cache_arg = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

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
                      cache_position=cache_position, use_cache=True, **{cache_arg: cache})
        return out.logits

    model.forward = types.MethodType(cached_forward, model)
    return model


class CacheGraphs:
    """The prompt's graph and the one-token graph of one batch size and cache length, over a parallel
    module's state, with its pieces of the caches (module docstring)."""

    def __init__(self, module: nn.Module, switch: Any, batch: int, max_cache_len: int, prompt_len: int) -> None:
        if switch is None or switch.skeleton is None or not hasattr(switch.skeleton, "config"):
            raise NotImplementedError("generate() runs a Hugging Face causal language model parallelized by "
                                      "autotp.parallelize; for a model with a cache of its own, call the "
                                      "parallel module in a decoding loop (examples/models.py: greedy_with_cache)")
        self.batch, self.max_cache_len = batch, max_cache_len
        model = _with_static_cache(switch.skeleton, batch, max_cache_len, switch.mesh.device_type)
        spec = MeshSpec.of(switch.mesh)
        first = module.plan
        self.graphs, self.plans = {}, {}
        length = max(prompt_len, 2)  # the prompt's graph holds every length from 2 (a length of 1 is the other)
        pins = dict(first.parameter_placements)  # the prompt's: the weights as stored, the caches free
        for kind, n in (("prompt", length), ("token", 1)):
            ids = torch.zeros(batch, n, dtype=torch.int64, device="meta")
            mask = torch.ones(batch, max_cache_len, dtype=torch.int64, device="meta")  # over the whole cache
            positions = torch.zeros(batch, n, dtype=torch.int64, device="meta")  # not ids: one tensor twice is one input
            dims = {"input_ids": (1,), "cache_position": (0,), "position_ids": (1,)} if n > 1 else False
            graph = capture(model, (ids, torch.arange(n, device="meta"), mask, positions), dynamic_dims=dims,
                            training=False, device=switch.mesh.device_type)
            if kind == "token":  # the caches too where the prompt's plan stores them
                pins = self.plans["prompt"].storage_pins(graph)
            # the weights stay as stored; the caches must fit the device (parallelize's budget was the model's)
            plan = agreed_plan(graph, spec, switch.mesh, first.hardware, "inference", None, 0.0,
                               first.optimizer, None, keep=pins, hardware_source=first.hardware_source)
            if kind == "prompt":
                self._allocate(module, graph, plan, switch.mesh)
            fx_graph = build_graph(graph, plan, switch.mesh, module, dropout_seed(switch.mesh, graph),
                                   prefix=f"generate_{batch}x{max_cache_len}_{kind}_")
            self.graphs[kind] = torch.fx.GraphModule(module, fx_graph, class_name="AutotpGenerateGraph")
            self.plans[kind] = plan

    @staticmethod
    def _allocate(module: nn.Module, graph: Any, plan: Any, mesh: Any) -> None:
        """This rank's piece of each cache tensor, zeroed, as a non-persistent buffer of ``module``."""
        for node in graph.nodes:
            if node.role == BUFFER and node.param_fqn.startswith(CACHE_PREFIX):
                piece = buffer_piece(node.output.shape, getattr(torch, node.output.dtype), plan.strategy(node.name).output,
                                     mesh)
                put(module, node.param_fqn, piece.zero_(), "buffer", persistent=False)

    def cache_bytes(self) -> int:
        """Bytes of cache this rank holds."""
        return sum(b.numel() * b.element_size() for n, b in self.graphs["prompt"].named_buffers()
                   if n.startswith(CACHE_PREFIX))

    def reset(self) -> None:
        for name, b in self.graphs["prompt"].named_buffers():
            if name.startswith(CACHE_PREFIX):
                b.zero_()


def generate(module: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             max_cache_len: Optional[int] = None, generator: Optional[torch.Generator] = None,
             **options: Any) -> torch.Tensor:
    """``module.generate`` (:meth:`autotp.runtime.module.ParallelModule.generate`)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a (batch, length) tensor of token ids, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    batch, length = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}; expected the prompts' "
                         f"{[batch, length]} (1 for a token, 0 for padding)")
    config = getattr(module, "generation_config", None)
    opts = GenerateOptions.of(config, length, **options)
    model_config = getattr(module, "config", None)
    cache_config = getattr(config, "cache_config", None) or {}
    limit = (max_cache_len or (cache_config.get("max_cache_len") if isinstance(cache_config, dict) else None)
             or getattr(model_config, "max_position_embeddings", None))
    if limit is None:
        raise ValueError("generate() needs max_cache_len: the model's config gives no max_position_embeddings")
    if length + opts.max_new_tokens > limit:
        raise ValueError(f"a prompt of {length} tokens and max_new_tokens={opts.max_new_tokens} need a cache of "
                         f"{length + opts.max_new_tokens} positions; the cache holds {limit} "
                         f"(max_cache_len, or the config's max_position_embeddings): give a larger max_cache_len "
                         f"or fewer new tokens")
    graphs = module._autotp_cache_graphs(batch, limit, length)
    graphs.reset()
    mesh = module._autotp_switch.mesh
    if opts.do_sample and generator is None:  # one seed for every rank: every rank picks the same token
        seed = from_first_rank(mesh, [int(torch.randint(0, 2**62, (1,)).item())])[0]
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    tokens = input_ids
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    # the mask over the whole cache (prompts left-padded: 0 where a pad is), and each token's position
    # counted from its sequence's first real token, as Hugging Face's generate counts them
    given = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.int64)
    mask = torch.zeros(batch, limit, dtype=torch.int64, device=input_ids.device)
    mask[:, :length] = given
    positions = (given.cumsum(-1) - 1).masked_fill(given == 0, 1)
    with torch.no_grad():
        logits = graphs.graphs["prompt" if length > 1 else "token"](input_ids, torch.arange(length), mask, positions)
        position = positions[:, -1:]
        for step in range(opts.max_new_tokens):
            nxt = opts.choose(tokens, logits[:, -1], generator)
            if opts.pad_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, opts.pad_token_id), nxt)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            if opts.eos_token_ids:
                done |= torch.isin(nxt, torch.tensor(opts.eos_token_ids, device=nxt.device))
                if bool(done.all()):
                    break
            if step + 1 < opts.max_new_tokens:
                mask[:, length + step] = 1
                position = position + 1
                logits = graphs.graphs["token"](nxt[:, None], torch.tensor([length + step]), mask, position)
    return tokens

