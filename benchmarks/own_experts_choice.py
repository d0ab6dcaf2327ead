"""Where does the planner put the experts of MoE layers written by hand, at a real width?

Each form of ``examples/own_experts.py`` (a list of ``nn.Linear`` experts, one batched parameter by
``einsum`` on every token, GShard's capacity dispatch with ``bmm``, ``torch._grouped_mm`` over tokens
sorted by expert, its rows added back by ``index_add`` or summed as Hugging Face does) with 64 experts, top 8, width 2048, expert hidden 768, a 32768-token vocabulary,
a batch of 4 x 2048, on ``h100-sxm``, mesh (8,), training; planned only (meta weights, no process
group). Per form: the plan autotp chooses, and the plans with the experts pinned whole on ranks
(``S(0)``, the forms with a batched parameter) and split by features (``w1`` by its hidden
features, ``w2`` by its input features). Prints each plan's predicted step and the experts'
placements.

    python -m benchmarks.own_experts_choice
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import autotp
from autotp.planning.planner import plan_graph
from examples.own_experts import batched_expert_weights, own_moe

WIDTH = dict(vocab=32768, dim=2048, hidden=768, experts=64, k=8, batch=4, seq=2048)


@dataclass(frozen=True)
class Choice:
    """One plan of one form: its label, predicted step and the experts' placements."""

    form: str
    label: str
    step_s: float
    placements: dict

    def __str__(self) -> str:
        return f"{self.form} {self.label}: predicted step {self.step_s * 1e3:.2f} ms, experts {self.placements}"


def pins(model) -> dict[str, Optional[dict]]:
    """The plans to price for ``model``: the one chosen, whole experts (a batched parameter's expert dim) and
    the feature split (Megatron's, per expert)."""
    batched = batched_expert_weights(model)
    alternatives: dict[str, Optional[dict]] = {"chosen": None}
    if batched:
        alternatives["whole (pinned S(0))"] = {n: "S(0)" for n in batched}
        alternatives["features (pinned)"] = {n: "S(2)" if n.endswith("w1") else "S(1)" for n in batched}
    else:  # nn.Linear weights: (out, in)
        alternatives["features (pinned)"] = {n: "S(0)" if ".w1." in n else "S(1)" for n, _ in model.named_parameters()
                                             if n.startswith("moe.experts.")}
    return alternatives


def choices(form: str, mesh=(8,), hardware: str = "h100-sxm", **options) -> list[Choice]:
    """The plans of :func:`pins` for ``own_moe(form, **options)`` at :data:`WIDTH` (``options`` may
    change it), each with its predicted step; the form's label names the options."""
    model, inputs = own_moe(form, device="meta", **{**WIDTH, **options})
    graph = autotp.capture(model, inputs)
    named = form + "".join(f" {k}={v}" for k, v in options.items())
    out = []
    for label, pin in pins(model).items():
        plan = plan_graph(graph, mesh, hardware, "train", pin=pin)
        placed = Counter(str(v) for n, v in plan.parameter_placements.items()
                         if n.startswith("moe.") and ".router." not in n)
        a2a = sum(c.kind == "all_to_all" for c in plan.collectives())
        out.append(Choice(named, label + (f", {a2a} all-to-alls" if a2a else ""), plan.predicted_time().total_s,
                          dict(placed)))
    return out


def main() -> None:
    for form, options in (("list", {}), ("dense", {}), ("capacity", {}), ("grouped", {}),
                          ("grouped", {"combine": "sum"})):
        for choice in choices(form, **options):
            print(choice)


if __name__ == "__main__":
    main()
