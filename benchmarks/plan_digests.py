"""The digest of every plan a refactor must leave unchanged: ``benchmarks/plan_time.py``'s shapes
(Llama 3 8B on (8,), 70B at 8 layers on (8, 8), both traced whole and unrolled) and each zoo
architecture at real widths (2 and 4 layers on the zoo's mesh), planned from costs, one line each.

    PYTHONHASHSEED=1 .venv/bin/python -m benchmarks.plan_digests --out before.json
    PYTHONHASHSEED=1 .venv/bin/python -m benchmarks.plan_digests --out after.json --against before.json

``--against`` prints each row whose digest differs from the earlier file's and exits 1 if any does.
Give both runs the same ``PYTHONHASHSEED``: where two plans cost the same, which one the solver
returns can follow the order of Python's hashed sets (Llama 4 Scout's 4-layer plan: two digests of
one predicted time, by the seed). Every rank runs the plan of the mesh's first rank, so ranks
never disagree; two separate processes may.
"""

from __future__ import annotations

import argparse
import json
import sys


def _rows(only: list[str] | None):
    import autotp
    from autotp.planning.planner import plan_graph
    from benchmarks import plan_time, zoo
    from examples import models as M

    for name in ("8b", "70b-8"):
        shape, mesh = plan_time.CONFIGS[name]
        for unroll in (False, True):
            key = f"plan_time/{name}/{'unrolled' if unroll else 'whole'}"
            if only and not any(o in key for o in only):
                continue
            model, inputs = M.hf_llama(**shape, seq=2048, batch=1, device="meta")
            graph = autotp.capture(model, inputs, unroll=unroll)
            yield key, plan_graph(graph, mesh, plan_time.HARDWARE, mode="train")
    for arch in zoo.ARCHS:
        if zoo.missing(arch):
            continue
        for n in (2, 4):
            key = f"zoo/{arch.name}/{n}"
            if only and not any(o in key for o in only):
                continue
            try:
                model, inputs = zoo.build(arch, n, tiny=False)
                graph = autotp.capture(model, inputs)
                yield key, plan_graph(graph, zoo.MESH, zoo.HARDWARE, "train")
            except Exception as err:  # noqa: BLE001 - a failure is that row's digest
                yield key, f"error: {type(err).__name__}: {str(err)[:120]}"


def main() -> None:
    from benchmarks.plan_time import _digest

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--against")
    ap.add_argument("--only", action="append", help="rows whose key contains this")
    args = ap.parse_args()
    digests = {}
    for key, plan in _rows(args.only):
        digests[key] = plan if isinstance(plan, str) else _digest(plan)
        print(f"{key:<40} {digests[key]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(digests, f, indent=1)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = [k for k in before.keys() | digests.keys() if before.get(k) != digests.get(k)]
        for k in sorted(differ):
            print(f"DIFFERS {k}: {before.get(k)} -> {digests.get(k)}")
        print(f"{len(digests)} rows, {len(differ)} differ")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
