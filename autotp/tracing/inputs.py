"""What a trace is given: the example inputs as export takes them, and the model as it is traced.

:func:`normalize_inputs` reads example inputs (a tuple, one tensor, a dict of keywords);
:func:`distinct` gives a tensor passed twice a copy (export would trace it as one input);
:func:`check_devices` refuses a model and inputs on different devices; :func:`in_modes` puts the
model in train or eval mode for the trace; :func:`cache_off` turns a Hugging Face model's KV cache
off; a model on meta (:func:`meta_parameters`) is traced on meta (:func:`buffers_on_meta`) or, for
the device it will run on, on fake tensors that say that device (:func:`on_fake_device`). Every
one puts the model back as it was.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union

import torch

from autotp.tracing.refusals import CaptureError
from autotp.words import with_article

__all__ = ["normalize_inputs", "distinct", "check_devices", "in_modes", "modes_of", "describe_modes", "Modes", "cache_off", "meta_parameters",
           "on_fake_device", "buffers_on_meta"]


def normalize_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn the user's example inputs into ``(args, kwargs)`` or raise a clear ``TypeError``.

    Accepted: a tensor, a tuple or list of tensors (and plain Python scalars / None), or a dict of
    keyword arguments.
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TypeError("example_inputs: a dict must map argument names (str) to values")
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        for i, x in enumerate(example_inputs):
            if not isinstance(x, (torch.Tensor, int, float, bool, type(None))):
                raise TypeError(
                    f"example_inputs[{i}] is {with_article(type(x).__name__)}; expected a torch.Tensor "
                    "(or an int/float/bool/None)"
                )
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs is {with_article(type(example_inputs).__name__)}; expected a tuple of tensors "
        "(the positional arguments of model.forward), a single tensor, or a dict of keyword arguments"
    )


def check_devices(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    model_devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    input_devices = {x.device.type for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}
    if len(model_devices) > 1:
        raise CaptureError(f"the model's parameters and buffers are spread over devices {sorted(model_devices)}; "
                           "put the whole model on one device (or on 'meta' for planning only)")
    if model_devices and input_devices and model_devices != input_devices:
        raise CaptureError(
            f"the model is on {sorted(model_devices)[0]!r} but the example inputs are on {sorted(input_devices)}; "
            "put the example inputs on the model's device (for a model on 'meta', build inputs with device='meta')"
        )


def distinct(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with a tensor given twice (``{"input_ids": ids, "labels": ids}``) given as a
    copy the second time. ``torch.export`` traces one tensor given twice as one input: every use of
    either would read the same placeholder, and the module, called later with two different tensors,
    would silently compute with one of them for both."""
    seen: set[int] = set()

    def once(x: Any) -> Any:
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    return torch.utils._pytree.tree_map_only(torch.Tensor, once, (args, kwargs))


@contextlib.contextmanager
def cache_off(model: torch.nn.Module, kwargs: dict) -> Iterator[None]:
    """A model whose config asks for a KV cache (a Hugging Face model's ``config.use_cache``, True by
    default; and a submodule's config, where it keeps a copy of its own) is traced with it off,
    unless the inputs say otherwise: a cache object cannot be traced, and the forward with a cache is a graph of its own (``ParallelModule.generate``,
    :mod:`autotp.runtime.generation`). The config is put back as it was."""
    # every config that asks for one: a submodule may hold a copy of its own (T5's decoder stack)
    configs = {id(c): c for m in model.modules() for c in (getattr(m, "config", None),)
               if getattr(c, "use_cache", None) is True}
    if "use_cache" in kwargs or not configs:
        yield
        return
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


Modes = Union[bool, tuple[bool, tuple[str, ...]]]
"""The modes a model's modules are in, as one value: ``True`` / ``False`` where every module is in
train / eval mode, else ``(top, others)``: the top module's flag and the names of the modules whose
flag differs from it (a frozen backbone in eval mode inside a model in train mode)."""


def modes_of(model: torch.nn.Module) -> Modes:
    """``model``'s :data:`Modes`."""
    others = tuple(name for name, m in model.named_modules() if m.training != model.training)
    return (bool(model.training), others) if others else bool(model.training)


def describe_modes(modes: Modes) -> str:
    """``"train"``, ``"eval"``, or ``"train (backbone in eval)"``."""
    if isinstance(modes, bool):
        return "train" if modes else "eval"
    top, others = modes
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return f"{'train' if top else 'eval'} ({shown} in {'eval' if top else 'train'})"


@contextlib.contextmanager
def in_modes(model: torch.nn.Module, modes: Modes) -> Iterator[None]:
    """``model``'s modules set to ``modes`` (:func:`modes_of` of a model of the same structure) for
    the block; every module's own flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    top, others = (modes, ()) if isinstance(modes, bool) else modes
    model.train(top)
    named = dict(model.named_modules())
    missing = [name for name in others if name not in named]
    try:
        if missing:
            raise ValueError(f"the modes name modules the model does not have: {', '.join(missing)}")
        for name in others:
            named[name].training = not top
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def meta_parameters(model: torch.nn.Module) -> bool:
    """Parameters all on meta (a model built under ``autotp.meta_init``, or wholly on meta)."""
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


@contextlib.contextmanager
def on_fake_device(model: torch.nn.Module, device: torch.device, inputs: Any) -> Iterator[Any]:
    """The (meta) model's parameters and buffers, and the (meta) inputs, as fake tensors that say
    ``device``, while it is traced; the originals put back. Yields the inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fake: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, kept alive; its fake)

    def on_device(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fake:  # one tensor, one fake: a tied weight stays tied
            fake[id(t)] = (t, mode.fake_tensor_converter.from_meta_and_device(mode, t.detach().to("meta"), device))
        return fake[id(t)][1]

    saved, params = [], {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                saved.append((module._parameters, name, p))
                if id(p) not in params:  # a tied parameter: one fake Parameter for every name of it
                    params[id(p)] = torch.nn.Parameter(on_device(p), requires_grad=p.requires_grad)
                module._parameters[name] = params[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                saved.append((module._buffers, name, b))
                module._buffers[name] = on_device(b)
    try:
        yield torch.utils._pytree.tree_map_only(torch.Tensor, on_device, inputs)
    finally:
        for table, name, value in saved:
            table[name] = value


@contextlib.contextmanager
def buffers_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """The model's buffers swapped for meta copies while it is traced; the originals put back."""
    saved = []
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                saved.append((module, name, buf))
                module._buffers[name] = buf.to("meta")
    try:
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf
