"""Step time of an MoE with its experts whole on ranks, against the feature split, replicated, one process.

A Hugging Face ``Qwen3MoeForCausalLM`` built from its config (float32; 16 experts, top 2, hidden
256, ``moe_intermediate_size`` 256, 2 layers, vocabulary 2048, batch 4 x 128 tokens), its
stacked expert weights ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f) pinned three ways,
each planned for ``cpu-gloo`` on 2 and 4 gloo ranks (processes, ``examples/ranks.py``):

* ``experts``: whole experts on ranks, both weights ``S(0)``: each rank computes its experts' rows
  of every token, one all-reduce per MoE layer (``docs/design.md``, "Whole experts on ranks");
* ``features``: Megatron's split of each expert, ``gate_up_proj`` ``S(1)[2]`` (its output features,
  gate and up each split) and ``down_proj`` ``S(2)`` (its input features);
* ``replicated``: every weight ``R`` (each rank computes the whole model);

and the planner's own choice, priced and printed beside them. Each variant's training step
(``zero_grad``, forward with ``labels=``, the model's own loss, backward, ``AdamW`` step) is timed,
the median of ``--steps`` steps after ``--warmup``, the variants taking turns (two rounds, each with
a fresh ``AdamW``) so the machine's load hits them alike; a variant's time is its slowest rank's. The
model in one process runs the same rounds after the ranks, on one thread and on as many as the
ranks had cores. Each variant's loss at every step must equal the one process's (asserted), so what
is timed is a correct program. Prints each plan's placements of the expert weights, its grouped
matmuls' strategies and its predicted step, a table, and the ratios experts / features and
experts / replicated.

    .venv/bin/python -m benchmarks.experts [--ranks 2 4] [--steps 5] [--warmup 2] [--quick]

``--quick``: a tiny model of the same shape of experts (hidden 32, one layer, batch 2 x 16), one
step on 2 ranks; ``tests/test_benchmarks.py`` runs it on threads (:func:`measure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import threading
import time
from typing import Callable

import torch

from examples.ranks import run_ranks

HARDWARE = "cpu-gloo"
VARIANTS = ("experts", "features", "replicated")
ROUNDS = 2  # each variant's steps, in turns with the others; a round starts a fresh AdamW


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int = 256
    moe_ffn: int = 256
    layers: int = 2
    vocab: int = 2048
    experts: int = 16
    top_k: int = 2
    heads: int = 4
    batch: int = 4
    seq: int = 128


_BUILD_LOCK = threading.Lock()
FULL = Size()
QUICK = Size(hidden=32, moe_ffn=16, layers=1, vocab=64, heads=2, batch=2, seq=16)


def build(size: Size, seed: int = 0):
    """The model (its weights from ``seed``) and its inputs: token ids that are their own labels. One
    build at a time in a process: a build seeds the global generator and draws from it, so threaded
    ranks building at once would take each other's numbers."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=2 * size.hidden,
        moe_intermediate_size=size.moe_ffn, num_experts=size.experts, num_experts_per_tok=size.top_k,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads // 2,
        head_dim=size.hidden // size.heads, max_position_embeddings=max(size.seq, 64), tie_word_embeddings=False)
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        model = transformers.Qwen3MoeForCausalLM(config).float()
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def expert_weights(model) -> list[str]:
    """The stacked expert weights: the 3-d parameters (experts x features x features)."""
    return [n for n, p in model.named_parameters() if p.ndim == 3]


def pins(model) -> dict[str, dict[str, str]]:
    """Each variant's pins: the expert weights whole on ranks, split by features, or every weight R."""
    experts = expert_weights(model)
    return {
        "experts": {n: "S(0)" for n in experts},
        "features": {n: "S(1)[2]" if n.endswith("gate_up_proj") else "S(2)" for n in experts},
        "replicated": {n: "R" for n, _ in model.named_parameters()},
    }


def make_plans(graph, model, world: int) -> dict[str, "object"]:
    """The plans of the three variants and the planner's own (``chosen``), for ``world`` ranks."""
    from autotp.planning.planner import plan_graph

    out = {name: plan_graph(graph, (world,), HARDWARE, "train", pin=pin) for name, pin in pins(model).items()}
    out["chosen"] = plan_graph(graph, (world,), HARDWARE, "train")
    return out


def describe(plan, experts: list[str]) -> str:
    """The expert weights' placements, the grouped matmuls' strategies and the predicted step."""
    weights = sorted({f"{n.rsplit('.', 1)[1]} {plan.parameter_placements[n]}" for n in experts})
    grouped = sorted({n.strategy for n in plan.nodes if "grouped_mm" in n.target})
    t = plan.predicted_time()
    return (f"predicted {t.total_s * 1e3:.1f} ms (compute {t.compute_s * 1e3:.1f}, communication "
            f"{t.communication_s * 1e3:.1f}); weights {', '.join(weights)}; grouped matmuls {', '.join(grouped)}")


def train_steps(model, inputs: dict, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of each step after ``warmup`` and the loss of every step (forward, the model's own loss,
    backward, AdamW step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def _rank(rank: int, world: int, size: Size, texts: dict[str, str], steps: int, warmup: int,
          graph=None) -> dict:
    """One rank: each variant built from its plan (``texts``: plan JSON), timed in turns. ``graph``:
    the captured model (threads: captured by the caller, as ``torch.export`` cannot run on several
    threads); else this process captures its own."""
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, inputs = build(size)
    if graph is None:
        graph = autotp.capture(model, inputs)
    modules = {name: build_parallel_module(graph, autotp.Plan.from_json(text), mesh, build(size)[0])
               for name, text in texts.items()}
    times = {name: [] for name in modules}
    losses = {name: [] for name in modules}
    for _ in range(ROUNDS):  # in turns, so the machine's load hits all alike
        for name, pm in modules.items():
            t, loss = train_steps(pm, inputs, steps, warmup)
            times[name] += t
            losses[name] += loss
    return {"step_s": {k: statistics.median(v) for k, v in times.items()}, "losses": losses}


def one_process(size: Size, inputs: dict, steps: int, warmup: int, threads: int) -> tuple[float, list[float]]:
    """The model in this process on ``threads`` threads, ``ROUNDS`` rounds as a rank runs them: the
    median step seconds and every step's loss."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, _ = build(size)
        times, losses = [], []
        for _ in range(ROUNDS):
            t, loss = train_steps(model, inputs, steps, warmup)
            times += t
            losses += loss
    finally:
        torch.set_num_threads(before)
    return statistics.median(times), losses


def measure(size: Size, world: int, steps: int, warmup: int, runner: Callable = run_ranks) -> dict:
    """The variants on ``world`` ranks and the model in one process: median step seconds, each plan's
    description, and the losses checked against one process's. ``runner``: ``run_ranks``
    (processes) or ``run_threads`` (one process's threads; the graph is captured here then)."""
    import autotp

    model, inputs = build(size)
    graph = autotp.capture(model, inputs)
    plans = make_plans(graph, model, world)
    experts = expert_weights(model)
    texts = {name: plans[name].to_json() for name in VARIANTS}
    threaded = runner is not run_ranks
    results = runner(_rank, world, size, texts, steps, warmup, graph if threaded else None)
    # one process on one thread and on as many as the ranks had cores (threaded ranks: one thread, the
    # ranks shared this process's cores), the same rounds of steps
    counts = {1} if threaded else {1, min(world, os.cpu_count() or 1)}
    single = {n: one_process(size, inputs, steps, warmup, n) for n in sorted(counts)}
    single_losses = single[1][1]
    for name in VARIANTS:
        for rank, r in enumerate(results):
            torch.testing.assert_close(r["losses"][name], single_losses, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name, rank=rank: f"{name}, rank {rank}: {m}")
    slowest = {name: max(r["step_s"][name] for r in results) for name in VARIANTS}
    return {"world": world, "step_s": slowest, "single_s": {n: t for n, (t, _) in single.items()},
            "describe": {name: describe(plan, experts) for name, plan in plans.items()},
            "predicted_s": {name: plan.predicted_time().total_s for name, plan in plans.items()},
            "loss": single_losses[0]}


def report(size: Size, rows: list[dict]) -> list[str]:
    lines = [f"Qwen3MoeForCausalLM float32: {size.experts} experts top {size.top_k}, hidden {size.hidden}, "
             f"moe_intermediate {size.moe_ffn}, {size.layers} layers, vocab {size.vocab}, batch {size.batch} x "
             f"{size.seq}; gloo ranks (processes), profile {HARDWARE}; step = forward, loss, backward, AdamW"]
    for r in rows:
        lines.append(f"{r['world']} ranks:")
        for name in (*VARIANTS, "chosen"):
            lines.append(f"  {name:10} {r['describe'][name]}")
    lines.append(f"{'ranks':>5} {'variant':>10} {'measured ms':>12} {'predicted ms':>13}")
    for r in rows:
        for name in VARIANTS:
            lines.append(f"{r['world']:>5} {name:>10} {r['step_s'][name] * 1e3:>12.1f} "
                         f"{r['predicted_s'][name] * 1e3:>13.1f}")
        for threads, t in r["single_s"].items():
            lines.append(f"{r['world']:>5} {'1 process':>10} {t * 1e3:>12.1f} {'':>13}  ({threads} thread"
                         f"{'s' if threads > 1 else ''})")
    for r in rows:
        s = r["step_s"]
        single = min(r["single_s"].values())
        lines.append(f"{r['world']} ranks: experts / features = {s['experts'] / s['features']:.2f}x, "
                     f"experts / replicated = {s['experts'] / s['replicated']:.2f}x, experts / 1 process = "
                     f"{s['experts'] / single:.2f}x (its faster thread count); predicted experts / features = "
                     f"{r['predicted_s']['experts'] / r['predicted_s']['features']:.2f}x, predicted experts / replicated = "
                     f"{r['predicted_s']['experts'] / r['predicted_s']['replicated']:.2f}x")
    lines.append("every variant's loss at every step equals one process's (asserted)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one step on 2 ranks")
    args = parser.parse_args(argv)
    size, ranks, steps, warmup = (QUICK, [2], 1, 0) if args.quick else (FULL, args.ranks, args.steps, args.warmup)
    rows = [measure(size, world, steps, warmup) for world in ranks]
    print("\n".join(report(size, rows)))


if __name__ == "__main__":
    main()
