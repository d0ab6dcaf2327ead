"""Planning time on the Llama 3 8B shape (mesh (8,)) and 70B (mesh (8, 8), at 80 layers and at 8):
end to end, the model traced whole against its stacks traced at three layers and unrolled (what
``autotp.plan`` does), side by side, with whether the two plans are the same.

Stages timed separately, in one run: capture (``autotp.capture``, ``unroll=False`` or ``True``),
strategies (layer tying + ``all_strategies``), solve (formulating and solving the ILP); plus the
ILP's size and the predicted step time of the plan found. "same plan" compares the unrolled row's
placements, collectives and predicted time with the whole row's.

Variants (``--variants``): ``whole``, ``unrolled`` (default both); ``old``, the unrolled graph with
recompute left out of the ILP (the formulation before it was a choice); ``untied``, the whole graph
with every node its own variables (slow: minutes). Each configuration runs in its own process under
a wall-clock limit (``--limit-s``) and the solver under ``--solver-limit-s``.

    .venv/bin/python -m benchmarks.plan_time
    .venv/bin/python -m benchmarks.plan_time --only 8b --variants unrolled
    .venv/bin/python -m benchmarks.plan_time --variants unrolled --repeat 5   # medians of 5 runs each
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = {  # name: (examples.models.hf_llama kwargs, mesh shape)
    "8b": (dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256), (8,)),
    "70b": (dict(n_layer=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256), (8, 8)),
    "70b-8": (dict(n_layer=8, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256), (8, 8)),
}
VARIANTS = ("whole", "unrolled", "old", "untied")
HARDWARE = "h100-sxm"


def _digest(plan) -> str:
    """The plan's choices, as a short hash: equal for equal placements and collectives."""
    text = json.dumps([[n.name, n.strategy] for n in plan.nodes] + sorted(plan.parameter_placements.items())
                      + [str(c) for c in plan.collective_list])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def one(name: str, variant: str, solver_limit_s: float) -> dict:
    """One configuration, in this process; returns the figures as a dict."""
    import torch  # noqa: F401

    import autotp
    from autotp.mesh import MeshSpec
    from autotp.planning.choices.strategies import all_strategies
    from autotp.planning.costs.costing import CostModel
    from autotp.planning.planner import plan_graph, predicted_time
    from autotp.planning.solve.solver import solve
    from cost_models import resolve_hardware
    from examples import models as M

    shape, mesh = CONFIGS[name]
    model, inputs = M.hf_llama(**shape, seq=2048, batch=1, device="meta")
    t0 = time.perf_counter()
    graph = autotp.capture(model, inputs, unroll=variant in ("unrolled", "old"))
    capture_s = time.perf_counter() - t0
    out = dict(name=name, mesh=list(mesh), variant=variant, nodes=len(graph), capture_s=capture_s,
               unrolled=bool(graph.unrolled))
    if variant != "untied":
        plan = plan_graph(graph, mesh, HARDWARE, mode="train", time_limit_s=solver_limit_s, capture_s=capture_s,
                          recompute=False if variant == "old" else None)
        st = plan.stats
        out.update(strategies_s=st.strategies_s, solve_s=st.solve_s, variables=st.variables,
                   constraints=st.constraints, representatives=st.representatives, status=st.status,
                   predicted_ms=plan.predicted_time().total_s * 1e3, recompute=len(plan.recompute),
                   total_s=time.perf_counter() - t0, digest=_digest(plan))
        return out
    spec = MeshSpec.of(mesh)
    profile = resolve_hardware(HARDWARE)
    t1 = time.perf_counter()
    rep = {n.name: n.name for n in graph.nodes}
    strategies = all_strategies(graph, spec.shape)
    out["strategies_s"] = time.perf_counter() - t1
    cost = CostModel(spec, profile, "train")
    solution = solve(graph, strategies, rep, cost, float(profile.device.memory_bytes), solver_limit_s, recompute=False)
    chosen = {k: strategies[k][i] for k, i in solution.choice.items()}
    predicted = predicted_time(graph, chosen, spec, cost).total_s
    out.update(solve_s=solution.seconds, variables=solution.variables, constraints=solution.constraints,
               representatives=solution.representatives, status=solution.status, predicted_ms=predicted * 1e3,
               total_s=time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(CONFIGS), action="append")
    ap.add_argument("--variants", default="whole,unrolled", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--limit-s", type=float, default=900.0, help="wall-clock limit per configuration")
    ap.add_argument("--solver-limit-s", type=float, default=600.0, help="the ILP solver's own time limit")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each configuration (fresh processes, in rounds); the table shows the median run")
    ap.add_argument("--one", nargs=2, metavar=("NAME", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], args.one[1], args.solver_limit_s)))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {', '.join(unknown)}: expected some of {', '.join(VARIANTS)}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):  # rounds of every configuration, so a slow spell of the machine hits them alike
        for name in args.only or list(CONFIGS):
            for variant in variants:
                start = time.perf_counter()
                cmd = [sys.executable, "-m", "benchmarks.plan_time", "--one", name, variant,
                       "--solver-limit-s", str(args.solver_limit_s)]
                try:
                    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.limit_s)
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                    if lines:
                        row = json.loads(lines[-1][len("RESULT "):])
                    else:
                        row = dict(name=name, variant=variant, mesh=list(CONFIGS[name][1]),
                                   status=f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
                except subprocess.TimeoutExpired:
                    row = dict(name=name, variant=variant, mesh=list(CONFIGS[name][1]),
                               status=f"did not finish within {args.limit_s:.0f} s wall clock")
                row["wall_s"] = time.perf_counter() - start
                runs.setdefault((name, variant), []).append(row)
                print(f"  done: {name} {variant} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    _table([_median(rows) for rows in runs.values()], args.repeat)


def _median(rows: list[dict]) -> dict:
    """The run of median end-to-end time (the last one where a run failed), with every run's total."""
    timed = sorted((r for r in rows if "total_s" in r), key=lambda r: r["total_s"])
    if len(timed) < len(rows):
        return rows[-1]
    row = dict(timed[(len(timed) - 1) // 2])
    row["totals_s"] = [r["total_s"] for r in rows]
    return row


def _table(rows: list[dict], repeat: int = 1) -> None:
    def f(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    head = (f"{'model':<6} {'mesh':<5} {'capture':<9} {'nodes':>6} {'reps':>5} {'capture s':>9} {'strat s':>8} "
            f"{'solve s':>8} {'total s':>8} {'variables':>10} {'pred ms':>9}  plan          status")
    print(f"HF LlamaForCausalLM on meta, batch 1 x seq 2048, train mode, hardware {HARDWARE}")
    print(head)
    print("-" * len(head))
    for r in rows:
        mesh = "x".join(map(str, r["mesh"]))
        print(f"{r['name']:<6} {mesh:<5} {r['variant']:<9} {f(r, 'nodes', 'd'):>6} "
              f"{f(r, 'representatives', 'd'):>5} {f(r, 'capture_s', '.2f'):>9} {f(r, 'strategies_s', '.2f'):>8} "
              f"{f(r, 'solve_s', '.2f'):>8} {f(r, 'total_s', '.2f'):>8} {f(r, 'variables', 'd'):>10} "
              f"{f(r, 'predicted_ms', '.1f'):>9}  {r.get('digest', '-'):<12}  {r.get('status', '')} "
              f"(wall {r['wall_s']:.0f} s)")
    print("capture: whole = torch.export over every layer; unrolled = each stack of alike layers traced at three "
          "layers and unrolled (autotp.plan); old = unrolled, recompute left out of the ILP; untied = every node "
          "its own variables. total = capture to the finished plan, in one process"
          + (f"; each row is the median of {repeat} runs" if repeat > 1 else ""))
    by = {(r["name"], r["variant"]): r for r in rows}
    for name in dict.fromkeys(r["name"] for r in rows):
        whole, unrolled = by.get((name, "whole")), by.get((name, "unrolled"))
        if whole and unrolled and "total_s" in whole and "total_s" in unrolled:
            print(f"{name}: end to end unrolled / whole = {unrolled['total_s'] / whole['total_s']:.2f} "
                  f"({unrolled['total_s']:.2f} s / {whole['total_s']:.2f} s); same plan: "
                  f"{'yes' if whole.get('digest') == unrolled.get('digest') else 'NO'}")
    for variant in ("unrolled", "whole"):
        deep, shallow = by.get(("70b", variant)), by.get(("70b-8", variant))
        if deep and shallow and "total_s" in deep and "total_s" in shallow:
            print(f"70B, {variant}: 80 layers / 8 layers end to end = {deep['total_s'] / shallow['total_s']:.2f} "
                  f"({deep['total_s']:.2f} s / {shallow['total_s']:.2f} s)")
            if "totals_s" in deep and "totals_s" in shallow:
                print("  every run, 80 layers: " + ", ".join(f"{t:.2f}" for t in deep["totals_s"])
                      + " s; 8 layers: " + ", ".join(f"{t:.2f}" for t in shallow["totals_s"]) + " s")


if __name__ == "__main__":
    main()
