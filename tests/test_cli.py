"""``autotp plan`` on the command line: report, JSON, HTML, and clear refusals."""

from __future__ import annotations

import argparse

import pytest

import autotp
from autotp.cli import main, parse_mesh


def test_plan_prints_the_report_and_writes_json_and_html(tmp_path, capsys):
    out_json, out_html = tmp_path / "plan.json", tmp_path / "plan.html"
    rc = main(["plan", "examples.models:tiny_llama", "--mesh", "2", "--hardware", "cpu-gloo", "--mode", "inference",
               "--json", str(out_json), "--html", str(out_html)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Dynamic dims" not in printed  # static unless --dynamic
    plan = autotp.load_plan(out_json)
    assert plan.mesh.shape == (2,) and plan.mode == "inference" and plan.hardware.name == "cpu-gloo"
    for module in plan.module_styles():
        assert module in printed
    assert out_html.read_text().startswith("<!doctype html>")


def test_two_axis_mesh_and_memory_budget(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "examples.models:tiny_gpt", "--mesh", "2x2", "--memory-budget", "1GB", "--json", str(out)])
    assert rc == 0
    assert "2x2 (dp, tp)" in capsys.readouterr().out
    assert autotp.load_plan(out).memory_per_device().budget_bytes == 1e9


def test_memory_budget_reaches_the_solver(tmp_path, capsys):
    """A budget the free plan does not fit makes the plan store weights split until it fits."""
    free_json, tight_json = tmp_path / "free.json", tmp_path / "tight.json"
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--json", str(free_json)]) == 0
    free = autotp.load_plan(free_json)
    assert set(free.parameter_placements.values()) == {"R"}, "the free plan must not fit the budget below"
    budget = int(free.memory_per_device().total_bytes * 0.75)
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--memory-budget", str(budget),
                 "--json", str(tight_json)]) == 0
    tight = autotp.load_plan(tight_json)
    assert tight.memory_per_device().budget_bytes == budget
    assert tight.memory_per_device().total_bytes <= budget
    assert set(tight.parameter_placements.values()) != {"R"}, tight.parameter_placements


def test_optimizer_and_recompute_flags(tmp_path, capsys):
    """--optimizer sets the state the memory counts, --master-dtype adds fp32 master weights,
    --recompute all recomputes every repeated layer (the report's column and line say so)."""
    out = {}
    for name, flags in {"sgd": ["--optimizer", "sgd", "--recompute", "off"],
                        "mixed": ["--master-dtype", "float32", "--recompute", "all"]}.items():
        path = tmp_path / f"{name}.json"
        assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--json", str(path), *flags]) == 0
        out[name] = (autotp.load_plan(path), capsys.readouterr().out)
    sgd, mixed = out["sgd"][0], out["mixed"][0]
    assert sgd.memory.optimizer_bytes == 0 and sgd.recompute == ()
    # float32 weights: two float32 moments plus a float32 master copy, three times the parameters
    assert mixed.memory.optimizer_bytes == 3 * mixed.memory.parameters_bytes
    assert mixed.recompute == ("layers.0", "layers.1")  # the two blocks form one chain
    assert "Recompute: 2 layers (layers.0, layers.1)" in out["mixed"][1]
    assert "adamw (4-byte master weights)" in out["mixed"][1]
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--master-dtype", "int3"]) == 2
    assert "--master-dtype 'int3'" in capsys.readouterr().err


def test_refusals(capsys):
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--pin", "no.such=R"]) == 2
    assert "no parameter 'no.such'" in capsys.readouterr().err
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--memory-budget", "1KB"]) == 2
    assert "below the minimum" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        main(["plan", "examples.models", "--mesh", "2"])
    with pytest.raises(SystemExit, match="no 'nope'"):
        main(["plan", "examples.models:nope", "--mesh", "2"])
    with pytest.raises(argparse.ArgumentTypeError, match="expected a shape such as 8 or 2x4"):
        parse_mesh("2xq")


def test_a_profile_file_drives_plan_and_cli(tmp_path, capsys):
    """A profile written to disk (as `autotp profile` writes one) is what the planner prices with."""
    from cost_models import load_profile

    from examples import models

    slow = load_profile("h100-sxm").scaled_links(1e-4, name="slow-links")
    path = tmp_path / "slow.json"
    path.write_text(slow.to_json())
    model, inputs = models.llama3_8b(device="meta", n_layer=1)
    fast_plan = autotp.plan(model, (8,), inputs, hardware="h100-sxm")
    slow_plan = autotp.plan(model, (8,), inputs, hardware=str(path))
    assert slow_plan.hardware == slow
    assert "colwise" in fast_plan.module_styles().values()
    assert set(slow_plan.module_styles().values()) == {"replicate"}
    assert main(["plan", "examples.models:tiny_gpt", "--mesh", "2", "--hardware", str(path)]) == 0
    assert "hardware slow-links" in capsys.readouterr().out


def test_dynamic_flag_lists_the_dynamic_dims(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "examples.models:tiny_llama", "--mesh", "2", "--hardware", "cpu-gloo", "--dynamic",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Dynamic dims" in printed and "input_ids dim 0: example 2, any size >= 2" in printed
    assert [(d.input, d.dim) for d in autotp.load_plan(out).dynamic_dims] == [("input_ids", 0), ("input_ids", 1)]
