"""The data axis at run time: a rank's modules as one replica of many, as the layout's ZeRO stage runs it.

In: the modules a rank runs (a pipeline rank's stages, or a ``ParallelModule`` on the tensor axis),
the layout's data axis (:class:`autotp.layout.DataAxis`: its size and ZeRO stage), its one-axis
sub-mesh, and how many times a step accumulates each module's gradients (its micro-batches). Out:
:class:`DataParallel`, the modules to run and :meth:`DataParallel.step`, the block a step's
backwards run in. Each replica runs its own rows of the batch; after the step every replica holds
the gradients of the whole batch, as one process would.

- **ZeRO 0**: the gradients averaged over the axis as PyTorch's DDP averages them, in buckets
  all-reduced during the last micro-batch's backward (:class:`autotp.runtime.bucket_reducer.BucketReducer`,
  the buckets the search prices): ``step()`` arms it and waits for the averages at its end.
- **ZeRO 1 and 3**: PyTorch's FSDP2 (``fully_shard``) over the data axis, over the tensor-parallel
  shards (torchtitan's composition): parameters, gradients and optimizer state sharded over the
  replicas, each layer of a module's stack one unit (a ``Layer`` or ``Recompute`` submodule: the
  pipeline's :func:`autotp.runtime.pipeline.stage_units.group_stage_layers`, a plan's recomputed
  layers) and the rest of the module another (:func:`shard_over_replicas`). FSDP2 averages the
  gradients itself; ``step()`` adds nothing.

The pricing of both is :mod:`autotp.planning.search.pipeline_search`'s; ``fsdp_units`` counts the
units whose gathers and reduce-scatters it prices.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

from torch import nn

from autotp.layout import DataAxis
from autotp.runtime.bucket_reducer import BucketReducer

__all__ = ["DataParallel", "fsdp_units", "shard_over_replicas"]


class DataParallel:
    """``modules`` as one replica over ``mesh``, the data axis ``data`` (module docstring). ``inner``:
    per module, the one whose parameters FSDP2 shards where it is not the module itself (a stage
    seen through a module that only rebuilds its outputs); ``accumulations``: the backwards a step
    runs through each module (micro-batches).

    ``modules`` are what to run from here on (under ZeRO 1 and 3 FSDP2's modules, or modules around
    them); ``gradient_reducer`` the ZeRO 0 reducer (else None); ``fsdp_units`` the FSDP2 units that
    hold parameters (0 under ZeRO 0)."""

    def __init__(self, modules: Sequence[nn.Module], data: DataAxis, mesh: Any, accumulations: int = 1,
                 inner: Optional[Sequence[nn.Module]] = None) -> None:
        if not isinstance(data, DataAxis):
            raise TypeError(f"data is {type(data).__name__}; expected the layout's DataAxis (Layout.data)")
        shape = tuple(int(n) for n in mesh.mesh.shape)
        if shape != (data.size,):
            raise ValueError(f"the data axis {data.name!r} has {data.size} replicas; the mesh given for it has shape "
                             f"{shape}, expected the one-axis sub-mesh ({data.size},), e.g. mesh[{data.name!r}]")
        if accumulations < 1:
            raise ValueError(f"a step accumulates each gradient at least once; given accumulations={accumulations}")
        inner = list(modules) if inner is None else list(inner)
        if len(inner) != len(modules):
            raise ValueError(f"inner names {len(inner)} modules for the {len(modules)} given; one each")
        if data.zero == 0:
            # the schedule leaves the gradients unscaled: the reducer divides by replicas x micro-batches
            self.modules = tuple(modules)
            self.gradient_reducer: Optional[BucketReducer] = BucketReducer(
                [list(m.parameters()) for m in modules], mesh.get_group(), accumulations, data.size * accumulations)
            self.fsdp_units = 0
        else:
            self.modules = tuple(shard_over_replicas(m, g, mesh, data.zero) for m, g in zip(modules, inner))
            self.gradient_reducer = None
            self.fsdp_units = fsdp_units(self.modules)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The block a step's backwards run in: under ZeRO 0, the reducer armed, and its averages in
        the gradients when the block ends; under FSDP2, nothing (its hooks reduce)."""
        with self.gradient_reducer.step() if self.gradient_reducer is not None else contextlib.nullcontext():
            yield


def shard_over_replicas(module: nn.Module, inner: nn.Module, mesh: Any, zero: int) -> nn.Module:
    """``module`` under PyTorch's FSDP2 over the data axis (``mesh``), over its tensor-parallel shards:
    each of ``inner``'s layers (its ``Layer`` and ``Recompute`` submodules, each holding the state only
    it reads) one unit, the rest of ``inner`` another.

    - ZeRO 1: the parameters gathered at the step's first forward and kept to its last backward, the
      gradients kept whole over the micro-batches and reduce-scattered once: a pipelining schedule
      is given the FSDP module itself, so ``torch.distributed.pipelining`` turns FSDP's gradient sync
      and resharding off until the last backward.
    - ZeRO 3: gathered for each micro-batch's forward and again for its backward, the gradients
      reduce-scattered after each backward (held sharded): FSDP's own hooks run every micro-batch,
      since the schedule is given a plain module around it.
    """
    from torch.distributed.fsdp import fully_shard

    from autotp.runtime.recompute import Layer, Recompute

    layers = [m for m in inner.modules() if isinstance(m, (Layer, Recompute))]
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=zero >= 3)
    if zero >= 3:
        fully_shard(inner, mesh=mesh, reshard_after_forward=True)
        return module if module is not inner else _Around(module)
    return fully_shard(module, mesh=mesh, reshard_after_forward=False)


class _Around(nn.Module):
    """A module seen through a plain module: a schedule drives it as it drives any other."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def fsdp_units(modules: Sequence[nn.Module]) -> int:
    """The FSDP2 units in ``modules`` that hold parameters (each gathers and reduce-scatters its own)."""
    return sum(1 for st in modules for u in st.modules() if hasattr(u, "unshard") and any(True for _ in _own_parameters(u)))


def _own_parameters(unit: nn.Module):
    """The parameters an FSDP unit manages: its module's, less those of the units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and hasattr(m, "unshard") for p in m.parameters()}
    return (p for p in unit.parameters() if id(p) not in inner)
