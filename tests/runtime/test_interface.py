"""What ``autotp.parallelize`` returns, either kind, is a ``Parallelized`` (``autotp/runtime/interface.py``):
its annotation says so, and a ``ParallelModule`` takes a training step as a ``PipelineModule`` does
(the pipeline's: tests/runtime/test_pipeline_runtime.py)."""

from __future__ import annotations

import inspect

import torch

import autotp
from autotp.runtime.interface import Parallelized
from autotp.runtime.pipeline.module import PipelineModule
from examples import models as M
from examples.ranks import run_threads


def test_parallelize_returns_a_parallelized_of_either_kind():
    assert inspect.signature(autotp.parallelize).return_annotation in (Parallelized, "Parallelized")
    assert issubclass(autotp.ParallelModule, Parallelized) and issubclass(PipelineModule, Parallelized)


def _step(rank, world, graph, plan, model, inputs, loss_fn):
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.runtime.module import build_parallel_module

    pm = build_parallel_module(graph, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), model)
    given = dict(target=inputs["input_ids"], loss_fn=loss_fn) if loss_fn else {}
    loss = pm.step(**{k: v for k, v in inputs.items() if k != "labels" or not loss_fn}, **given)
    return (isinstance(pm, Parallelized), pm.layout, loss.requires_grad, loss.item(),
            {n: p.grad.full_tensor() for n, p in pm.named_parameters()})


def _logits_loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def test_a_parallel_module_s_step_is_one_process_s():
    """``step()`` with the model's own loss (``labels=``) and with a ``loss_fn``: the loss and every
    gradient one process's, on 2 threaded ranks."""
    model, (ids,) = M.hf_llama(batch=2, seq=8)
    for loss_fn in (None, _logits_loss):
        inputs = {"input_ids": ids} if loss_fn else {"input_ids": ids, "labels": ids}
        graph = autotp.capture(model, inputs)
        plan = autotp.planning.planner.plan_graph(graph, (2,), "cpu-gloo", "train", memory_budget=None)
        model.zero_grad()
        output = model(**inputs)
        ref = loss_fn(output, ids) if loss_fn else output.loss
        ref.backward()
        for kind, layout, attached, loss, grads in run_threads(_step, 2, graph, plan, model, inputs, loss_fn):
            assert (kind, layout, attached) == (True, None, False)  # a plain mesh: no layout; the loss detached
            assert abs(loss - ref.item()) < 1e-5
            for n, p in model.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
