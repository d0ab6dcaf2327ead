"""``autotp.load_weights``: fill a parallel module from a checkpoint, each rank reading only its shards.

Two kinds of checkpoint directory:

- **Hugging Face safetensors**: ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json`` (what ``save_pretrained`` writes). Each rank opens the files
  with ``safetensors`` and reads, per parameter, only the rows and columns its shard holds
  (``get_slice``); replicated parameters and buffers are read whole. A piece that is contiguous in
  the file and of the module's dtype (a replicated tensor, a split along dim 0) becomes the shard
  itself, backed by the file's pages mapped privately (as ``from_pretrained`` does: no copy, and a
  write, an optimizer step, copies only the page it touches); any other piece is copied into the
  shard, converted to the module's dtype (a bfloat16 file into a float32 model and back). A weight tied to another
  (``lm_head.weight`` and ``model.embed_tokens.weight``) is one parameter under two names and is
  read from whichever name the file has. Before a file is read, the kernel is asked to read ahead
  the byte spans this rank's pieces cover (``posix_fadvise``), so a cold read sees the rank's whole
  share at once rather than one page fault at a time; meanwhile a second thread writes a byte of each
  page of the shards that pieces are copied into, so the kernel hands over their fresh pages while
  the disk reads (``_Prefault``).
  On a GPU, a piece is copied through pinned memory without waiting (:class:`_Uploads`), and the
  device synchronized once at the end.
- **torch.distributed.checkpoint** (a directory with ``.metadata``): written by
  ``autotp.checkpoint.save`` on any mesh and plan, or by DCP from an unsharded model; DCP reads
  the pieces each rank's placements need (resharding on load).

Before anything is read, every key is checked: names the module has and the files do not
(missing), names the files have and the module does not (unexpected), and global shapes that
differ are reported together in one ``ValueError``, with nothing loaded. The ranks then compare
what they found (an all-gather along each mesh axis): where one rank's host lacks a file or holds
other keys, or sees another kind of checkpoint, every rank raises before any reads.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotp.runtime.shards import local_ranges, placements_of

__all__ = ["load_weights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def load_weights(module: nn.Module, path: str | os.PathLike) -> None:
    """Fill ``module`` (from ``autotp.parallelize``) from the checkpoint directory ``path`` (module doc)."""
    root = Path(path)
    kind, plan, problem = "safetensors", None, None
    try:  # anything this rank finds wrong is raised in _agree, which every rank must reach
        kind = "dcp" if (root / ".metadata").is_file() else "safetensors"
        if kind == "safetensors":
            plan = _match(_targets(module), _safetensors_files(root), getattr(module, "autotp_other_stages_keys", ()))
    except Exception as err:  # noqa: BLE001 - an unreadable directory too (is_file raises on EACCES)
        problem = err
    _agree(module, root, kind, problem)
    if kind == "dcp":
        from autotp.weights import checkpoint

        return checkpoint.load(module, root)
    from autotp.weights.checkpoint import _placements

    with torch.no_grad():
        _read(plan, _placements(module))


def _agree(module: nn.Module, root: Path, kind: str, problem: BaseException | None) -> None:
    """Every rank's view of the checkpoint, on every rank of the module's mesh, before any rank reads:
    where one rank finds it does not fit (a missing, truncated or unreadable file on its host, other
    keys) or sees another kind of checkpoint, every rank of the mesh raises, and none has loaded
    anything. An all-gather along each mesh axis in turn. A module with no DTensor (one process)
    only raises its own problem."""
    import torch.distributed as dist

    seen = {"kind": kind, "problem": None if problem is None else f"{type(problem).__name__}: {problem}"}
    mesh = next((v.device_mesh for v in module.state_dict(keep_vars=True).values() if hasattr(v, "device_mesh")), None)
    views = {0: seen}
    if mesh is not None and dist.is_available() and dist.is_initialized():
        views = {dist.get_rank(): seen}
        for axis in range(mesh.ndim):
            gathered: list[Any] = [None] * mesh.size(axis)
            dist.all_gather_object(gathered, views, group=mesh.get_group(axis))
            views = {rank: view for part in gathered for rank, view in part.items()}
    if problem is not None:
        raise problem
    kinds = {view["kind"] for view in views.values()}
    failed = {rank: view["problem"] for rank, view in sorted(views.items()) if view["problem"]}
    if len(kinds) > 1:
        raise ValueError(f"the ranks see different checkpoints at {root}, nothing was loaded: " + "; ".join(
            f"rank {rank}: {'a torch.distributed.checkpoint' if view['kind'] == 'dcp' else 'a safetensors'} directory"
            for rank, view in sorted(views.items())))
    if failed:
        raise ValueError(f"the checkpoint at {root} does not fit on other ranks, nothing was loaded on any rank: "
                         + "; ".join(f"rank {rank}: {text}" for rank, text in failed.items()))


def _safetensors_files(root: Path) -> dict[str, Path]:
    """``{key: file}`` of a safetensors checkpoint directory."""
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return {key: root / name for key, name in weight_map.items()}
    if (root / SINGLE).is_file():
        return {key: root / SINGLE for key in _file_shapes(root / SINGLE)}
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}")
    raise ValueError(f"{root} holds no checkpoint autotp reads: expected {INDEX}, {SINGLE}, or a "
                     f"torch.distributed.checkpoint directory (with .metadata)")


def _targets(module: nn.Module) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Each tensor of the state dict once, with all the names it goes by (tied weights)."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), ([], value))[0].append(name)
    return [(tuple(names), value) for names, value in by_id.values()]


def _match(targets, files: dict[str, Path], elsewhere=()) -> list[tuple[str, Path, torch.Tensor]]:
    """``(key, file, tensor)`` to read for every target, or one ValueError naming every problem.
    ``elsewhere``: keys another part of the model holds (a pipeline's other stages), not read here."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for file in sorted(set(files.values())):
        for key, shape in _file_shapes(file).items():
            shapes[key], where[key] = shape, file
    missing, wrong, out, known = [], [], [], set()
    misplaced = sorted(f"{key} (listed in {file.name})" for key, file in files.items() if where.get(key) != file)
    for names, value in targets:
        known.update(names)
        key = next((n for n in names if n in shapes), None)
        if key is None:
            missing.append(" = ".join(names))
            continue
        if shapes[key] != tuple(value.shape):
            wrong.append(f"{key}: {list(shapes[key])} in the file, {list(value.shape)} in the model")
            continue
        out.append((key, where[key], value))
    unexpected = sorted(k for k in shapes if k not in known and k not in elsewhere)
    if missing or unexpected or wrong or misplaced:
        parts = [f"missing from the checkpoint: {', '.join(missing)}" if missing else "",
                 f"the index lists them in a file that does not hold them: {', '.join(misplaced)}" if misplaced else "",
                 f"in the checkpoint but not in the model: {', '.join(unexpected)}" if unexpected else "",
                 f"shapes differ: {'; '.join(wrong)}" if wrong else ""]
        raise ValueError("the checkpoint does not fit the model, nothing was loaded: "
                         + "; ".join(p for p in parts if p))
    return out


def _read(plan: list[tuple[str, Path, torch.Tensor]], placements: dict) -> None:
    """Each entry's piece from its file; ``placements``: autotp's, by name (``checkpoint._placements``)."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for key, file, value in plan:
        by_file.setdefault(file, []).append((key, value))
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    wanted = {file: [(key, value, _ranges(value, meshes, placements.get(key))) for key, value in entries]
              for file, entries in by_file.items()}
    files = list(wanted)

    def prefetch(file: Path) -> None:
        _prefetch(file, [(key, ranges) for key, _, ranges in wanted[file]])

    if files:
        prefetch(files[0])
    # the shards that pieces are copied into get their fresh pages in a second thread meanwhile (_Prefault)
    copied = set()
    for file in files:
        dtypes = {key: entry["dtype"] for key, entry in _header(file)[1].items()}
        copied.update(key for key, value, ranges in wanted[file]
                      if _copied(tuple(value.shape), ranges, _shard(value), dtypes.get(key)))
    faulting = _Prefault([_shard(value) for file in files for key, value, _ in wanted[file] if key in copied])
    uploads = _Uploads()
    try:
        for i, file in enumerate(files):
            if i + 1 < len(files):  # the disk reads the next file's share while this one is copied
                prefetch(files[i + 1])
            with safe_open(file, framework="pt") as f:
                for key, value, ranges in wanted[file]:
                    if key in copied:
                        faulting.wait(_shard(value))
                    _load_entry(f, key, ranges, _shard(value), key in copied, uploads)
    finally:
        faulting.stop()
        uploads.wait()


def _load_entry(f: Any, key: str, ranges, local: torch.Tensor, copied: bool, uploads: "_Uploads") -> None:
    """Fill ``local`` with the piece ``ranges`` (None: whole) of ``key`` in the open file ``f``: where
    it is not ``copied`` (:func:`_copied`) and is one block of the file's pages in ``local``'s dtype and
    on its device, ``local`` takes those pages; else it is copied in (:func:`_copy_piece`, through
    ``uploads``: to a GPU, not waited for)."""
    if not copied and (ranges is None or all(len(r) == 1 for r in ranges)):
        piece = f.get_slice(key)[tuple(slice(a, b) for ((a, b),) in ranges)] if ranges else f.get_tensor(key)
        if piece.dtype == local.dtype and piece.is_contiguous() and piece.device == local.device:
            local.set_(piece)  # the file's pages, mapped privately: no copy; a write copies its page
            return
    if ranges is None:
        uploads.copy(local, f.get_tensor(key))  # to another device, or converting the dtype as it copies
    else:
        _copy_piece(f.get_slice(key), ranges, local, uploads)


def _shard(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard itself (``to_local()`` may hand back a view, which ``set_`` would not reach)."""
    return value._local_tensor if hasattr(value, "_local_tensor") else value


def _copied(shape: tuple[int, ...], ranges, local: torch.Tensor, file_dtype: str | None) -> bool:
    """Whether the piece ``ranges`` of a row-major tensor of ``shape`` (stored as ``file_dtype``, the
    header's name) is copied into the CPU shard ``local`` (and ``local`` faulted in early) rather than
    mapped: it is strided in the file (split along a later dim, or in blocks) or of another dtype. Other
    shards take the piece :func:`_read` gets (on another device, a copy)."""
    if local.device.type != "cpu" or not local.is_contiguous() or local.numel() == 0:
        return False
    if _DTYPES.get(file_dtype) != local.dtype:
        return True
    if ranges is None:
        return False
    cut = [d for d, r in enumerate(ranges) if r != ((0, shape[d]),)]
    if not cut:
        return False
    first = cut[0]
    return len(ranges[first]) > 1 or len(cut) > 1 or any(n > 1 for n in shape[:first])


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Prefault:
    """Gets fresh pages for ``tensors`` (writing a byte of each page, in order) in a thread of its own, so
    that the kernel hands them over while this rank waits on the disk or maps other pieces: copying into
    memory never touched before costs as much as the copy itself, and more on a virtual machine. Before a
    tensor is written or replaced, :meth:`wait` for it (the thread writes into it)."""

    PAGE_BYTES = 4096

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import threading

        self._done = {id(t): threading.Event() for t in tensors}
        self._cancel = threading.Event()
        self._thread = None
        if tensors:
            bytes_ = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
            self._thread = threading.Thread(target=self._run, args=(tensors, bytes_), daemon=True)
            self._thread.start()

    def _run(self, tensors, bytes_) -> None:
        for t, b in zip(tensors, bytes_):
            if not self._cancel.is_set():
                b[::self.PAGE_BYTES].zero_()
            self._done[id(t)].set()

    def wait(self, tensor: torch.Tensor) -> None:
        event = self._done.get(id(tensor))
        if event is not None:
            event.wait()

    def stop(self) -> None:
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()


def _file_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a safetensors file, opened with ``safetensors`` itself: it checks the whole
    layout (the header against the file's size, the offsets against the shapes and dtypes), so a
    truncated or corrupt file is refused here, before any rank reads, not halfway through loading."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors' own error types; named with the file
        raise ValueError(f"{file} is not a safetensors file autotp can read ({type(err).__name__}: {err})") from None


def _prefetch(file: Path, wanted: list[tuple[str, Any]]) -> None:
    """Ask the kernel to start reading, all at once, the bytes of ``file`` that ``wanted`` (key, ranges
    or None for whole) covers. The reads that follow go through the file's pages one fault at a time;
    with this the disk sees the rank's whole share at once (a piece split along its last dims spans
    whole rows: its rows are read whole). A no-op where ``posix_fadvise`` is missing."""
    if not hasattr(os, "posix_fadvise"):
        return
    start_bytes, layout = _data_layout(file)
    fd = os.open(file, os.O_RDONLY)
    try:
        for key, ranges in wanted:
            for lo, hi in _byte_spans(*layout[key], ranges):
                os.posix_fadvise(fd, start_bytes + lo, hi - lo, os.POSIX_FADV_WILLNEED)
    except OSError:  # a hint the file system may refuse: the reads that follow do not need it
        pass
    finally:
        os.close(fd)


def _data_layout(file: Path) -> tuple[int, dict[str, tuple[tuple[int, ...], int, int]]]:
    """Where a safetensors file's data starts, and per key ``(shape, first byte, last byte + 1)`` after it
    (the offsets ``safetensors`` does not expose). The format: an 8-byte little-endian header length,
    a JSON header, then the data; the file was checked whole by :func:`_file_shapes` before."""
    start_bytes, header = _header(file)
    return start_bytes, {key: (tuple(entry["shape"]), *entry["data_offsets"]) for key, entry in header.items()}


def _header(file: Path) -> tuple[int, dict[str, dict]]:
    """Where a safetensors file's data starts, and its JSON header's entries by key."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _byte_spans(shape: tuple[int, ...], first: int, end: int, ranges) -> list[tuple[int, int]]:
    """The byte spans (from the tensor's first byte) that hold the piece ``ranges`` of a row-major
    tensor stored in ``[first, end)``: one span per block of a blocked split, from the piece's first
    element to its last.

    >>> _byte_spans((4, 6), 0, 96, (((2, 4),), ((0, 6),)))  # rows 2..3 of float32
    [(48, 96)]
    >>> _byte_spans((4, 6), 0, 96, (((0, 4),), ((0, 3),)))  # the first 3 columns: rows 0..3 spanned
    [(0, 84)]
    """
    numel = math.prod(shape)
    if ranges is None or numel == 0:
        return [(first, end)] if end > first else []
    item = (end - first) // numel
    if item == 0:  # elements smaller than a byte: the whole tensor
        return [(first, end)]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    spans = []
    for block in itertools.product(*ranges):
        if any(hi <= lo for lo, hi in block):
            continue
        lo = sum(a * s for (a, _), s in zip(block, strides))
        hi = sum((b - 1) * s for (_, b), s in zip(block, strides)) + 1
        spans.append((first + lo * item, first + hi * item))
    return spans


def _copy_piece(sliced: Any, ranges: tuple, local: torch.Tensor, uploads: "_Uploads") -> None:
    """Copy the piece ``ranges`` of a file's tensor into ``local``, block by block where a blocked split
    cuts a dim (no piece-sized intermediate), converting the dtype as it copies."""
    multi = [d for d, r in enumerate(ranges) if len(r) > 1]
    if not multi:
        uploads.copy(local, sliced[tuple(slice(a, b) for ((a, b),) in ranges)])
        return
    (d,) = multi  # a blocked split cuts one dim (autotp.planning.choices.strategies refuses a dim split twice)
    start = 0
    for lo, hi in ranges[d]:
        uploads.copy(local.narrow(d, start, hi - lo), sliced[tuple(slice(a, b) for ((a, b),) in ranges[:d])
                                                             + (slice(lo, hi),)
                                                             + tuple(slice(a, b) for ((a, b),) in ranges[d + 1:])])
        start += hi - lo


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _pinned(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


class _Uploads:
    """Copies of a file's pieces into shards. Into a CUDA shard, a piece (the file's pageable pages)
    is first copied into pinned memory, in the shard's dtype, then to the device with
    ``non_blocking=True``: the copies queue on the device while the next pieces are read, and
    :meth:`wait` synchronizes once, when every piece is in. (PyTorch's pinned-memory allocator keeps a
    staged buffer from reuse until its copy has run.) Into any other shard, a plain copy."""

    def __init__(self) -> None:
        self.devices: set[torch.device] = set()

    def copy(self, local: torch.Tensor, piece: torch.Tensor) -> None:
        if not _is_cuda(local):
            local.copy_(piece)
            return
        staged = _pinned(piece.shape, local.dtype)
        staged.copy_(piece)
        local.copy_(staged, non_blocking=True)
        self.devices.add(local.device)

    def wait(self) -> None:
        for device in sorted(self.devices, key=str):
            _synchronize(device)
        self.devices.clear()


def _ranges(value: Any, meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], placements=None):
    """This rank's ``(start, stop)`` per dim of a DTensor, None for a plain tensor (read whole).

    ``meshes`` caches each mesh's (coordinate, shape): ``DeviceMesh.mesh`` rebuilds a tensor per call.
    """
    if not hasattr(value, "placements"):
        return None
    mesh = value.device_mesh
    if id(mesh) not in meshes:
        meshes[id(mesh)] = (tuple(mesh.get_coordinate()), tuple(mesh.mesh.shape))
    coordinate, shape = meshes[id(mesh)]
    own = placements if placements is not None else placements_of(value)
    return local_ranges(tuple(value.shape), own, coordinate, shape)
