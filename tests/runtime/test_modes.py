"""The parallel module as a PyTorch user holds it: ``train()``/``eval()``, its own tensors, the inputs
of every rank compared.

One run of 2 threaded ranks (``autotp.parallelize`` is collective; each rank traces its own model, the
traces taken in turns: tests/helpers/turns.py) covers a Hugging Face GPT-2 built from its config (dropout 0.1, as a user gets it) and an
MLP with batch norm, each planned under a memory budget that makes the plan split weights, and compares
with the model itself in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers.turns import run_threads_tracing_in_turns

pytestmark = pytest.mark.timeout(300)


class _NormNet(nn.Module):
    """Batch norm between two linears: in train mode it normalizes by the batch and updates its
    running statistics, in eval mode it reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.norm = nn.BatchNorm1d(64)
        self.down = nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _sharding_budget(model, inputs, share: float, mode: str = "train") -> float:
    import autotp

    full = autotp.plan(model, (2,), inputs, hardware="h100-sxm", mode=mode).memory_per_device().total_bytes
    return share * full


def _split(plan) -> list:
    """The parameters the plan stores split (the models are small: most are gathered before use)."""
    return [name for name, placements in plan.parameter_placements.items() if placements != "R"]


def _norm_input() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(2))


def _ranks(rank, world, built, budgets, norm_plan):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    # each rank's own copies of the models, built once outside the threads (building seeds the global
    # generator, which the threads share)
    (model, ids), (net, ref) = copy.deepcopy(built)

    # -- GPT-2: dropout 0.1 in train mode ---------------------------------------------------------
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = autotp.parallelize(model, mesh, (ids,), hardware="h100-sxm", memory_budget=budgets[0])
    out["gpt2_train_split"] = _split(pm.plan)
    with torch.no_grad():
        a, b = pm(ids).logits, pm(ids).logits
    out["gpt2_train_calls_differ"] = (a - b).abs().max().item()
    pm.eval()
    out["gpt2_eval_flags"] = (pm.training, any(m.training for m in pm.modules()))
    out["gpt2_eval_replanned"] = pm.plan is not pm.plans[True]
    out["gpt2_eval_same_weights"] = pm.plan.parameter_placements == pm.plans[True].parameter_placements
    with torch.no_grad():
        a, b = pm(ids).logits, pm(ids).logits
        model.eval()
        reference = model(ids).logits
        model.train()
    out["gpt2_eval_calls_differ"] = (a - b).abs().max().item()
    out["gpt2_eval_vs_model"] = (a - reference).abs().max().item()
    pm.train()
    with torch.no_grad():
        a, b = pm(ids).logits, pm(ids).logits
    out["gpt2_train_again_calls_differ"] = (a - b).abs().max().item()
    # one SGD step on the parallel module: the user's model keeps every value
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    local = {k: p.to_local().clone() for k, p in pm.named_parameters()}
    pm(ids).logits.float().pow(2).mean().backward()
    opt.step()
    out["gpt2_model_changed"] = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    out["gpt2_module_changed"] = sum(not torch.equal(p.to_local(), local[k]) for k, p in pm.named_parameters())
    # inference: traced in eval mode whatever mode the model is in
    pmi = autotp.parallelize(model, mesh, (ids,), hardware="h100-sxm", mode="inference",
                              memory_budget=budgets[1])
    with torch.no_grad():
        out["gpt2_inference_vs_model"] = (pmi(ids).logits - reference).abs().max().item()
    out["gpt2_inference_training"] = pmi.training
    out["gpt2_inference_split"] = _split(pmi.plan)
    # a cast to another dtype after parallelize: refused at the call, nothing cast, the module runs on
    casts = []
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.double()):
        try:
            cast(pmi)
            casts.append("cast")
        except TypeError as err:
            casts.append(str(err))
    pmi.float()  # already float32: nothing to cast
    out["gpt2_casts"] = casts
    out["gpt2_dtypes_after_casts"] = {str(p.dtype) for p in pmi.parameters()}
    with torch.no_grad():
        out["gpt2_after_casts_vs_model"] = (pmi(ids).logits - reference).abs().max().item()

    # -- ranks given different inputs ---------------------------------------------------------------
    other = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    try:
        with torch.no_grad():
            pmi(other)
        out["different_inputs"] = None
    except ValueError as err:
        out["different_inputs"] = str(err)
    unchecked = autotp.parallelize(model, mesh, (ids,), plan=pmi.plan, check_inputs=False)
    with torch.no_grad():
        unchecked(other)  # runs: the check is off
    out["unchecked_ran"] = True

    # -- batch norm: train mode updates the statistics, eval mode reads them --------------------------
    x = _norm_input()
    pn = autotp.parallelize(net, mesh, (x,), plan=autotp.Plan.from_json(norm_plan))
    out["norm_styles"] = set(pn.plan.module_styles().values())
    y = pn(x)
    y_ref = ref(x)
    out["norm_train_vs_model"] = (y - y_ref).abs().max().item()
    stats = dict(pn.named_buffers())
    out["norm_stats_vs_model"] = max((stats[k] - v).abs().max().item() for k, v in ref.named_buffers()
                                     if v.is_floating_point())
    out["norm_batches_tracked"] = (int(stats["norm.num_batches_tracked"]), int(ref.norm.num_batches_tracked))
    pn.eval()
    ref.eval()
    with torch.no_grad():
        out["norm_eval_vs_model"] = (pn(x) - ref(x)).abs().max().item()
        out["norm_eval_of_one_row"] = (pn(x[:1].expand(8, 16)) - ref(x[:1].expand(8, 16))).abs().max().item()
    out["norm_stats_unchanged_in_eval"] = int(dict(pn.named_buffers())["norm.num_batches_tracked"])
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks():
    import autotp

    torch.manual_seed(0)
    net = _NormNet()
    ref = _NormNet()
    ref.load_state_dict(net.state_dict())
    model, ids = _gpt2()
    # the budgets are the same on every rank: planned once here, not traced again on each; so is the
    # batch norm net's plan, its linears pinned colwise and rowwise around the norm (the planner's own
    # choice at this size stores them split and gathers them: its peak is the optimizer's step, where
    # no copy lives)
    norm_plan = autotp.plan(net, (2,), (_norm_input(),), hardware="h100-sxm",
                            pin={"up.weight": "S(0)", "down.weight": "S(1)"})
    budgets = (_sharding_budget(model, (ids,), 0.6), _sharding_budget(model, (ids,), 0.7, "inference"))
    return run_threads_tracing_in_turns(_ranks, 2, ((model, ids), (net, ref)), budgets, norm_plan.to_json())


def test_eval_turns_dropout_off_and_equals_the_model_in_eval_mode(ranks):
    for out in ranks:
        assert out["gpt2_train_split"], "the plan splits nothing: the test would not see a wrong split"
        assert out["gpt2_train_calls_differ"] > 1e-3, "dropout draws in train mode"
        assert out["gpt2_eval_flags"] == (False, False)
        # the eval graph has dropout with train=False: planned again, every weight where it was
        assert out["gpt2_eval_replanned"] and out["gpt2_eval_same_weights"]
        assert out["gpt2_eval_calls_differ"] == 0.0
        assert out["gpt2_eval_vs_model"] < 1e-5


def test_train_after_eval_brings_dropout_back(ranks):
    for out in ranks:
        assert out["gpt2_train_again_calls_differ"] > 1e-3


def test_inference_mode_runs_the_model_as_in_eval(ranks):
    for out in ranks:
        assert out["gpt2_inference_training"] is False
        assert out["gpt2_inference_split"]
        assert out["gpt2_inference_vs_model"] < 1e-5


def test_a_cast_to_another_dtype_is_refused_with_what_to_do_and_changes_nothing(ranks):
    for out in ranks:
        assert len(out["gpt2_casts"]) == 4
        for message in out["gpt2_casts"]:
            assert message.startswith("this parallel module was traced and planned with float32 weights"), message
            assert "model.to(" in message and "Nothing was changed" in message
        assert out["gpt2_dtypes_after_casts"] == {"torch.float32"}
        assert out["gpt2_after_casts_vs_model"] < 1e-5


def test_training_the_parallel_module_leaves_the_model_untouched(ranks):
    for out in ranks:
        assert out["gpt2_model_changed"] == [], "the model shares tensors with the parallel module"
        assert out["gpt2_module_changed"] > 0, "the step changed nothing: the control failed"


def test_different_inputs_on_the_ranks_are_refused_on_every_rank(ranks):
    for out in ranks:
        message = out["different_inputs"]
        assert message is not None, "the ranks ran on different inputs without an error"
        assert "'input_ids'" in message and "rank 0 and rank 1" in message and "check_inputs=False" in message
        assert out["unchecked_ran"]


def test_batch_norm_updates_its_statistics_in_train_mode_and_reads_them_in_eval(ranks):
    for out in ranks:
        assert out["norm_styles"] & {"colwise", "rowwise"}, out["norm_styles"]
        assert out["norm_train_vs_model"] < 1e-5
        assert out["norm_stats_vs_model"] < 1e-6
        assert out["norm_batches_tracked"] == (1, 1)
        assert out["norm_eval_vs_model"] < 1e-5
        # eval reads the running statistics: a batch of one repeated row is not normalized to zero
        assert out["norm_eval_of_one_row"] < 1e-5
        assert out["norm_stats_unchanged_in_eval"] == 1


def test_the_input_fingerprint_sees_values_and_their_order():
    """What the ranks compare: equal inputs give equal numbers (NaNs too: bits, not values), and another
    value, a batch in another order, or a row's elements in another order give other numbers."""
    from autotp.runtime.guard import fingerprint

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 32), generator=g)
    x = torch.randn(4, 8, 16, generator=g)
    x[0, 0, 0] = float("nan")
    assert torch.equal(fingerprint(ids), fingerprint(ids.clone()))
    assert torch.equal(fingerprint(x), fingerprint(x.clone()))
    changed = ids.clone()
    changed[3, 31] += 1
    for other in (changed, ids.flip(0), ids.flip(1), ids[[1, 0, 2, 3]]):
        assert not torch.equal(fingerprint(ids), fingerprint(other))
    assert not torch.equal(fingerprint(x), fingerprint(x.flip(0)))
    for t in (x.bfloat16(), x > 0, torch.tensor(3.0), torch.zeros(0, 4), torch.randn(3, 2, dtype=torch.complex64)):
        assert fingerprint(t).shape == (3,) and fingerprint(t).dtype == torch.int64
