"""Models too big for one device: parameters on the meta device, buffers real.

``autotp.parallelize`` takes a model whose parameters live on the meta device (no memory): each
rank allocates only its shard, uninitialized, and ``autotp.load_weights`` fills it. Buffers are
small and are kept whole on every rank; a buffer that checkpoints do not hold (a non-persistent
one, such as a rotary embedding's ``inv_freq``) must have its values when the model is built,
so build with :func:`meta_init`, which puts parameters on meta and leaves buffers where they are
made (``torch.device("meta")`` would put the buffers on meta too, and their values would be lost).

>>> import torch
>>> with meta_init():
...     layer = torch.nn.Linear(4096, 4096)
...     layer.register_buffer("scale", torch.arange(3.0), persistent=False)
>>> layer.weight.is_meta, layer.scale.tolist()
(True, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

__all__ = ["meta_init", "unfillable_state"]

_PATCH_LOCK = threading.RLock()
_depth = [0]  # nested meta_init blocks: only the outermost patches and restores


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Inside it, every parameter a module registers is moved to the meta device as it is
    registered (each is made, and freed, one at a time); buffers stay where they are made.
    Process-wide while it lasts (it patches ``nn.Module.register_parameter``): other threads wait
    to enter; nested blocks are fine."""
    with _PATCH_LOCK:
        original = nn.Module.register_parameter
        if _depth[0] == 0:

            def register_parameter(module: nn.Module, name: str, param) -> None:
                original(module, name, param)
                if param is not None and not param.is_meta:
                    module._parameters[name] = nn.Parameter(param.detach().to("meta"),
                                                            requires_grad=param.requires_grad)

            nn.Module.register_parameter = register_parameter
        _depth[0] += 1
        try:
            yield
        finally:
            _depth[0] -= 1
            if _depth[0] == 0:
                nn.Module.register_parameter = original


def unfillable_state(model: nn.Module, constants: dict) -> list[str]:
    """Meta tensors that no checkpoint can fill: non-persistent buffers and traced constants."""
    persistent = set(model.state_dict().keys())
    buffers = dict(model.named_buffers())
    out = [f"buffer {name} (not saved in checkpoints)" for name, buf in buffers.items()
           if buf.is_meta and name not in persistent]
    from torch._subclasses.fake_tensor import FakeTensor  # a trace on a fake device: no values either

    out += [f"constant {name} (made in forward)" for name, c in constants.items()
            if isinstance(c, torch.Tensor) and (c.is_meta or isinstance(c, FakeTensor)) and name not in buffers]
    return out
