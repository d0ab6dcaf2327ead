"""The statistics `benchmarks/fidelity.py` prints its verdicts from."""

from __future__ import annotations

import doctest
import random
import statistics

import pytest
import torch

from benchmarks import fidelity
from tests.helpers.captures import captures_shared


def test_fidelity_docstring_examples_run():
    result = doctest.testmod(fidelity, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_pairing_cancels_the_load_two_steps_of_a_turn_share():
    """Plan B costs 50 ms more than plan A; the machine's load moves both by up to +-1 s per turn.
    Paired by turn, the interval is tight around +50 ms; the unpaired spread would hide it."""
    rng = random.Random(0)
    load = [rng.uniform(-1.0, 1.0) for _ in range(12)]
    a = [3.0 + x + rng.gauss(0, 0.01) for x in load]
    b = [3.05 + x + rng.gauss(0, 0.01) for x in load]
    mean_s, half_s = fidelity.paired_difference_s(b, a)
    assert mean_s == pytest.approx(0.05, abs=0.015) and 0 < half_s < 0.02
    assert statistics.stdev(a) > 10 * half_s  # what an unpaired comparison would face
    assert fidelity.paired_difference_s([1.0], [0.5]) == (0.5, float("inf"))  # one turn: no interval


def test_tie_groups_keep_the_order_and_chain_ties():
    order = ["megatron", "autotp", "poor", "replicated"]
    assert fidelity._tie_groups(order, [("megatron", "autotp")]) == [["megatron", "autotp"], ["poor"], ["replicated"]]
    assert fidelity._tie_groups(order, [("autotp", "poor"), ("poor", "replicated")]) == [
        ["megatron"], ["autotp", "poor", "replicated"]]
    rank0 = {"megatron": {"steps_s": [1.0, 3.0]}, "autotp": {"steps_s": [2.0, 5.0]}}
    assert fidelity._per_step_mean_s(["megatron", "autotp"], rank0) == [1.5, 4.0]


def test_device_now_prices_each_plan_as_the_planner_does_with_that_device():
    """``predicted_now_s`` with the profile's own device figures gives back each plan's predicted
    step; with a device half as fast at matmuls every prediction grows."""
    import dataclasses

    from autotp.profiling.device import DeviceMeasurement
    from cost_models import resolve_hardware

    profile = resolve_hardware("cpu-gloo")
    dev = profile.device
    same = DeviceMeasurement("cpu", "test", 1, dict(dev.peak_flops), dev.memory_bandwidth_bytes_per_s,
                             int(dev.memory_bytes), dev.kernel_overhead_s, (), dict(dev.matmul_curve or {}),
                             tuple(dev.memory_curve or ()), dev.memory_overlap)
    with captures_shared():  # its four plans (pinned and not) of one model read one capture
        planned = fidelity.plans(profile, 1, 16)
    now = fidelity.predicted_now_s(planned, profile, [same], 1, 16)
    for name, plan in planned.items():
        assert now[name] == pytest.approx(plan.predicted_time().total_s, rel=1e-9)
    halved = dataclasses.replace(same, peak_flops={k: v / 2 for k, v in same.peak_flops.items()},
                                 matmul_curve={k: tuple((f, r / 2) for f, r in c) for k, c in same.matmul_curve.items()})
    slower = fidelity.predicted_now_s(planned, profile, [same, halved], 1, 16)
    assert all(slower[name] > now[name] for name in planned)


def test_a_zoo_row_plans_gpt2_at_real_width_megatron_quality_and_exact():
    """benchmarks/zoo.py's row for GPT-2 XL widths: its fused c_attn split in blocks keeps every block
    matrix split with at most 4 activation collectives per block, and the tiny model is exact."""
    from benchmarks import zoo

    row = zoo.run_arch(next(a for a in zoo.ARCHS if a.name == "gpt2"), exact=True)
    assert row["status"] == "planned", row
    assert row["megatron_weights"] and row["few_collectives"] and row["ratio_ok"], row
    assert row["is_exact"], row


@pytest.mark.slow  # the mechanism is in the default suite: tests/runtime/test_inplace.py
def test_the_zoo_deepseek_v3_row_is_exact():
    """DeepSeek-V3's attention fills its keys through slices of ``new_empty`` and reads the empty
    tensor afterwards; at tiny widths (a low-rank query, MLA's compressed keys and values, routed
    and shared experts) the 2-rank plan shards most weights and is exact (its output was NaN before
    writes through views were kept where later reads see them)."""
    from benchmarks import zoo

    arch = next(a for a in zoo.ARCHS if a.name == "deepseek_v3")
    result = zoo.check_exact(arch)
    assert result.startswith("exact"), result
    sharded, total = (int(v) for v in result.rsplit("; ", 1)[1].split(" ")[0].split("/"))
    assert sharded >= total // 2, result


@pytest.mark.slow  # the mechanism is in the default suite: tests/tracing/test_regions.py
def test_the_zoo_phimoe_row_is_megatron_quality_and_exact():
    """PhiMoE's router picks the experts under ``torch.no_grad()`` inside ``forward()`` (refused at
    capture before ``autotp/tracing/regions.py``): at Phi-3.5-MoE widths the plan is Megatron-quality, and
    the tiny model's step is exact on 2 ranks."""
    from benchmarks import zoo

    row = zoo.run_arch(next(a for a in zoo.ARCHS if a.name == "phimoe"), exact=True)
    assert row["status"] == "planned", row
    assert row["megatron_weights"] and row["few_collectives"] and row["ratio_ok"], row
    assert row["is_exact"], row


@pytest.mark.slow  # the vision zoo's default case is DiT's below; convnets plan in tests/planning/test_convolutions.py
def test_a_zoo_vision_row_plans_resnet50_no_slower_than_data_parallel_or_hand_tp_and_exact():
    """benchmarks/zoo_vision.py's ResNet-50 row: at real widths, batch 256, autotp's predicted step is at
    most data parallel's and the hand channel-split layout's; the tiny model's training step (batch norm
    on a split batch) is exact on 2 ranks with its weights sharded."""
    from benchmarks import zoo_vision

    row = zoo_vision.run_entry(next(e for e in zoo_vision.ENTRIES if e.name == "resnet50"), exact=True)
    assert row["ok"] and row["is_exact"], row
    assert "batch" in row["status"] and row["hand"].split()[0] != "-", row
    assert int(row["exact"].rsplit("; ", 1)[1].split("/")[0]) > 0, row


def test_a_zoo_vision_diffusion_transformer_is_exact_on_2_ranks():
    """DiT at tiny widths (adaptive layer norm from the timestep and class label, patch embedding and
    unpatchify): one training step on 2 ranks equals one process."""
    pytest.importorskip("diffusers")
    from benchmarks import zoo_vision

    result = zoo_vision.check_exact(next(e for e in zoo_vision.ENTRIES if e.name == "dit"))
    assert result.startswith("exact"), result


def test_gpu_check_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main() == 0
    assert "no CUDA device present" in capsys.readouterr().out


def test_gpu_check_items_run_guarded_each_within_its_budget():
    import time

    from benchmarks.gpu_check import Item, run_items

    lines = []

    def slow():
        time.sleep(5)
        return ["never"]

    def broken():
        raise RuntimeError("first line\nthe error's last line")

    failed = run_items([Item("a", 1, lambda: ["fine"]), Item("b", 0.2, slow), Item("c", 1, broken),
                        Item("d", 1, lambda: ["after"])], out=lines.append)
    assert failed == 2
    said = [line for line in lines if not line.endswith(" s") or "budget" in line]
    assert said == ["a: fine", "b: STOPPED after its budget of 0.2 s", "c: FAILED: RuntimeError: the error's last line",
                    "d: after"]
    with pytest.raises(ValueError, match="budgets add up to 500 s, over 480 s"):
        run_items([Item("x", 500, list)])


def test_gpu_check_prices_the_roofline_as_the_planner_does():
    from benchmarks.gpu_check import device_profile, roofline_lines

    profile, note = device_profile("NVIDIA H200")
    assert profile.name == "h200" and note == ""
    assert device_profile("NVIDIA GH200 480GB")[0].name == "h100-sxm"
    # measured at exactly what h200 prices: 0.7 of 989 and of 67 TFLOP/s, and its 4.8 TB/s
    lines = roofline_lines({"bfloat16": 692.3e12, "float32": 46.9e12, "copy_bytes_per_s": 2.4e12}, profile)
    assert lines[0].startswith("bfloat16 matmul 692 TFLOP/s measured, 692 priced by h200 (989 peak x 0.7)")
    assert lines[0].endswith("measured/priced 1.00") and lines[1].endswith("measured/priced 1.00")
    assert lines[2] == "copy 2.40 TB/s measured, 4.80 priced; measured/priced 0.50"

def _habit_row(name: str, columns: tuple[str, ...]) -> dict[str, str]:
    from benchmarks import habits, zoo

    arch = next(a for a in zoo.ARCHS if a.name == name)
    return {h: habits.CELLS[h](arch) for h in columns}


def test_the_habits_matrix_runs_its_padded_and_bf16_columns_on_a_representative_row():
    """benchmarks/habits.py on Llama: a training step on a right-padded batch with ignored labels, and
    bf16 weights, each against one process. The other columns' representative rows run in their own
    tests of the same check: generate with and without a mask (tests/runtime/test_generation.py,
    test_generate_variants.py), the pipeline step on a padded batch (test_pipeline_runtime.py),
    save_pretrained (tests/weights/test_export.py), a checkpoint restored into another plan
    (tests/weights/test_loading.py, test_resume.py), a frozen batch norm (tests/runtime/test_batch_norm.py);
    the slow suite runs every cell."""
    with captures_shared():  # each cell's least-budget plan and its plan read one capture
        row = _habit_row("llama", ("padded", "bf16"))
    assert row["padded"].startswith("exact"), row
    assert row["bf16"].startswith("within bf16"), row


def _documented_matrix() -> dict[tuple[str, str], str]:
    """docs/coverage.md's habits table, by (row, column header): each cell's verdict (its text before
    the figures in brackets)."""
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "docs" / "coverage.md").read_text()
    section = text.split("## Habits: the zoo as a matrix", 1)[1].split("\n## ", 1)[0]
    cells: dict[tuple[str, str], str] = {}
    for table in section.split("\n\n"):
        rows = [line.strip().strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
        if rows:
            header = [h.strip() for h in rows[0]]
            cells.update({(r[0].strip(), header[k]): cell.strip().split(" (")[0]
                          for r in rows[1:] for k, cell in enumerate(r) if k})
    return cells


@pytest.mark.slow  # the whole language-model matrix: about an hour on 2 cores
def test_every_cell_of_the_documented_habits_matrix_is_what_a_run_sees():
    from benchmarks import habits, zoo, zoo_vision

    documented = _documented_matrix()
    assert documented, "docs/coverage.md has no habits table"
    by_header = {v: k for k, v in habits.HEADERS.items()}
    archs = {a.name: a for a in zoo.ARCHS}
    entries = {e.name: e for e in zoo_vision.ENTRIES}
    wrong = []
    for (name, header), want in documented.items():
        if header == "frozen":
            got = habits._cell(habits.frozen, entries[name])
        else:
            got = habits._cell(habits.CELLS[by_header[header]], archs[name])
        if got.split(" (")[0] != want:
            wrong.append((name, header, got, want))
    assert not wrong, wrong


def test_the_experts_benchmark_runs_each_variant_as_one_process_computes():
    """benchmarks/experts.py --quick on 2 threaded ranks: the experts pinned whole on ranks (each
    grouped matmul's output Pd), split by features and replicated each run a training step whose loss
    equals one process's (``measure`` asserts it), and every plan is priced and described."""
    pytest.importorskip("transformers")
    from benchmarks import experts
    from examples.ranks import run_threads

    row = experts.measure(experts.QUICK, 2, steps=1, warmup=0, runner=run_threads)
    assert set(row["step_s"]) == set(experts.VARIANTS) and all(t > 0 for t in row["step_s"].values())
    described = row["describe"]
    assert "grouped matmuls (Pd, S(0), R) -> Pd, (R, S(0), R) -> Pd" in described["experts"], described
    assert "down_proj S(2), gate_up_proj S(1)[2]" in described["features"], described
    assert "down_proj R, gate_up_proj R" in described["replicated"], described
    lines = experts.report(experts.QUICK, [row])
    assert any(line.startswith("2 ranks: experts / features = ") for line in lines), lines


@pytest.mark.parametrize("shape", [pytest.param("qwen3-30b-a3b", marks=pytest.mark.slow), "deepseek-v3"])
def test_experts_choice_prices_each_placement_of_a_shrunk_shape(shape):
    """benchmarks/experts_choice.py's row at tiny widths on (2,): one kind of MoE layer (DeepSeek-V3's
    first layer dense, found as no MoE layer), each placement of its experts priced, the unpinned plan's the least. The
    Qwen3 row is slow: tests/planning/test_expert_choice.py plans a tiny Qwen3-MoE by default."""
    from benchmarks import experts_choice

    row = experts_choice.row(shape, 2, tiny=True)
    steps, plan = row["steps_s"], row["plan"]
    assert steps[row["placement"]] == plan.predicted_time().total_s
    assert set(steps) >= {"features", "whole", "routed"} and all(s is not None for s in steps.values())
    assert all(s >= steps[row["placement"]] * (1 - 1e-9) for s in steps.values())
    assert row["choice"].layers == (1 if shape == "deepseek-v3" else 2) and row["choice"].experts == 8

@pytest.mark.slow  # about 28 s: the search plans one ILP per (ep or tp, micro-batch), as the full row does
def test_a_shrunk_moe_row_of_plan_3d_prices_the_search_no_slower_than_its_hand_layout():
    """benchmarks/plan_3d.py's Qwen3-235B-A22B row through the same code, shrunk (4 layers, 8 experts,
    width 64, sequences of 64, 16 devices): the hand layout (FSDP over the rest x TP 8, layers
    recomputed) is priced by the search kept to it, and the search's choice prices no slower."""
    from benchmarks.plan_3d import moe_row

    r = moe_row("qwen3-235b-64", layers=4, seq=64, devices=16, vocab_size=128, hidden_size=64,
                intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=8)
    h, c = r["hand"], r["chosen"]
    assert (h.pp, h.dp, h.ep, h.tp, h.zero, h.recompute) == (1, 2, 1, 8, 3, True) and h.step_s > 0
    assert c.step_s <= h.step_s * (1 + 1e-9) and r["priced"] > 1
    for x in (c, h):  # the terms the script prints: each part of the step, none negative
        assert min(x.compute_s, x.communication_s, x.bubble_s) >= 0 and x.compute_s > 0


def test_experts_by_features_pins_the_experts_on_the_larger_axis_and_their_features_on_the_other():
    """benchmarks/experts_by_features.py's three pinned layouts of a 2-d mesh, read from the graph."""
    import autotp
    from benchmarks import experts_by_features as B
    from benchmarks.experts_choice import build

    graph = autotp.capture(*build("qwen3-30b-a3b", tiny=True))
    layouts = B.pins(graph, (2, 4))
    assert len(layouts) == 3 and all(len(p) == 4 for p in layouts.values())  # gate_up_proj and down_proj of 2 layers
    by_features, whole, both = layouts.values()
    for name in whole:
        up = name.endswith("gate_up_proj")
        assert whole[name] == "RS(0)" and both[name] == ("S(1)[2]S(0)" if up else "S(2)S(0)")
        assert by_features[name] == ("S(1)[2]S(2)" if up else "S(2)S(1)")


@pytest.mark.slow  # 78 s of two-axis ILPs
def test_experts_by_features_prices_each_pinned_layout_of_a_shrunk_shape():
    """benchmarks/experts_by_features.py's pins and lines at tiny widths on (2, 2): each pinned layout
    plans with its expert weights as pinned, and the unpinned plan prices no slower than any of them."""
    import autotp
    from autotp.planning.planner import plan_graph
    from benchmarks import experts_by_features as B
    from benchmarks.experts_choice import build

    model, inputs = build("qwen3-30b-a3b", tiny=True)
    graph = autotp.capture(model, inputs)
    mesh = (2, 2)
    free = plan_graph(graph, mesh, "h100-sxm", "train")
    steps = {}
    for label, pin in B.pins(graph, mesh).items():
        plan = plan_graph(graph, mesh, "h100-sxm", "train", pin=pin)
        assert all(plan.parameter_placements[n] == p for n, p in pin.items()), label
        line = B.describe(graph, plan, label)
        assert line.startswith(f"{label}: predicted step ") and "grouped matmuls [" in line, line
        steps[label] = plan.predicted_time().total_s
    assert len(steps) == 3 and all(free.predicted_time().total_s <= s * (1 + 1e-9) for s in steps.values()), steps


def test_the_long_context_benchmark_steps_autotp_as_one_process_and_says_why_context_parallel_did_not():
    """benchmarks/long_context.py at 256 tokens on 2 threaded ranks: autotp's step has one process's
    loss (``measure`` asserts it), its attention's strategy is named, and PyTorch's
    ``context_parallel`` either ran with that loss too or (on CPU, where its ring attention has no
    rule for the CPU flash kernel) the row carries its error."""
    pytest.importorskip("transformers")
    from benchmarks import long_context as L
    from examples.ranks import run_threads

    size = L.Size(seq=256, layers=1)
    row = L.measure(size, 2, steps=1, warmup=0, runner=run_threads)
    assert row["variants"]["autotp"]["loss_diff"] <= 1e-4 * row["loss"] and row["variants"]["autotp"]["step_s"] > 0
    assert row["attention"] and all(": (" in a for a in row["attention"]), row["attention"]
    if "context_parallel" in row["errors"]:
        assert "_scaled_dot_product_flash_attention_for_cpu" in row["errors"]["context_parallel"], row["errors"]
    else:
        assert row["variants"]["context_parallel"]["loss_diff"] <= 1e-4 * row["loss"]
    lines = L.report([row])
    assert any(line.startswith("256 tokens: autotp / 1 process = ") for line in lines), lines


@pytest.mark.slow  # a layout search and the hand layout's plan on 8 at 32768 tokens: 7-9 s
def test_long_context_plan_prices_the_context_parallel_hand_layout_as_the_search_prices_its_own():
    """benchmarks/long_context_plan.py's row, narrowed (4 layers, hidden 512, 32768 tokens) on 8
    devices: the hand layout (a context axis of 8 with FSDP over the same ranks) is the search's
    ZeRO 3 over a data axis of 8 on the context plan, whose attention is the balanced causal rows
    (``price_hand`` asserts it); both are priced, the terms printed."""
    from benchmarks import long_context_plan as P

    shape = dict(n_layer=4, hidden=512, ffn=1024, heads=4, kv_heads=2, vocab=128)
    r = P.row(32768, shape)
    c, h = r["chosen"], r["hand"]
    assert (h.pp, h.dp, h.tp, h.zero) == (1, 8, 8, 3) and h.step_s > 0 and c.step_s > 0, (c, h)
    assert r["loss"] == "labels=" and all(a.startswith("balanced causal rows") for a in r["attention"])
    lines = P.lines_of(r)
    assert any("autotp / torchtitan = " in line for line in lines) and sum("step " in x for x in lines) == 2, lines
