"""Does the cost model predict what runs? Predicted against measured step time of four plans.

On 2 gloo ranks (CPU), a GPT-2-small-shaped model (4 layers, dim 768, 12 heads, vocab 50304),
training mode, forward + backward (the optimizer step is not part of the prediction). The plans:

* replicated: every weight pinned ``R``;
* Megatron: q/k/v and up ``colwise``, o and down ``rowwise`` (pinned), the rest left to the solver;
* autotp: the solver's own choice;
* poor: the Megatron pins swapped (q/k/v and up ``rowwise``, o and down ``colwise``).

The profile is the one ``autotp profile`` measures on this machine (``--profile PATH`` to reuse one;
without it a short sweep runs first). Prints predicted/measured per plan and both rankings.

    .venv/bin/python benchmarks/fidelity.py [--profile my.json] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import autotp  # noqa: E402
from benchmarks.runtime import CFG, build  # noqa: E402
from examples.ranks import run_ranks  # noqa: E402

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


def _measure(rank: int, world: int, plan_jsons: dict, batch: int, seq: int, steps: int) -> dict:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, text in plan_jsons.items():
        model, inputs, targets = build(batch, seq)
        pm = autotp.parallelize(model, mesh, inputs, plan=autotp.Plan.from_json(text))
        times = []
        for i in range(steps + 2):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            logits = pm(*inputs)  # (B, T, V)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=None, help="a profile JSON from autotp profile (default: measure now)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    path = args.profile
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "profile.json")
        print("measuring this machine: autotp profile --nproc 2 -b 64K -e 32M ...", flush=True)
        subprocess.run([sys.executable, "-m", "autotp.cli", "profile", "--nproc", "2", "-b", "64K", "-e", "32M",
                        "-n", "5", "-w", "2", "-o", path], check=True, stdout=subprocess.DEVNULL)
    profile = autotp.planner.resolve_hardware(path)
    planned = plans(profile, args.batch, args.seq)
    measured = run_ranks(_measure, 2, {k: p.to_json() for k, p in planned.items()}, args.batch, args.seq,
                         args.steps)[0]

    print(f"GPT-2-small shape, {CFG.n_layer} layers, batch {args.batch} x seq {args.seq}, 2 gloo ranks, "
          f"profile {profile.name}; forward + backward")
    print(f"{'plan':12}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}   styles")
    for name, plan in planned.items():
        pred = plan.predicted_time().total_s
        styles = ", ".join(sorted({v for v in plan.module_styles().values()}))
        print(f"{name:12}{pred * 1e3:>14.1f}{measured[name] * 1e3:>13.1f}{pred / measured[name]:>11.2f}   {styles}")
    by_pred = sorted(planned, key=lambda k: planned[k].predicted_time().total_s)
    by_meas = sorted(measured, key=measured.get)
    print(f"ranking by prediction: {' < '.join(by_pred)}")
    print(f"ranking by measurement: {' < '.join(by_meas)}")
    print(f"ranking preserved: {by_pred == by_meas}")


if __name__ == "__main__":
    main()
