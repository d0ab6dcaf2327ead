"""The loss as part of the traced model: ``WithLoss(model, loss_fn)``.

A training step's largest tensors are often the loss's: cross-entropy over a vocabulary keeps the
log-softmax of the logits and, at the start of the backward, makes two more logits-sized tensors.
A plan of the model alone neither prices them nor splits them. ``WithLoss`` is the model and its
loss as one module, so that ``autotp.plan`` / ``autotp.parallelize`` trace, price and split the
loss with the rest (``loss_fn=`` on both wraps the model in it):

    loss = WithLoss(model, loss_fn)(*inputs, targets)     # loss_fn(model(*inputs), targets)
    loss = WithLoss(model, loss_fn)(**kwargs, targets=t)  # keyword inputs: targets by name

The wrapper holds no state of its own: its parameters, buffers and submodules *are* the model's,
under the model's names (a checkpoint or ``load_weights`` reads the same keys), and attributes it
does not have (``config``, ``generation_config``) are the model's. ``loss_fn`` is traced as code,
like the model: any function of the model's output and the targets that ``torch.export`` traces
(``torch.nn.functional.cross_entropy`` on the logits, a lambda that reads ``output.logits``).

>>> import torch
>>> model = torch.nn.Linear(4, 3)
>>> wrapped = WithLoss(model, lambda out, t: torch.nn.functional.cross_entropy(out, t))
>>> [name for name, _ in wrapped.named_parameters()]
['weight', 'bias']
>>> wrapped(torch.randn(2, 4), torch.tensor([0, 2])).shape
torch.Size([])
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from autotp.words import with_article

__all__ = ["WithLoss", "TARGETS"]

TARGETS = "targets"  # the keyword the targets take with keyword inputs


class WithLoss(nn.Module):
    """``loss_fn(model(*args, **kwargs), targets)`` as a module that shares ``model``'s state
    (module docstring). The targets are the last positional argument, or ``targets=`` by keyword."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], Any]) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model is {with_article(type(model).__name__)}; expected a torch.nn.Module")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn is {with_article(type(loss_fn).__name__)}; expected a function of the model's output "
                            f"and the targets, e.g. torch.nn.functional.cross_entropy")
        super().__init__()
        # the model's own registries: the same names, the same tensors, no prefix
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "wrapped_model", model)
        object.__setattr__(self, "loss_fn", loss_fn)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if TARGETS in kwargs:
            targets = kwargs.pop(TARGETS)
        elif args:
            *args, targets = args
        else:
            raise TypeError(f"{type(self.wrapped_model).__name__} with a loss: no targets given; pass them as the "
                            f"last positional argument or as {TARGETS}=")
        return self.loss_fn(self.wrapped_model(*args, **kwargs), targets)

    def train(self, mode: bool = True) -> "WithLoss":
        self.wrapped_model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "wrapped_model"), name)

    def extra_repr(self) -> str:
        fn = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        return f"model={type(self.wrapped_model).__name__}, loss_fn={fn}"
