"""``autotp.init_weights``: a fresh initialization of a parallel module, with the model's own init.

For training from scratch a model built on the meta device: its own init code runs on the shards.
The parallel module's DTensor parameters are put in place of the model's (meta) parameters, and
the model's init runs on them: Hugging Face's ``_init_weights`` on every module where the model
has one, else every module's ``reset_parameters``. Each init sees the DTensor, so what it derives
from the shape (a fan-in) is the full tensor's, and the random op fills each rank's shard.

A parameter the init does not write (a module with neither an ``_init_weights`` on the model nor
its own ``reset_parameters``) is an error naming it, rather than uninitialized memory. (An init
that writes a row of a weight split by rows, as Hugging Face's zeroing of an embedding's padding
row does, writes into a copy on a DTensor and is lost: that row keeps its random values.)

Randomness: every rank draws from a stream seeded by ``seed`` and its rank, so shards of one
parameter are different draws of the same distribution, and one seed always gives the same
values. A tensor that is replicated on a mesh axis must be equal across it: after the init each
one is broadcast from the first rank of that axis. The values are therefore those of the init's
distribution, deterministic for a seed, but not the values a single-device init with the same
seed would give (on CPU or CUDA alike; DTensor's offset-based generator, which can reproduce them
on CUDA, does not run on CPU meshes). The model's own parameters are put back on meta afterwards.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["init_weights"]


def _swapped(model: nn.Module, parallel: nn.Module) -> Iterator[tuple[nn.Module, str, object, str]]:
    """``(module, name, the model's own tensor, the parallel module's)`` for every parameter and
    buffer the parallel module has under the same name."""
    params = dict(parallel.named_parameters(remove_duplicate=False))
    buffers = dict(parallel.named_buffers())
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind, own, theirs in (("parameter", module._parameters, params), ("buffer", module._buffers, buffers)):
            for name, value in list(own.items()):
                fqn = f"{prefix}.{name}" if prefix else name
                if value is not None and fqn in theirs:
                    yield module, name, value, theirs[fqn]


def init_weights(parallel: nn.Module, model: nn.Module, seed: int = 0) -> None:
    """Fill ``parallel`` (``autotp.parallelize(model, ...)``) by ``model``'s own init (module doc).

    Every rank must call it (replicated tensors are broadcast).
    """
    swaps = list(_swapped(model, parallel))
    params = dict(parallel.named_parameters())
    with torch.no_grad():
        for p in params.values():  # what no init writes stays NaN, and is named below
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    for module, name, _, value in swaps:
        (module._parameters if name in module._parameters else module._buffers)[name] = value
    rank = dist.get_rank() if dist.is_initialized() else 0
    cuda = [torch.cuda.current_device()] if any(p.device.type == "cuda" for p in params.values()) else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():  # the caller's generators come back
            torch.default_generator.manual_seed(seed * 1_000_003 + rank)
            if cuda:
                torch.cuda.manual_seed(seed * 1_000_003 + rank)
            own = getattr(model, "_init_weights", None)
            for module in model.modules():
                if callable(own):
                    own(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
    finally:
        for module, name, original, _ in swaps:
            (module._parameters if name in module._parameters else module._buffers)[name] = original
    unset = [name for name, p in params.items()
             if torch.isnan(p.to_local() if hasattr(p, "to_local") else p).any().item()]
    if unset:
        raise ValueError(f"the model's own init left {', '.join(unset)} unset (no _init_weights, and no "
                         f"reset_parameters on the module that holds it); initialize it before parallelizing, "
                         f"or load weights with autotp.load_weights")
    _agree_replicated(parallel)



def _agree_replicated(parallel: nn.Module) -> None:
    """Broadcast every tensor from the first rank of each mesh axis it is replicated on."""
    seen = set()
    for value in [*parallel.parameters(), *parallel.buffers()]:
        if id(value) in seen:
            continue
        seen.add(id(value))
        if hasattr(value, "placements"):
            mesh, local = value.device_mesh, value.to_local()
            axes = [a for a, p in enumerate(value.placements) if p.is_replicate()]
        else:
            continue  # plain buffers are whole on every rank; the init reads them, never draws them
        with torch.no_grad():
            for a in axes:
                dist.broadcast(local, group=mesh.get_group(a), group_src=0)
