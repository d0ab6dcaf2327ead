"""Blocked splits: a fused projection's weight split so that each rank holds its piece of every part.

GPT-2's ``c_attn`` (q|k|v cut with ``split``), Phi-3's ``qkv_proj`` (cut with slices) and
``gate_up_proj`` (``chunk``), and Mixtral's experts' ``gate_up_proj`` (``chunk`` after a grouped
matmul) are found from the graph, planned at their real widths with the block layout and as few
activation collectives per block as Megatron's, and run exactly on 2 ranks with the model's
state_dict values unchanged.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import autotp
from autotp.placement import S, Strategy
from examples.ranks import run_threads
from tests.helpers.blocks import SEQ, Logits, activation_collectives_per_layer, gpt2
from tests.helpers.exactness import assert_step_matches_one_process

FAST = "h100-sxm"


def _phi3(hidden=64, heads=4, ffn=128, vocab=128, layers=2, device="cpu"):
    config = transformers.Phi3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                     num_attention_heads=heads, num_key_value_heads=heads, use_cache=False,
                                     pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return Logits(transformers.Phi3ForCausalLM(config))


def _mixtral(hidden=64, heads=4, kv=2, ffn=128, experts=4, vocab=128, layers=2, device="cpu"):
    config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                        num_local_experts=experts, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return Logits(transformers.MixtralForCausalLM(config))


# real widths: GPT-2 at 2048 wide with 32 heads, Phi-3-mini, Mixtral 8x7B
REAL = {
    "gpt2": lambda layers: gpt2(hidden=2048, heads=32, vocab=50304, layers=layers, device="meta"),
    "phi3": lambda layers: _phi3(hidden=3072, heads=32, ffn=8192, vocab=32064, layers=layers, device="meta"),
    "mixtral": lambda layers: _mixtral(hidden=4096, heads=32, kv=8, ffn=14336, experts=8, vocab=32000, layers=layers,
                                       device="meta"),
}
HIDDEN = {"gpt2": 2048, "phi3": 3072, "mixtral": 4096}
FUSED = {  # the fused weights and the blocked split they must get (Conv1D stores (in, out))
    "gpt2": {"attn.c_attn.weight": "S(1)[3]", "attn.c_attn.bias": "S(0)[3]"},
    "phi3": {"self_attn.qkv_proj.weight": "S(0)[3]", "mlp.gate_up_proj.weight": "S(0)[2]"},
    "mixtral": {"mlp.experts.gate_up_proj": "S(1)[2]"},
}


@pytest.mark.parametrize("name", ["gpt2", "phi3", "mixtral"])
def test_fused_projections_are_split_in_blocks_at_real_width(name):
    model = REAL[name](2)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    graph = autotp.capture(model, (ids,))
    from autotp.planning.planner import plan_graph

    plan = plan_graph(graph, (8,), FAST, "train")
    stored = plan.parameter_placements
    for suffix, placement in FUSED[name].items():
        found = [v for k, v in stored.items() if k.endswith(suffix)]
        assert found and set(found) == {placement}, (suffix, found)
    per_layer = activation_collectives_per_layer(plan, graph, HIDDEN[name])
    # Megatron's count (sequence parallel: a gather before attention and before the MLP, a reduce-scatter
    # after each); Mixtral's router copies each token to its experts, and that copy passes its partial
    # gradient back to the tokens (Rg) rather than being gathered (twice the activation)
    assert sorted(per_layer) == [0, 1] and max(per_layer.values()) <= 4, (name, per_layer)
    # every matrix of a block is split (norm weights and biases are vectors the plan may keep whole;
    # so is a matrix under a thousandth of the block's weights, such as Mixtral's router, as Megatron does)
    matrices = {p.fqn: p.info.numel for p in graph.parameters if ".0." in p.fqn and p.info.ndim >= 2}
    large = [k for k, numel in matrices.items() if numel >= sum(matrices.values()) / 1000]
    assert large and all(stored[k] != "R" for k in large), {k: stored[k] for k in matrices}


def test_a_cut_into_blocks_is_what_finds_them():
    """The same projection read whole (no cut after it) is split plainly: blocks come from the graph."""

    class Unfused(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 192)
            self.out = nn.Linear(192, 64)

        def forward(self, x):
            return self.out(torch.relu(self.proj(x)))

    class Fused(Unfused):
        def forward(self, x):
            q, k, v = self.proj(x).split(64, dim=-1)
            return self.out(torch.cat([q * k, k, v], dim=-1))

    from autotp.planning.choices.strategies import node_strategies

    for model, blocked in ((Unfused(), False), (Fused(), True)):
        g = autotp.capture(model, (torch.randn(4, 64),))
        weight = next(n for n in g.nodes if n.param_fqn == "proj.weight")
        placements = {str(s.output) for s in node_strategies(g, weight, (2,))}
        assert ("(S(0)[3],)" in placements) == blocked, placements


TINY = {"gpt2": gpt2, "phi3": _phi3, "mixtral": _mixtral}


def _full_weights(rank, world, graph, plan, model):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = build_parallel_module(graph, plan, mesh, model)
    return {k: (str(v.placements), v.full_tensor()) for k, v in pm.state_dict().items() if hasattr(v, "placements")}


# GPT-2's tiny plan under the least budget stores c_attn split by its input rows (its activations
# are too small for the blocked split to pay): its fused projection is pinned blocked here, so that
# the blocked layout itself is what runs (the planner finds it alone at real width, above)
_PINS = {"gpt2": {f"m.transformer.h.{i}.attn.c_attn.weight": "S(1)[3]" for i in range(2)}}


def _tight_plan(name: str):
    """A tiny model planned on 2 ranks under a budget just above the least any plan needs: it shards."""
    from autotp.planning.planner import plan_graph

    model = TINY[name]()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    graph = autotp.capture(model, (ids,))
    pin = _PINS.get(name)
    try:
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", 1.0, recompute=False, pin=pin)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.02) + 1, recompute=False,
                          pin=pin)
    return model, ids, graph, plan


@pytest.mark.parametrize("name", ["gpt2", "phi3", "mixtral"])
def test_blocked_models_are_exact_on_two_ranks(name):
    model, ids, graph, plan = _tight_plan(name)
    blocked = {k for k, v in plan.parameter_placements.items() if "[" in v}
    assert blocked, plan.parameter_placements
    assert_step_matches_one_process(graph, plan, model, ids)
    # the state_dict holds the model's own values (a blocked shard is a _StridedShard DTensor)
    original = dict(model.state_dict())
    for full in run_threads(_full_weights, 2, graph, plan, model):
        assert {k for k in full if "Strided" in full[k][0]} >= blocked
        for k, (_, value) in full.items():
            torch.testing.assert_close(value, original[k], rtol=0, atol=0)


def test_a_blocked_plan_round_trips_through_json_and_reports_its_blocks():
    plan = _tight_plan("gpt2")[3]
    assert any("[3]" in v for v in plan.parameter_placements.values())
    # the report's weight column is the stored weight (a Conv1D's (in, out) matrix, not its bias)
    c_attn = next(m for m in plan.modules if m.module.endswith("h.0.attn.c_attn"))
    assert (c_attn.style, c_attn.weight) == ("colwise", plan.parameter_placements["m.transformer.h.0.attn.c_attn.weight"])
    assert "S(1)[3]" in plan.report()
    again = autotp.Plan.from_json(plan.to_json())
    assert again.strategies == plan.strategies and again.parameter_placements == plan.parameter_placements
    assert Strategy.parse("(R, S(0)[3]) -> S(1)[3]").inputs[1] == (S(0, 3),)


def _checkpoint_round_trip(rank, world, graph, plan, model, other, directory, unsharded):
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    saved = build_parallel_module(graph, plan, mesh, model)
    autotp.checkpoint.save(saved, directory)
    out = {}
    for source in (directory, unsharded):  # autotp's own checkpoint, and DCP of the unsharded model
        fresh = build_parallel_module(graph, plan, mesh, other)  # other values until loaded
        autotp.load_weights(fresh, source)
        out[source] = {k: v.full_tensor() for k, v in fresh.state_dict().items() if hasattr(v, "full_tensor")}
    return out


def test_blocked_weights_survive_a_dcp_checkpoint(tmp_path):
    """DCP describes a shard as one run per dim; a blocked shard is handed to it as a plain split of
    the same values, saved whole under its own name and loaded back blocked."""
    import torch.distributed.checkpoint as dcp

    model, ids, graph, plan = _tight_plan("gpt2")
    other = TINY["gpt2"]()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    unsharded = str(tmp_path / "unsharded")
    dcp.save(dict(model.state_dict()), checkpoint_id=unsharded, no_dist=True)
    want = dict(model.state_dict())
    for result in run_threads(_checkpoint_round_trip, 2, graph, plan, model, other, str(tmp_path / "ckpt"), unsharded):
        for loaded in result.values():
            blocked = [k for k in loaded if "c_attn" in k]
            assert blocked
            for k, value in loaded.items():
                torch.testing.assert_close(value, want[k], rtol=0, atol=0)


def test_no_blocks_on_a_dynamic_dim():
    """A cut of a dim whose size varies has no fixed blocks: neither a blocked split nor a cut of one
    is offered there (the example's block count would be wrong at other sizes)."""
    from autotp.planning.choices.strategies import node_strategies

    class CutSequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):  # (B, T, 8): T is dynamic
            y = self.lin(x)
            a, b = y.chunk(2, dim=1)
            return a * b, y[:, :4] * 2

    g = autotp.capture(CutSequence(), (torch.randn(2, 8, 8),), dynamic_dims=None)
    assert g.dynamic, "the sequence dim should be traced as a symbol"
    for node in g.ops():
        offered = [str(s) for s in node_strategies(g, node, (2,))]
        assert not any("[" in s for s in offered), (node.name, offered)
