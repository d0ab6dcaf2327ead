"""A rank's state on a parallel module: its pieces of the model's tensors, and graphs over them.

:func:`register_state` puts this rank's parameters (DTensors of its shards), buffers (its piece
where the plan splits one) and constants on a module; :func:`build_graph` makes another graph of the
same model (another mode, ``generate``'s cache graphs) over a module's state; :func:`buffer_piece`
is this rank's piece of a buffer the plan stores split. Nothing here plans.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autotp.placement import Placement, local_shape
from autotp.planning.result.plan import Plan
from autotp.runtime.devices import mesh_device
from autotp.runtime.rewrite import GraphRewrite, constant_name
from autotp.runtime.shards import as_dtensor, local_shard
from autotp.tracing.graph import BUFFER, OpGraph

__all__ = ["put", "register_state", "build_graph", "buffer_piece"]


def put(root: nn.Module, fqn: str, value: Any, kind: str, persistent: bool = True) -> None:
    """``value`` as the parameter or buffer ``fqn`` of ``root``, the submodules on its path made where missing."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if kind == "parameter":
        mod.register_parameter(leaf, value)
    else:
        if leaf in mod._buffers:
            del mod._buffers[leaf]
            mod._non_persistent_buffers_set.discard(leaf)
        mod.register_buffer(leaf, value, persistent=persistent)


def register_state(root: nn.Module, graph: OpGraph, plan: Plan, mesh: DeviceMesh,
                   model: nn.Module, keep: Optional[Any] = None) -> dict[str, tuple[Placement, ...]]:
    """This rank's state on ``root``: parameters as DTensors of its shard, buffers and constants as
    they are, each a copy (the module owns its tensors: training it leaves ``model`` as it was). A
    parameter on the meta device gets an uninitialized shard of its local shape on the mesh's device
    (never its full size); a buffer on meta an uninitialized tensor (``autotp.load_weights`` fills
    both). ``keep(fqn)``: where given, a parameter it refuses gets its shard on the meta device, no
    memory (a pipeline rank holds its stages' only). Returns autotp's placements of every parameter
    name (tied names too)."""
    mesh_shape, coordinate = tuple(int(n) for n in mesh.mesh.shape), mesh.get_coordinate()
    params = dict(model.named_parameters(remove_duplicate=False))
    device = mesh_device(mesh)
    placements_of: dict[str, tuple[Placement, ...]] = {}
    for p in graph.parameters:
        full = params[p.fqn].detach()
        placements = plan.strategy(p.node).output
        if keep is not None and not keep(p.fqn):
            local = torch.empty(local_shape(full.shape, placements, mesh_shape, coordinate), dtype=full.dtype,
                                device="meta")
        elif full.is_meta:
            local = torch.empty(local_shape(full.shape, placements, mesh_shape, coordinate), dtype=full.dtype,
                                device=device)
        else:
            local = local_shard(full, placements, coordinate, mesh_shape)
            if local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                local = local.clone()  # a replicated parameter would be the model's own tensor
        param = nn.Parameter(as_dtensor(local, mesh, placements, full.shape), requires_grad=params[p.fqn].requires_grad)
        param._autotp_placements = placements  # type: ignore[attr-defined]
        for name in (p.fqn, *p.aliases):
            placements_of[name] = placements
            put(root, name, param, "parameter")
    persistent = set(model.state_dict().keys())
    buffers = dict(model.named_buffers())
    split = {n.param_fqn: plan.strategy(n.name).output for n in graph.nodes if n.param_fqn in plan.buffer_placements}
    for name, buf in buffers.items():
        if name in split:  # this rank's piece only (a KV cache: the heads its attention reads)
            value = buffer_piece(buf.shape, buf.dtype, split[name], mesh, None if buf.is_meta else buf)
        else:
            value = torch.empty_like(buf, device=device) if buf.is_meta else buf.detach().to(device).clone()
        put(root, name, value, "buffer", persistent=name in persistent)
    read_as_buffers = {n.param_fqn for n in graph.nodes if n.role == BUFFER}
    for name, const in graph.exported.constants.items():
        # export lists non-persistent buffers among its constants too: the graph reads those as buffers
        if isinstance(const, torch.Tensor) and name not in read_as_buffers:
            # export lifts non-persistent buffers as constants; a model traced on meta has them real
            value = buffers[name] if _no_values(const) and name in buffers else const
            put(root, constant_name(name), value.detach().to(device).clone(), "buffer", persistent=False)
    return placements_of


def buffer_piece(shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement], mesh: DeviceMesh,
                 full: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's piece of a buffer of ``shape`` stored with ``placements``: cut from ``full`` (a copy),
    or, without it, uninitialized."""
    mesh_shape, coordinate = tuple(int(n) for n in mesh.mesh.shape), mesh.get_coordinate()
    device = mesh_device(mesh)
    if full is None:
        return torch.empty(local_shape(shape, placements, mesh_shape, coordinate), dtype=dtype, device=device)
    return local_shard(full.detach(), placements, coordinate, mesh_shape).to(device).clone()


def build_graph(graph: OpGraph, plan: Plan, mesh: DeviceMesh, module: nn.Module, seed: int | None = None,
                prefix: str = "") -> torch.fx.Graph:
    """The graph of ``graph`` (another mode of ``module``'s model) over ``module``'s parameters and
    buffers, its own submodules added to ``module`` under names that start with ``prefix``."""
    read_as_buffers = {n.param_fqn for n in graph.nodes if n.role == BUFFER}
    for name, const in graph.exported.constants.items():
        target = constant_name(name)
        if isinstance(const, torch.Tensor) and name not in read_as_buffers and not _has_buffer(module, target):
            if _no_values(const):
                raise NotImplementedError(f"the model in this mode reads the constant {name}, which it did not read "
                                          f"when it was parallelized; parallelize it in this mode")
            put(module, target, const.detach().to(mesh_device(mesh)).clone(), "buffer",
                 persistent=False)
    rewrite = GraphRewrite(graph, plan, mesh, module, seed, prefix=prefix, check_inputs=module.autotp_check_inputs)
    rewrite.emit()
    gm = rewrite.finish(torch.fx.GraphModule(module, rewrite.fx))  # over the module's state, for a while
    # the recomputed layers' modules go to the module; the ones moved into them leave it
    for name in rewrite.added:
        if not hasattr(gm, name):
            delattr(module, name)
    for name, child in gm.named_children():
        if not hasattr(module, name):
            module.add_module(name, child)
    return gm.graph


def _no_values(t: torch.Tensor) -> bool:
    """A tensor with no values: on meta, or a fake one (a trace on a fake device)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def _has_buffer(module: nn.Module, target: str) -> bool:
    try:
        module.get_buffer(target)
        return True
    except AttributeError:
        return False
