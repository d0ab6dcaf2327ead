"""Unequal blocks ``S(d)[s1,s2,...]``: a fused q|k|v whose k and v are narrower than q (multi-query or
grouped-query attention: GPT-BigCode's ``c_attn`` cut with ``split((embed, kv, kv))``, Phi-3's
``qkv_proj`` cut by three slices) is split so that each rank holds its piece of every block, found
from the cut, planned at StarCoder's and Phi-3-medium's widths with Megatron's count of activation
collectives, exact on 2 ranks, and saved and loaded with its values unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import autotp
from autotp.placement import Placement, S, Strategy, block_permutation, local_shape, parse_placements
from autotp.planning.planner import plan_graph
from examples.ranks import run_threads
from tests.helpers.blocks import Logits, activation_collectives_per_layer
from tests.helpers.exactness import assert_step_matches_one_process


def test_unequal_blocks_print_parse_and_order_the_pieces():
    p = S(3, (6144, 128, 128))
    assert str(p) == "S(3)[6144,128,128]" and p.is_unequal and p.blocks == 3
    assert parse_placements(str(p)) == (p,)
    assert Strategy.parse("(R, S(0)[32,8,8], S(0)[32,8,8]) -> S(2)[32,8,8]").inputs[1] == (S(0, (32, 8, 8)),)
    assert S(0, (4, 4)) == S(0, 2)  # equal sizes are the plain blocked split
    with pytest.raises(ValueError, match="unequal blocks"):
        Placement("S", 0, 2, 0, (4, 4))
    # rank 0 holds rows 0-1 of the first block and 4 of the second, rank 1 rows 2-3 and 5
    assert block_permutation(S(0, (4, 2)), 2, 6) == [0, 1, 4, 2, 3, 5]
    assert local_shape((6400, 8), (S(0, (6144, 128, 128)),), (8,)) == (800, 8)
    with pytest.raises(ValueError, match="each split evenly"):
        local_shape((6408, 8), (S(0, (6144, 132, 132)),), (8,))


class MultiQuery(nn.Module):
    """Attention with one k and one v head read by every q head, its projections fused."""

    def __init__(self, heads: int = 4, hd: int = 8) -> None:
        super().__init__()
        self.heads, self.hd = heads, hd
        self.c_attn = nn.Linear(heads * hd, heads * hd + 2 * hd)
        self.c_proj = nn.Linear(heads * hd, heads * hd)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).unsqueeze(1).split((self.heads * self.hd, self.hd, self.hd), dim=3)
        q = q.view(b, t, self.heads, self.hd).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(2, 3), -1) @ v
        return self.c_proj(a.transpose(1, 2).reshape(b, t, -1))


def test_a_cut_into_unequal_blocks_splits_each_block_and_reports_the_items_bytes():
    torch.manual_seed(0)
    model, x = MultiQuery(heads=8, hd=64), torch.randn(2, 256, 512)  # wide enough to be worth splitting
    graph = autotp.capture(model, (x,))
    pin = {"c_attn.weight": "S(0)[512,64,64]", "c_attn.bias": "S(0)[512,64,64]", "c_proj.weight": "S(1)"}
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)
    cut = next(n for n in plan.nodes if n.target == "aten.split_with_sizes.default")
    assert cut.strategy == "(S(3)[512,64,64]) -> S(3)", cut.strategy  # each block's piece is on its rank
    # a gather of k or v moves k's bytes (2 x 1 x 256 x 64 floats), not the first item's (q, 8 times more)
    at_cut = [c for c in plan.collectives() if c.at == cut.name and c.phase == "forward"]
    assert at_cut and all(c.bytes == 2 * 256 * 64 * 4 for c in at_cut), at_cut
    assert_step_matches_one_process(graph, plan, model, x)
    # the fused weight read whole by another plan (at a smaller width): gathered, then put back in place
    model, x = MultiQuery(), torch.randn(2, 5, 32)
    graph = autotp.capture(model, (x,))
    gathered = plan_graph(graph, (2,), "cpu-gloo", "train", pin={"c_attn.weight": "S(0)[32,8,8]"})
    cut = next(n.name for n in gathered.nodes if n.target == "aten.split_with_sizes.default")
    assert gathered.strategy(cut).inputs[0] == (Placement("R"),) and "," in str(gathered.strategy("linear"))
    assert_step_matches_one_process(graph, gathered, model, x)


def _bigcode(hidden=64, heads=4, vocab=128, layers=2, device="cpu"):
    config = transformers.GPTBigCodeConfig(vocab_size=vocab, n_embd=hidden, n_head=heads, n_layer=layers,
                                           n_inner=4 * hidden, n_positions=64, multi_query=True, use_cache=False,
                                           embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        return Logits(transformers.GPTBigCodeForCausalLM(config))


def test_gpt_bigcode_at_starcoders_width_gets_megatrons_layout():
    """StarCoder's widths (6144 wide, 48 q heads, one kv head): c_attn is split in its three blocks,
    every block matrix is split, and a block has Megatron's 4 activation collectives (k and v, a 48th
    of an activation each, are gathered)."""
    model = _bigcode(hidden=6144, heads=48, vocab=49152, layers=2, device="meta")
    seq = 2048
    graph = autotp.capture(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))
    plan = plan_graph(graph, (8,), "h100-sxm", "train")
    stored = plan.parameter_placements
    for i in range(2):
        assert stored[f"m.transformer.h.{i}.attn.c_attn.weight"] == "S(0)[6144,128,128]", stored
        for name in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert stored[f"m.transformer.h.{i}.{name}.weight"] != "R", stored
    per_layer = activation_collectives_per_layer(plan, graph, 6144)
    assert sorted(per_layer) == [0, 1] and max(per_layer.values()) <= 4, per_layer
    assert "S(0)[6144,128,128]" in plan.report()
    again = autotp.Plan.from_json(plan.to_json())
    assert again.parameter_placements == plan.parameter_placements


def _pinned_bigcode():
    model = _bigcode()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    graph = autotp.capture(model, (ids,))
    # at 64 wide the planner may keep attention whole (latency outweighs the work): pin the fused weights
    pin = {f"m.transformer.h.{i}.attn.c_attn.{leaf}": "S(0)[64,16,16]" for i in range(2) for leaf in ("weight", "bias")}
    return model, ids, graph, plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)


def _round_trip(rank, world, graph, plan, model, other, directory, safetensors_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    saved = build_parallel_module(graph, plan, mesh, model)
    out = {"built": autotp.checkpoint.full_state_dict(saved, rank=None)}
    autotp.checkpoint.save(saved, directory)
    for source in (directory, safetensors_dir):
        # other values until loaded; a copy per rank (threaded ranks would share replicated tensors)
        fresh = build_parallel_module(graph, plan, mesh, copy.deepcopy(other))
        autotp.load_weights(fresh, source)
        out[source] = autotp.checkpoint.full_state_dict(fresh, rank=None)
    return out


def test_gpt_bigcode_is_exact_on_two_ranks_and_its_weights_round_trip(tmp_path):
    from safetensors.torch import save_file

    model, ids, graph, plan = _pinned_bigcode()
    unequal = {k: v for k, v in plan.parameter_placements.items() if "," in v}
    assert unequal, plan.parameter_placements
    assert_step_matches_one_process(graph, plan, model, ids)
    # the values are the model's own: gathered, saved with DCP, and read from safetensors slices
    other = _bigcode()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    (tmp_path / "hf").mkdir()
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(tmp_path / "hf" / "model.safetensors"))
    want = dict(model.state_dict())
    for result in run_threads(_round_trip, 2, graph, plan, model, other, str(tmp_path / "dcp"), str(tmp_path / "hf")):
        for values in result.values():
            assert set(unequal) <= set(values)
            for k, value in values.items():
                torch.testing.assert_close(value, want[k], rtol=0, atol=0)


def _phi3(hidden=64, heads=4, kv=2, ffn=128, vocab=128, layers=2, device="cpu"):
    config = transformers.Phi3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                     use_cache=False, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return Logits(transformers.Phi3ForCausalLM(config))


def test_slices_that_tile_a_fused_output_in_unequal_blocks_cut_it_locally():
    """Phi-3 with grouped-query attention slices q, k and v out of qkv_proj's output: each slice takes
    its block's piece on every rank, and the step is exact."""
    model = _phi3()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    graph = autotp.capture(model, (ids,))
    pin = {f"m.model.layers.{i}.self_attn.qkv_proj.weight": "S(0)[64,32,32]" for i in range(2)}
    plan = plan_graph(graph, (2,), "cpu-gloo", "train", pin=pin)
    cuts = [n for n in plan.nodes if n.target == "aten.slice.Tensor" and n.strategy == "(S(2)[64,32,32]) -> S(2)"]
    assert len(cuts) == 6, [(n.name, n.strategy) for n in plan.nodes if n.target == "aten.slice.Tensor"]
    assert_step_matches_one_process(graph, plan, model, ids)


def test_phi3_medium_at_real_width_gets_megatrons_layout():
    """Phi-3-medium (5120 wide, 40 q heads, 10 kv heads) on 8 ranks: qkv_proj split in its unequal
    blocks, 4 activation collectives per block (a plain column split of qkv_proj needs a fifth)."""
    model = _phi3(hidden=5120, heads=40, kv=10, ffn=17920, vocab=32064, layers=2, device="meta")
    graph = autotp.capture(model, (torch.zeros(1, 2048, dtype=torch.long, device="meta"),))
    plan = plan_graph(graph, (8,), "h100-sxm", "train")
    stored = plan.parameter_placements
    for i in range(2):
        assert stored[f"m.model.layers.{i}.self_attn.qkv_proj.weight"] == "S(0)[5120,1280,1280]", stored
    per_layer = activation_collectives_per_layer(plan, graph, 5120)
    assert sorted(per_layer) == [0, 1] and max(per_layer.values()) <= 4, per_layer


def test_unequal_blocks_do_not_move_to_another_mesh_axis():
    """Each axis size orders the pieces its own way (block_permutation), so a move of unequal blocks
    from one axis to another is no plain step: it is refused (and never priced), while a gather or a
    slice on one axis with the other axis split elsewhere converts."""
    from autotp.planning.costs.redistribute import conversion, is_convertible

    u = S(0, (32, 8, 8))
    assert block_permutation(u, 2, 48) != block_permutation(u, 4, 48)
    assert not is_convertible((u, Placement("R")), (Placement("R"), u))
    assert not is_convertible((Placement("P"), u), (u, Placement("R")))
    steps = conversion((48, 32), (u, S(1)), (Placement("R"), S(1)), (2, 2))
    assert [s.forward for s in steps.steps] == ["all_gather"] and steps.reorder_after == (0, u)
