"""``autotp.parallelize`` refuses what it cannot run, before it touches anything.

Each refusal must raise the documented error with a message that says what was wrong, leave the
user's model exactly as it was (same state_dict values, plain tensors, same requires_grad and
training flag) and communicate nothing (``tests/helpers/observed.py`` sees no collective).

The cases that need a live ``DeviceMesh`` run on threaded ranks of this process
(``examples.ranks.run_threads``), one run per mesh size (one rank, or three for the uneven case);
every refusal comes before any communication, so the ranks take turns (torch.export must not trace
beside another thread's work). The module-scoped fixtures collect every outcome once and the tests
below read them.
"""

from __future__ import annotations

import threading

import pytest
import torch

import autotp
from examples import models
from examples.ranks import run_threads
from tests.helpers.observed import CollectiveLog

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------- helpers

def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": model.training,
        "types": {n: type(p) for n, p in model.named_parameters()},
    }


def _unchanged(model: torch.nn.Module, before: dict) -> list[str]:
    """What differs from ``before`` (empty: the model is exactly as it was)."""
    after = _snapshot(model)
    diffs = []
    if list(after["state"]) != list(before["state"]):
        diffs.append(f"state_dict keys {list(before['state'])} -> {list(after['state'])}")
    for k, v in before["state"].items():
        w = after["state"].get(k)
        same = (w is not None and type(w) is type(v) and w.shape == v.shape and w.dtype == v.dtype
                and w.device == v.device and (v.device.type == "meta" or torch.equal(w, v)))
        if not same:
            diffs.append(f"state_dict[{k}] changed")
    for key in ("requires_grad", "training", "types"):
        if after[key] != before[key]:
            diffs.append(f"{key} changed")
    return diffs


def _attempt(mesh, model, call) -> dict:
    """Run ``call()``; record the error, whether the model is unchanged and the collectives seen."""
    before = _snapshot(model)
    with CollectiveLog(mesh) as comm:
        try:
            call()
            error, message = None, ""
        except Exception as err:  # noqa: BLE001 - recorded for the test to judge
            error, message = type(err).__name__, str(err)
    return {"error": error, "message": message, "changes": _unchanged(model, before),
            "collectives": len(comm.seen)}


_TURNS = threading.Lock()  # one rank at a time (module docstring)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


class _Masked(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, mask):
        return self.inner(x) * mask


def _one_rank_cases(rank, world):
    """Every refusal that a one-rank mesh can show."""
    mesh = _mesh(world)
    with _TURNS:
        return _one_rank_outcomes(mesh)


def _one_rank_outcomes(mesh):
    out = {}

    model, (x,) = models.mlp()  # Linear(64, 256) -> GELU -> Linear(256, 64), twice; x (8, 64) float32
    for name, inputs in {
        "wrong_shape": (torch.randn(8, 63),),
        "wrong_ndim": (torch.randn(8, 64, 2),),
        "too_many_inputs": (x, x),
        "wrong_dtype_float64": (x.double(),),
        "wrong_dtype_int64": (x.long(),),
    }.items():
        out[name] = _attempt(mesh, model, lambda inputs=inputs: autotp.parallelize(model, mesh, inputs, hardware="cpu-gloo"))

    llama, (ids,) = models.tiny_llama()
    out["float_token_ids"] = _attempt(
        mesh, llama, lambda: autotp.parallelize(llama, mesh, (ids.float(),), hardware="cpu-gloo"))

    # a plan made for another model / other inputs / another mesh
    narrow_plan = autotp.plan(models.mlp(hidden=128)[0], (1,), (x,), hardware="cpu-gloo")
    out["plan_other_width"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=narrow_plan))
    deep_plan = autotp.plan(models.mlp(depth=3)[0], (1,), (x,), hardware="cpu-gloo")
    out["plan_other_depth"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=deep_plan))
    batch_plan = autotp.plan(model, (1,), (x[:4],), hardware="cpu-gloo")
    out["plan_other_batch"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=batch_plan))
    gpt, gpt_inputs = models.tiny_gpt()
    gpt_plan = autotp.plan(gpt, (1,), gpt_inputs, hardware="cpu-gloo")
    out["plan_gpt_on_llama"] = _attempt(mesh, llama, lambda: autotp.parallelize(llama, mesh, (ids,), plan=gpt_plan))
    # the same plan through a JSON round trip (what a saved plan is)
    loaded = autotp.Plan.from_json(gpt_plan.to_json())
    out["loaded_plan_gpt_on_llama"] = _attempt(mesh, llama, lambda: autotp.parallelize(llama, mesh, (ids,), plan=loaded))
    mesh2_plan = autotp.plan(model, (2,), (x,), hardware="cpu-gloo")
    out["plan_other_mesh"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=mesh2_plan))
    mesh1x1_plan = autotp.plan(model, (1, 1), (x,), hardware="cpu-gloo")
    out["plan_other_mesh_ndim"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=mesh1x1_plan))
    out["plan_not_a_plan"] = _attempt(
        mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=narrow_plan.to_dict()))

    # wholly on meta, rotary inv_freq too (a non-persistent buffer no checkpoint holds): refused
    meta_llama, meta_ids = models.hf_llama(n_layer=1, device="meta")  # one layer: the refusal is the same
    out["meta_buffers"] = _attempt(mesh, meta_llama, lambda: autotp.parallelize(meta_llama, mesh, meta_ids))
    # the control: parameters on meta, buffers real (autotp.meta_init), inputs on meta or on the device
    meta_mlp, meta_inputs = models.mlp(device="meta")
    out["meta_params"] = [tuple(p.to_local().shape) for p in
                          autotp.parallelize(meta_mlp, mesh, meta_inputs, hardware="cpu-gloo").parameters()]
    out["meta_params_cpu_inputs"] = len(list(
        autotp.parallelize(meta_mlp, mesh, (torch.randn(8, 64),), hardware="cpu-gloo").parameters()))

    # the parallel module called with inputs of another shape or dtype than it was built for: GPT-2's
    # first op views the token ids as [8, 64], which a [16, 32] batch would pass through silently
    gpt2, (gpt2_ids,) = models.hf_gpt2(batch=8, seq=64, n_layer=1)  # one layer: its capture was most of this
    gpt2_pm = autotp.parallelize(gpt2, mesh, (gpt2_ids,), hardware="cpu-gloo", mode="inference")
    gpt2_static = autotp.parallelize(gpt2, mesh, (gpt2_ids,), hardware="cpu-gloo", mode="inference",
                                     dynamic_dims=False)
    other = torch.randint(0, 128, (16, 32))
    out["gpt2_model_takes_16x32"] = tuple(gpt2(other).logits.shape)
    out["call_other_shape"] = _attempt(mesh, gpt2, lambda: gpt2_static(other))
    out["dynamic_other_shape_error"] = (gpt2_pm(other).logits - gpt2(other).logits).abs().max().item()
    out["call_other_rank"] = _attempt(mesh, gpt2, lambda: gpt2_pm(gpt2_ids.reshape(8, 8, 8)))
    out["call_other_dtype"] = _attempt(mesh, gpt2, lambda: gpt2_pm(gpt2_ids.int()))
    out["call_same_shape"] = tuple(gpt2_pm(gpt2_ids.flip(0)).logits.shape)
    out["call_unknown_keyword"] = _attempt(
        mesh, gpt2, lambda: gpt2_pm(gpt2_ids, attention_mask=torch.ones_like(gpt2_ids)))
    out["config"] = (gpt2_pm.config.to_dict() == gpt2.config.to_dict(), gpt2_pm.config is gpt2.config)
    masked = torch.nn.Linear(8, 8)  # traced with two inputs, called with one of them
    masked_pm = autotp.parallelize(_Masked(masked), mesh, {"x": torch.randn(4, 8), "mask": torch.ones(4, 8)},
                                   hardware="cpu-gloo")
    out["call_missing_input"] = _attempt(mesh, masked, lambda: masked_pm(torch.randn(4, 8)))

    # a plan made in one mode: an inference plan asked to train is refused; a train plan given a model
    # in eval mode builds the graph it was made for and switches to eval, as model.eval() would
    inference_plan = autotp.plan(model, (1,), (x,), hardware="cpu-gloo", mode="inference")
    out["inference_plan_mode_train"] = _attempt(
        mesh, model, lambda: autotp.parallelize(model, mesh, (x,), plan=inference_plan, mode="train"))
    drop, drop_x = _dropout_mlp(), torch.randn(4, 16)
    drop_plan = autotp.plan(drop, (1,), (drop_x,), hardware="cpu-gloo")
    drop.eval()
    pm_eval = autotp.parallelize(drop, mesh, (drop_x,), plan=drop_plan)
    out["train_plan_eval_model"] = {"training": pm_eval.training,
                                    "matches": torch.equal(pm_eval(drop_x), drop(drop_x)),
                                    "graph_mode": pm_eval.graph_training}
    drop.train()

    # the control: the same calls with fitting inputs and the right plan succeed
    good_plan = autotp.plan(model, (1,), (x,), hardware="cpu-gloo")
    before = _snapshot(model)
    pm = autotp.parallelize(model, mesh, (x,), plan=good_plan)
    out["control"] = {"matches": torch.allclose(pm(x), model(x), rtol=1e-5, atol=1e-6),
                      "changes": _unchanged(model, before)}
    return out


def _dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 16))


def _three_rank_cases(rank, world):
    """A plan for 2 ranks on a 3-rank mesh: 256 hidden units do not split in 3."""
    mesh = _mesh(world)
    with _TURNS:
        return _three_rank_outcomes(mesh, world)


def _three_rank_outcomes(mesh, world):
    from autotp.planning.result.plan import Plan

    model, inputs = models.mlp()
    try:  # a budget just above the minimum (132 kB today) makes the plan shard the hidden dim
        plan2 = autotp.plan(model, (2,), inputs, hardware="cpu-gloo", mode="inference", memory_budget=140_000)
    except autotp.MemoryBudgetError as err:  # the minimum moved: take the new one, plus 5 %
        plan2 = autotp.plan(model, (2,), inputs, hardware="cpu-gloo", mode="inference",
                            memory_budget=int(err.minimum_bytes * 1.05) + 1)
    sharded = {k: v for k, v in plan2.module_styles().items() if v in ("colwise", "rowwise")}
    out = {"sharded_on_2": sharded}
    out["plan_2_on_3"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, inputs, plan=plan2))
    # the same plan with its mesh edited to (3,) in the JSON: the mesh check passes, the dims do not divide
    d = plan2.to_dict()
    d["mesh"]["shape"] = [world]
    edited = Plan.from_dict(d)
    out["edited_plan_uneven"] = _attempt(mesh, model, lambda: autotp.parallelize(model, mesh, inputs, plan=edited))
    return out


def _outside_the_mesh(rank, world):
    """A (2,) mesh in a world of 3 (``torchrun --nproc-per-node 3`` with a 2-rank mesh): the third rank
    is refused, naming itself and the mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    if rank != 2:
        return None
    model, inputs = models.mlp()
    before = _snapshot(model)
    with _TURNS:  # no CollectiveLog: it names the mesh's groups, which this rank is not in
        try:
            autotp.parallelize(model, mesh, inputs, hardware="cpu-gloo")
            error, message = None, ""
        except Exception as err:  # noqa: BLE001 - recorded for the test to judge
            error, message = type(err).__name__, str(err)
    return {"error": error, "message": message, "changes": _unchanged(model, before)}


@pytest.fixture(scope="module")
def one_rank():
    return run_threads(_one_rank_cases, 1)[0]


@pytest.fixture(scope="module")
def three_ranks():
    return run_threads(_three_rank_cases, 3)


def test_a_keyword_the_trace_did_not_see_says_how_to_give_it(one_rank):
    """``pm(ids, attention_mask=mask)`` on a module traced with ids alone was Python's bare "unexpected
    keyword argument"; the module reads like the model (its config, a copy)."""
    _assert_refused(one_rank["call_unknown_keyword"], "TypeError", "traced with the inputs (input_ids)",
                    "attention_mask", "example_inputs={'input_ids': ..., 'attention_mask': ...}")
    assert one_rank["config"] == (True, False)


def test_an_input_the_trace_had_and_the_call_lacks_says_so(one_rank):
    """A module traced with ``(x, mask)`` called with ``x`` alone was Python's bare "missing 1 required
    positional argument"; the message names the inputs, the one missing and the two ways out."""
    _assert_refused(one_rank["call_missing_input"], "TypeError", "traced with the inputs (x, mask)",
                    "mask not given", "parallelize with example inputs without it")


def test_a_rank_outside_the_mesh_is_refused_naming_it():
    outcome = run_threads(_outside_the_mesh, 3)[2]
    assert outcome["error"] == "ValueError", outcome
    assert "global rank 2 of 3" in outcome["message"] and "is not in the mesh [0, 1]" in outcome["message"]
    assert not outcome["changes"]


def test_an_inference_plan_asked_to_train_is_refused_naming_both_modes(one_rank):
    _assert_refused(one_rank["inference_plan_mode_train"], "PlanError", "is an inference plan", "mode='train'")


def test_a_train_plan_with_the_model_in_eval_runs_it_in_eval_mode(one_rank):
    """The plan was traced in train mode: the module is built for it and switched to eval (the model's
    own mode), so dropout is off and it equals the model; it was "node 96 differs" before."""
    assert one_rank["train_plan_eval_model"] == {"training": False, "matches": True, "graph_mode": False}


def _assert_refused(outcome: dict, error: str, *fragments: str) -> None:
    assert outcome["error"] == error, f"expected {error}, got {outcome['error']}: {outcome['message']}"
    for fragment in fragments:
        assert fragment in outcome["message"], f"{fragment!r} not in the message:\n{outcome['message']}"
    assert not outcome["changes"], f"the model was touched: {outcome['changes']}"
    assert outcome["collectives"] == 0, f"{outcome['collectives']} collectives ran before the refusal"


# ----------------------------------------------------------------------- no process needed

def test_tuple_mesh_is_a_type_error_pointing_to_plan():
    model, inputs = models.mlp()
    before = _snapshot(model)
    with pytest.raises(TypeError, match=r"autotp\.plan") as info:
        autotp.parallelize(model, (2,), inputs)
    assert "DeviceMesh" in str(info.value) and "tuple" in str(info.value)
    assert not _unchanged(model, before)


@pytest.mark.parametrize("mesh", [8, "tp", [2, 4]])
def test_other_non_mesh_is_a_type_error(mesh):
    model, inputs = models.mlp()
    with pytest.raises(TypeError, match="DeviceMesh"):
        autotp.parallelize(model, mesh, inputs)


# ---------------------------------------------------------------------- inputs that don't fit

@pytest.mark.parametrize("case, fragment", [
    ("wrong_shape", "[8, 63] X [64, 256]"),
    ("wrong_ndim", "[512, 2] X [64, 256]"),
    ("too_many_inputs", "positional"),
    ("float_token_ids", "float32"),
])
def test_inputs_that_do_not_fit_are_a_capture_error_pointing_at_them(one_rank, case, fragment):
    """The capture's own error, not reworded: what failed, then the hint to check the inputs."""
    _assert_refused(one_rank[case], "CaptureError", "autotp could not capture", "check the example inputs", fragment)


@pytest.mark.parametrize("case", ["wrong_dtype_float64", "wrong_dtype_int64"])
def test_input_dtype_that_does_not_fit_is_a_capture_error(one_rank, case):
    _assert_refused(one_rank[case], "CaptureError", "example inputs")


# -------------------------------------------------------------------- a plan for something else

def test_plan_for_a_wider_model_names_the_first_differing_node(one_rank):
    # the first node of both graphs is the first parameter: (128, 64) in the plan, (256, 64) in the model
    _assert_refused(one_rank["plan_other_width"], "PlanError", "another model", "p_layers_0_up_proj_weight",
                    "[128, 64]", "[256, 64]")


def test_plan_for_a_deeper_model_names_the_first_differing_node(one_rank):
    # layers 0 and 1 match; the plan's model has a layers.2 where this one has its input
    _assert_refused(one_rank["plan_other_depth"], "PlanError", "another model", "p_layers_2_up_proj_weight")


def test_plan_for_other_input_shapes_names_the_input(one_rank):
    _assert_refused(one_rank["plan_other_batch"], "PlanError", "[4, 64]", "[8, 64]")


@pytest.mark.parametrize("case", ["plan_gpt_on_llama", "loaded_plan_gpt_on_llama"])
def test_plan_for_another_architecture(one_rank, case):
    # the plan names the class it was made for: the error says so before any node
    _assert_refused(one_rank[case], "PlanError", "another model", "a GPT,", "a Llama;")


def test_plan_for_another_mesh_names_both_meshes(one_rank):
    _assert_refused(one_rank["plan_other_mesh"], "PlanError", "2 (tp)", "1 (tp)")


def test_plan_for_a_2d_mesh_on_a_1d_mesh(one_rank):
    _assert_refused(one_rank["plan_other_mesh_ndim"], "PlanError", "1x1", "1 (tp)")


def test_plan_that_is_not_a_plan_is_a_type_error(one_rank):
    _assert_refused(one_rank["plan_not_a_plan"], "TypeError", "dict", "load_plan")


# ------------------------------------------------------ the parallel module called with other inputs

def test_other_input_shape_is_refused_before_any_collective(one_rank):
    """GPT-2 built for 8 x 64 once returned [8, 64, vocab] logits for a 16 x 32 batch, with no error.
    With dynamic dims (the default) it computes the model's logits; with every dim static it refuses."""
    assert one_rank["gpt2_model_takes_16x32"] == (16, 32, 128), "the model itself accepts the batch"
    assert one_rank["dynamic_other_shape_error"] < 1e-5
    _assert_refused(one_rank["call_other_shape"], "ValueError", "input 'input_ids'", "dim 0 has size 16",
                    "built for size 8", "[8, 64]", "[16, 32]")
    assert one_rank["call_same_shape"] == (8, 64, 128)


def test_other_input_rank_and_dtype_are_refused(one_rank):
    _assert_refused(one_rank["call_other_rank"], "ValueError", "input 'input_ids' has 3 dims", "[8, 8, 8]",
                    "shape [*, *], * a dynamic dim")
    _assert_refused(one_rank["call_other_dtype"], "ValueError", "input 'input_ids' is int32", "built for int64")


# ----------------------------------------------------------------------------------- meta model

def test_meta_buffers_nothing_could_fill_are_refused_with_a_clear_message(one_rank):
    _assert_refused(one_rank["meta_buffers"], "ValueError", "meta device", "model.rotary_emb.inv_freq",
                    "autotp.meta_init()")


def test_meta_parameters_are_accepted_with_inputs_on_meta_or_on_the_device(one_rank):
    assert one_rank["meta_params"] == [(256, 64), (256,), (64, 256), (64,)] * 2
    assert one_rank["meta_params_cpu_inputs"] == 8


def test_control_fitting_inputs_and_plan_succeed(one_rank):
    assert one_rank["control"]["matches"]
    assert not one_rank["control"]["changes"]


# ---------------------------------------------------------------------------------- uneven mesh

def test_plan_for_2_ranks_on_a_3_rank_mesh_is_refused(three_ranks):
    for result in three_ranks:
        assert result["sharded_on_2"], "the 2-rank plan shards nothing: the case would be vacuous"
        _assert_refused(result["plan_2_on_3"], "PlanError", "2 (tp)", "3 (tp)")


def test_plan_whose_dims_do_not_divide_the_mesh_is_refused(three_ranks):
    for result in three_ranks:
        _assert_refused(result["edited_plan_uneven"], "PlanError", "dim 0 (size 256)", "p_layers_0_up_proj_weight",
                        "over 3 ranks", "does not divide")
