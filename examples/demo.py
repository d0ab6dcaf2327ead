"""The main job on CPU: plan a small GPT for 2 ranks, train it on 2 gloo processes, compare.

``make demo`` runs this. It prints the plan report, then the loss of each training step for the
parallel run next to a single-process run of the original model, and the step times; last, the
plan's predicted forward and backward next to the one measured here. The built-in ``cpu-gloo``
profile was measured on another 2-core machine: the demo says how far this one is from it, and
how to measure a profile of this one (``autotp profile``).

    python -m examples.demo            # from the repository root; make demo runs this
"""

from __future__ import annotations

import sys

import torch

import autotp
from examples.train_gpt import build, train
from examples.ranks import run_ranks

WORLD, STEPS = 2, 5


def _rank_main(rank: int, world: int, plan_json: str) -> tuple[list[float], list[float], float]:
    import time

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, inputs, targets = build("cpu")
    pmodel = autotp.parallelize(model, mesh, inputs, plan=autotp.Plan.from_json(plan_json))
    losses, times = train(pmodel, inputs, targets, STEPS)
    # what the plan predicts: the model's forward and backward (no loss, no optimizer step)
    spent = []
    for _ in range(3):
        t0 = time.perf_counter()
        pmodel(*inputs).float().pow(2).mean().backward()
        spent.append(time.perf_counter() - t0)
    return losses, times, sorted(spent)[1]


def main() -> None:
    torch.set_num_threads(1)
    meta_model, meta_inputs, _ = build("meta")
    plan = autotp.plan(meta_model, (WORLD,), meta_inputs, hardware="cpu-gloo")
    print(plan.report())
    print(f"\nTraining {STEPS} steps on {WORLD} gloo processes (CPU) ...")
    parallel_losses, parallel_times, measured_s = run_ranks(_rank_main, WORLD, plan.to_json())[0]

    model, inputs, targets = build("cpu")
    single_losses, single_times = train(model, inputs, targets, STEPS)
    print(f"\n{'step':>4}  {'loss autotp (2 ranks)':>22}  {'loss single process':>20}  {'|diff|':>9}  "
          f"{'step ms autotp':>14}  {'step ms single':>14}")
    for i in range(STEPS):
        print(f"{i:>4}  {parallel_losses[i]:>22.6f}  {single_losses[i]:>20.6f}  "
              f"{abs(parallel_losses[i] - single_losses[i]):>9.2e}  {parallel_times[i] * 1e3:>14.1f}  "
              f"{single_times[i] * 1e3:>14.1f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(parallel_losses, single_losses))
    print(f"\nlargest relative loss difference: {worst:.2e} ({'match' if worst < 1e-4 else 'MISMATCH'})")
    predicted_s = plan.predicted_time().total_s
    print(f"\nPredicted forward and backward: {predicted_s * 1e3:.1f} ms with the built-in {plan.hardware.name} profile, "
          f"which was measured on another 2-core machine; measured here: {measured_s * 1e3:.1f} ms, "
          f"{measured_s / predicted_s:.1f}x the prediction. For figures that describe this machine, measure it "
          f"(about a minute) and plan with its profile:\n"
          f"  .venv/bin/autotp profile --nproc 2 -o here.json\n"
          f"  .venv/bin/autotp plan examples.train_gpt:model_and_inputs --mesh 2 --hardware here.json")
    if worst >= 1e-4:
        sys.exit(1)


if __name__ == "__main__":
    main()
