"""Does the cost model predict what runs? Predicted against measured step time of four plans.

On 2 gloo ranks (CPU), a GPT-2-small-shaped model (4 layers, dim 768, 12 heads, vocab 50304),
training mode, forward + backward (the optimizer step is not part of the prediction). The plans:

* replicated: every weight pinned ``R``;
* Megatron: q/k/v and up ``colwise``, o and down ``rowwise`` (pinned), the rest left to the solver;
* autotp: the solver's own choice;
* poor: the Megatron pins swapped (q/k/v and up ``rowwise``, o and down ``colwise``).

The profile is the one ``autotp profile`` measures on this machine (``--profile PATH`` to reuse one;
without it a short sweep runs first). Prints predicted/measured per plan and both rankings.

The measured step is what a plan's prediction covers, the planned model's forward and backward:
``pm(tokens).backward(grad)``, with a fixed gradient of the logits' shape standing in for the loss's.
A loss such as ``cross_entropy`` runs outside the planned model (the user's code, not the plan's),
and its one-thread ``log_softmax`` on this host is bound by its ``exp`` rather than by memory, which
no plan changes. Each plan's figure is the median step
over ``--repeats`` rounds of ``--steps`` turns; in a turn every plan takes one step, in an order
that rotates from turn to turn (so a change of load on the machine, which lasts seconds to
minutes on a shared VM, hits all alike, and no plan always goes first);
``spread`` is the lowest to highest median of a round, and ``cpu/wall``
the rank's CPU time over wall time (well below 1 with the ranks waiting on each other or on
collectives, and lower still when other processes take the cores: a warning sign).

``device now`` prices the same plans with the profile's links and the device measured again (as
``autotp profile`` does, both ranks at once) just before and just after the steps, the mean of the
two: this VM's matmul rate drifts by up to half between minutes, so ``pred/meas`` moves with the
drift since the profile was taken, and ``now/meas`` shows the cost model without it.

Then, for each two plans (or groups of plans tied in the prediction) next to each other in the
predicted ranking, the measured difference of their steps in the same turn, with a 95% interval:
where the interval holds zero, this machine cannot tell the two plans apart in that many steps,
and the strict ranking line above is a coin toss for that pair.

    .venv/bin/python -m benchmarks.fidelity [--profile my.json] [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import autotp
import cost_models
from benchmarks.runtime import CFG, build
from examples.ranks import run_ranks

_QKV_UP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")
_O_DOWN = ("self_attn.o_proj", "mlp.down_proj")


def _pins(colwise: str, rowwise: str) -> dict[str, str]:
    pins = {}
    for i in range(CFG.n_layer):
        pins.update({f"layers.{i}.{m}.weight": colwise for m in _QKV_UP})
        pins.update({f"layers.{i}.{m}.weight": rowwise for m in _O_DOWN})
    return pins


def plans(profile, batch: int, seq: int) -> dict[str, autotp.Plan]:
    with torch.device("meta"):
        model, inputs, _ = build(batch, seq)
    names = [n for n, _ in model.named_parameters()]
    common = dict(hardware=profile, mode="train")
    return {
        "replicated": autotp.plan(model, (2,), inputs, pin={n: "R" for n in names}, **common),
        "megatron": autotp.plan(model, (2,), inputs, pin=_pins("S(0)", "S(1)"), **common),
        "autotp": autotp.plan(model, (2,), inputs, **common),
        "poor": autotp.plan(model, (2,), inputs, pin=_pins("S(1)", "S(0)"), **common),
    }


def _measure(rank: int, world: int, plan_jsons: dict, batch: int, seq: int, steps: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # the same gradient of the logits on every rank, as a loss on the replicated logits would give
    grad = torch.randn(batch, seq, CFG.vocab_size, generator=torch.Generator().manual_seed(1)) / (batch * seq)
    models = {}
    for name, text in plan_jsons.items():
        model, inputs, _ = build(batch, seq)
        models[name] = (autotp.parallelize(model, mesh, inputs, plan=autotp.Plan.from_json(text)), inputs, grad)

    def step(pm, inputs, grad) -> tuple[float, float]:
        pm.zero_grad(set_to_none=True)  # as a training step does: backward writes fresh gradients
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        pm(*inputs).backward(grad)  # logits (B, T, V)
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(2):  # warm-up
        for pm, inputs, grad in models.values():
            step(pm, inputs, grad)
    devices = [_device_now(world)]
    names = list(models)
    turn = 0
    wall = {name: [] for name in models}  # one list of step times per round
    cpu = {name: [] for name in models}
    for _ in range(repeats):
        for name in models:
            wall[name].append([])
            cpu[name].append([])
        for _ in range(steps):
            first = turn % len(names)
            turn += 1
            for name in names[first:] + names[:first]:  # one step of each plan, the order rotating
                w, c = step(*models[name])
                wall[name][-1].append(w)
                cpu[name][-1].append(c)
    devices.append(_device_now(world))
    plans_measured = {name: {"median_s": statistics.median(t for r in wall[name] for t in r),
                             "steps_s": [t for r in wall[name] for t in r],  # in the order taken, paired
                             "round_medians_s": [statistics.median(r) for r in wall[name]],
                             "cpu_over_wall": sum(map(sum, cpu[name])) / sum(map(sum, wall[name]))}
                      for name in models}
    return {"plans": plans_measured, "devices": devices}


def _device_now(world: int):
    """The device as ``autotp profile`` measures it (every rank at once, the slowest kept), now."""
    from autotp.profiling.device import measure_device, slowest_rank

    return slowest_rank(measure_device(torch.device("cpu")), world)


def predicted_now_s(planned: dict, profile, devices: list, batch: int, seq: int) -> dict[str, float]:
    """Each plan's predicted step with the profile's links and the device measured
    just before and just after the steps (the mean of the two predictions): what the cost model
    says once the host's drift in speed since the profile is taken out."""
    from autotp.planning.costs.costing import CostModel
    from autotp.planning.planner import predicted_time
    from autotp.profiling.hardware import device_spec

    with torch.device("meta"):
        model, inputs, _ = build(batch, seq)
    graph = autotp.capture(model, inputs)
    out = {name: 0.0 for name in planned}
    for measured in devices:
        now = dataclasses.replace(profile, device=device_spec(measured))
        for name, plan in planned.items():
            cost = CostModel(plan.mesh, now, plan.mode)
            out[name] += predicted_time(graph, dict(plan.strategies), plan.mesh, cost).total_s / len(devices)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=None, help="a profile JSON from autotp profile (default: measure now)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of --steps steps, the plans in turn")
    args = parser.parse_args()

    path = args.profile
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "profile.json")
        # up to 256 MiB: the plans' largest collectives (the logits, 206 MB) lie in that range
        print("measuring this machine: autotp profile --nproc 2 -b 64K -e 256M -f 4 ...", flush=True)
        subprocess.run([sys.executable, "-m", "autotp.cli", "profile", "--nproc", "2", "-b", "64K", "-e", "256M",
                        "-f", "4", "-n", "5", "-w", "2", "--no-held-out", "-o", path], check=True,
                       stdout=subprocess.DEVNULL)
    profile = cost_models.resolve_hardware(path)
    planned = plans(profile, args.batch, args.seq)
    load_before = os.getloadavg()[0]
    measured = run_ranks(_measure, 2, {k: p.to_json() for k, p in planned.items()}, args.batch, args.seq,
                         args.steps, args.repeats)
    load_after = os.getloadavg()[0]
    rank0 = measured[0]["plans"]  # rank 0's steps (the ranks start each step together at a barrier)

    print(f"GPT-2-small shape, {CFG.n_layer} layers, batch {args.batch} x seq {args.seq}, 2 gloo ranks, "
          f"profile {profile.name}; the model's forward + backward")
    print(f"{'plan':12}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}{'spread ms':>17}{'cpu/wall':>10}"
          f"{'device now':>12}{'now/meas':>10}   styles")
    predicted = {k: p.predicted_time().total_s for k, p in planned.items()}
    now = predicted_now_s(planned, profile, measured[0]["devices"], args.batch, args.seq)
    for name, plan in planned.items():
        m = rank0[name]
        lo, hi = min(m["round_medians_s"]), max(m["round_medians_s"])
        styles = ", ".join(sorted({v for v in plan.module_styles().values()}))
        print(f"{name:12}{predicted[name] * 1e3:>14.1f}{m['median_s'] * 1e3:>13.1f}"
              f"{predicted[name] / m['median_s']:>11.2f}{f'{lo * 1e3:.0f}..{hi * 1e3:.0f}':>17}"
              f"{m['cpu_over_wall']:>10.2f}{now[name] * 1e3:>12.1f}{now[name] / m['median_s']:>10.2f}   {styles}")
    before, after = (d.peak_flops["float32"] for d in measured[0]["devices"])
    print(f"device now: the profile's links with the device measured again just before and just after the "
          f"steps (float32 matmul peak {before / 1e9:.0f} and {after / 1e9:.0f} GFLOP/s; the profile's "
          f"{profile.device.peak_flops['float32'] / 1e9:.0f})")
    same = _ties(planned, predicted)
    for a, b in same:
        how = ("the same plan" if dict(planned[a].strategies) == dict(planned[b].strategies)
               else "different plans of equal predicted time")
        print(f"{a} and {b}: {how}, a tie in the prediction; ranked by the mean of their measurements")
    by_pred = sorted(planned, key=predicted.get)
    by_meas = sorted(planned, key=lambda k: _group_mean_s(k, same, rank0))
    print(f"ranking by prediction: {_ranking(by_pred, same)}")
    print(f"ranking by measurement: {_ranking(by_meas, same)}")
    print(f"ranking preserved: {_canonical(by_pred, same) == _canonical(by_meas, same)}"
          + (" (ties in the prediction count as ties)" if same else ""))
    print("measured differences of the plans next to each other in the predicted ranking "
          "(steps of the same turn paired; mean and 95% interval):")
    groups = _tie_groups(by_pred, same)
    for first, second in zip(groups, groups[1:]):
        mean_s, half_s = paired_difference_s(_per_step_mean_s(second, rank0), _per_step_mean_s(first, rank0))
        verdict = ("agrees" if mean_s - half_s > 0 else "disagrees" if mean_s + half_s < 0
                   else "too close to tell on this machine")
        gap_s = predicted[second[0]] - predicted[first[0]]
        print(f"  {' = '.join(second)} - {' = '.join(first)}: predicted {gap_s * 1e3:+.0f} ms, measured "
              f"{mean_s * 1e3:+.0f} ms +- {half_s * 1e3:.0f} ms: {verdict}")
    print(f"load average (1 min) on this host: {load_before:.2f} before, {load_after:.2f} after"
          + (f"; {os.cpu_count()} cores: other processes were competing with the ranks"
             if max(load_before, load_after) > (os.cpu_count() or 1) + 0.5 else ""))


# two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 18: 2.10, 20: 2.09, 25: 2.06, 30: 2.04}


def paired_difference_s(later: list[float], earlier: list[float]) -> tuple[float, float]:
    """Mean of ``later[k] - earlier[k]`` over steps of the same turn, and the half-width of its
    95% interval (Student's t): pairing cancels most of the machine's load, which both steps share.
    Turns follow each other, so their load is not quite independent: read the interval as a guide.

    >>> [round(x, 3) for x in paired_difference_s([3.0, 4.0, 3.5, 5.0], [2.0, 3.1, 2.4, 4.1])]
    [0.975, 0.152]
    """
    diffs = [x - y for x, y in zip(later, earlier)]
    if len(diffs) < 2:
        return (diffs[0] if diffs else 0.0), float("inf")
    dof = len(diffs) - 1
    t = _T95[max(k for k in _T95 if k <= dof)] if dof <= 30 else 1.96
    return statistics.fmean(diffs), t * statistics.stdev(diffs) / len(diffs) ** 0.5


def _tie_groups(order: list[str], same: list[tuple[str, str]]) -> list[list[str]]:
    """``order`` cut into groups of plans tied in the prediction, in order."""
    root = _tie_root(same)
    groups: dict[str, list[str]] = {}
    for name in order:
        groups.setdefault(root.get(name, name), []).append(name)
    return list(groups.values())


def _per_step_mean_s(group: list[str], rank0: dict) -> list[float]:
    """Step by step, the mean over the plans of ``group`` (one plan: its own steps)."""
    return [statistics.fmean(ts) for ts in zip(*(rank0[name]["steps_s"] for name in group))]


def _ties(planned: dict, predicted: dict) -> list[tuple[str, str]]:
    """Pairs of plans whose predicted step times agree within 0.1%."""
    names = list(planned)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if abs(predicted[a] - predicted[b]) <= 1e-3 * max(predicted[a], predicted[b])]


def _tie_root(same: list[tuple[str, str]]) -> dict[str, str]:
    """Each tied plan -> the first plan of its tie group (ties chain: a~b and b~c make one group)."""
    root: dict[str, str] = {}

    def find(x: str) -> str:
        while root.get(x, x) != x:
            x = root[x]
        return x

    for a, b in same:  # a comes before b in the plans' order, so the first plan stays the root
        ra, rb = find(a), find(b)
        if ra != rb:
            root[rb] = ra
    return {x: find(x) for pair in same for x in pair}


def _group_mean_s(name: str, same: list[tuple[str, str]], rank0: dict) -> float:
    """A plan's measured median, or for plans tied in the prediction the mean over the tied group
    (the same plan measured twice is ranked once, at its average, not at its luckier run)."""
    root = _tie_root(same)
    group = [k for k in rank0 if root.get(k, k) == root.get(name, name)]
    return sum(rank0[k]["median_s"] for k in group) / len(group)


def _canonical(order: list[str], same: list[tuple[str, str]]) -> list[str]:
    """The order with each plan named by the first plan of its tie group."""
    root = _tie_root(same)
    return list(dict.fromkeys(root.get(name, name) for name in order))


def _ranking(order: list[str], same: list[tuple[str, str]]) -> str:
    return " < ".join(" = ".join(g) for g in _tie_groups(order, same))


if __name__ == "__main__":
    main()
