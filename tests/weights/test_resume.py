"""Resuming training: ``autotp.checkpoint.save`` / ``load`` with ``optimizer=``.

A tiny Hugging Face Llama (one layer) trains with AdamW on 2 ranks (threads of this process over a real group,
the plans made once in this thread), and its weights and optimizer are saved after a few steps.
The steps after it, run on without stopping, are the reference; the same steps resumed from the
checkpoint give the same losses, in a plain model in one process and in a parallel module planned
under another memory budget (another split of the weights, and of AdamW's moments). A fresh
optimizer instead of the restored one does not: the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from examples import models
from examples.ranks import run_threads

STEPS = 3


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each position predicts the next token."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train(module, optimizer, ids, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = _loss(module(ids).logits, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _plans():
    """The graph, and two train plans on 2 ranks that split the weights differently."""
    import autotp
    from autotp.planning.planner import plan_graph

    model, inputs = models.hf_llama(n_layer=1, device="cpu")
    model.train()
    graph = autotp.capture(model, inputs, False)
    try:
        tight = plan_graph(graph, (2,), "cpu-gloo", "train", 600_000)
    except autotp.MemoryBudgetError as err:
        tight = plan_graph(graph, (2,), "cpu-gloo", "train", int(err.minimum_bytes * 1.05) + 1)
    loose = plan_graph(graph, (2,), "cpu-gloo", "train", None)
    assert tight.parameter_placements != loose.parameter_placements, "the two budgets should plan two splits"
    return graph, tight, loose, inputs[0]


def _rank(rank, world, graph, plan, ids, path, resume):
    """Train, save after STEPS and run on STEPS (``resume`` False); or load and run STEPS (True)."""
    import autotp
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, _ = models.hf_llama(n_layer=1, device="cpu", seed=1 if resume else 0)  # resumed: other weights, overwritten
    model.train()
    pm = build_parallel_module(graph, plan, mesh, model)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if resume:
        autotp.checkpoint.load(pm, path, optimizer=opt)
        return _train(pm, opt, ids, STEPS)
    _train(pm, opt, ids, STEPS)
    autotp.checkpoint.save(pm, path, optimizer=opt)
    return _train(pm, opt, ids, STEPS)


def test_training_resumes_from_model_and_optimizer_in_another_plan_or_one_process(tmp_path):
    import autotp

    graph, tight, loose, ids = _plans()
    path = str(tmp_path / "ckpt")
    uninterrupted = run_threads(_rank, 2, graph, tight, ids, path, False)[0]

    resumed = run_threads(_rank, 2, graph, loose, ids, path, True)[0]  # another plan
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=0)

    model, _ = models.hf_llama(n_layer=1, device="cpu", seed=1)  # one process, no parallel module
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    autotp.checkpoint.load(model, path, optimizer=opt)
    assert opt.state_dict()["state"][0]["step"].item() == STEPS
    torch.testing.assert_close(torch.tensor(_train(model, opt, ids, STEPS)), torch.tensor(uninterrupted),
                               rtol=1e-5, atol=0)

    model, _ = models.hf_llama(n_layer=1, device="cpu", seed=1)  # the weights alone, AdamW started afresh: other losses
    model.train()
    autotp.checkpoint.load(model, path)
    fresh = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ids, STEPS)
    assert fresh[0] == pytest.approx(uninterrupted[0], rel=1e-5)  # the same weights to start from
    assert abs(fresh[-1] - uninterrupted[-1]) > 1e-3, (fresh, uninterrupted)


def test_a_bad_optimizer_is_refused_before_anything_loads(tmp_path):
    import autotp

    model, _ = models.hf_llama(n_layer=1, device="cpu")
    autotp.checkpoint.save(model, tmp_path / "weights")  # no optimizer
    other, _ = models.hf_llama(n_layer=1, device="cpu", seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(TypeError, match=r"optimizer is a dict; expected a torch.optim.Optimizer"):
        autotp.checkpoint.load(other, tmp_path / "weights", optimizer={"lr": 1e-3})
    with pytest.raises(ValueError, match=r"the optimizer holds 1 of its 1 parameters that are not this module's"):
        autotp.checkpoint.load(other, tmp_path / "weights", optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))]))
    with pytest.raises(ValueError, match=r"holds no optimizer state \(it was saved without optimizer=\)"):
        autotp.checkpoint.load(other, tmp_path / "weights", optimizer=torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match=r"not this module's"):
        autotp.checkpoint.save(other, tmp_path / "again", optimizer=torch.optim.AdamW(model.parameters()))
    assert not (tmp_path / "again").exists()
