"""Models and counts the tests of blocked, unequal and uneven splits share.
"""

from __future__ import annotations

import collections
import re

from torch import nn

from examples import models as M


SEQ = 2048


class Logits(nn.Module):
    """A Hugging Face model returning its logits (a plain tensor to compare)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(ids).logits


def gpt2(hidden=64, heads=4, vocab=128, layers=2, device="cpu"):
    model, _ = M.hf_gpt2(hidden=hidden, heads=heads, n_layer=layers, vocab=vocab, seq=16, batch=2, device=device)
    return Logits(model)


def activation_collectives_per_layer(plan, graph, hidden: int) -> dict[int, int]:
    """Forward collectives moving at least half an activation (batch x tokens x hidden, float32) on an
    activation (not on a weight's stored shard), by the layer whose module runs them."""
    weights = {p.node for p in graph.parameters}
    module = {n.name: n.module for n in plan.nodes}
    per_layer: collections.Counter = collections.Counter()
    for c in plan.collectives():
        found = re.search(r"\.(\d+)\.", module[c.at] + ".")
        if c.phase == "forward" and c.bytes >= SEQ * hidden * 4 / 2 and c.at not in weights and found:
            per_layer[int(found.group(1))] += 1
    return dict(per_layer)
