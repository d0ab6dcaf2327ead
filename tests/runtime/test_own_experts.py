"""Mixture-of-Experts layers written by hand (examples/own_experts.py), their experts on ranks.

The forms with one batched parameter per projection (``einsum`` on every token, GShard's capacity
dispatch with ``bmm``, ``torch._grouped_mm`` over tokens sorted by expert) pinned ``S(0)`` on 2
threaded ranks: each rank holds half of the experts, and the output and every gradient equal one
process's. The list of ``nn.Linear`` experts splits by features, exact too. The loop over experts
with ``nonzero`` is refused at capture naming the op; so are per-expert counts by ``bincount``
(pointing to ``histc``) and ``torch._grouped_mm`` in float32 (pointing to bfloat16).
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.planning.planner import plan_graph
from examples.own_experts import GroupedExperts, batched_expert_weights, own_moe
from tests.helpers.exactness import assert_step_matches_one_process
from tests.runtime.test_experts_all_to_all import tightest_plan


def check_exact(model, ids, pin, split=(), plan_with=None):
    """The model planned with ``pin`` (by ``plan_with(graph, pin)``, default ``plan_graph`` on
    ``(2,)``) on 2 threaded ranks: output and every gradient of ``sum(out ** 2)`` equal one
    process's; each tensor of ``split`` holds half its experts per rank."""
    graph = autotp.capture(model, (ids,))
    plan = (plan_with or (lambda g, p: plan_graph(g, (2,), "cpu-gloo", "train", pin=p)))(graph, pin)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for local in assert_step_matches_one_process(graph, plan, model, ids):
        for n in split:
            assert local[n] == (shapes[n][0] // 2, *shapes[n][1:]), (n, local[n])
    model.zero_grad()
    return graph, plan


def every_expert_routed(model, ids) -> bool:
    seen = []
    hook = model.moe.router.register_forward_hook(lambda m, args, out: seen.append(out[1]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return bool(torch.bincount(seen[0].flatten(), minlength=model.moe.router.gate.out_features).min() > 0)


# capacity 6: 24 tokens x top 2 = 48 rows over 4 experts keep 24 at most, so rows are dropped
@pytest.mark.parametrize("form, options", [("dense", {}), ("capacity", {"capacity": 6}), ("grouped", {})])
def test_batched_experts_whole_on_ranks_equal_one_process(form, options):
    model, (ids,) = own_moe(form, **options)
    assert every_expert_routed(model, ids)
    experts = batched_expert_weights(model)
    assert experts == ["moe.w1", "moe.w2"]
    check_exact(model, ids, {n: "S(0)" for n in experts}, split=experts)


def test_grouped_experts_with_a_bias_per_expert_split_with_the_weights():
    """``h + b1[ids]``, the offsets ``counts.cumsum(0).to(torch.int32)``: the table gathered by the
    sorted ids splits with the experts (each rank adds its experts' rows, the others zero)."""
    model, (ids,) = own_moe("grouped", bias=True)
    assert isinstance(model.moe, GroupedExperts) and model.moe.b1 is not None
    experts = batched_expert_weights(model)
    assert experts == ["moe.w1", "moe.w2", "moe.b1"]
    _, plan = check_exact(model, ids, {n: "S(0)" for n in experts}, split=experts)
    assert {str(plan.parameter_placements[n]) for n in experts} == {"S(0)"}


def test_grouped_experts_combined_as_hugging_face_does_send_tokens_by_all_to_all():
    """The rows put back in token order and summed over ``k`` (not ``index_add``): the routed region
    is found, and under the least memory each rank routes its own tokens and sends them to their
    experts' ranks and back; equal to one process."""
    model, (ids,) = own_moe("grouped", combine="sum", batch=4, seq=16)  # at 2 x 12 tokens the rows cost too little to move
    assert every_expert_routed(model, ids)
    experts = batched_expert_weights(model)
    graph, plan = check_exact(model, ids, {n: "S(0)" for n in experts}, split=experts, plan_with=tightest_plan)
    grouped = [n.name for n in plan.nodes if n.target == "aten._grouped_mm.default"]
    assert [str(plan.strategy(n)) for n in grouped] == ["(St, S(0), Pt) -> Se", "(Se, S(0), Pt) -> St"]
    assert {c.kind for c in plan.collectives() if c.at in grouped} == {"all_to_all"}


def test_list_experts_split_by_features_equal_one_process():
    """A list of ``nn.Linear`` experts has no expert dim: each expert splits as an MLP does, its
    ``w1`` by output features and ``w2`` by input features (one partial sum for the whole layer)."""
    model, (ids,) = own_moe("list", hidden=64)
    pin = {n: "S(0)" if ".w1." in n else "S(1)" for n, _ in model.named_parameters() if n.startswith("moe.experts.")}
    _, plan = check_exact(model, ids, pin)
    forward = [c for c in plan.collectives() if c.phase == "forward"]
    assert [c.kind for c in forward] == ["all_reduce"], [str(c) for c in forward]


def _state(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


def test_the_loop_over_experts_is_refused_naming_nonzero_and_its_module():
    model, (ids,) = own_moe("loop")
    before = _state(model)
    with pytest.raises(autotp.CaptureError, match=r"(?s)nonzero.*at module 'moe' \(LoopExperts\).*depends on tensor values"):
        autotp.capture(model, (ids,))
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert model(ids).shape == (*ids.shape, 64)  # the model still runs as it did


class _BincountExperts(GroupedExperts):
    def forward(self, x):
        weights, ids = self.router(x)
        expert_ids, order = ids.flatten().sort()
        offsets = torch.bincount(expert_ids, minlength=self.w1.shape[0]).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x[order // self.k].to(self.w1.dtype), self.w1, offs=offsets)
        return torch._grouped_mm(h, self.w2, offs=offsets).sum() * x


def test_per_expert_counts_by_bincount_are_refused_pointing_to_histc():
    """``bincount``'s length is ``max(ids) + 1`` or ``minlength``, whichever is larger: a size the
    trace cannot know. The refusal names it and the fixed-size count."""
    model, (ids,) = own_moe("grouped")
    model.moe = _BincountExperts(32, 32, 4, 2)
    with pytest.raises(autotp.CaptureError, match=r"(?s)bincount.*at module 'moe'.*histc\(ids.float\(\), bins=E, min=0, max=E - 1\)"):
        autotp.capture(model, (ids,))


def test_grouped_mm_in_float32_is_refused_pointing_to_bfloat16():
    """torch traces ``torch._grouped_mm`` in bfloat16 only (its meta kernel), though it runs float32
    on CPU: the refusal says so instead of torch's bare dtype check."""
    model, (ids,) = own_moe("grouped")
    model.float()
    with pytest.raises(autotp.CaptureError, match=r"(?s)torch._grouped_mm.*bfloat16"):
        autotp.capture(model, (ids,))


@pytest.mark.slow  # plans at a real width: about 8 s here
@pytest.mark.parametrize("form, options", [("dense", {}), ("grouped", {}), ("grouped", {"combine": "sum"})])
def test_at_a_real_width_the_planner_prices_its_choice_at_most_each_pinned_one(form, options):
    """64 experts, width 2048, hidden 768, top 8, 4 x 2048 tokens on (8,) h100-sxm (plan only): the
    plan chosen is no slower than the experts pinned whole or by features. As docs/training.md says:
    the dense form places whole experts on ranks (its (E, N, d) outputs split with them), and the
    grouped one combined as Hugging Face does places them whole with the tokens sent by all-to-all."""
    from benchmarks.own_experts_choice import choices

    found = {c.label.split(",")[0]: c for c in choices(form, **options)}
    chosen = found.pop("chosen")
    assert set(found) == {"whole (pinned S(0))", "features (pinned)"}
    assert all(chosen.step_s <= c.step_s * (1 + 1e-6) for c in found.values()), [str(c) for c in found.values()]
    if form == "dense" or options:
        assert chosen.placements == {"S(0)": 2}, str(chosen)
    if options:
        assert "all-to-alls" in chosen.label, str(chosen)
