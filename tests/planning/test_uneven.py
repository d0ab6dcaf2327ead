"""Uneven splits: heads (and rows) the ranks do not divide are dealt out whole.

A model whose head count the mesh does not divide keeps Megatron's layout: q, k, v split by whole
heads (``S(0)~hd``), attention local, the output projection's partial sum reduced once. The tests
check the rules (a head view keeps the split only in whole heads), the runtime (exact outputs and
gradients on 2 and 3 ranks, ranks holding no head included), the state (checkpoints and
``load_weights`` of uneven shards) and, at real widths, the plan quality.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autotp
from autotp.placement import S, Strategy, local_shape, piece_sizes
from autotp.runtime.shards import local_ranges, local_shard
from examples.ranks import run_threads
from tests.helpers.exactness import assert_step_matches_one_process


class Block(nn.Module):
    """Attention with ``heads`` heads of ``hd`` and an MLP of ``ffn`` (k without bias: its gradient is zero)."""

    def __init__(self, heads: int = 3, hd: int = 16, ffn: int = 80) -> None:
        super().__init__()
        d = heads * hd
        self.heads = heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        b, t, d = x.shape

        def heads(y):
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        a = nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                                       is_causal=True)
        h = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(torch.relu(self.up(h)))


def _loose_plan(model, x, world):
    """A plan on ``world`` ranks under a budget that makes it shard (30% above the least any plan
    needs: an uneven split holds more than an even share)."""
    from autotp.planning.planner import plan_graph

    graph = autotp.capture(model, (x,))
    try:
        plan = plan_graph(graph, (world,), "cpu-gloo", "train", 1.0, recompute=False)
    except autotp.MemoryBudgetError as err:
        plan = plan_graph(graph, (world,), "cpu-gloo", "train", int(err.minimum_bytes * 1.3) + 1, recompute=False)
    return graph, plan


def test_pieces_are_whole_units_dealt_as_torch_chunk_deals_them():
    assert piece_sizes(36 * 128, S(0, grain=128), 8) == (640,) * 7 + (128,)
    assert piece_sizes(12, S(0, grain=1), 8) == (2,) * 6 + (0, 0)  # torch.chunk leaves the last ranks empty
    assert piece_sizes(2 * 5 * 4, S(0, 2, 4), 2) == (12, 8)  # per block: 5 units of 4, 3 and 2
    full = torch.arange(40.0).view(40, 1)
    for c in range(2):
        piece = local_shard(full, (S(0, 2, 4),), [c], (2,))
        assert piece.shape == local_shape((40, 1), (S(0, 2, 4),), (2,), [c])
        ((a, b), (e, f)), _ = local_ranges((40, 1), (S(0, 2, 4),), [c], (2,))
        torch.testing.assert_close(piece, torch.cat([full[a:b], full[e:f]]))
    assert [r[0] for r in local_ranges((40, 1), (S(0, 2, 4),), [0], (2,))[0]] == [0, 20]
    assert Strategy.parse(str(Strategy(((S(0, 3, 64),),), (S(1, grain=1),)))).inputs[0] == (S(0, 3, 64),)
    with pytest.raises(ValueError, match="coordinate"):
        local_shape((10,), (S(0, grain=2),), (2,))


def test_a_head_view_keeps_a_split_only_in_whole_heads():
    from autotp.planning.choices.strategies import node_strategies

    g = autotp.capture(Block(heads=3), (torch.randn(2, 4, 48),))
    view = next(n for n in g.nodes if n.target == "aten.view.default")
    found = {str(s) for s in node_strategies(g, view, (2,))}
    assert "(S(2)~16) -> S(2)~1" in found  # 3 heads of 16 features: two on rank 0, one on rank 1
    assert not any("S(2)) -> S(2)" in s for s in found)  # 24 features each would cut a head in half
    q = next(n for n in g.nodes if n.param_fqn == "q.weight")
    assert "() -> S(0)~16" in {str(s) for s in node_strategies(g, q, (2,))}
    assert not any("~" in str(s) for s in node_strategies(g, q, (3,)))  # 3 heads divide over 3 ranks


@pytest.mark.parametrize("world,heads", [(2, 3), (3, 4), (3, 5)])
def test_uneven_heads_run_exactly(world, heads):
    torch.manual_seed(0)
    model, x = Block(heads=heads), torch.randn(2, 8, heads * 16)
    graph, plan = _loose_plan(model, x, world)
    uneven = {k for k, v in plan.parameter_placements.items() if "~" in v}
    assert {"q.weight", "v.weight"} <= uneven, plan.parameter_placements
    assert any(u.parameter == "q.weight" for u in plan.uneven) and "Uneven splits" in plan.report()
    assert_step_matches_one_process(graph, plan, model, x, world=world)


def _round_trip(rank, world, graph, plan, model, directory, safetensors_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module
    from autotp.weights import checkpoint

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # a copy per rank: threaded ranks would otherwise share the replicated tensors, which the rewrite
    # takes from the model as they are
    pm = build_parallel_module(graph, plan, mesh, copy.deepcopy(model))
    checkpoint.save(pm, directory)
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().zero_()
    checkpoint.load(pm, directory)
    from_dcp = checkpoint.full_state_dict(pm, rank=None)
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().zero_()
    autotp.load_weights(pm, safetensors_dir)
    from_file = checkpoint.full_state_dict(pm, rank=None)
    return from_dcp, from_file


@pytest.mark.parametrize("world,heads", [(2, 3), (3, 5)])
def test_uneven_shards_survive_a_checkpoint_and_load_from_safetensors(tmp_path, world, heads):
    """(3, 5): 80 rows over 3 ranks, which DCP's plain split of them cuts 27/27/26."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model, x = Block(heads=heads), torch.randn(2, 8, heads * 16)
    graph, plan = _loose_plan(model, x, world)
    assert any("~16" in v for v in plan.parameter_placements.values())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    original = {k: v.clone() for k, v in model.state_dict().items()}  # replicated shards share the model's storage
    for from_dcp, from_file in run_threads(_round_trip, world, graph, plan, model, str(tmp_path / "dcp"),
                                                      str(tmp_path)):
        for k, v in original.items():
            torch.testing.assert_close(from_dcp[k], v, rtol=0, atol=0, msg=k)
            torch.testing.assert_close(from_file[k], v, rtol=0, atol=0)


class Squeezed(nn.Module):
    """Attention whose output is squeezed with no dims: a rank holding one head must keep its head dim."""

    def __init__(self, heads: int = 5, hd: int = 16) -> None:
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(heads * hd, 3 * heads * hd), nn.Linear(heads * hd, heads * hd)

    def forward(self, x):  # (1, T, D)
        t = x.shape[1]
        q, k, v = (y.view(1, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        a = nn.functional.scaled_dot_product_attention(q, k, v).squeeze()  # (H, T, hd)
        return self.o(a.transpose(0, 1).reshape(t, -1))


def test_a_squeeze_keeps_a_split_dim_a_rank_holds_one_unit_of():
    from autotp.planning.planner import plan_graph

    torch.manual_seed(0)
    model, x = Squeezed(), torch.randn(1, 8, 80)
    graph = autotp.capture(model, (x,))
    plan = plan_graph(graph, (3,), "cpu-gloo", "train", pin={"qkv.weight": "S(0)[3]~16", "o.weight": "S(1)~16"})
    assert any(n.target == "aten.squeeze.default" and "~" in n.strategy for n in plan.nodes)
    assert_step_matches_one_process(graph, plan, model, x, world=3)  # 2/2/1 heads


def _gpt2_tiny(heads: int):
    from examples import models as M

    model, _ = M.hf_gpt2(hidden=heads * 8, heads=heads, n_layer=2, vocab=96, seq=8, batch=2)
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_a_fused_qkv_with_uneven_heads_splits_whole_heads_of_each_block(world):
    """GPT-2's c_attn (q|k|v cut with split) with 5 heads: each rank holds whole heads of q, k and v."""
    from autotp.planning.planner import plan_graph
    from tests.helpers.blocks import Logits

    model = Logits(_gpt2_tiny(5))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = autotp.capture(model, (ids,))
    # at 40 wide the planner keeps attention whole (latency outweighs the work): pin Megatron's layout,
    # Conv1D weights being (in, out)
    pin = {f"m.transformer.h.{i}.attn.{name}.weight": placement for i in range(2)
           for name, placement in (("c_attn", "S(1)[3]~8"), ("c_proj", "S(0)~8"))}
    if world == 3:  # 96 rows in 2 units of 48 over 3 ranks: the last rank looks up in no rows at all
        pin["m.transformer.wte.weight"] = "S(0)~48"
    plan = plan_graph(graph, (world,), "cpu-gloo", "train", pin=pin)
    attention = [n for n in graph.nodes if n.target == "aten.scaled_dot_product_attention.default"]
    assert attention and all(str(plan.strategy(n.name).output[0]) == "S(1)~1" for n in attention)
    assert_step_matches_one_process(graph, plan, model, ids, world=world)


def test_real_widths_with_uneven_heads_get_megatron_layouts():
    """GPT-Neo-2.7B's 20 heads and GPT-2 XL's 25 (fused q|k|v) on 8 ranks: every block matrix split,
    heads whole, at most 4 activation collectives per block (Megatron's count)."""
    import transformers

    from autotp.planning.planner import plan_graph
    from tests.helpers.blocks import activation_collectives_per_layer

    def neo(layers):
        config = transformers.GPTNeoConfig(vocab_size=50257, hidden_size=2560, num_heads=20, num_layers=layers,
                                           attention_types=[[["global", "local"], layers // 2]], use_cache=False)
        with torch.device("meta"):
            return transformers.GPTNeoForCausalLM(config), 2560

    def gpt2(layers):
        from tests.helpers.blocks import gpt2

        return gpt2(hidden=1600, heads=25, vocab=50257, layers=layers, device="meta"), 1600

    for build, heads in ((neo, "S(0)~128"), (gpt2, "S(1)[3]~64")):
        model, hidden = build(2)
        graph = autotp.capture(model, (torch.zeros(1, 2048, dtype=torch.long, device="meta"),))
        plan = plan_graph(graph, (8,), "h100-sxm", "train")
        stored = plan.parameter_placements
        assert heads in {v for k, v in stored.items() if ".0." in k}, stored
        matrices = [p.fqn for p in graph.parameters if ".0." in p.fqn and p.info.ndim >= 2]
        assert all(stored[k] != "R" for k in matrices), {k: stored[k] for k in matrices}
        per_layer = activation_collectives_per_layer(plan, graph, hidden)
        assert max(per_layer.values()) <= 4, per_layer


def _gloo_step(rank, world, plan_json, heads):
    """On a gloo process: the model (same seed), parallelized with the plan made in the parent."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.shards import placements_of
    from autotp.weights.checkpoint import full_tensor

    torch.manual_seed(0)
    model, x = Block(heads=heads), torch.randn(2, 8, heads * 16)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = autotp.parallelize(model, mesh, (x,), plan=autotp.Plan.from_json(plan_json))
    out = pm(x)
    out.pow(2).sum().backward()
    return out.detach(), {n: full_tensor(p.grad, placements_of(p)) for n, p in pm.named_parameters()}


@pytest.mark.slow  # three spawned gloo processes: ~15 s
def test_uneven_heads_are_exact_on_three_gloo_processes():
    from examples.ranks import run_ranks

    torch.manual_seed(0)
    model, x = Block(heads=4), torch.randn(2, 8, 64)
    _, plan = _loose_plan(model, x, 3)
    assert any("~" in v for v in plan.parameter_placements.values()), plan.parameter_placements
    ref = model(x)
    ref.pow(2).sum().backward()
    for out, grads in run_ranks(_gloo_step, 3, plan.to_json(), 4):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())


def test_uneven_heads_on_a_two_axis_mesh_are_exact_and_run_as_planned():
    """3 heads on a (2, 2) mesh: collectives over one axis move pieces whose size depends on the place
    on the other; outputs and gradients still equal one process, and each collective that runs is one
    the plan lists, at most as large (tests/test_properties.py's check)."""
    from tests.helpers.properties import Case, build, check, plan_near_the_floor

    case = Case(blocks=("attention", "mlp"), dim=12, heads=3, head_dim=4, batch=1, seq=3, mesh=(2, 2), mode="train",
                slack=0.1, seed=0)
    model, inputs = build(case)
    plan = plan_near_the_floor(case, autotp.capture(model, inputs))
    assert any("~" in n.strategy for n in plan.nodes), [n.strategy for n in plan.nodes]
    check(case, plan)  # runs that plan on 4 threads, compares
