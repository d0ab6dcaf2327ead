"""Export a parallel module as a Hugging Face checkpoint: safetensors files ``from_pretrained`` reads,
written tensor by tensor.

>>> # on every rank (collective):
>>> # pm.save_pretrained("out/")      # ParallelModule or PipelineModule: rank 0 writes the files
>>> # LlamaForCausalLM.from_pretrained("out/")   # later, on one device

What is written is what the model's own ``save_pretrained`` writes: ``model.safetensors``, or, over
``max_shard_size``, ``model-00001-of-0000N.safetensors``... and ``model.safetensors.index.json``
(the same split: Hugging Face's ``split_state_dict_into_shards_factory`` over the tensors in the
model's state dict order, ``autotp_state_keys``), the state dict's persistent tensors under the
model's names, a weight tied to another (GPT-2's ``lm_head.weight`` and token embedding) once under
its first name in the model, and beside
them the module's ``config`` (its ``dtype`` the parameters', its ``architectures`` the model's class)
and ``generation_config`` where it has them.

Streaming: the sizes are known from the shapes, so each file's header is written first and its
tensors after it, one at a time. For each tensor every rank that holds a piece of it takes part in
gathering it whole (:func:`autotp.weights.checkpoint.full_tensor`, by autotp's placements); rank 0
writes its bytes and drops it before the next one, so no rank holds more than one whole tensor
beyond its own shards. A pipeline module's ranks first share which stage holds what (names, shapes
and dtypes only); a tensor of another stage is gathered over that stage's mesh and sent to rank 0
over the pipeline axis.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from autotp.weights.checkpoint import _check_sizable, _placements, full_tensor
from autotp.weights.loading import INDEX, SINGLE, _targets

__all__ = ["save_pretrained", "TensorEntry"]

# safetensors' names of the dtypes
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the export: its name in the file, global shape, dtype, whether it is a parameter,
    and the pipeline rank that holds it (0 without a pipeline)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool
    owner: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def save_pretrained(module: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write ``module``'s whole model to ``save_directory`` as Hugging Face writes it (module docstring).
    Collective: every rank of the module calls it; rank 0 writes."""
    limit_bytes = _shard_size_bytes(max_shard_size)
    if not isinstance(save_directory, (str, os.PathLike)):
        raise TypeError(f"save_directory is a {type(save_directory).__name__}; expected a path (str or os.PathLike)")
    root = Path(save_directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"save_directory {root} is a file; expected a directory (made if missing)")
    _check_sizable(module)
    bad = sorted({str(v.dtype) for v in module.state_dict().values() if v.dtype not in _DTYPES})
    if bad:
        raise TypeError(f"the module holds tensors of dtype {', '.join(bad)}, which safetensors does not store")
    own = _placements(module)
    held = {names[0]: value for names, value in _targets(module)}
    params = {id(p) for p in module.parameters()}
    mine = [TensorEntry(name, tuple(v.shape), v.dtype, id(v) in params) for name, v in held.items()]
    pp_group = getattr(module, "pp_group", None)
    entries = mine if pp_group is None else _over_the_stages(mine, pp_group)
    order = {name: i for i, name in enumerate(getattr(module, "autotp_state_keys", ()))}
    entries.sort(key=lambda e: order.get(e.name, len(order)))  # the model's order: the split its own save makes
    writer = not dist.is_initialized() or dist.get_rank() == 0
    files = _split(entries, limit_bytes)
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root, files)
    for filename, part in files.items():
        with _SafetensorsWriter(root / filename if writer else None, part) as out:
            for entry in part:
                whole = _gathered(entry, held.get(entry.name), own.get(entry.name), pp_group, module)
                out.write(whole)
                del whole
    if writer:
        _write_index(root, files, entries)
        _write_configs(module, root)
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the files are there


def _shard_size_bytes(max_shard_size: Any) -> int:
    """``max_shard_size`` in bytes: an int, or a size as Hugging Face reads it (``"5GB"``, ``"500MB"``)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        raise TypeError(f"max_shard_size is a {type(max_shard_size).__name__}; expected bytes (an int) or a size "
                        f"such as '5GB' or '500MB'")
    try:
        size = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    except ValueError as err:
        raise ValueError(f"max_shard_size {max_shard_size!r}: expected a size such as '5GB', '500MB' or '10KB' "
                         f"({err})") from None
    if size <= 0:
        raise ValueError(f"max_shard_size {max_shard_size!r} is {size} bytes; expected a positive size")
    return size


def _over_the_stages(mine: list[TensorEntry], pp_group: Any) -> list[TensorEntry]:
    """Every stage's entries, each once, owned by the first pipeline rank that holds it (names, shapes
    and dtypes shared over the pipeline axis; no tensor)."""
    parts: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, mine, group=pp_group)
    out: dict[str, TensorEntry] = {}
    for owner, part in enumerate(parts):
        for e in part:
            out.setdefault(e.name, TensorEntry(e.name, e.shape, e.dtype, e.parameter, owner))
    return list(out.values())


def _split(entries: list[TensorEntry], limit_bytes: int) -> dict[str, list[TensorEntry]]:
    """The files and their tensors, in order: Hugging Face's split (one file when it fits)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    by_name = {e.name: e for e in entries}
    split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda e: e.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=limit_bytes)
    return {filename: [by_name[n] for n in names] for filename, names in split.filename_to_tensors.items()}


def _gathered(entry: TensorEntry, value: Optional[torch.Tensor], placements: Any, pp_group: Any,
              module: nn.Module) -> Optional[torch.Tensor]:
    """The whole tensor on rank 0 (None elsewhere, or a rank's own copy it drops at once): gathered
    over the mesh of the ranks that hold it, then, in a pipeline, sent to rank 0 over the pipeline axis."""
    whole = full_tensor(value, placements).detach() if value is not None else None
    if pp_group is None:
        return whole
    ranks = dist.get_process_group_ranks(pp_group)
    if 0 not in ranks:  # rank 0's pipeline group moves the tensors; this rank only helped gather
        return None
    writer, me = ranks.index(0), dist.get_rank(pp_group)
    if entry.owner == writer:
        return whole
    if me == entry.owner:
        dist.send(whole.contiguous(), group_dst=writer, group=pp_group)
    elif me == writer:
        whole = torch.empty(entry.shape, dtype=entry.dtype, device=module.device)
        dist.recv(whole, group_src=entry.owner, group=pp_group)
    return whole if me == writer else None


class _SafetensorsWriter:
    """A safetensors file written as it goes: the header (every tensor's dtype, shape and byte range,
    known from the entries), then each tensor's bytes in turn. ``path`` None: a rank that writes nothing."""

    def __init__(self, path: Optional[Path], entries: list[TensorEntry]) -> None:
        self.path, self.entries, self.written = path, entries, 0
        self.file = None

    def __enter__(self) -> "_SafetensorsWriter":
        if self.path is None:
            return self
        if sys.byteorder != "little":
            raise NotImplementedError("safetensors files are little-endian; this machine is big-endian")
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in self.entries:
            header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(text)))
        self.file.write(text)
        return self

    def write(self, tensor: Optional[torch.Tensor]) -> None:
        if self.file is None:
            return
        e = self.entries[self.written]
        if tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise RuntimeError(f"{e.name}: gathered {tuple(tensor.shape)} {tensor.dtype}, the header says {e.shape} {e.dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(data.numpy().data)
        self.written += 1

    def __exit__(self, *exc: Any) -> None:
        if self.file is not None:
            self.file.close()
            if exc[0] is None and self.written != len(self.entries):
                raise RuntimeError(f"{self.path}: {self.written} of {len(self.entries)} tensors written")


def _remove_stale(root: Path, files: dict[str, list[TensorEntry]]) -> None:
    """Weight files of an earlier save that this one does not write (shards of another count, the
    index of a sharded save, a single file), so ``from_pretrained`` reads this save's alone."""
    for path in root.iterdir():
        stale = _SHARD_FILE.fullmatch(path.name) or path.name in (INDEX, SINGLE)
        if stale and path.is_file() and path.name not in files:
            path.unlink()


def _write_index(root: Path, files: dict[str, list[TensorEntry]], entries: list[TensorEntry]) -> None:
    """``model.safetensors.index.json`` where there are several files, as Hugging Face writes it."""
    if len(files) == 1:
        return
    total_parameters = sum(e.nbytes // e.dtype.itemsize for e in entries if e.parameter)
    index = {"metadata": {"total_parameters": total_parameters, "total_size": sum(e.nbytes for e in entries)},
             "weight_map": {e.name: filename for filename, part in files.items() for e in part}}
    (root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_configs(module: nn.Module, root: Path) -> None:
    """The module's ``config`` (a copy: its ``dtype`` the first floating parameter's, as Hugging Face
    records it, and ``architectures`` the model's class, ``autotp_model_class``, where it names none)
    and ``generation_config``."""
    architecture = getattr(module, "autotp_model_class", None)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        if dtype is not None:
            config.dtype = str(dtype).split(".")[1]
        if architecture and not getattr(config, "architectures", None):
            config.architectures = [architecture]
        config.save_pretrained(root)
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(root)


def _method(self: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Write the whole model as its own ``save_pretrained`` does: safetensors files its
    ``from_pretrained`` reads on one device (one ``model.safetensors``, or files of at most
    ``max_shard_size`` and ``model.safetensors.index.json``), the ``config`` and ``generation_config``
    beside them. Collective: every rank calls it; rank 0 writes, one tensor gathered at a time
    (:mod:`autotp.weights.export`); a pipeline's stages send theirs to rank 0."""
    save_pretrained(self, save_directory, max_shard_size)


def _give_the_modules_save_pretrained() -> None:
    """``save_pretrained`` as a method of both parallel module kinds: defined here, where the weights
    are, since the runtime that defines the classes imports nothing from this stage."""
    from autotp.runtime.module import ParallelModule
    from autotp.runtime.pipeline.module import PipelineModule

    _method.__name__ = _method.__qualname__ = "save_pretrained"
    ParallelModule.save_pretrained = _method  # type: ignore[attr-defined]
    PipelineModule.save_pretrained = _method  # type: ignore[attr-defined]


_give_the_modules_save_pretrained()
