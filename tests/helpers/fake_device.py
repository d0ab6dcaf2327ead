"""A parallel module whose mesh and tensors are on a device that is not the CPU, run on a CPU-only build.

What it fakes, and nothing else:

- a process group: the ``fake`` backend over ``FakeStore`` (rank 0 of ``world``): every collective
  returns at once, nothing is communicated;
- the device: ``DeviceMesh("meta", ...)`` over that group, so the runtime's
  :func:`autotp.runtime.devices.mesh_device` is ``meta``, and tensors made under
  ``FakeTensorMode(allow_non_fake_inputs=True)`` on it, which hold no data and compute nothing;
- reads of a value on the host (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``: one
  ``aten._local_scalar_dense`` each): a fake tensor holds no value, so such a read raises, unless
  :func:`fake_tensors` is given ``answer``, the value every read returns (a GPU's device-to-host
  sync each, where the tensor is on the device). :class:`HostSyncs` records the reads of the
  device's tensors and every copy of one to the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into a
  CPU tensor), which fake mode lets through, each with the first frame outside torch that asked;
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
import os
import traceback
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DEVICE", "DEVICE_MISMATCH", "HostSyncs", "fake_ranks", "fake_tensors"]

DEVICE = torch.device("meta")
# the error fake mode raises for an op over two devices
DEVICE_MISMATCH = "found at least two devices"


@contextlib.contextmanager
def fake_ranks(world: int = 2, names: tuple[str, ...] = ("tp",), shape: tuple[int, ...] | None = None,
               rank: int = 0) -> Iterator[Any]:
    """``rank``'s ``DeviceMesh`` on :data:`DEVICE` over a fake process group of ``world`` ranks
    (``shape``: the mesh's, default ``(world,)``); the group destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(f"cpu:fake,{DEVICE.type}:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh(DEVICE.type, shape or (world,), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HELPERS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_aten = torch.ops.aten


class HostSyncs(TorchDispatchMode):
    """Under fake mode: each read of a tensor's value on the host answered with ``answer`` (None: the
    read raises, as fake mode makes it); ``reads`` and ``copies`` list where each read of a tensor on
    :data:`DEVICE`, and each copy of one to the host, was asked for (``file:line`` of the first frame
    outside torch: the caller's code, autotp's or transformers')."""

    def __init__(self, answer: Any = None) -> None:
        super().__init__()
        self.answer = answer
        self.reads: list[str] = []
        self.copies: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            if args[0].device == DEVICE:
                self.reads.append(_asker())
            if self.answer is not None:
                return self.answer
        elif func is _aten._to_copy.default and args[0].device == DEVICE and kwargs.get("device") == torch.device("cpu"):
            self.copies.append(_asker())
        elif func is _aten.copy_.default and args[0].device.type == "cpu" and args[1].device == DEVICE:
            self.copies.append(_asker())
        return func(*args, **kwargs)


def _asker() -> str:
    """``file:line`` of the innermost frame outside torch and these helpers (``HostReads`` wraps torch's reads)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith((_TORCH, _HELPERS)):
            return f"{os.sep.join(frame.filename.split(os.sep)[-2:])}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def fake_tensors(answer: Any = None) -> Iterator[HostSyncs]:
    """Fake mode: every tensor made inside holds no data (module docstring); yields the
    :class:`HostSyncs` of the block, each read of a value answered with ``answer`` (None: it raises)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    generator = torch.Generator

    class OnTheHost(generator):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> Any:
            return generator.__new__(cls, "cpu" if torch.device(device).type == DEVICE.type else device)

    torch.Generator = OnTheHost  # type: ignore[misc]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), HostSyncs(answer) as syncs:
            yield syncs
    finally:
        torch.Generator = generator  # type: ignore[misc]
