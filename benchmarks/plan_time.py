"""Planning time on Llama 3 8B (mesh (8,)) and 70B (mesh (8, 8)): the ILP with recompute as a choice
against the one without (side by side, with their ratio), and, with ``--untied``, without layer tying.

Stages timed separately, in one run: capture (``autotp.capture``), strategies (layer tying +
``all_strategies``), solve (formulating and solving the ILP); plus the ILP's size (variables,
constraints, representative nodes) and the predicted step time of the plan found, so the two
columns can be compared side by side.

"tied" is what ``autotp.plan`` does; "old" is the same with ``recompute=False`` (the formulation
before recompute was a choice). "untied" calls the planner's stages directly with
an identity representative map (every node its own representative): ``autotp.planning.planner.plan_graph``
has no switch for it, so this script repeats its three steps (``find_repeats`` -> ``all_strategies``
-> ``solver.solve``) with ``rep = {n: n}``.

Each configuration runs in its own process under a wall-clock limit (``--limit-s``, default 900 s)
and the solver under ``--solver-limit-s`` (default 600 s); a configuration that runs out of time is
reported as such.

    .venv/bin/python -m benchmarks.plan_time
    .venv/bin/python -m benchmarks.plan_time --only 8b --limit-s 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = {  # name: (examples.models.hf_llama kwargs, mesh shape)
    "8b": (dict(n_layer=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256), (8,)),
    "70b": (dict(n_layer=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256), (8, 8)),
}
HARDWARE = "h100-sxm"


def one(name: str, variant: str, solver_limit_s: float) -> dict:
    """One configuration, in this process; returns the figures as a dict."""
    tying = variant != "untied"
    import torch  # noqa: F401

    import autotp
    from autotp.planning.costing import CostModel
    from autotp.mesh import MeshSpec
    from autotp.planning.planner import plan_graph, predicted_time, resolve_hardware
    from autotp.planning.solver import solve
    from autotp.planning.strategies import all_strategies
    from autotp.planning.tying import find_repeats
    from examples import models as M

    shape, mesh = CONFIGS[name]
    model, inputs = M.hf_llama(**shape, seq=2048, batch=1, device="meta")
    t0 = time.perf_counter()
    graph = autotp.capture(model, inputs)
    capture_s = time.perf_counter() - t0
    out = dict(name=name, mesh=list(mesh), tying=tying, variant=variant, nodes=len(graph), capture_s=capture_s)
    if tying:
        # "tied": the planner as it is (recompute a choice where memory is short); "old": recompute left
        # out of the formulation, as before it was a choice
        plan = plan_graph(graph, mesh, HARDWARE, mode="train", time_limit_s=solver_limit_s, capture_s=capture_s,
                          recompute=False if variant == "old" else None)
        st = plan.stats
        out.update(strategies_s=st.strategies_s, solve_s=st.solve_s, variables=st.variables,
                   constraints=st.constraints, representatives=st.representatives, status=st.status,
                   predicted_ms=plan.predicted_time().total_s * 1e3, recompute=len(plan.recompute))
        return out
    spec = MeshSpec.of(mesh)
    profile = resolve_hardware(HARDWARE)
    t0 = time.perf_counter()
    rep = {n.name: n.name for n in graph.nodes}
    strategies = all_strategies(graph, spec.shape)
    out["strategies_s"] = time.perf_counter() - t0
    cost = CostModel(spec, profile, "train")
    solution = solve(graph, strategies, rep, cost, float(profile.device.memory_bytes), solver_limit_s, recompute=False)
    chosen = {k: strategies[k][i] for k, i in solution.choice.items()}
    predicted = predicted_time(graph, chosen, spec, cost).total_s
    out.update(solve_s=solution.seconds, variables=solution.variables, constraints=solution.constraints,
               representatives=solution.representatives, status=solution.status, predicted_ms=predicted * 1e3)
    _ = find_repeats  # (the tied path's first step; unused here on purpose)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(CONFIGS), action="append")
    ap.add_argument("--limit-s", type=float, default=900.0, help="wall-clock limit per configuration")
    ap.add_argument("--solver-limit-s", type=float, default=600.0, help="the ILP solver's own time limit")
    ap.add_argument("--untied", action="store_true", help="also plan without layer tying (slow: minutes)")
    ap.add_argument("--one", nargs=2, metavar=("NAME", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], args.one[1], args.solver_limit_s)))
        return
    rows = []
    for name in args.only or list(CONFIGS):
        for tying in ("old", "tied") + (("untied",) if args.untied else ()):
            start = time.perf_counter()
            cmd = [sys.executable, "-m", "benchmarks.plan_time", "--one", name, tying,
                   "--solver-limit-s", str(args.solver_limit_s)]
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.limit_s)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if lines:
                    row = json.loads(lines[-1][len("RESULT "):])
                else:
                    row = dict(name=name, tying=tying != "untied", variant=tying, mesh=list(CONFIGS[name][1]),
                               status=f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            except subprocess.TimeoutExpired:
                row = dict(name=name, tying=tying != "untied", variant=tying, mesh=list(CONFIGS[name][1]),
                           status=f"did not finish within {args.limit_s:.0f} s wall clock")
            row["wall_s"] = time.perf_counter() - start
            rows.append(row)
            print(f"  done: {name} {tying} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    _table(rows)


def _table(rows: list[dict]) -> None:
    def f(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    head = (f"{'model':<5} {'mesh':<7} {'ilp':<7} {'nodes':>6} {'reps':>6} {'capture s':>9} {'strat s':>8} "
            f"{'solve s':>8} {'variables':>10} {'constraints':>11} {'pred ms':>9}  status")
    print(f"HF LlamaForCausalLM on meta, batch 1 x seq 2048, train mode, hardware {HARDWARE}")
    print(head)
    print("-" * len(head))
    for r in rows:
        mesh = "x".join(map(str, r["mesh"]))
        print(f"{r['name']:<5} {mesh:<7} {r['variant']:<7} {f(r, 'nodes', 'd'):>6} "
              f"{f(r, 'representatives', 'd'):>6} {f(r, 'capture_s', '.1f'):>9} {f(r, 'strategies_s', '.2f'):>8} "
              f"{f(r, 'solve_s', '.1f'):>8} {f(r, 'variables', 'd'):>10} {f(r, 'constraints', 'd'):>11} "
              f"{f(r, 'predicted_ms', '.1f'):>9}  {r.get('status', '')} (wall {r['wall_s']:.0f} s)")
    print("ilp: old = recompute left out of the ILP (the formulation before it was a choice), tied = the planner "
          "today (layers tied, recompute a choice), untied = every node its own variables")
    for name in dict.fromkeys(r["name"] for r in rows):
        old, new = ({r["variant"]: r for r in rows if r["name"] == name}.get(v) for v in ("old", "tied"))
        if old and new and "solve_s" in old and "solve_s" in new:
            print(f"{name}: solve time new / old = {new['solve_s'] / old['solve_s']:.2f} "
                  f"({new['solve_s']:.1f} s / {old['solve_s']:.1f} s; layers recomputed {new.get('recompute', 0)})")


if __name__ == "__main__":
    main()
