"""Rewrite: an exported graph and its Plan → the ``torch.fx`` graph of one rank, on local shards.

The graph reads the parallel module's parameters (DTensors with the planned placements, under the
model's own names: :mod:`autotp.runtime.module` registers them) and runs every op on the local shard
as its op family says (:mod:`autotp.planning.rules`: each family's local execution, called with a
:class:`~autotp.local.site.LocalSite`, makes shape arguments local, runs a row-split embedding as a
masked lookup, dropout with masks that follow the shards, ...; an op no family names runs as it
is). What every op shares is done here: its tensor arguments read in their planned placements, a
copy of a redistributed value an op writes in place, constants moved to the mesh's device. The
layers the plan recomputes run under ``torch.utils.checkpoint``
(:mod:`autotp.planning.costs.recompute`), and the graph holds the plan's collectives as
``call_module`` nodes (:mod:`autotp.local.collectives`), placed exactly where
:mod:`autotp.planning.costs.program` says. Nothing else communicates but the ops that run
collectives inside themselves (:mod:`autotp.planning.rules.inner`): DTensor is the format of the
parameters, not the engine that runs the ops. Before any of it the graph checks its inputs against
the example inputs it was built for (:mod:`autotp.runtime.guard`).
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autotp.local.collectives import GradAllReduce, RedistributeStep, to_local
from autotp.local.outputs import HeldOutput, held_placements
from autotp.local.site import LocalSite, run_locally
from autotp.placement import Placement, dim_pieces, local_shape, piece_sizes
from autotp.planning.costs.program import OUTPUT, reads
from autotp.planning.costs.recompute import recomputed_nodes
from autotp.planning.costs.redistribute import conversion, fused_axes, reduced_axes
from autotp.planning.result.plan import Plan
from autotp.planning.rules import local_executions
from autotp.runtime.devices import mesh_device, on_mesh_device
from autotp.runtime.guard import MASK_DTYPES, InputGuard, InputSpec, SameOnEveryRank, as_traced_dtype
from autotp.runtime.recompute import apply_recompute
from autotp.runtime.shards import block_index
from autotp.tracing.aliasing import writes_first_argument
from autotp.tracing.dynamic import requirements
from autotp.tracing.export import map_tensor_arguments
from autotp.tracing.graph import OpGraph

__all__ = ["GraphRewrite", "constant_name"]

aten = torch.ops.aten


def constant_name(name: str) -> str:
    """Where the parallel module holds the exported program's constant ``name`` (a lifted tensor)."""
    return "_autotp_constants." + name.replace(".", "_")


class GraphRewrite:
    """The graph of one rank, emitted over ``root``: a module that already holds the parameters,
    buffers and constants under their names (:func:`autotp.runtime.state.register_state`). The submodules
    the graph calls (collectives, dropout, the input guard, recomputed layers) are added to ``root``
    under names that start with ``prefix`` (another mode's graph of the same module names its own).
    ``check_inputs``: how many calls compare the inputs across the ranks (None: every call).

    ``emit()`` builds ``self.fx``; ``finish(gm)`` completes a GraphModule made on it."""

    def __init__(self, graph: OpGraph, plan: Plan, mesh: DeviceMesh, root: nn.Module,
                 seed: int | None = None, prefix: str = "", check_inputs: int | None = 0) -> None:
        self.g, self.plan, self.mesh, self.root = graph, plan, mesh, root
        self.check_inputs = check_inputs
        self.prefix = prefix
        self.ep = graph.exported
        self.mesh_shape = tuple(int(n) for n in mesh.mesh.shape)
        self.coordinate = mesh.get_coordinate()
        self.axis_names = plan.mesh.axis_names
        self.groups = [mesh.get_group(a) for a in range(len(self.mesh_shape))]
        self.added: list[str] = []  # the submodules this build added to the root
        self.fx = torch.fx.Graph()
        self.local: dict[str, torch.fx.Node] = {}  # producer name -> its local value
        self.sizes: dict[str, torch.fx.Node] = {}  # symbolic size node -> its value (a global size)
        self.read_cache: dict[tuple, torch.fx.Node] = {}
        self.order_buffers: dict[tuple, str] = {}  # (axis, placement, size, inverse) -> buffer name
        self.n_modules = 0
        self.n_dropouts = 0
        self.seed = torch.initial_seed() if seed is None else int(seed)
        train = plan.mode == "train"
        self.recomputed = recomputed_nodes(graph, plan.recompute)  # node -> the recomputed layer it is in
        self.layer_of: dict[str, str] = {}  # fx node name -> the recomputed layer it runs in
        self.origin: dict[str, str] = {}  # fx node name -> the graph op it was emitted for (pipeline stages)
        self.size_layer: dict[str, str] = {}  # exported size node -> the recomputed layer it is computed in
        program_reads = reads(graph, plan.strategies, plan.mesh, train)
        self.grad_axes = {(r.consumer, r.index): r.grad_axes for r in program_reads}
        self.read_keys = {(r.consumer, r.index): r.value for r in program_reads}  # what reads share

    # -- reads ---------------------------------------------------------------------------------

    def _add_module(self, module: nn.Module, prefix: str) -> str:
        name = f"autotp_{self.prefix}{prefix}_{self.n_modules}"
        self.n_modules += 1
        self.root.add_module(name, module)
        self.added.append(name)
        return name

    def read(self, producer: str, q, grad_axes: tuple[int, ...], base: torch.fx.Node | None = None,
             value_key: str | None = None) -> torch.fx.Node:
        """The local value of ``producer`` as a consumer needing placements ``q`` sees it.

        Reads of the same value (``value_key``: :func:`autotp.planning.costs.program.read_key`) with the same ``q``
        share one redistribution, and with the same ``grad_axes`` one gradient reduction.
        """
        value = base if base is not None else self.local[producer]
        if q is None:
            return value
        vkey = value_key or producer
        p = self.plan.strategy(producer).output
        fused = fused_axes(p, q, grad_axes)
        key = (vkey, q, fused)
        if key not in self.read_cache:
            item = vkey.partition("@")[0]  # the producer or the getitem; @n: after n writes in place
            node = self.g[item] if item in self.g else self.g[producer]
            steps = conversion(node.outputs[0].shape, p, q, self.mesh_shape, fused)
            if steps.view is not None:  # a blocked split: the steps run on dim d seen as (blocks, block)
                value = self.fx.call_function(torch.unflatten, (value, steps.view[0], (steps.view[1], -1)))
            if steps.reorder_before is not None:  # unequal blocks: dim d in the ranks' order, then split
                value = self.reorder(value, *steps.reorder_before, node.outputs[0].shape, inverse=False)
            for step in steps.steps:
                uneven = next((u for u in (step.src, step.dst) if u.is_uneven), None)
                n = self.mesh_shape[step.axis]
                sizes = piece_sizes(steps.shape[uneven.dim], uneven, n) if uneven is not None else None
                mod = RedistributeStep(step.src, step.dst, self.axis_names[step.axis], self.groups[step.axis],
                                       n, self.coordinate[step.axis],
                                       reduce_grad=step.backward == "reduce_scatter" and step.src.is_shard,
                                       sizes=sizes)
                value = self.fx.call_module(self._add_module(mod, "redistribute"), (value,))
            if steps.view is not None:
                value = self.fx.call_function(torch.flatten, (value, steps.view[0], steps.view[0] + 1))
            if steps.reorder_after is not None:  # gathered in the ranks' order: put back in place
                value = self.reorder(value, *steps.reorder_after, node.outputs[0].shape, inverse=True)
            self.read_cache[key] = value
        value = self.read_cache[key]
        reduce_axes = reduced_axes(p, q, grad_axes)
        if reduce_axes:
            gkey = (vkey, q, grad_axes)
            if gkey not in self.read_cache:
                for a in reduce_axes:
                    mod = GradAllReduce(self.axis_names[a], self.groups[a])
                    value = self.fx.call_module(self._add_module(mod, "grad_reduce"), (value,))
                self.read_cache[gkey] = value
            value = self.read_cache[gkey]
        return value

    def reorder(self, value: torch.fx.Node, axis: int, p: Placement, shape, inverse: bool) -> torch.fx.Node:
        """``value`` with dim ``p.dim`` taken in the order the ranks of ``axis`` hold unequal blocks
        (:func:`block_permutation`), or, ``inverse``, put back from it. A constant index, made here."""
        key = (axis, p, shape[p.dim], inverse)
        if key not in self.order_buffers:
            self.order_buffers[key] = name = f"_autotp_{self.prefix}order_{len(self.order_buffers)}"
            index = block_index(p, self.mesh_shape[axis], shape[p.dim], inverse)
            self.root.register_buffer(name, index.to(mesh_device(self.mesh)), persistent=False)
        index = self.fx.get_attr(self.order_buffers[key])
        return self.fx.call_function(aten.index_select.default, (value, p.dim, index))

    # -- graph ---------------------------------------------------------------------------------

    def finish(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """``gm`` (made on ``self.fx``) with export's codegen (the inputs' pytree) and input guards
        (:meth:`emit_guard`), recompiled, and the layers the plan recomputes moved into their
        checkpointed submodules (:func:`autotp.runtime.recompute.apply_recompute`)."""
        unlifted = self.ep.module()
        gm.graph._codegen = unlifted.graph._codegen
        guard = getattr(gm, self.guard_name, None)
        if guard is not None:
            guard.recorded = getattr(unlifted, "_guards_fn", None)
        gm.recompile()
        if self.layer_of:
            apply_recompute(gm, {n: self.layer_of[n.name] for n in gm.graph.nodes if n.name in self.layer_of},
                            prefix=self.prefix)
        return gm

    @property
    def guard_name(self) -> str:
        return f"autotp_{self.prefix}input_guard"

    def emit(self) -> None:
        """The graph, node by node from the exported one, into ``self.fx``."""
        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        alias = dict(self.g.alias_placeholders)
        user_inputs: list[tuple[torch.fx.Node, InputSpec | None]] = []  # None: not a tensor
        guarded = False
        for node in self.ep.graph.nodes:
            if node.op != "placeholder" and not guarded:
                guarded = True
                self.emit_guard(user_inputs)
            if node.op == "placeholder":
                spec = specs.get(node.name)
                kind = spec.kind.name if spec is not None else "USER_INPUT"
                if kind == "USER_INPUT":
                    self.local[node.name] = self.fx.placeholder(node.name)
                    value = node.meta.get("val")
                    input_spec = InputSpec.of(node.name, value) if isinstance(value, torch.Tensor) else None
                    user_inputs.append((self.local[node.name], input_spec))
                elif node.name in alias:
                    continue
                elif kind == "PARAMETER":
                    fqn = self.g.parameter(spec.target).fqn
                    self.local[node.name] = self.fx.call_function(to_local, (self.fx.get_attr(fqn),))
                elif kind == "BUFFER":
                    self.local[node.name] = self.fx.get_attr(spec.target)
                else:
                    self.local[node.name] = self.fx.get_attr(constant_name(spec.target))
            elif node.op == "call_function":
                if node.name not in self.g and _is_size(node):
                    tail = self.fx._root.prev
                    self.emit_size(node, alias)
                    # a size read from a tensor of a recomputed layer is computed in that layer (it may
                    # feed a shape inside it: outside, it would both read the layer and be read by it)
                    sources = [alias.get(a.name, a.name) for a in node.all_input_nodes]
                    layer = next((self.recomputed.get(n) or self.size_layer.get(n) for n in sources
                                  if self.recomputed.get(n) or self.size_layer.get(n)), None)
                    if layer is not None:
                        self.size_layer[node.name] = layer
                        self.tag_since(tail, layer)
                    continue
                if node.name not in self.g:
                    if node.users:
                        raise NotImplementedError(f"node {node.name} ({node.target}) returns no tensor but is used by "
                                                  f"{list(node.users)}; autotp cannot run it on shards yet")
                    continue
                tail = self.fx._root.prev  # the last node so far: what emit adds comes after it
                self.emit_node(node, alias)
                added = self.fx._root.prev
                while added is not tail:
                    self.origin[added.name] = node.name
                    added = added.prev
                layer = self.recomputed.get(node.name)
                if layer is not None:  # the node and the reads made for it run in its layer's recompute
                    self.tag_since(tail, layer)
            elif node.op == "output":
                self.emit_output(node, alias)

    def tag_since(self, tail: torch.fx.Node, layer: str) -> None:
        """The fx nodes added after ``tail`` run in recomputed ``layer``."""
        added = self.fx._root.prev
        while added is not tail:
            self.layer_of[added.name] = layer
            added = added.prev

    def emit_guard(self, user_inputs: list[tuple[torch.fx.Node, InputSpec | None]]) -> None:
        """The input check, first of all nodes (:mod:`autotp.runtime.guard`): autotp's own, then the conditions
        on sizes that ``torch.export`` recorded from the model's code (``x.size(1) % 2 == 0`` where the
        model branched on it, set by ``build`` once export's module exists), which the graph, holding
        one branch, no longer shows."""
        tensors = [i for i, (_, spec) in enumerate(user_inputs) if spec is not None]
        if tensors:
            divisibility = requirements(self.g.symbolic, self.g.nodes, self.plan.strategies, self.mesh_shape)
            same = SameOnEveryRank(self.mesh, self.check_inputs) if self.check_inputs != 0 else None
            guard = InputGuard(tuple(user_inputs[i][1] for i in tensors), self.g.dynamic, divisibility,
                               tensor_positions=tuple(tensors), same_on_ranks=same, device=mesh_device(self.mesh))
            self.root.add_module(self.guard_name, guard)
            self.added.append(self.guard_name)
            self.fx.call_module(self.guard_name, tuple(node for node, _ in user_inputs))
            for node, spec in user_inputs:  # a mask given bool where the trace had integers (or the other way)
                if spec is not None and spec.dtype in MASK_DTYPES:
                    self.local[node.name] = self.fx.call_function(
                        as_traced_dtype, (node, getattr(torch, spec.dtype)))

    def emit_node(self, node: torch.fx.Node, alias: dict[str, str]) -> None:
        op = self.g[node.name]
        strat = self.plan.strategy(node.name)
        if node.target is operator.getitem:
            src = alias.get(node.args[0].name, node.args[0].name)
            item = self.fx.call_function(operator.getitem, (self.local[src], node.args[1]))
            self.local[node.name] = self.read(src, strat.inputs[0], self.grad_axes.get((node.name, 0), ()), base=item,
                                              value_key=self.read_keys[(node.name, 0)])
            return

        def tensor(k: int, a: torch.fx.Node) -> Any:  # the k-th tensor argument: OpNode.inputs[k]
            src = op.inputs[k]
            assert src == alias.get(a.name, a.name), (node.name, src, a.name)
            return self.read(src, strat.inputs[k], self.grad_axes.get((node.name, k), ()),
                             value_key=self.read_keys[(node.name, k)])

        def other(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                if a.name in self.sizes:
                    return self.sizes[a.name]
                raise NotImplementedError(f"node {node.name} reads {a.name}, which is not a tensor")
            return a

        args, kwargs = map_tensor_arguments(node, tensor, other)
        if writes_first_argument(str(node.target)) and args and isinstance(args[0], torch.fx.Node):
            src = op.inputs[0]
            if args[0] is not self.local[src]:
                # ``h += x`` on a redistributed h: write into a copy, not into the value redistributed
                # from (a slice of it is a view) nor into what other reads of it share
                args = (self.fx.call_function(aten.clone.default, (args[0],)), *args[1:])
        # a model traced on meta, or on a fake device that says cuda:0 on every rank, runs on this rank's device
        here = mesh_device(self.mesh)

        def on_device(a: Any) -> Any:
            return on_mesh_device(a, here)

        args, kwargs = torch.fx.node.map_aggregate(args, on_device), torch.fx.node.map_aggregate(kwargs, on_device)
        # how the op runs on this rank's pieces: its family's local execution (autotp.planning.rules), or as it is
        site = LocalSite(node=op, strategy=strat, reads=tuple(self.read_placements(op, k) for k in range(len(op.inputs))),
                         mesh_shape=self.mesh_shape, coordinate=tuple(self.coordinate or ()), groups=tuple(self.groups),
                         axis_names=tuple(self.axis_names), target=node.target, args=args, kwargs=kwargs,
                         seed=self.seed, emitter=self, graph=self.g)
        self.local[node.name] = run_locally(site, local_executions(op.target))

    # -- what a local execution emits through (autotp.local.site.Emitter) ------------------------

    def call_function(self, target: Any, args: tuple, kwargs: Mapping[str, Any]) -> torch.fx.Node:
        return self.fx.call_function(target, args, dict(kwargs))

    def call_module(self, module: nn.Module, kind: str, args: tuple, kwargs: Mapping[str, Any]) -> torch.fx.Node:
        return self.fx.call_module(self._add_module(module, kind), args, dict(kwargs))

    def new_stream(self) -> int:
        """The next random stream of this graph: one per dropout-like node, in the graph's order."""
        self.n_dropouts += 1
        return self.n_dropouts - 1

    def local_value(self, name: str) -> torch.fx.Node:
        """The local value node ``name`` left (one emitted before)."""
        if name not in self.local:
            raise LookupError(f"node {name} has no local value yet: a local execution reads only the nodes before it")
        return self.local[name]

    def read_placements(self, op, k: int) -> tuple[Placement, ...]:
        """The placements op ``op`` reads its ``k``-th tensor argument with."""
        q = self.plan.strategy(op.name).inputs[k]
        return q if q is not None else self.plan.strategy(op.inputs[k]).output

    def emit_size(self, node: torch.fx.Node, alias: dict[str, str]) -> None:
        """A size computed in the graph (a dynamic dim's symbol, or arithmetic on sizes): the same value,
        a global size, from the local tensors. ``x.size(d)`` of a tensor this rank holds split along
        ``d`` is its local size times the number of pieces (even pieces: the guard checks that)."""
        def mapped(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                if a.name in self.sizes:
                    return self.sizes[a.name]
                raise NotImplementedError(f"size node {node.name} ({node.target}) reads tensor {a.name}; autotp "
                                          f"cannot compute it on shards")
            return a

        if node.target is aten.sym_size.int:
            src = alias.get(node.args[0].name, node.args[0].name)
            d = node.args[1] % self.g[src].outputs[0].ndim
            pieces = dim_pieces(self.plan.strategy(src).output, self.mesh_shape, d)
            size = self.fx.call_function(aten.sym_size.int, (self.local[src], d))
            self.sizes[node.name] = size if pieces == 1 else self.fx.call_function(operator.mul, (size, pieces))
            return
        args = torch.fx.node.map_aggregate(node.args, mapped)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, mapped)
        self.sizes[node.name] = self.fx.call_function(node.target, args, kwargs)

    def local_sizes(self, sizes: Any, op, placements: tuple[Placement, ...]) -> list:
        """The shape argument of a ``view``/``expand`` for this rank's piece. With every size static,
        the piece's shape. Else static sizes become the piece's sizes; a size node (a dynamic dim) split
        over ``k`` pieces becomes its size ``// k``; ``-1`` (infer, or keep) stays."""
        static = local_shape(op.output.shape, placements, self.mesh_shape, self.coordinate)
        if op.name not in self.g.symbolic:
            return list(static)
        out = []
        for d, size in enumerate(sizes):
            pieces = dim_pieces(placements, self.mesh_shape, d)
            if isinstance(size, torch.fx.Node):
                out.append(size if pieces == 1 else self.fx.call_function(operator.floordiv, (size, pieces)))
            else:
                out.append(size if size == -1 else static[d])
        return out

    def emit_output(self, node: torch.fx.Node, alias: dict[str, str]) -> None:
        position = {name: i for i, name in enumerate(self.g.outputs)}

        def mapped(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                src = alias.get(a.name, a.name)
                if src in position:
                    key = self.read_keys[(OUTPUT, position[src])]
                    held = self.held_output(src)
                    if held is not None:  # nothing reads it whole in a step: as the plan holds it
                        return self.fx.call_module(self._add_module(held, "held_output"),
                                                   (self.read(src, None, (), value_key=key),))
                    return self.read(src, self.plan_output_placement(), (), value_key=key)
                return self.local[src]
            return a

        self.fx.output(torch.fx.node.map_aggregate(node.args[0], mapped))

    def held_output(self, name: str) -> HeldOutput | None:
        """The module returning output ``name`` as the plan holds it, where the plan leaves it unread
        (``Plan.unread_outputs``) and DTensor can say its placements; else None (gathered whole)."""
        if name not in self.plan.unread_outputs or self.g.symbolic.get(name):
            return None
        shape = tuple(self.g[name].outputs[0].shape)
        placements = held_placements(self.plan.strategy(name).output, shape, self.mesh_shape)
        return None if placements is None else HeldOutput(self.mesh, placements, shape)

    def plan_output_placement(self) -> tuple[Placement, ...]:
        return tuple(Placement("R") for _ in self.mesh_shape)


def _is_size(node: torch.fx.Node) -> bool:
    """A node that computes a size (an int or a symbolic int), not a tensor."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt, torch.SymFloat, torch.SymBool, float, bool))

