"""``generate()`` on the parallel module of Hugging Face causal LMs and an encoder-decoder, with KV caches split like the attention.

References: the model's own ``generate`` in one process (greedy tokens; sampled tokens from the same
seed), and the plans of the two cache graphs (the prompt's and one token's) for placements and
collectives. The models are built from their configs with ``use_cache`` at its default (True), and
planned under a budget that makes the plan split attention by heads. One run of 2 gloo processes.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from examples.ranks import run_ranks
from tests.helpers.host_reads import HostReads
from tests.helpers.observed import CollectiveLog, planned

NEW_TOKENS = 6
CACHE = 8 + NEW_TOKENS  # generate's default cache: the prompt (8 tokens) and the new tokens
PENALTIES = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "suppress_tokens": [1, 2, 3]}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _prompt(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 8 and 5 tokens, the second left-padded, and their attention mask."""
    ids, mask = _prompt(), torch.ones(2, 8, dtype=torch.int64)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def _bart():
    """An encoder-decoder; BART's generation config forces its end token at the last position, which
    only transformers' own processors do."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128,
                        max_position_embeddings=64, init_std=0.5)
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).eval()


def _t5():
    """An encoder-decoder with relative position biases, no position limit, and a decoder stack that
    keeps a config of its own (use_cache too)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=128,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=10.0)
    torch.manual_seed(1)
    return T5ForConditionalGeneration(config).eval()


def _source() -> tuple[torch.Tensor, torch.Tensor]:
    """Two source texts of 9 and 6 tokens, the second right-padded (as a tokenizer pads an encoder's)."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, 6:], mask[1, 6:] = 1, 0
    return ids, mask


def _budget(model) -> float:
    return 0.6 * sum(p.numel() * p.element_size() for p in model.parameters())


def _rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, prompt = _llama(), _prompt()
    pm = autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo", memory_budget=_budget(model))
    out = {"greedy": pm.generate(prompt, max_new_tokens=NEW_TOKENS).tolist()}
    out["sampled"] = pm.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=20,
                                 top_p=0.9, generator=torch.Generator().manual_seed(5)).tolist()
    out["seeded_alike"] = pm.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True).tolist()
    T = prompt.shape[1]
    eos = out["greedy"][0][T + 2]  # the first sequence's third new token
    out["eos"], out["stopped"] = eos, pm.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                                  pad_token_id=0).tolist()
    padded, mask = _padded()
    out["padded"] = pm.generate(padded, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0).tolist()
    out["penalized"] = pm.generate(prompt, max_new_tokens=NEW_TOKENS, **PENALTIES).tolist()
    # past the input check's first calls: what a decoded token reads on the host, and makes there
    reads = []
    for n in (2, NEW_TOKENS):
        with HostReads() as seen:
            pm.generate(prompt, max_new_tokens=n)
        reads.append((seen.reads, seen.made, seen.where))
    out["host_reads"] = reads
    # every sequence ends at its second new token: the tokens stop there, as Hugging Face's do, whether
    # the loop saw it on the way (read every 2 tokens) or only at the end (every 16, the default)
    from autotp.runtime import generation

    out["ends"] = sorted({row[T + 1] for row in out["greedy"]})
    default = generation.STOP_CHECK_TOKENS
    for every in (default, 2):
        generation.STOP_CHECK_TOKENS = every
        out[f"all ended, read every {every}"] = pm.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=out["ends"],
                                                            pad_token_id=0).tolist()
    generation.STOP_CHECK_TOKENS = default
    out["cache_keys"] = sorted(pm._autotp_generation)
    for name, call in (("forward", lambda: pm(prompt.to("meta"))),
                       ("generate", lambda: pm.generate(prompt.to("meta"), max_new_tokens=2))):
        try:
            call()
        except ValueError as err:
            out[f"meta {name}"] = str(err)
    L = CACHE
    graphs = pm._autotp_generation[(2, L)]
    with CollectiveLog(mesh) as log:  # one decode step, observed
        graphs.graphs["token"](prompt[:, :1], torch.tensor([T]), torch.ones(2, L, dtype=torch.int64),
                               torch.full((2, 1), T))
    out["observed"], out["bytes"] = log.counts(), [s.bytes for s in log.seen]
    # the decode step compiles to one graph (fullgraph: a break is an error) and computes what it did eager;
    # it runs as generate runs it (without grad, a contiguous column of tokens), so generate's tokens below
    # run the same compiled graph: Dynamo compiles once for the step and every token, with no recompile
    from torch._dynamo.testing import CompileCounterWithBackend

    step_inputs = (prompt[:, :1].contiguous(), torch.tensor([T]), torch.ones(2, L, dtype=torch.int64),
                   torch.full((2, 1), T))
    backend = {"backend": CompileCounterWithBackend("aot_eager")}  # aot_eager, counting the graphs compiled
    with torch.no_grad():
        graphs.reset()
        eager = graphs.graphs["token"](*step_inputs)
        graphs.reset()
        compiled = graphs.step(backend)(*step_inputs)  # the one generate(compile=...) runs
    out["compiled_diff"] = (compiled - eager).abs().max().item()
    out["compiled_greedy"] = pm.generate(prompt, max_new_tokens=NEW_TOKENS, compile=backend).tolist()
    out["compiles"] = backend["backend"].frame_count
    out["plans"] = {k: p.to_json() for k, p in graphs.plans.items()}
    out["held"] = {n: tuple(b.shape) for n, b in pm.named_buffers() if n.startswith("autotp_kv_")}
    out["held_bytes"] = sum(b.numel() * b.element_size() for n, b in pm.named_buffers() if n.startswith("autotp_kv_"))
    out["cache_bytes"] = graphs.cache_bytes()
    for kwargs, error in (({"num_beams": 2}, NotImplementedError), ({"max_new_tokens": 100}, ValueError),
                          ({"guidance_scale": 2.0}, NotImplementedError), ({"stop_strings": ["a"]}, TypeError)):
        try:
            pm.generate(prompt, **kwargs)
        except error as err:
            out[f"refused {sorted(kwargs)[0]}"] = str(err)
    out["bart"] = _bart_rank(mesh)
    return out


BART_CACHE = 9  # the source's 9 tokens (the cross-attention's); a start token and 8 new ones too


def _bart_rank(mesh) -> dict:
    model, (ids, mask) = _bart(), _source()
    pm = autotp.parallelize(model, mesh, (ids,), mode="inference", hardware="cpu-gloo", memory_budget=_budget(model))
    out = {"greedy": pm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS + 2).tolist()}
    # a prompt of one token: padded for the encoder's graph, which holds lengths of 2 or more
    out["short"] = pm.generate(ids[:, :1], max_new_tokens=3).tolist()
    out["cache_keys"] = sorted(pm._autotp_generation)
    L = BART_CACHE
    graphs = pm._autotp_generation[(2, L)]
    out["plans"] = {k: p.to_json() for k, p in graphs.plans.items()}
    out["stored"] = dict(pm.plan.parameter_placements)  # where parallelize put the weights
    out["held"] = {n: tuple(b.shape) for n, b in pm.named_buffers() if n.startswith("autotp_kv_")}
    with CollectiveLog(mesh) as log:  # one decode step, observed
        graphs.graphs["token"](ids[:, :1], torch.tensor([1]), torch.ones(2, L, dtype=torch.int64),
                               torch.zeros(2, L, 64), torch.ones(2, L, dtype=torch.int64))
    out["observed"], out["bytes"] = log.counts(), [s.bytes for s in log.seen]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank, 2)


@pytest.fixture(scope="module")
def reference():
    model, prompt = _llama(), _prompt()
    greedy = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.manual_seed(5)  # Hugging Face samples from the global generator; autotp from the one given
    sampled = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    return model, prompt, greedy.tolist(), sampled.tolist()


def test_greedy_tokens_equal_the_model_s_own_generate(ranks, reference):
    _, _, greedy, _ = reference
    assert len({t for row in greedy for t in row[8:]}) > 2, "a degenerate reference would prove little"
    assert [r["greedy"] for r in ranks] == [greedy, greedy]


def test_sampling_from_a_seed_equals_the_model_s_own_and_every_rank_picks_the_same(ranks, reference):
    _, _, _, sampled = reference
    assert [r["sampled"] for r in ranks] == [sampled, sampled]
    assert ranks[0]["seeded_alike"] == ranks[1]["seeded_alike"]  # no generator: the first rank's seed


def test_a_sequence_stops_at_its_end_token_and_is_padded_after(ranks, reference):
    model, prompt, _, _ = reference
    r = ranks[0]
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=r["eos"], pad_token_id=0).tolist()
    assert r["stopped"] == expected == ranks[1]["stopped"]


def test_prompts_of_different_lengths_left_padded_equal_the_model_s_own(ranks, reference):
    model, _, _, _ = reference
    ids, mask = _padded()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0).tolist()
    unpadded = model.generate(ids[1:, 3:], max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    assert expected[1][3:] == unpadded[0]  # the reference: padding changes nothing of the short prompt's
    assert [r["padded"] for r in ranks] == [expected, expected]


def test_the_cache_is_split_like_the_attention_and_a_decode_step_runs_its_plan(ranks, reference):
    model, _, _, _ = reference
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for rank, r in enumerate(ranks):
        prompt_plan, token_plan = (autotp.Plan.from_json(r["plans"][k]) for k in ("prompt", "token"))
        split = prompt_plan.buffer_placements
        assert {n for n in split if n.endswith(("keys", "values"))} == {
            f"autotp_kv_{i}_{kind}" for i in range(cfg.num_hidden_layers) for kind in ("keys", "values")}
        assert set(split.values()) == {"S(1)"}  # by kv heads
        assert token_plan.buffer_placements == split  # the one-token graph keeps them where they are
        assert token_plan.parameter_placements == prompt_plan.parameter_placements
        whole = (2, cfg.num_key_value_heads, CACHE, head_dim)
        assert all(r["held"][n] == (2, 1, *whole[2:]) for n in split), r["held"]  # each rank: its kv head
        assert r["cache_bytes"] == r["held_bytes"] > sum(4 * torch.Size(r["held"][n]).numel() for n in split) / 2
        assert token_plan.memory.buffers_bytes >= r["cache_bytes"]
        # a decode step communicates what its plan lists: two all-reduces per block in this layout,
        # and nothing cache-sized (no gather of keys or values)
        assert r["observed"] == planned(token_plan, "forward")
        styles = token_plan.module_styles()
        if all(styles[f"model.layers.{i}.self_attn.o_proj"] == "rowwise" == styles[f"model.layers.{i}.mlp.down_proj"]
               for i in range(cfg.num_hidden_layers)):
            # (the embedding and the head may gather their token's vector: outside the blocks)
            assert sum(n for (kind, _, _), n in r["observed"].items() if kind == "all_reduce") == \
                2 * cfg.num_hidden_layers
            line = next(x for x in token_plan.report().splitlines() if x.startswith("per block of model.layers"))
            assert f"({cfg.num_hidden_layers} blocks): " in line and "forward 2 all_reduce" in line, line
        cache_piece = 4 * torch.Size(r["held"][next(iter(split))]).numel()
        assert all(b < cache_piece for b in r["bytes"]), r["bytes"]


def test_the_decode_step_compiles_to_one_graph_and_computes_the_same(ranks, reference):
    assert [r["compiled_diff"] for r in ranks] == [0.0, 0.0]
    assert [r["compiles"] for r in ranks] == [1, 1], "the step and generate's tokens: one compile, no recompile"
    _, _, greedy, _ = reference
    assert [r["compiled_greedy"] for r in ranks] == [greedy, greedy]


def test_what_generate_does_not_do_is_refused_by_name(ranks):
    r = ranks[0]
    assert "num_beams" in r["refused num_beams"] and "not supported" in r["refused num_beams"]
    assert "cache of 108 positions" in r["refused max_new_tokens"] and "holds 64" in r["refused max_new_tokens"]
    assert "guidance_scale" in r["refused guidance_scale"] and "not supported" in r["refused guidance_scale"]
    assert "stop_strings" in r["refused stop_strings"] and "repetition_penalty" in r["refused stop_strings"]


def test_the_generation_config_s_processors_apply_as_in_the_model_s_own_generate(ranks, reference):
    model, prompt, greedy, _ = reference
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **PENALTIES).tolist()
    assert expected != greedy  # the penalties change the tokens: a run that ignored them would differ
    assert [r["penalized"] for r in ranks] == [expected, expected]


def test_a_decoded_token_reads_nothing_on_the_host_and_copies_nothing_to_the_device(ranks):
    """After the input check's first calls, 6 new tokens make as many host reads (a GPU's syncs) and
    tensors made from host values (copies to the device) in autotp's code as 2 do: none per token."""
    for r in ranks:
        (reads_2, made_2, _), (reads_6, made_6, where) = r["host_reads"]
        assert (reads_6, made_6) == (reads_2, made_2), where


def test_when_every_sequence_has_ended_the_tokens_stop_as_the_model_s_own_do(ranks, reference):
    model, prompt, _, _ = reference
    r = ranks[0]
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=r["ends"], pad_token_id=0).tolist()
    assert len(expected[0]) == prompt.shape[1] + 2  # stopped early: the case proves the cut
    from autotp.runtime.generation import STOP_CHECK_TOKENS

    assert STOP_CHECK_TOKENS > NEW_TOKENS  # the default: read once, at the end
    for every in (STOP_CHECK_TOKENS, 2):
        assert [rank[f"all ended, read every {every}"] for rank in ranks] == [expected, expected]


def test_the_cache_defaults_to_the_prompt_and_the_new_tokens(ranks):
    # every call of the fixture fits the first call's cache (8 + 6 positions): one set of graphs
    assert [r["cache_keys"] for r in ranks] == [[(2, CACHE)]] * 2
    assert [r["bart"]["cache_keys"] for r in ranks] == [[(2, BART_CACHE)]] * 2


def test_an_input_on_another_device_is_refused_before_anything_runs(ranks):
    for name in ("forward", "generate"):
        error = ranks[0][f"meta {name}"]
        assert "input 'input_ids' is on meta, but this parallel module computes on cpu" in error, error


@pytest.fixture(scope="module")
def bart_reference():
    model, (ids, mask) = _bart(), _source()
    return model, model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS + 2).tolist()


def test_an_encoder_decoder_generates_the_model_s_own_greedy_tokens(ranks, bart_reference):
    model, expected = bart_reference
    assert len({t for row in expected for t in row[1:]}) > 4, "a degenerate reference would prove little"
    assert all(row[-1] == model.generation_config.forced_eos_token_id for row in expected)  # a processor's doing
    assert [r["bart"]["greedy"] for r in ranks] == [expected, expected]


def test_an_encoder_decoder_takes_a_one_token_prompt(ranks, bart_reference):
    model, _ = bart_reference
    ids, _ = _source()
    expected = model.generate(ids[:, :1], max_new_tokens=3).tolist()
    assert [r["bart"]["short"] for r in ranks] == [expected, expected]


def test_an_encoder_decoder_s_caches_are_split_and_its_decode_step_runs_its_plan(ranks, bart_reference):
    model, _ = bart_reference
    cfg = model.config
    layers, heads, head_dim = cfg.decoder_layers, cfg.decoder_attention_heads, cfg.d_model // cfg.decoder_attention_heads
    for r in (rank["bart"] for rank in ranks):
        plans = {k: autotp.Plan.from_json(v) for k, v in r["plans"].items()}
        assert set(plans) == {"encoder", "first", "token"}
        caches = {f"autotp_kv_{kind}_{i}_{t}" for kind in ("self", "cross") for i in range(layers)
                  for t in ("keys", "values")}
        assert {n for n in plans["first"].buffer_placements if n.endswith(("keys", "values"))} == caches
        assert set(plans["first"].buffer_placements.values()) == {"S(1)"}  # by heads: self and cross
        assert plans["token"].buffer_placements == plans["first"].buffer_placements  # read where written
        for p in plans.values():  # every graph keeps the weights where parallelize stored them
            assert dict(p.parameter_placements) == r["stored"]
        assert all(r["held"][n] == (2, heads // 2, BART_CACHE, head_dim) for n in caches)
        assert r["observed"] == planned(plans["token"], "forward")
        cache_piece = 4 * torch.Size(r["held"][next(iter(caches))]).numel()
        assert all(b < cache_piece for b in r["bytes"]), r["bytes"]  # no cache-sized gather


def _family(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if name == "mixtral":  # experts; their counts branch on the device (traced on a fake CPU device)
        return MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                max_position_embeddings=64, num_local_experts=4)).eval()
    if name == "gpt2":  # a fused q|k|v projection (Conv1D)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).eval()
    # one kv head for two ranks: each rank holds the whole of it
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                                        max_position_embeddings=64)).eval()


def _family_rank(rank, world, name):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, prompt = _family(name), _prompt()
    # under the replicated model's size, so the blocks split; above the least plan's (GPT-2's is 0.61 of it)
    budget = 0.7 * sum(p.numel() * p.element_size() for p in model.parameters())
    pm = autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo", memory_budget=budget)
    tokens = pm.generate(prompt, max_new_tokens=NEW_TOKENS).tolist()
    plan = next(iter(pm._autotp_generation.values())).plans["prompt"]
    return tokens, dict(plan.buffer_placements), sorted(set(plan.module_styles().values()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "qwen2", "mixtral"])
def test_other_families_generate_the_model_s_own_greedy_tokens(name):
    expected = _family(name).generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    results = run_ranks(_family_rank, 2, name)
    assert [r[0] for r in results] == [expected, expected]
    tokens, split, styles = results[0]
    if name == "mixtral":
        return
    assert {"colwise", "rowwise"} <= set(styles)  # the plan splits the blocks
    if name == "gpt2":  # 4 heads over 2 ranks: each holds 2
        assert split and set(split.values()) == {"S(1)"}
    else:  # one kv head cannot be split: it stays whole, read by both ranks' query heads
        assert not any(n.endswith(("keys", "values")) for n in split)


def _t5_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, (ids, mask) = _t5(), _source()
    ids = ids.masked_fill(mask == 0, 0)  # T5 pads with 0
    # T5's forward takes no decoder inputs of its own making: the example gives them
    pm = autotp.parallelize(model, mesh, {"input_ids": ids, "decoder_input_ids": ids[:, :4].clone()}, mode="inference",
                            hardware="cpu-gloo", memory_budget=_budget(model))
    tokens = pm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS + 2, max_cache_len=32).tolist()
    plan = pm.generation_plans[(2, 32)]["first"]
    return tokens, dict(plan.buffer_placements)


@pytest.mark.slow
def test_t5_generates_the_model_s_own_greedy_tokens():
    model, (ids, mask) = _t5(), _source()
    expected = model.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask,
                              max_new_tokens=NEW_TOKENS + 2).tolist()
    assert len({t for row in expected for t in row[1:]}) > 4, "a degenerate reference would prove little"
    results = run_ranks(_t5_rank, 2)
    assert [r[0] for r in results] == [expected, expected]
    assert {n for n, p in results[0][1].items() if n.endswith("keys") and p == "S(1)"} == {
        f"autotp_kv_{kind}_{i}_keys" for kind in ("self", "cross") for i in range(2)}


def _inductor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, prompt = _llama(), _prompt()
    pm = autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo", memory_budget=_budget(model))
    return pm.generate(prompt, max_new_tokens=NEW_TOKENS, compile={"backend": "inductor"}).tolist()


@pytest.mark.slow
def test_the_decode_step_compiled_by_inductor_generates_the_model_s_own_tokens():
    expected = _llama().generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    assert run_ranks(_inductor_rank, 2) == [expected, expected]
