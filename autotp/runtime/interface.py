"""What ``autotp.parallelize`` returns, whichever kind: :class:`Parallelized`, the members both have.

A plan on a plain mesh gives a :class:`autotp.runtime.module.ParallelModule` (one graph on the
rank's shards); a plan whose layout has pipeline stages or a data axis gives a
:class:`autotp.runtime.pipeline.module.PipelineModule` (the rank's stages under a schedule). Both
are ``torch.nn.Module`` s and both are :class:`Parallelized`: ``plan``, ``layout``, calling it (the
forward), ``step`` (one training step: forward, loss, backward), ``train()`` / ``eval()``,
``parameters()`` and ``state_dict()`` (this rank's pieces under the model's names). What only one
kind has (``generate`` and per-mode graphs; micro-batches and stages) stays on it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["Parallelized", "default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """The loss the model computes itself (``labels=`` given: ``output.loss``), or a scalar output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.ndim == 0:
        loss = output
    if loss is None:
        raise ValueError("the model's output holds no loss: give step() a loss_fn(output, target), or trace the model "
                         "with labels= so it computes its loss")
    return loss


class Parallelized(nn.Module):
    """The members every module ``autotp.parallelize`` returns has (module docstring); a base class,
    never built alone.

    - ``plan``: the plan it runs (with ``pipeline=True``, ``plan.pipeline`` the layout search's);
    - ``layout``: the :class:`autotp.layout.Layout` it runs, or None for a plan on a plain mesh
      (every axis planned by the ILP: ``plan.mesh``);
    - ``step(*inputs, target=None, loss_fn=None, **inputs)``: one training step over the batch
      given; returns the loss (where the rank holds it, else None) and leaves the gradients on
      this rank's parameters for the optimizer.
    """

    plan: Any

    @property
    def layout(self) -> Any:
        pipeline = getattr(self.plan, "pipeline", None)
        return None if pipeline is None else pipeline.layout

    def step(self, *args: Any, target: Any = None, loss_fn: Optional[Callable] = None, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define step()")
