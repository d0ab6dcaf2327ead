"""Generation with a KV cache: ``ParallelModule.generate`` for Hugging Face causal and encoder-decoder models.

The parallel module's own graph is the model's forward without a cache. To generate, copies of the
model on the meta device get a static cache of ``max_cache_len`` positions for the prompts' batch,
its tensors registered as buffers of the copies (:mod:`autotp.runtime.static_cache`). Traced, each
is a graph like any other whose caches are buffers written in place, and the planner stores each
cache by the kv heads its attention reads (:mod:`autotp.planning.choices.strategies`). On the first call
for a batch size and cache length, :class:`CacheGraphs` traces and plans, every weight kept where it
is stored:

- a causal LM: the prompt's graph (any length of 2 or more), which fills the cache from position 0
  (its positions made in the graph, so its mask is proven a description and its attention may be
  split by query rows), and one token's (``torch.export`` specializes a length of 1), the second
  with the caches where the first put them. A prompt plan that splits the query rows holds only the
  lengths that cut into its pieces (``n`` ranks, ``2n`` chunks balanced) and was chosen for the
  traced one: that graph serves that length only, and a prompt of another length gets one planned
  for it (:meth:`CacheGraphs.prompt`), its caches where the first put them;
- an encoder-decoder: the encoder's graph (any prompt length of 2 or more; it runs once per call),
  the decoder's first step (it computes the cross-attention keys and values from the encoder's
  states, padded to the cache's length, and stores them in the cross-attention cache) and a later
  step's (it reads them), the last with the caches where the first step put them.

Each rank then holds its piece of each cache, zeroed, as a buffer of the parallel module. A causal
LM whose cache would hold more than keys and values is refused before anything is traced
(:func:`autotp.runtime.static_cache.check_key_value_cache`), and one whose forward does not trace
over the static cache is refused with the trace's error, as autotp's limit.

The loop is Hugging Face's: the scores processed by ``transformers``' own processors from the
model's ``generation_config`` and the call's choices (:mod:`autotp.runtime.generate_options`),
then greedy, or sampled from a generator seeded alike on every rank (the first rank's seed), so
every rank picks the same token; prompts of different lengths come padded with their
``attention_mask`` (left-padded for a causal LM; given without one, a causal LM's mask is the one
Hugging Face's ``generate`` infers from the pad token, :meth:`GenerateOptions.inferred_mask`); a sequence that reaches an end token is padded
after it, and the tokens stop where every sequence has (no token waits for the host to learn it:
:func:`_decode`). With ``compile``, the decode step runs as one compiled graph (:meth:`CacheGraphs.step`).

The cache holds the prompt plus ``max_new_tokens`` positions unless ``max_cache_len`` says otherwise
(a cache of the batch size that is held already and fits serves the call); every tensor the loop
makes is on the inputs' device, which must be the rank's device of the mesh, and the positions of a
decoded token advance there.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch import nn

from autotp.mesh import MeshSpec
from autotp.runtime.agreement import agreed_plan, dropout_seed, from_first_rank
from autotp.runtime.devices import mesh_device, wrong_device
from autotp.runtime.generate_options import GenerateOptions
from autotp.runtime.state import buffer_piece, build_graph, put
from autotp.runtime.static_cache import (
    CACHE_PREFIX,
    check_key_value_cache,
    with_encoder_decoder_cache,
    with_static_cache,
)
from autotp.tracing.export import capture
from autotp.tracing.graph import BUFFER
from autotp.tracing.refusals import CaptureError

__all__ = ["CACHE_PREFIX", "CacheGraphs", "GenerateOptions", "generate"]


def _is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


class CacheGraphs:
    """``generate``'s graphs of one batch size and cache length over a parallel module's state, with
    its pieces of the caches (module docstring): ``graphs`` and ``plans`` by kind, ``"prompt"`` and
    ``"token"`` for a causal LM (and ``"prompt of <length>"`` for each other prompt length where the
    prompt's graph holds one length only, ``prompt_length``), ``"encoder"``, ``"first"`` and
    ``"token"`` for an encoder-decoder."""

    def __init__(self, module: nn.Module, switch: Any, batch: int, max_cache_len: int, prompt_len: int) -> None:
        if switch is None or switch.skeleton is None or not hasattr(switch.skeleton, "config"):
            raise NotImplementedError("generate() runs a Hugging Face causal or encoder-decoder language model "
                                      "parallelized by autotp.parallelize; for a model with a cache of its own, call "
                                      "the parallel module in a decoding loop (examples/models.py: greedy_with_cache)")
        self.batch, self.max_cache_len = batch, max_cache_len
        self.encoder_decoder = _is_encoder_decoder(switch.skeleton)
        self.skeleton = switch.skeleton
        self._module, self._switch = module, switch
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.plans: dict[str, Any] = {}
        self._compiled: dict[str, Callable] = {}
        device = switch.mesh.device_type
        meta = dict(dtype=torch.int64, device="meta")
        length = max(prompt_len, 2)  # a prompt's graph holds every length from 2 (export specializes 1)
        self.prompt_length: Optional[int] = None  # the one prompt length the prompt's graph holds, where it holds one
        if not self.encoder_decoder:
            if _rows_split(*self._add_prompt("prompt", length, None)):
                self.prompt_length = length
            model = with_static_cache(switch.skeleton, batch, max_cache_len, device)
            # the mask spans the whole cache; the positions are not the ids: one tensor twice is one input
            inputs = (torch.zeros(batch, 1, **meta), torch.arange(1, device="meta"),
                      torch.ones(batch, max_cache_len, **meta), torch.zeros(batch, 1, **meta))
            self._add("token", model, inputs, False, caches_from="prompt")
            return
        copies = with_encoder_decoder_cache(switch.skeleton, batch, max_cache_len, device)
        self._add("encoder", copies.encoder, (torch.zeros(batch, length, **meta), torch.ones(batch, length, **meta)),
                  {"input_ids": (1,), "attention_mask": (1,)}, caches_from=None)
        states = torch.zeros(batch, max_cache_len, copies.hidden_size, dtype=copies.dtype, device="meta")
        step = (torch.zeros(batch, 1, **meta), torch.arange(1, device="meta"), torch.ones(batch, max_cache_len, **meta),
                states, torch.ones(batch, max_cache_len, **meta))
        self._add("first", copies.first_step, step, False, caches_from=None)
        self._add("token", copies.later_step, step, False, caches_from="first")

    def _add_prompt(self, kind: str, length: int, caches_from: Optional[str]) -> tuple[Any, Any]:
        """The graph of a causal LM's prompt of ``length`` tokens (any length from 2 where its plan allows),
        filling the cache from position 0: its mask is proven, so its attention may be split by query rows."""
        meta = dict(dtype=torch.int64, device="meta")
        model = with_static_cache(self.skeleton, self.batch, self.max_cache_len, self._switch.mesh.device_type,
                                  from_start=True)
        inputs = (torch.zeros(self.batch, length, **meta), torch.ones(self.batch, self.max_cache_len, **meta),
                  torch.zeros(self.batch, length, **meta))
        return self._add(kind, model, inputs, {"input_ids": (1,), "position_ids": (1,)}, caches_from=caches_from)

    def prompt(self, length: int) -> torch.fx.GraphModule:
        """The graph of a prompt of ``length`` tokens (2 or more). Where the prompt's plan splits an
        attention's query rows (:func:`_rows_split`), another length gets a graph traced and planned
        for it, its caches stored as the first put them."""
        if self.prompt_length in (None, length):
            return self.graphs["prompt"]
        kind = f"prompt of {length}"
        if kind not in self.graphs:
            self._add_prompt(kind, length, caches_from="prompt")
        return self.graphs[kind]

    def _add(self, kind: str, model: nn.Module, inputs: tuple, dims: Any, caches_from: Optional[str]) -> tuple[Any, Any]:
        """Trace ``model`` on ``inputs``, plan it with every weight where the parallel module stores it
        (and the caches where the plan ``caches_from`` put them; else the planner chooses and this
        rank's pieces are allocated), and build its graph over the module's state. Returns the traced
        graph and its plan."""
        module, switch = self._module, self._switch
        try:
            graph = capture(model, inputs, dynamic_dims=dims, training=False, device=switch.mesh.device_type)
        except CaptureError as err:
            raise _untraceable(self.skeleton, err) from err
        pins = (self.plans[caches_from].storage_pins(graph) if caches_from is not None
                else dict(module.plan.parameter_placements))
        first = module.plan
        # the weights stay as stored; the caches must fit the device (parallelize's budget was the model's)
        plan = agreed_plan(graph, MeshSpec.of(switch.mesh), switch.mesh, first.hardware, "inference", None, 0.0,
                           first.optimizer, None, keep=pins, hardware_source=first.hardware_source)
        if caches_from is None:
            self._allocate(graph, plan)
        fx_graph = build_graph(graph, plan, switch.mesh, module, dropout_seed(switch.mesh, graph),
                               prefix=f"generate_{self.batch}x{self.max_cache_len}_{kind}_")
        self.graphs[kind] = torch.fx.GraphModule(module, fx_graph, class_name="AutotpGenerateGraph")
        self.plans[kind] = plan
        return graph, plan

    def _allocate(self, graph: Any, plan: Any) -> None:
        """This rank's piece of each cache tensor, zeroed, as a non-persistent buffer of the module."""
        for node in graph.nodes:
            if node.role == BUFFER and node.param_fqn.startswith(CACHE_PREFIX):
                piece = buffer_piece(node.output.shape, getattr(torch, node.output.dtype),
                                     plan.strategy(node.name).output, self._switch.mesh)
                put(self._module, node.param_fqn, piece.zero_(), "buffer", persistent=False)

    def step(self, compile: Any = False) -> Callable:
        """The graph of one decoded token, or (``compile``: True, or ``torch.compile``'s keyword
        arguments such as ``{"mode": "reduce-overhead"}``) that graph compiled whole
        (``fullgraph=True``: a break is an error), once per set of arguments."""
        if compile is False or compile is None:
            return self.graphs["token"]
        if compile is not True and not isinstance(compile, dict):
            raise TypeError(f"generate(compile={compile!r}): expected True, False, or a dict of torch.compile's "
                            f"keyword arguments, e.g. {{'mode': 'reduce-overhead'}}")
        options = {} if compile is True else dict(compile)
        key = repr(sorted(options.items()))
        if key not in self._compiled:
            self._compiled[key] = torch.compile(self.graphs["token"], fullgraph=True, **options)
        return self._compiled[key]

    def _caches(self) -> list[torch.Tensor]:
        """This rank's pieces of the caches these graphs read (another batch size's are others)."""
        seen: dict[int, torch.Tensor] = {}
        for graph in self.graphs.values():
            for name, b in graph.named_buffers():
                if name.startswith(CACHE_PREFIX):
                    seen.setdefault(id(b), b)
        return list(seen.values())

    def cache_bytes(self) -> int:
        """Bytes of cache this rank holds."""
        return sum(b.numel() * b.element_size() for b in self._caches())

    def reset(self) -> None:
        for b in self._caches():
            b.zero_()


def _rows_split(graph: Any, plan: Any) -> bool:
    """Whether ``plan`` of ``graph`` splits the query rows of an attention under a described mask: such a split
    holds only the lengths that cut into its pieces (``n`` ranks, ``2n`` chunks balanced), and was
    chosen for the traced one, so its graph serves that length only."""
    from autotp.planning.rules.attention import attention_mask_of

    for node in graph.ops():
        if attention_mask_of(node) is None:
            continue
        q = plan.strategy(node.name).inputs[0]
        if q is not None and any(p.is_shard and p.dim == node.input_infos[0].ndim - 2 for p in q):
            return True
    return False


def _untraceable(skeleton: nn.Module, err: CaptureError) -> NotImplementedError:
    """The error for a model whose forward over the static cache does not trace: autotp's limit,
    with the cause (the first line of the trace's own error)."""
    cause = err.__cause__ if err.__cause__ is not None else err
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    # an unbacked symbol (u0, u1, ...) is a size the trace read from a tensor's values
    sized = (isinstance(cause, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode)
             or re.search(r"\bu\d+\b", str(cause)) is not None)
    why = (": its forward computes a tensor's size from a value held in a tensor (such as the count of tokens "
           "the cache holds, a tensor in a static cache), a size one graph for every step cannot carry" if sized else "")
    return NotImplementedError(
        f"generate() of {type(skeleton).__name__}: autotp could not trace its forward over a static KV cache "
        f"(transformers' StaticCache, traced once for the prompt and once for a decoded token){why}; autotp's "
        f"generate does not support this model (docs/serving.md#limits). The parallel module's forward is "
        f"unaffected. The trace's error: {type(cause).__name__}: {text}")


def _position_limit(module: nn.Module, config: Any, max_cache_len: Optional[int]) -> Optional[int]:
    """The most positions a call may fill: ``max_cache_len`` given, else the generation config's cache
    config, else the model's ``max_position_embeddings`` (or T5-style ``n_positions``); None where
    none says (T5's relative positions)."""
    cache_config = getattr(config, "cache_config", None) or {}
    model_config = getattr(module, "config", None)
    limit = (max_cache_len or (cache_config.get("max_cache_len") if isinstance(cache_config, dict) else None)
             or getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None))
    return None if limit is None else int(limit)


def _cache_length(module: nn.Module, batch: int, needed: int, given: Optional[int]) -> int:
    """The cache's positions for a call that fills ``needed``: ``given`` (``max_cache_len``), else the
    shortest cache of this batch size that the module holds already and that fits (no new trace), else
    ``needed`` (the prompt plus ``max_new_tokens``, as Hugging Face's static cache defaults to)."""
    if given is not None:
        return int(given)
    held = [n for b, n in getattr(module, "_autotp_generation", {}) if b == batch and n >= needed]
    return min(held, default=needed)


def generate(module: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             max_cache_len: Optional[int] = None, generator: Optional[torch.Generator] = None,
             compile: Any = False, **options: Any) -> torch.Tensor:
    """``module.generate`` (:meth:`autotp.runtime.module.ParallelModule.generate`)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a (batch, length) tensor of token ids, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    batch, length = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}; expected the prompts' "
                         f"{[batch, length]} (1 for a token, 0 for padding)")
    config = getattr(module, "generation_config", None)
    switch = module._autotp_switch
    if switch is not None:  # before anything is traced or communicated
        device = mesh_device(switch.mesh)
        for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            error = wrong_device(name, value.device, device) if value is not None else None
            if error:
                raise ValueError(error)
    encoder_decoder = switch is not None and _is_encoder_decoder(switch.skeleton)
    if switch is not None and hasattr(switch.skeleton, "config") and not encoder_decoder:
        check_key_value_cache(switch.skeleton)  # before anything is traced or communicated
    opts = GenerateOptions.of(config, 1 if encoder_decoder else length, **options)
    limit = _position_limit(module, config, max_cache_len)
    decoded = 1 + opts.max_new_tokens if encoder_decoder else length + opts.max_new_tokens
    if limit is not None and (decoded > limit or (encoder_decoder and length > limit)):
        what = (f"a decoder start token and max_new_tokens={opts.max_new_tokens} need a cache of {decoded} positions, "
                f"and a prompt of {length} tokens one of {length}" if encoder_decoder else
                f"a prompt of {length} tokens and max_new_tokens={opts.max_new_tokens} need a cache of {decoded} "
                f"positions")
        raise ValueError(f"{what}; the cache holds {limit} (max_cache_len, or the config's max_position_embeddings): "
                         f"give a larger max_cache_len or fewer new tokens")
    if encoder_decoder and opts.decoder_start_token_id is None:
        raise ValueError("generate() of an encoder-decoder needs decoder_start_token_id (the model's generation_config "
                         "has none): pass decoder_start_token_id=...")
    # the encoder's states fill the cross-attention cache: a prompt of one token is padded to two
    needed = max(decoded, length, 2) if encoder_decoder else decoded
    graphs = module._autotp_cache_graphs(batch, _cache_length(module, batch, needed, max_cache_len), length)
    token = graphs.step(compile)
    graphs.reset()
    mesh = switch.mesh
    if opts.do_sample and generator is None:  # one seed for every rank: every rank picks the same token
        seed = from_first_rank(mesh, [int(torch.randint(0, 2**62, (1,)).item())])[0]
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    if attention_mask is None and not encoder_decoder:  # as Hugging Face's generate: from the pad token
        attention_mask = opts.inferred_mask(switch.skeleton, input_ids)
    given = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.int64)
    with torch.no_grad():
        if encoder_decoder:
            return _generate_encoder_decoder(graphs, token, opts, input_ids, given, generator)
        return _generate_causal(graphs, token, opts, input_ids, given, generator)


def _generate_causal(graphs: CacheGraphs, token: Callable, opts: GenerateOptions, input_ids: torch.Tensor,
                     given: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    batch, length = input_ids.shape
    device = input_ids.device
    # the mask over the whole cache (prompts left-padded: 0 where a pad is), and each token's position
    # counted from its sequence's first real token, as Hugging Face's generate counts them
    mask = torch.zeros(batch, graphs.max_cache_len, dtype=torch.int64, device=device)
    mask[:, :length] = given
    positions = (given.cumsum(-1) - 1).masked_fill(given == 0, 1)
    processors = opts.processors(graphs.skeleton, length, input_ids, given, device)
    cache_position = torch.arange(length, device=device)
    if length > 1:  # the prompt fills the cache from position 0
        logits = graphs.prompt(length)(input_ids, mask, positions)
    else:
        logits = graphs.graphs["token"](input_ids, cache_position, mask, positions)
    # the decoded token's cache slot and position: advanced on the device, no copy from the host per token
    at, position = cache_position[-1:], positions[:, -1:]

    def step(i: int, nxt: torch.Tensor) -> torch.Tensor:  # the i-th new token in, the logits of the next out
        nonlocal at, position
        mask[:, length + i] = 1
        at, position = at + 1, position + 1
        return token(nxt[:, None], at, mask, position)

    return _decode(opts, processors, input_ids, logits, step, generator)


def _generate_encoder_decoder(graphs: CacheGraphs, token: Callable, opts: GenerateOptions, input_ids: torch.Tensor,
                              given: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    batch, length = input_ids.shape
    device = input_ids.device
    ids = input_ids
    if length == 1:  # the encoder's graph holds lengths from 2: a masked pad after the token changes nothing
        ids = torch.cat([input_ids, torch.zeros_like(input_ids)], dim=1)
        given = torch.cat([given, torch.zeros_like(given)], dim=1)
    cache = graphs.max_cache_len
    states = graphs.graphs["encoder"](ids, given)  # (batch, prompt, hidden)
    encoded = states.new_zeros(batch, cache, states.shape[-1])  # padded to the cross-attention cache's length
    encoded[:, :states.shape[1]] = states
    encoded_mask = torch.zeros(batch, cache, dtype=torch.int64, device=device)
    encoded_mask[:, :given.shape[1]] = given
    tokens = torch.full((batch, 1), opts.decoder_start_token_id, dtype=input_ids.dtype, device=device)
    mask = torch.zeros(batch, cache, dtype=torch.int64, device=device)  # the decoder's, over its cache
    mask[:, 0] = 1
    processors = opts.processors(graphs.skeleton, 1, input_ids, None, device)
    at = torch.zeros(1, dtype=torch.int64, device=device)  # the decoded token's cache slot, advanced on the device
    logits = graphs.graphs["first"](tokens, at, mask, encoded, encoded_mask)

    def step(i: int, nxt: torch.Tensor) -> torch.Tensor:
        nonlocal at
        mask[:, 1 + i] = 1
        at = at + 1
        return token(nxt[:, None], at, mask, encoded, encoded_mask)

    return _decode(opts, processors, tokens, logits, step, generator)


# decoded tokens between two reads of "has every sequence ended?" on the host (each read one step late,
# so the device is never left waiting for it)
STOP_CHECK_TOKENS = 16


def _decode(opts: GenerateOptions, processors: Any, tokens: torch.Tensor, logits: torch.Tensor,
            step: Callable[[int, torch.Tensor], torch.Tensor], generator: Optional[torch.Generator]) -> torch.Tensor:
    """Hugging Face's loop: pick a token from the last position's logits, pad a finished sequence,
    stop when every sequence has ended or ``max_new_tokens`` are made; ``step(i, token)`` runs the
    graph of the ``i``-th new token and returns the logits of the next.

    No token waits for the host: whether every sequence has ended is kept on the device per token,
    read every :data:`STOP_CHECK_TOKENS` tokens (after the next step is queued), and the tokens after
    the first step at which all had ended (pads only) are cut at the end, so the result is Hugging
    Face's, which stops there."""
    start, made = tokens.shape[1], 0
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    ended = torch.zeros(opts.max_new_tokens, dtype=torch.bool, device=tokens.device)  # every sequence, by token
    ends = torch.tensor(opts.eos_token_ids, device=tokens.device)
    pending: Optional[torch.Tensor] = None
    for i in range(opts.max_new_tokens):
        nxt = opts.choose(processors, tokens, logits[:, -1], generator)
        if opts.pad_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, opts.pad_token_id), nxt)
        tokens, made = torch.cat([tokens, nxt[:, None]], dim=1), i + 1
        if opts.eos_token_ids:
            done |= torch.isin(nxt, ends)
            ended[i] = done.all()
        if i + 1 < opts.max_new_tokens:
            logits = step(i, nxt)
        if pending is not None and bool(pending):  # read a step late: the device runs the step just queued
            break
        pending = ended[i] if opts.eos_token_ids and (i + 1) % STOP_CHECK_TOKENS == 0 else None
    if not opts.eos_token_ids:
        return tokens
    ran = ended[:made]
    kept = int(torch.where(ran.any(), ran.to(torch.int64).argmax() + 1, made))  # the call's one read
    return tokens[:, :start + kept]
