"""Expert x tensor parallelism, where the costs say: the Qwen3-30B-A3B-like model of
``benchmarks/experts_choice.py`` (128 experts, hidden 2048, moe_intermediate 768, 2 layers, 8 x 4096
tokens, ``h100-sxm``, training) on a 2-d mesh, plan-only: the plan autotp chooses, beside the experts
pinned by features only (over both axes), whole on ranks only (over the larger axis, the tokens sent
by all-to-all where that prices cheaper) and expert x tensor (the experts over the larger axis, each
expert's features over the other). Prints each plan's predicted step, its grouped matmuls' split and
the seconds it took to plan.

    python -m benchmarks.experts_by_features [--mesh 2,8]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import autotp
from autotp.planning.planner import plan_graph
from benchmarks.experts_choice import build


def describe(graph, plan, label: str) -> str:
    """The plan's predicted step, its grouped matmuls' strategies and the collectives at them."""
    grouped = [n for n in plan.nodes if "grouped_mm" in graph[n.name].target]
    names = {n.name for n in grouped}
    at = Counter(f"{c.phase} {c.kind}" for c in plan.collectives() if c.at in names)
    t = plan.predicted_time()
    return (f"{label}: predicted step {t.total_s * 1e3:.1f} ms (compute {t.compute_s * 1e3:.1f} ms, "
            f"communication {t.communication_s * 1e3:.1f} ms); grouped matmuls "
            f"{sorted({str(plan.strategy(n.name)) for n in grouped})}; collectives at them {dict(sorted(at.items()))}")


def pins(graph, mesh: tuple[int, ...]) -> dict[str, dict[str, str]]:
    """Each pinned layout's placements of Hugging Face's stacked expert weights: ``gate_up_proj``
    ``(E, 2f, d)`` by its output features in blocks (``S(1)[2]``, gate and up each split),
    ``down_proj`` ``(E, d, f)`` by its input features (``S(2)``)."""
    features = {p.fqn: "S(1)[2]" if p.fqn.endswith("gate_up_proj") else "S(2)"
                for p in graph.parameters if p.info.ndim == 3}
    big = max(range(len(mesh)), key=lambda a: mesh[a])

    def on(expert: str, feature: str) -> str:  # the experts' placement on the larger axis, the other's elsewhere
        return "".join(expert if a == big else feature for a in range(len(mesh)))

    # by features over both axes: each expert's hidden features (``S(2)`` of gate|up, ``S(1)`` of down)
    # over the larger axis, its intermediate ones over the other (the planner's choice before the
    # experts could take an axis of their own beside the features)
    hidden = {n: "S(2)" if f == "S(1)[2]" else "S(1)" for n, f in features.items()}
    return {
        "experts split by features over both axes (pinned)": {n: on(hidden[n], f) for n, f in features.items()},
        f"whole experts over axis {big} (pinned)": {n: on("S(0)", "R") for n in features},
        f"experts over axis {big} x features over the other (pinned)": {n: on("S(0)", f) for n, f in features.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2,8", help="the mesh shape, comma-separated (default 2,8)")
    mesh = tuple(int(v) for v in parser.parse_args().mesh.split(","))
    model, inputs = build("qwen3-30b-a3b")
    graph = autotp.capture(model, inputs)
    for label, pin in {"autotp's choice": None, **pins(graph, mesh)}.items():
        start = time.perf_counter()
        plan = plan_graph(graph, mesh, "h100-sxm", "train", pin=pin)
        print(f"{describe(graph, plan, label)}; planned in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
