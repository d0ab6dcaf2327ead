"""Decoding with a KV cache on 2 gloo ranks: time per token, against a hand-written plan and one process.

A random Hugging Face ``LlamaForCausalLM`` of about 100 M parameters (from its config: 8 layers,
hidden 768, 12 heads, 4 kv heads, ffn 2048, vocab 32000), prompts of 128 tokens, 128 new tokens,
greedy, at batch 1 and batch 8. Side by side in one run:

* autotp: ``autotp.parallelize(model, mesh, (prompt,), mode="inference", hardware="cpu-gloo")``,
  then ``pmodel.generate`` (a static cache split like the attention, as long as the run needs:
  prompt + new tokens);
* hand plan: PyTorch's ``parallelize_module`` with the Megatron layout of the model's own
  ``base_model_tp_plan`` (q, k, v, gate, up ``ColwiseParallel``; o, down ``RowwiseParallel``), then the
  model's own ``generate`` (its dynamic cache holds the local heads);
* one process: the model's own ``generate``.

Printed per batch size: the time per token of tokens 113-128 over that of tokens 1-16 (the cache
works when it stays near 1; recomputing the prefix gives several times that), autotp's time per
decoded token over the hand plan's and over one process's, and the prompt's time (the first token)
over the hand plan's. The tokens of the three are compared too.

    python -m benchmarks.generate [--batches 1,8] [--new 128] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from examples.ranks import run_ranks

PROMPT = 128


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=12,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every run generates all its tokens
    return model


class Clock:
    """A forward hook that records when each call ends (one call per token)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def hook(self, *_: object) -> None:
        self.ends.append(time.perf_counter())


def per_token(ends: list[float], start: float) -> list[float]:
    """Seconds of each token: the first is the prompt's call, the others one decode step each."""
    marks = [start, *ends]
    return [b - a for a, b in zip(marks, marks[1:])]


def _hand(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _ranks(rank: int, world: int, batches: list[int], new: int, layers: int) -> dict:
    import autotp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for batch in batches:
        prompt = torch.randint(0, 32000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        pmodel = autotp.parallelize(build(layers), mesh, (prompt,), mode="inference", hardware="cpu-gloo")
        cache = PROMPT + new  # a static cache as long as the run needs (the config allows 512)
        pmodel.generate(prompt, max_new_tokens=2, max_cache_len=cache)  # traces and plans the cache graphs
        graphs = next(iter(pmodel._autotp_generation.values()))
        clock = Clock()
        for g in graphs.graphs.values():
            g.register_forward_hook(clock.hook)
        start = time.perf_counter()
        tokens = pmodel.generate(prompt, max_new_tokens=new, max_cache_len=cache)
        autotp_times = per_token(clock.ends, start)
        hand = _hand(build(layers), mesh)
        hand_clock = Clock()
        hand.register_forward_hook(hand_clock.hook)
        hand.generate(prompt, max_new_tokens=2, do_sample=False)
        hand_clock.ends.clear()
        start = time.perf_counter()
        hand_tokens = hand.generate(prompt, max_new_tokens=new, do_sample=False)
        hand_times = per_token(hand_clock.ends, start)
        out[batch] = {"autotp": autotp_times, "hand": hand_times, "same": tokens.tolist() == hand_tokens.tolist(),
                      "styles": sorted(set(graphs.plans["token"].module_styles().values())),
                      "decode_collectives": len(graphs.plans["token"].collective_list)}
    return out


def _one_process(batches: list[int], new: int, layers: int) -> dict:
    torch.set_num_threads(2)
    model = build(layers)
    out = {}
    for batch in batches:
        prompt = torch.randint(0, 32000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        clock = Clock()
        model.register_forward_hook(clock.hook)
        model.generate(prompt, max_new_tokens=2, do_sample=False)
        clock.ends.clear()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, do_sample=False)
        out[batch] = per_token(clock.ends, start)
        model._forward_hooks.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ranks = run_ranks(_ranks, 2, batches, args.new, args.layers)[0]
    single = _one_process(batches, args.new, args.layers)
    n = min(16, args.new // 4)
    print(f"Llama of {sum(p.numel() for p in build(args.layers).parameters()) / 1e6:.0f} M parameters, prompt {PROMPT}, "
          f"{args.new} new tokens, greedy, 2 gloo ranks (cpu-gloo), decode time per token: median of tokens")
    for batch in batches:
        r = ranks[batch]
        a, h, s = r["autotp"], r["hand"], single[batch]
        early, late = statistics.median(a[1:1 + n]), statistics.median(a[-n:])
        decode_a, decode_h, decode_s = statistics.median(a[1:]), statistics.median(h[1:]), statistics.median(s[1:])
        print(f"batch {batch}: autotp {decode_a * 1e3:.1f} ms/token (plan: {', '.join(r['styles'])}; "
              f"{r['decode_collectives']} collectives a step), hand plan {decode_h * 1e3:.1f}, one process "
              f"{decode_s * 1e3:.1f}; tokens equal to the hand plan's: {r['same']}")
        print(f"  tokens {args.new - n + 1}-{args.new} / tokens 2-{n + 1} (autotp) = {late / early:.2f}   (goal <= 1.3)")
        print(f"  autotp / hand plan per decoded token = {decode_a / decode_h:.2f}   (goal <= 1.0)")
        print(f"  autotp prompt / hand plan prompt     = {a[0] / h[0]:.2f}")
        print(f"  autotp on 2 ranks / one process      = {decode_a / decode_s:.2f}")


if __name__ == "__main__":
    main()
