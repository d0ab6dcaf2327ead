"""``autotp plan`` on the command line: report, JSON, HTML, and clear refusals."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

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
    # each module's row, a stack's alike layers once (tiny_llama's two layers have the same rows)
    rows = {line.split()[0]: line.split()[1] for line in printed.split("Modules")[1].split("Collectives")[0].splitlines()
            if line.strip() and not line.startswith(("module", "-", " ("))}
    for module, style in plan.module_styles().items():
        named = re.sub(r"^layers\.[01]\.", "layers.{0..1}.", module)
        assert rows.get(named) == style, (module, named)
    assert not any(name.startswith(("layers.0.", "layers.1.")) for name in rows), rows
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
    assert f"Hardware: slow-links, profile file {str(path)!r}, given" in capsys.readouterr().out


def test_dynamic_flag_lists_the_dynamic_dims(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "examples.models:tiny_llama", "--mesh", "2", "--hardware", "cpu-gloo", "--dynamic",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Dynamic dims" in printed and "input_ids dim 0: example 2, any size >= 2" in printed
    assert [(d.input, d.dim) for d in autotp.load_plan(out).dynamic_dims] == [("input_ids", 0), ("input_ids", 1)]


_USER_FILE = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.drop, self.down = torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(self.drop(self.up(x)))


def build():
    return Net(), (torch.randn(4, 16),)


def only_a_model():
    return Net()


def needs_an_argument(width):
    return Net(), (torch.randn(4, width),)
'''


def test_a_factory_in_a_file_of_ones_own(tmp_path, capsys, monkeypatch):
    """``autotp plan ./my_models.py:build`` from the user's folder (it was a TypeError about relative
    imports); --mode inference traces in eval mode (no dropout node left active); the header says which
    hardware priced the plan and that it is the default."""
    (tmp_path / "my_models.py").write_text(_USER_FILE)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "./my_models.py:build", "--mesh", "2", "--mode", "inference"]) == 0
    printed = capsys.readouterr().out
    assert "Hardware: h100-sxm, the default of autotp.plan and the CLI (no hardware given" in printed
    assert "Traced: the model in eval mode" in printed
    assert main(["plan", "my_models.py:build", "--mesh", "2", "--hardware", "cpu-gloo"]) == 0
    printed = capsys.readouterr().out
    assert "Hardware: cpu-gloo, built-in profile, given" in printed and "Traced: the model in train mode" in printed


@pytest.mark.parametrize("factory, fragment", [
    ("only_a_model", "returned a Net; expected (model, example_inputs)"),
    ("needs_an_argument", "could not be called with no arguments"),
    ("missing", "has no 'missing'"),
])
def test_a_factory_that_does_not_fit_is_named(tmp_path, monkeypatch, factory, fragment):
    (tmp_path / "my_models.py").write_text(_USER_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as err:
        main(["plan", f"./my_models.py:{factory}", "--mesh", "2"])
    assert fragment in str(err.value)


def test_help_names_the_default_hardware(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: h100-sxm" in text and "cpu-gloo on CPU" in text and "eval mode" in text


def test_an_inference_report_has_no_backward_no_optimizer_no_gradients(capsys):
    assert main(["plan", "examples.models:tiny_llama", "--mesh", "2", "--hardware", "cpu-gloo",
                 "--mode", "inference"]) == 0
    printed = capsys.readouterr().out
    memory = next(line for line in printed.splitlines() if line.startswith("Memory per device"))
    assert "no gradients, no optimizer state" in memory and "adamw" not in printed
    assert "Predicted forward time" in printed and "Recompute" not in printed and "backward" not in printed.lower()


def test_explain_prices_each_placement_of_a_replicated_weight(capsys):
    """Every alternative costs at least what the chosen placement does (the plan is the optimum), and the
    explained module's chosen row is the plan's own figures."""
    assert main(["plan", "examples.models:mlp", "--mesh", "2", "--hardware", "cpu-gloo", "--explain", "layers.0.up_proj"]) == 0
    assert "layers.0.up_proj: replicate, weight layers.0.up_proj.weight [256, 64] stored R" in capsys.readouterr().out
    model, inputs = __import__("examples.models", fromlist=["x"]).tiny_llama(device="meta", n_layer=1)
    plan = autotp.plan(model, (2,), inputs, hardware="cpu-gloo")
    why = plan.explain("layers.0.mlp.up_proj")
    chosen = [a for a in why.alternatives if a.chosen]
    assert len(chosen) == 1 and chosen[0].placement == plan.parameter_placements["layers.0.mlp.up_proj.weight"]
    assert chosen[0].step_s == plan.predicted_time().total_s
    others = [a for a in why.alternatives if not a.chosen and not a.refused]
    assert others and all(a.step_s >= chosen[0].step_s * (1 - 1e-9) for a in others)
    # each row is the plan the public pin gives (autotp.plan(pin=...)), not a figure of explain's own
    pinned = autotp.plan(model, (2,), inputs, hardware="cpu-gloo", pin={"layers.0.mlp.up_proj.weight": others[0].placement})
    assert others[0].step_s == pinned.predicted_time().total_s
    assert others[0].memory_bytes == pinned.memory_per_device().total_bytes
    assert {a.placement for a in why.alternatives} >= {"R", "S(0)", "S(1)"}
    assert "Why these modules stay replicated" in plan.report(explain=True)
    with pytest.raises(autotp.PlanError, match="loaded from a file"):
        autotp.Plan.from_json(plan.to_json()).explain("layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="no parameters of its own"):
        plan.explain("layers.0")


def test_pipeline_layouts_from_the_command_line(tmp_path, capsys):
    """``--devices 2 --pipeline``: the layout search, its report section and file; with ``--mesh`` refused."""
    factory = tmp_path / "factory.py"
    factory.write_text(
        "from examples.models import hf_llama\n\n\n"
        "def build():\n"
        "    model, (ids,) = hf_llama(n_layer=4, batch=2)\n"
        "    model.train()\n"
        "    return model, {'input_ids': ids, 'labels': ids}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", f"{factory}:build", "--devices", "2", "--pipeline", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = autotp.load_plan(out)
    assert plan.pipeline is not None and f"Chosen: {plan.pipeline.chosen.describe()}" in printed
    assert main(["plan", f"{factory}:build", "--mesh", "2", "--pipeline"]) == 2
    assert "give the number of devices" in capsys.readouterr().err


def test_the_report_of_a_moe_model_says_where_its_experts_went(tmp_path, capsys):
    """``autotp plan`` on a tiny Qwen3-MoE: the report's experts section names the placement chosen and
    prices the others, the figures the plan's own (``plan.expert_choices()``)."""
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch, transformers\n\n\n"
        "def build():\n"
        "    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,\n"
        "        num_attention_heads=4, num_key_value_heads=2, head_dim=8)\n"
        "    with torch.device('meta'):\n"
        "        model = transformers.Qwen3MoeForCausalLM(config)\n"
        "    ids = torch.zeros(4, 8, dtype=torch.long, device='meta')\n"
        "    return model, {'input_ids': ids, 'labels': ids}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", f"{factory}:build", "--mesh", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    section = printed[printed.index("Experts (routed MoE layers"):]
    words = autotp.load_plan(out).expert_choices()[0].chosen.words  # what the saved plan chose
    assert "1 MoE layer of 4 experts" in section and f"chosen {words}, step " in section
    assert all(f"pinned {w}" in section or f"; {w}" in section for w in ("split by features", "whole on ranks, every token on every rank",
                                             "whole on ranks, tokens sent by all-to-all") if w not in words)


def test_help_says_parallelize_runs_pipeline_plans(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    pipeline = text[text.index("--pipeline with"):text.index("--axis-names AXIS_NAMES comma")]
    assert "priced only" not in pipeline and "tensor parallelism alone" not in pipeline
    assert "autotp.parallelize runs" in pipeline and "('pp', 'tp')" in pipeline


_UNTRACEABLE = '''
import torch


class Picks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.up(x)
        return y[y > 0].sum()  # a size that depends on the data: no plan can place it


def build():
    return Picks(), (torch.randn(4, 8),)
'''


def test_a_capture_error_prints_its_message_alone_unless_debug(tmp_path, capsys, monkeypatch):
    """A model the trace refuses: exit code 2 and the error's message, no traceback; --debug adds it."""
    (tmp_path / "untraceable.py").write_text(_UNTRACEABLE)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "untraceable.py:build", "--mesh", "2", "--hardware", "cpu-gloo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp plan: ") and "Traceback" not in err, err
    message = err[len("autotp plan: "):].strip()
    with pytest.raises(autotp.CaptureError) as raised:
        autotp.plan(__import__("untraceable").Picks(), (2,), (torch.randn(4, 8),), hardware="cpu-gloo")
    assert message == str(raised.value).strip()
    assert main(["plan", "untraceable.py:build", "--mesh", "2", "--hardware", "cpu-gloo", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and f"autotp plan: {message}" in err
