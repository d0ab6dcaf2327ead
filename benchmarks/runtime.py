"""Step time of autotp's plan against a hand-written Megatron plan and a single process.

On 2 gloo ranks (CPU), a GPT-2-small-shaped model (4 layers, dim 768, 12 heads, vocab 50304):

* autotp: ``autotp.parallelize(model, mesh, inputs, hardware=...)``, the planner's own choice;
* hand plan: PyTorch's ``parallelize_module`` with the Megatron plan an expert writes (q/k/v and
  up ``ColwiseParallel``, o and down ``RowwiseParallel``, attention edited to local head counts);
* single process: the original model, one process with both cores.

Each measures forward + backward + AdamW step, median of ``--steps`` steps after ``--warmup``,
interleaved in one run so load on the machine hits both alike. Prints the ratios side by side.
With ``--compile BACKEND`` (``inductor``, ``aot_eager``) both 2-rank models are also measured
under ``torch.compile(model, backend=BACKEND)`` (the optimizer step stays eager), and the ratios
compiled / eager and compiled autotp / compiled hand plan are printed too.

    .venv/bin/python -m benchmarks.runtime [--steps 5] [--hardware cpu-gloo] [--compile inductor] [--layers 4]

The runtime's own cost per step is printed after the ratios, measured in the same run:

* the input check (every rank's inputs compared, on a module's first 8 calls by default): the
  step of a module that checks every call (``check_inputs=True``) against the same plan unchecked;
* the fixed cost of a step, where compute is least: forward and backward at batch 1 x 8 tokens,
  autotp and the hand plan on 2 ranks against the model in one process (Python, dispatch and
  collective latency; the optimizer step, which is the same for all, is left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from examples.models import GPT, GPTConfig
from examples.ranks import run_ranks

CFG = GPTConfig(vocab_size=50304, n_layer=4, n_head=12, dim=768, max_seq_len=1024)


def build(batch: int, seq: int, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (batch, seq + 1))
    return model, (tokens[:, :-1],), tokens[:, 1:]


def step_time(model, inputs, targets, steps: int, warmup: int) -> tuple[float, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss = [], None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(*inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), loss.item()


def forward_backward_time(model, inputs, targets, steps: int, warmup: int) -> float:
    """Median seconds of forward and backward alone (no optimizer step)."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(*inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def hand_megatron(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    plan = {}
    for i, layer in enumerate(model.layers):
        layer.self_attn.n_head = CFG.n_head // world  # the expert's edit: local head count
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _ranks(rank: int, world: int, batch: int, seq: int, steps: int, warmup: int, hardware: str,
           backend: str | None = None, layers: int = 4) -> dict:
    import autotp
    from torch.distributed.device_mesh import init_device_mesh

    global CFG
    CFG = dataclasses.replace(CFG, n_layer=layers)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, inputs, targets = build(batch, seq)
    pmodel = autotp.parallelize(model, mesh, inputs, hardware=hardware)
    hand_model, _, _ = build(batch, seq)
    hand = hand_megatron(hand_model, mesh)
    models = {"autotp": pmodel, "hand": hand}
    if backend:
        models |= {"autotp_compiled": torch.compile(pmodel, backend=backend),
                   "hand_compiled": torch.compile(hand, backend=backend)}
    # the same plan, its inputs compared across the ranks on every call (the default: the first 8)
    models["autotp_checked"] = autotp.parallelize(build(batch, seq)[0], mesh, inputs, plan=pmodel.plan,
                                                  check_inputs=True)
    results = {k: [] for k in models}
    for _ in range(2):  # interleave, so the machine's load hits all alike
        for k, m in models.items():
            results[k].append(step_time(m, inputs, targets, steps, warmup))
    # the fixed cost of a step: forward and backward where there is next to nothing to compute
    small_model, small_inputs, small_targets = build(1, 8)
    small = {"autotp": autotp.parallelize(small_model, mesh, small_inputs, hardware=hardware, check_inputs=False),
             "hand": hand_megatron(build(1, 8)[0], mesh)}
    fixed = {k: [] for k in small}
    for _ in range(2):
        for k, m in small.items():
            fixed[k].append(forward_backward_time(m, small_inputs, small_targets, steps * 4, warmup))
    return {k: min(t for t, _ in v) for k, v in results.items()} | {
        "styles": sorted(set(pmodel.plan.module_styles().values())),
        "predicted_s": pmodel.plan.predicted_time().total_s,
        "fixed": {k: min(v) for k, v in fixed.items()},
        "loss_autotp": results["autotp"][-1][1], "loss_hand": results["hand"][-1][1]}


def main() -> None:
    global CFG
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hardware", default="cpu-gloo")
    parser.add_argument("--compile", default=None, metavar="BACKEND", help="also measure under torch.compile")
    parser.add_argument("--layers", type=int, default=CFG.n_layer)
    args = parser.parse_args()

    CFG = dataclasses.replace(CFG, n_layer=args.layers)
    r = run_ranks(_ranks, 2, args.batch, args.seq, args.steps, args.warmup, args.hardware, args.compile,
                  args.layers)[0]
    model, inputs, targets = build(args.batch, args.seq)
    torch.set_num_threads(2)
    single, _ = step_time(model, inputs, targets, args.steps, args.warmup)
    small_model, small_inputs, small_targets = build(1, 8)
    single_fixed = forward_backward_time(small_model, small_inputs, small_targets, args.steps * 4, args.warmup)
    print(f"GPT-2-small shape, {CFG.n_layer} layers, batch {args.batch} x seq {args.seq}, 2 gloo ranks, "
          f"profile {args.hardware}; autotp plan styles: {', '.join(r['styles'])}")
    print(f"{'':28}{'step time':>12}")
    print(f"{'autotp (2 ranks)':28}{r['autotp'] * 1e3:>10.1f}ms   (predicted {r['predicted_s'] * 1e3:.1f} ms)")
    print(f"{'hand Megatron (2 ranks)':28}{r['hand'] * 1e3:>10.1f}ms")
    print(f"{'single process (2 threads)':28}{single * 1e3:>10.1f}ms")
    print(f"autotp / hand plan     = {r['autotp'] / r['hand']:.2f}x   (goal <= 1.0, aim 0.8)")
    print(f"autotp / single process = {r['autotp'] / single:.2f}x")
    print("runtime cost per step, measured in this run:")
    print(f"  input check on every call: {(r['autotp_checked'] - r['autotp']) * 1e3:+.1f} ms a step "
          f"({r['autotp_checked'] * 1e3:.1f} ms checked, {r['autotp'] * 1e3:.1f} ms with the default, "
          f"which checks the first 8 calls only)")
    fixed = r["fixed"]
    print(f"  forward + backward at batch 1 x 8 tokens: autotp {fixed['autotp'] * 1e3:.1f} ms, hand plan "
          f"{fixed['hand'] * 1e3:.1f} ms, single process {single_fixed * 1e3:.1f} ms "
          f"(autotp - single = {(fixed['autotp'] - single_fixed) * 1e3:.1f} ms: dispatch, Python and collective latency)")
    if args.compile:
        print(f"torch.compile(backend={args.compile!r}): autotp {r['autotp_compiled'] * 1e3:.1f} ms, hand plan "
              f"{r['hand_compiled'] * 1e3:.1f} ms")
        print(f"compiled autotp / eager autotp = {r['autotp_compiled'] / r['autotp']:.2f}x")
        print(f"compiled autotp / compiled hand plan = {r['autotp_compiled'] / r['hand_compiled']:.2f}x")


if __name__ == "__main__":
    main()
