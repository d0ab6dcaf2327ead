"""A parallel module whose mesh and tensors are on a device that is not the CPU, run on a CPU-only build.

What it fakes, and nothing else:

- a process group: the ``fake`` backend over ``FakeStore`` (rank 0 of ``world``): every collective
  returns at once, nothing is communicated;
- the device: ``DeviceMesh("meta", ...)`` over that group, so the runtime's
  :func:`autotp.runtime.devices.mesh_device` is ``meta``, and tensors made under
  ``FakeTensorMode(allow_non_fake_inputs=True)`` on it, which hold no data and compute nothing;
- random generators: ``torch.Generator(device="meta")`` (the meta device has none) is a CPU generator
  while the fake mode is on. Fake tensors do not check a generator's device, so the harness cannot
  catch a generator made on the wrong device.

Why it catches a tensor made on the wrong device: an op whose operands are on two devices raises in
fake mode (``FakeTensorDeviceMismatchError``: "found at least two devices, meta and cpu"), as it
would on a GPU ("cuda:0 and cpu"); a CPU tensor the runtime makes (``torch.arange(n)``,
``torch.tensor([...])``, ``torch.zeros(...)`` with no ``device=``) meets the mesh's tensors in its
next op. A zero-dim CPU tensor is allowed beside them, as CUDA allows it.

Why ``meta`` and not ``cuda``: fake tensors can say ``cuda:0`` on a CPU-only build, but everything
that asks for CUDA's device guard fails there, and the runtime does all of it: recording autograd
(the process aborts: ``torch.export`` of a trainable model, any op on an ``nn.Parameter`` with grad
enabled), ``Tensor.__getitem__`` and ``Tensor.contiguous`` of a strided tensor (they raise "PyTorch is
not linked with support for cuda devices"). ``torch._C._ensureCUDADeviceGuardSet`` fakes the guard on
a CUDA build without a GPU only. The runtime names no device type (it asks the mesh), so ``meta``
exercises the same code a CUDA mesh does, apart from ``mesh_device``'s ``torch.cuda.current_device()``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["DEVICE", "DEVICE_MISMATCH", "fake_ranks", "fake_tensors"]

DEVICE = torch.device("meta")
# the error fake mode raises for an op over two devices
DEVICE_MISMATCH = "found at least two devices"


@contextlib.contextmanager
def fake_ranks(world: int = 2, names: tuple[str, ...] = ("tp",), shape: tuple[int, ...] | None = None) -> Iterator[Any]:
    """Rank 0's ``DeviceMesh`` on :data:`DEVICE` over a fake process group of ``world`` ranks
    (``shape``: the mesh's, default ``(world,)``); the group destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh(DEVICE.type, shape or (world,), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """Fake mode: every tensor made inside holds no data (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    generator = torch.Generator

    class OnTheHost(generator):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> Any:
            return generator.__new__(cls, "cpu" if torch.device(device).type == DEVICE.type else device)

    torch.Generator = OnTheHost  # type: ignore[misc]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        torch.Generator = generator  # type: ignore[misc]
