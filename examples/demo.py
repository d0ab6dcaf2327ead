"""The main job on CPU: plan a small GPT for 2 ranks, train it on 2 gloo processes, compare.

``make demo`` runs this. It prints the plan report, then the loss of each training step for the
parallel run next to a single-process run of the original model, and the step times.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import autotp  # noqa: E402
from examples.train_gpt import build, train, train_parallel  # noqa: E402
from examples.ranks import run_ranks  # noqa: E402

WORLD, STEPS = 2, 5


def _rank_main(rank: int, world: int, plan_json: str) -> tuple[list[float], list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    losses, times, _ = train_parallel(mesh, STEPS, plan=autotp.Plan.from_json(plan_json))
    return losses, times


def main() -> None:
    torch.set_num_threads(1)
    meta_model, meta_inputs, _ = build("meta")
    plan = autotp.plan(meta_model, (WORLD,), meta_inputs, hardware="cpu-gloo")
    print(plan.report())
    print(f"\nTraining {STEPS} steps on {WORLD} gloo processes (CPU) ...")
    parallel_losses, parallel_times = run_ranks(_rank_main, WORLD, plan.to_json())[0]

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
    if worst >= 1e-4:
        sys.exit(1)


if __name__ == "__main__":
    main()
