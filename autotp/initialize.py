"""``autotp.init_weights``: a fresh initialization of a parallel module, with the model's own init.

For training from scratch a model built on the meta device: its own init code runs on the shards.
The parallel module's DTensor parameters are put in place of the model's (meta) parameters, and
the model's init runs on them: Hugging Face's ``_init_weights`` on every module where the model
has one, else every module's ``reset_parameters``. Each init sees the DTensor, so what it derives
from the shape (a fan-in) is the full tensor's, and the random op fills each rank's shard.

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
    for module, name, _, value in swaps:
        (module._parameters if name in module._parameters else module._buffers)[name] = value
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed * 1_000_003 + rank)
            own = getattr(model, "_init_weights", None)
            for module in model.modules():
                if callable(own):
                    own(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
    finally:
        for module, name, original, _ in swaps:
            (module._parameters if name in module._parameters else module._buffers)[name] = original
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
