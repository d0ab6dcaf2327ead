"""Host round trips made by autotp's own code, counted on the CPU as they would be on a GPU.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``,
``.cpu()``, ``.numpy()``) waits for every kernel queued before it, and a tensor made from host
values (``torch.tensor([...])``) is a copy to the device, and one made with no ``device=``
(``torch.arange(n)``) is on the CPU. On the CPU neither costs anything, so a
test cannot time them; ``HostReads`` counts them instead, while it is open, in the thread that opened
it, where the caller is a file of the ``autotp`` package (a read inside torch or transformers is not
counted, nor the test's own). ``reads`` counts the reads, ``made`` the tensors made from host values or with no device,
``where`` lists (file:line, what) of each.

>>> import torch
>>> with HostReads() as seen:
...     _ = torch.ones(2).sum().item()   # the test's own read: not autotp's
>>> seen.reads, seen.made
(0, 0)
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import torch

import autotp

__all__ = ["HostReads"]

_PACKAGE = os.path.dirname(os.path.abspath(autotp.__file__)) + os.sep
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_MADE = ("tensor", "as_tensor")
_FACTORIES = ("arange", "zeros", "ones", "full", "empty")  # made on the CPU where no device is given

_lock = threading.Lock()
_open: dict[int, list["HostReads"]] = {}  # thread id -> the counters open in it
_originals: dict[tuple[Any, str], Callable] = {}


def _caller_is_autotp() -> bool:
    return sys._getframe(2).f_code.co_filename.startswith(_PACKAGE)


def _counting(owner: Any, name: str, kind: str) -> Callable:
    original = getattr(owner, name)
    factory = name in _FACTORIES

    def counted(*args: Any, **kwargs: Any) -> Any:
        counters = _open.get(threading.get_ident())
        if counters and (not factory or kwargs.get("device") is None) and _caller_is_autotp():
            frame = sys._getframe(1)
            at = f"{os.path.relpath(frame.f_code.co_filename, _PACKAGE)}:{frame.f_lineno} {name}"
            for c in counters:
                setattr(c, kind, getattr(c, kind) + 1)
                c.where.append(at)
        return original(*args, **kwargs)

    return counted


class HostReads:
    """The host reads and host-made tensors of autotp's code while open (module docstring)."""

    def __init__(self) -> None:
        self.reads, self.made, self.where = 0, 0, []

    def __enter__(self) -> "HostReads":
        with _lock:
            if not _originals:  # the first counter open in the process patches torch
                for owner, names, kind in ((torch.Tensor, _READS, "reads"), (torch, _MADE + _FACTORIES, "made")):
                    for name in names:
                        _originals[(owner, name)] = getattr(owner, name)
                        setattr(owner, name, _counting(owner, name, kind))
            _open.setdefault(threading.get_ident(), []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            mine = _open[threading.get_ident()]
            mine.remove(self)
            if not mine:
                del _open[threading.get_ident()]
            if not _open:  # the last counter closed: torch as it was
                for (owner, name), original in _originals.items():
                    setattr(owner, name, original)
                _originals.clear()
