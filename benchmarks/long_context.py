"""Long sequences on CPU: one training step of a narrow Llama at 8k-32k tokens, one process against
autotp's plan against PyTorch's own context parallelism, side by side.

A Hugging Face ``LlamaForCausalLM`` built from its config (float32; hidden 64, 4 heads, 2 kv heads,
ffn 128, 2 layers, vocabulary 128, ``sdpa`` attention), batch 1, at each ``--seq`` tokens, its token
ids its own labels. The step is the forward with the model's own loss and the backward (no
optimizer: what is compared is the work of the step's tokens), the median of ``--steps`` after
``--warmup``, on 2 gloo ranks (processes, ``examples/ranks.py``):

* ``one process``: the model alone, on one thread and on as many as the ranks had cores;
* ``autotp``: ``autotp.parallelize`` with the plan the planner picks for ``cpu-gloo`` on (2,) (its
  attention's strategy printed: split by batch, by heads, by query rows with keys and values whole,
  or by balanced causal rows; ``docs/training.md``, "Long sequences");
* ``context_parallel``: ``torch.distributed.tensor.experimental.context_parallel`` with a hand plan
  as torchtitan writes it: every weight whole on each rank, the token ids, positions and (shifted)
  labels split along the sequence in load-balanced causal chunks, the loss summed over the ranks and
  the gradients all-reduced. Its ring attention dispatches the flash, efficient and cuDNN kernels of
  ``scaled_dot_product_attention``; where the kernel that runs is another (on CPU,
  ``_scaled_dot_product_flash_attention_for_cpu``) the step raises, and the row prints that error.

Each variant's loss must equal the one process's (asserted, float32 tolerance; the largest
difference printed). A variant's time is its slowest rank's. Peak memory per rank is measured over
one more step under ``benchmarks.memory.LiveBytes`` (every storage the step allocates, on top of
the parameters and inputs), beside the plan's predicted peak (``memory_per_device()``, planned with
no optimizer state).

    .venv/bin/python -m benchmarks.long_context [--seq 8192 16384] [--steps 3] [--warmup 1]

``tests/test_benchmarks.py`` runs :func:`measure` at 256 tokens on 2 threaded ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import threading
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from examples.ranks import run_ranks

HARDWARE = "cpu-gloo"
ROUNDS = 2  # autotp's steps and the one process's, in turns
CP_ERROR_LINE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int = 64
    ffn: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    seq: int = 8192


_BUILD_LOCK = threading.Lock()


def build(size: Size, seed: int = 0):
    """The model (its weights from ``seed``, ``sdpa`` attention) and its inputs: token ids that are
    their own labels. One build at a time in a process (a build seeds the global generator)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=size.hidden, intermediate_size=size.ffn, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
        max_position_embeddings=size.seq, attn_implementation="sdpa")
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).float()
    ids = torch.randint(0, size.vocab, (1, size.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def attention_strategies(plan) -> list[str]:
    """The strategies of the plan's attention ops, each named: by batch, heads, query rows (keys and
    values whole) or balanced causal rows."""
    named = []
    for name in sorted({n.strategy: n.name for n in plan.nodes if "attention" in n.target}.values()):
        s = plan.strategy(name)
        q = s.inputs[0][0] if s.inputs and s.inputs[0] else None
        what = ("replicated" if q is None or not q.is_shard else "batch" if q.dim == 0 else
                "heads" if q.dim == 1 else "balanced causal rows" if s.variant == "balanced" else
                "query rows, keys and values whole")
        named.append(f"{what}: {s}")
    return named


def step(model, inputs: dict) -> tuple[float, float]:
    """Seconds and loss of one step: the forward with the model's own loss, the backward."""
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return time.perf_counter() - t0, loss.item()


def timed(run: Callable[[], tuple[float, float]], steps: int, warmup: int, rounds: int = 1,
          between: Callable[[], None] = lambda: None) -> dict:
    """``rounds`` of ``warmup + steps`` runs of ``run`` (``between`` called after each round: another
    variant's turn), then one more under ``LiveBytes``: the median seconds of the runs after each
    round's warmup, every loss, the measured peak bytes."""
    from benchmarks.memory import LiveBytes

    times, losses = [], []
    for _ in range(rounds):
        results = [run() for _ in range(warmup + steps)]
        times += [t for t, _ in results[warmup:]]
        losses += [loss for _, loss in results]
        between()
    meter = LiveBytes()
    with meter:
        run()
    return {"step_s": statistics.median(times), "losses": losses, "peak_bytes": meter.peak}


def context_parallel_step(model, inputs: dict, mesh) -> tuple[float, float]:
    """One step of ``model`` under PyTorch's ``context_parallel`` (module docstring): the ids,
    positions and labels shifted by one split along the sequence, load-balanced; the loss each
    rank's tokens' sum, all-reduced over the ranks and divided by the tokens that have a label; the
    gradients all-reduced (each rank holds every weight)."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import context_parallel

    ids = inputs["input_ids"]
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    buffers = [ids.clone(), torch.arange(ids.shape[1]).unsqueeze(0), labels]
    counted = ids.numel() - ids.shape[0]
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        logits = model(input_ids=buffers[0], position_ids=buffers[1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), buffers[2].flatten(), reduction="sum") / counted
        loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return time.perf_counter() - t0, total.item()


def _rank(rank: int, world: int, size: Size, plan_text: str, steps: int, warmup: int, threads: tuple[int, ...],
          graph=None) -> dict:
    """One rank: autotp's module timed in turns with the model alone on rank 0 (each of ``threads``
    thread counts; the other ranks wait), so the machine's load hits both alike; then the
    context-parallel step tried. ``graph``: the captured model (threads: captured by the caller, as
    ``torch.export`` cannot run on several threads); else ``autotp.parallelize`` captures it here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,))
    model, inputs = build(size)
    plan = autotp.Plan.from_json(plan_text)
    if graph is None:
        pm = autotp.parallelize(model, mesh, inputs, plan=plan)
    else:
        pm = build_parallel_module(graph, plan, mesh, model)
    alone = build(size)[0] if rank == 0 else None
    single: dict[int, list] = {n: [] for n in threads}

    def one_process_turn() -> None:
        dist.barrier()
        if rank == 0:
            for n in threads:
                single[n].append(on_threads(n, lambda: timed(lambda: step(alone, inputs), steps, warmup)))
        dist.barrier()

    out = {"autotp": timed(lambda: step(pm, inputs), steps, warmup, ROUNDS, one_process_turn)}
    if rank == 0:
        out["single"] = {n: {"step_s": statistics.median(r["step_s"] for r in rs), "peak_bytes": rs[-1]["peak_bytes"],
                             "losses": [x for r in rs for x in r["losses"]]} for n, rs in single.items()}
    del pm, alone
    try:
        out["context_parallel"] = timed(lambda: context_parallel_step(model, inputs, mesh), steps, warmup)
    except Exception as err:  # noqa: BLE001 - reported: the row says why PyTorch's own did not run
        out["context_parallel"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:CP_ERROR_LINE_CHARS]}"
    return out


def on_threads(threads: int, run: Callable):
    """``run()`` with torch on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def measure(size: Size, world: int = 2, steps: int = 3, warmup: int = 1, runner: Callable = run_ranks) -> dict:
    """The variants at ``size``: each one's median step, measured peak, losses' largest difference
    from one process's (asserted within float32 tolerance), and autotp's plan. ``runner``:
    ``run_ranks`` (processes) or ``run_threads`` (one process's threads)."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, inputs = build(size)
    graph = autotp.capture(model, inputs)
    plan = plan_graph(graph, (world,), HARDWARE, "train", optimizer="sgd")
    threaded = runner is not run_ranks
    # the model alone on one thread and on as many as the ranks had cores (threaded ranks: one
    # thread, the ranks share this process's cores)
    threads = (1,) if threaded else tuple(sorted({1, min(world, os.cpu_count() or 1)}))
    ranks = runner(_rank, world, size, plan.to_json(), steps, warmup, threads, graph if threaded else None)
    single = ranks[0]["single"]
    reference = single[1]["losses"]
    variants: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name in ("autotp", "context_parallel"):
        per_rank = [r[name] for r in ranks]
        if isinstance(per_rank[0], str):
            errors[name] = per_rank[0]
            continue
        want = reference[:len(per_rank[0]["losses"])]  # a step's loss is the same in every round
        diff = max(abs(a - b) for r in per_rank for a, b in zip(r["losses"], want))
        torch.testing.assert_close([r["losses"] for r in per_rank], [want] * world, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
        variants[name] = {"step_s": max(r["step_s"] for r in per_rank),
                          "peak_bytes": max(r["peak_bytes"] for r in per_rank), "loss_diff": diff}
    return {"size": size, "world": world, "single": single, "variants": variants, "errors": errors,
            "attention": attention_strategies(plan), "predicted_s": plan.predicted_time().total_s,
            "predicted_peak_bytes": plan.memory_per_device().peak_bytes, "loss": reference[0]}


def report(rows: list[dict]) -> list[str]:
    size = rows[0]["size"]
    lines = [f"LlamaForCausalLM float32, hidden {size.hidden}, {size.heads} heads ({size.kv_heads} kv), ffn "
             f"{size.ffn}, {size.layers} layers, vocabulary {size.vocab}, batch 1, sdpa; {rows[0]['world']} gloo "
             f"ranks (processes), profile {HARDWARE}; step = forward with the model's loss, backward"]
    head = f"{'tokens':>7} {'variant':>22} {'step ms':>9} {'peak MB/rank':>13} {'loss diff':>10}"
    lines += [head, "-" * len(head)]
    for r in rows:
        seq = r["size"].seq
        for threads, s in r["single"].items():
            label = f"1 process, {threads} thread{'s' if threads > 1 else ''}"
            lines.append(f"{seq:>7} {label:>22} {s['step_s'] * 1e3:>9.1f} {s['peak_bytes'] / 1e6:>13.1f} {'':>10}")
        for name, v in r["variants"].items():
            lines.append(f"{seq:>7} {name:>22} {v['step_s'] * 1e3:>9.1f} {v['peak_bytes'] / 1e6:>13.1f} "
                         f"{v['loss_diff']:>10.1e}")
        for name, err in r["errors"].items():
            lines.append(f"{seq:>7} {name:>22} did not run: {err}")
    for r in rows:
        single = min(s["step_s"] for s in r["single"].values())
        v = r["variants"]
        ratios = [f"autotp / 1 process = {v['autotp']['step_s'] / single:.2f}x (its faster thread count)"]
        if "context_parallel" in v:
            ratios.append(f"autotp / context_parallel = {v['autotp']['step_s'] / v['context_parallel']['step_s']:.2f}x")
        lines.append(f"{r['size'].seq} tokens: {', '.join(ratios)}; autotp's attention "
                     f"{'; '.join(r['attention'])}; predicted step {r['predicted_s'] * 1e3:.1f} ms, predicted "
                     f"peak {r['predicted_peak_bytes'] / 1e6:.1f} MB")
    lines.append("every variant that ran has each step's loss equal to one process's (asserted; loss diff: the largest)")
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    rows = [measure(Size(seq=seq), 2, args.steps, args.warmup) for seq in args.seq]
    print("\n".join(report(rows)))


if __name__ == "__main__":
    main()
