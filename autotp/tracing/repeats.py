"""Stacks of identical layers traced at three layers and unrolled: a capture whose time does not
grow with depth.

``torch.export`` spends its time per op, so a model's capture grows with its layers (most of
planning an 80-layer model). A stack of layers that are alike (an ``nn.ModuleList`` or
``nn.Sequential`` whose children have one class, the same parameters, buffers and submodules, and
the same attributes but an index of their own) computes, per layer, the same ops on its own
weights. :func:`capture_unrolled` traces the model with each such stack cut to its layers ``0``,
``1`` and the last (the model's own modules, under their own names), checks in the trace that the
three layers' ops are alike, and writes the layers between as copies of layer 1: their ops read
their own parameters and the layer before, under the names ``torch.export`` gives a full trace.

What the trace of three layers cannot see is taken as it is shown: a layer between that branches
on its index in a way that layers ``0``, ``1`` and the last do not (a ``layer_idx == 5`` test)
would be unrolled as layer 1. Where the check fails (the layers' ops differ, a layer reads another
layer's values than the one before it, the module is traced with dynamic dims, or the names would
not come out as a full trace's) the model is traced whole; the graph is then the same, only slower.
The unrolled graph has no exported program (``OpGraph.exported`` is None): it is for planning;
:func:`autotp.parallelize` traces the whole model for its rewrite, and
:meth:`autotp.planning.result.plan.Plan.check_matches` compares the two.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx.graph as fx_graph
from torch import nn

from autotp.tracing.graph import BUFFER, OP, PARAMETER, OpGraph, OpNode, ParameterInfo

__all__ = ["Stack", "find_stacks", "layers_alike", "capture_unrolled", "unroll"]

_SUFFIX = re.compile(r"(.*)_(\d+)$")


@dataclass(frozen=True)
class Stack:
    """A stack of alike layers: the container's module path and how many layers it holds."""

    path: str
    count: int

    def layer(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)


def find_stacks(model: nn.Module, least: int = 4) -> list[Stack]:
    """The stacks of at least ``least`` alike layers in ``model``, outermost first (a stack inside a
    stack's layer is left to the outer one's copies)."""
    stacks: list[Stack] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < least:
            continue
        if any(not s.path or _under(path, s.path) for s in stacks):
            continue
        keys = list(module._modules)
        if keys != [str(i) for i in range(len(keys))]:
            continue
        layers = list(module._modules.values())
        if all(layers_alike(layers[0], 0, layer, i) for i, layer in enumerate(layers[1:], 1)):
            stacks.append(Stack(path, len(layers)))
    return stacks


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")


def layers_alike(first: nn.Module, i0: int, other: nn.Module, i: int) -> bool:
    """Same class, parameters, buffers and submodules, no hooks, and the same attributes but ints
    that hold each layer's own index (``layer_idx``)."""
    mods_a, mods_b = list(first.named_modules()), list(other.named_modules())
    if [(p, type(m), m.training) for p, m in mods_a] != [(p, type(m), m.training) for p, m in mods_b]:
        return False  # another class, or a layer in another mode (a frozen first layer): traced whole

    def tensors(m: nn.Module) -> list:
        return ([(n, t.shape, t.dtype, t.requires_grad) for n, t in m.named_parameters()]
                + [(n, t.shape, t.dtype) for n, t in m.named_buffers()])

    if tensors(first) != tensors(other):
        return False
    for (_, a), (_, b) in zip(mods_a, mods_b):
        if any(getattr(m, h, None) for m in (a, b) for h in _HOOKS):
            return False
        if a._non_persistent_buffers_set != b._non_persistent_buffers_set:
            return False
        va = {k: v for k, v in vars(a).items() if not k.startswith("_") and k != "training"}
        vb = {k: v for k, v in vars(b).items() if not k.startswith("_") and k != "training"}
        if va.keys() != vb.keys():
            return False
        for k, x in va.items():
            y = vb[k]
            if not (_same(x, y) or (type(x) is int and type(y) is int and (x, y) == (i0, i))):
                return False
    return True


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, (torch.Tensor, nn.Module)):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float, str, bool, complex, bytes, torch.dtype, torch.device)) or a is None:
        return a == b
    if isinstance(a, functools.partial):  # an activation bound per layer (Gemma's GELU, approximate="tanh")
        return a.func is b.func and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    return False  # an object of its own per layer: not known to be alike


@contextlib.contextmanager
def cut(model: nn.Module, stacks: list[Stack]) -> Iterator[None]:
    """Each stack holds its layers 0, 1 and its last while the block runs (under their own keys, so
    their parameters keep their names); put back afterwards, whatever happens."""
    saved = []
    try:
        for s in stacks:
            container = model.get_submodule(s.path)
            saved.append((container, container._modules))
            keep = (0, 1, s.count - 1)
            container._modules = type(container._modules)((str(i), container._modules[str(i)]) for i in keep)
        yield
    finally:
        for container, modules in saved:
            container._modules = modules


def capture_unrolled(model: nn.Module, trace: Callable[[], OpGraph], stacks: list[Stack]) -> Optional[OpGraph]:
    """``trace()`` run with ``stacks`` cut to three layers, unrolled (:func:`unroll`); None where the
    cut model does not trace or its layers are not shown alike (the caller then traces it whole)."""
    try:
        with cut(model, stacks):
            shallow = trace()
    except Exception:  # noqa: BLE001 - the whole model's trace says what fails, if anything does
        return None
    return unroll(shallow, stacks)


def unroll(graph: OpGraph, stacks: list[Stack]) -> Optional[OpGraph]:
    """The graph of the whole model from ``graph``, traced with each stack at layers 0, 1 and its
    last; None where the trace does not show the layers alike."""
    base = {n.name: _base(n.name) for n in graph.nodes if n.role == OP}
    if graph.dynamic or graph.symbolic or not _names_as_traced(graph, base):
        return None
    nodes, outputs, params = list(graph.nodes), list(graph.outputs), list(graph.parameters)
    for stack in stacks:
        done = _unroll_stack(nodes, outputs, params, graph.alias_placeholders, stack, base)
        if done is None:
            return None
        nodes, outputs, params = done
    names = _fx_names(nodes, base, graph.erased)
    if names is None:
        return None

    def rn(name: str) -> str:
        return names.get(name, name)

    nodes = [_with(n, name=rn(n.name), inputs=tuple(rn(i) for i in n.inputs)) for n in nodes]
    params = [replace(p, node=rn(p.node)) for p in params]
    return OpGraph(nodes=tuple(nodes), outputs=tuple(rn(o) for o in outputs), parameters=tuple(params),
                   model_type=graph.model_type, alias_placeholders=dict(graph.alias_placeholders),
                   training=graph.training, other_mode=graph.other_mode, erased=graph.erased, unrolled=tuple(f"{s.path or 'the model'} ({s.count} layers)" for s in stacks))


def _with(node: OpNode, **changes: Any) -> OpNode:
    """``dataclasses.replace`` for the unroll's copies, one per node of every layer: the fields copied
    as they are, without ``replace``'s checks of every field on every call (a third of the unroll)."""
    unknown = changes.keys() - node.__dict__.keys()
    if unknown:
        raise TypeError(f"OpNode has no field {sorted(unknown)}")
    new = object.__new__(OpNode)
    new.__dict__.update(node.__dict__)
    new.__dict__.update(changes)
    return new


def _base(name: str) -> str:
    m = _SUFFIX.match(name)
    return m.group(1) if m else name


def _fx_names(nodes: list[OpNode], base: dict[str, str], erased: tuple = ()) -> Optional[dict[str, str]]:
    """The names torch.fx gives ``nodes`` in this order (placeholders keep theirs): op ``name`` gets
    ``base[name]`` with fx's count, the ops the capture erased (``OpGraph.erased``: a model's attention
    mask) counted where they were. None where a placeholder's name is taken twice."""
    ns = fx_graph._Namespace()
    names: dict[str, str] = {}
    for n in nodes:
        if n.role != OP:
            if ns.create_name(n.name, None) != n.name:
                return None
    before: dict[Optional[str], list[str]] = {}
    for name, following in erased:
        before.setdefault(following, []).append(name)
    for n in nodes:
        if n.role == OP:
            for name in before.pop(n.name, ()):
                ns.create_name(name, None)
            names[n.name] = ns.create_name(base[n.name], None)
    return names


def _names_as_traced(graph: OpGraph, base: dict[str, str]) -> bool:
    """The trace's op names are what :func:`_fx_names` makes of their bases: a full trace's names can
    then be told."""
    names = _fx_names(list(graph.nodes), base, graph.erased)
    return names is not None and all(k == v for k, v in names.items())


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _moved(path: str, old: str, new: str) -> str:
    return new + path[len(old):] if _under(path, old) else path


def _unroll_stack(nodes: list[OpNode], outputs: list[str], params: list[ParameterInfo], aliases: Any,
                  stack: Stack, base: dict[str, str]):
    """Insert layers 2 .. count-2 of ``stack`` (copies of layer 1) into the node list; None where the
    three traced layers are not alike."""
    last = stack.count - 1
    traced = (0, 1, last)
    layer_paths = [stack.layer(i) for i in traced]
    # each traced layer's ops: one contiguous run, the three one after another
    blocks: list[list[int]] = []
    for lp in layer_paths:
        at = [i for i, n in enumerate(nodes) if n.role == OP and lp in n.module_stack]
        if not at or at[-1] - at[0] + 1 != len(at):
            return None
        blocks.append(at)
    if blocks[1][0] != blocks[0][-1] + 1 or blocks[2][0] != blocks[1][-1] + 1:
        return None
    if not len(blocks[0]) == len(blocks[1]) == len(blocks[2]):
        return None
    # each traced layer's placeholders (parameters, then buffers), matched by their names in the layer
    holders: list[dict[str, int]] = []
    for lp in layer_paths:
        holders.append({nodes[i].param_fqn[len(lp) + 1:]: i for i, n in enumerate(nodes)
                        if n.role in (PARAMETER, BUFFER) and n.param_fqn and _under(n.param_fqn, lp)})
    if not holders[0].keys() == holders[1].keys() == holders[2].keys():
        return None
    template: dict[str, tuple[str, str]] = {}  # layer 1's placeholder -> its name around the layer's index
    for key in holders[1]:
        a, b, c = (nodes[h[key]] for h in holders)
        template[b.name] = _name_template(a.name, b.name, c.name, last)
        if not (_same_holder(a, b) and _same_holder(b, c)) or template[b.name] is None:
            return None
    stack_holders = {nodes[i].name for h in holders for i in h.values()}
    if any(k in stack_holders or v in stack_holders for k, v in aliases.items()):
        return None
    if any(p.aliases and p.node in stack_holders for p in params):
        return None
    block_of = {nodes[i].name: (k, j) for k, at in enumerate(blocks) for j, i in enumerate(at)}
    holder_of = {nodes[i].name: (k, key) for k, h in enumerate(holders) for key, i in h.items()}
    # layer k's ops against layer k-1's: the same op, reading the same place relative to its layer
    for k in (1, 2):
        for j, (ia, ib) in enumerate(zip(blocks[k - 1], blocks[k])):
            a, b = nodes[ia], nodes[ib]
            if not _same_op(a, b, layer_paths[k - 1], layer_paths[k]) or len(a.inputs) != len(b.inputs):
                return None
            for sa, sb in zip(a.inputs, b.inputs):
                if not _reads_alike(sa, sb, k, block_of, holder_of):
                    return None
    # after the stack, only the last layer's values are read, as in the whole model
    end = blocks[2][-1]
    for n in nodes[end + 1:]:
        if any(block_of.get(s, (2,))[0] != 2 for s in n.inputs):
            return None
    if any(block_of.get(o, (2,))[0] != 2 for o in outputs):
        return None

    # the copies: layers 2 .. last-1, as layer 1 with its own names, each reading the one before
    new_nodes = list(nodes[:blocks[1][-1] + 1])
    previous = {nodes[i].name: nodes[i].name for i in blocks[1]}  # layer-1 op -> the layer before's op
    for layer in range(2, last):
        lp = stack.layer(layer)
        mine = {}
        for i in blocks[1]:
            n = nodes[i]
            name = f"{n.name}@{lp}"
            base[name] = base[n.name]
            mine[n.name] = name
        for i in blocks[1]:
            n = nodes[i]
            inputs = []
            for s in n.inputs:
                if s in mine:
                    inputs.append(mine[s])
                elif s in block_of:  # layer 0's op: the layer before's
                    inputs.append(previous[nodes[blocks[1][block_of[s][1]]].name])
                elif s in holder_of:
                    inputs.append(_holder_name_at(template[s], layer))
                else:
                    inputs.append(s)
            new_nodes.append(_with(n, name=mine[n.name], inputs=tuple(inputs),
                                   module_path=_moved(n.module_path, layer_paths[1], lp),
                                   module_stack=tuple(_moved(p, layer_paths[1], lp) for p in n.module_stack)))
        previous = mine
    # the last layer reads the layer before it
    for i in blocks[2]:
        n = nodes[i]
        inputs = tuple(previous[s] if block_of.get(s, (None,))[0] == 1 else s for s in n.inputs)
        new_nodes.append(_with(n, inputs=inputs))
    new_nodes.extend(nodes[end + 1:])
    # the copies' placeholders, after layer 1's of each kind
    for role in (PARAMETER, BUFFER):
        run = [i for i in holders[1].values() if nodes[i].role == role]
        if not run:
            continue
        if max(run) - min(run) + 1 != len(run):
            return None
        after = new_nodes.index(nodes[max(run)]) + 1
        copies = [_with(nodes[i], name=_holder_name_at(template[nodes[i].name], layer),
                        param_fqn=_moved(nodes[i].param_fqn, layer_paths[1], stack.layer(layer)))
                  for layer in range(2, last) for i in sorted(run)]
        new_nodes[after:after] = copies
    # parameters in the order of their placeholders
    by_node = {p.node: p for p in params}
    new_params = [by_node.get(n.name) or ParameterInfo(n.param_fqn, n.name, n.outputs[0])
                  for n in new_nodes if n.role == PARAMETER]
    return new_nodes, outputs, new_params


def _name_template(name0: str, name1: str, name_last: str, last: int) -> tuple[str, str] | None:
    """The text around the layer's index in the placeholder names ``torch.export`` gave layers 0, 1 and
    ``last`` (``p_model_layers_`` and ``_mlp_up_proj_weight``); None where they do not differ by it alone."""
    n = 0
    while n < min(len(name0), len(name1)) and name0[n] == name1[n]:
        n += 1
    head = name0[:n]
    if name0[n:n + 1] != "0" or name1[n:n + 1] != "1" or name0[n + 1:] != name1[n + 1:]:
        return None
    tail = name0[n + 1:]
    if not head.endswith("_") or (tail and not tail.startswith("_")) or name_last != f"{head}{last}{tail}":
        return None
    return head, tail


def _holder_name_at(template: tuple[str, str], layer: int) -> str:
    return f"{template[0]}{layer}{template[1]}"


def _same_holder(a: OpNode, b: OpNode) -> bool:
    return (a.role, a.outputs, a.requires_grad, a.persistent) == (b.role, b.outputs, b.requires_grad, b.persistent)


def _same_op(a: OpNode, b: OpNode, path_a: str, path_b: str) -> bool:
    """The same op, in the same module of its layer."""
    return ((a.role, a.target, a.input_infos, a.outputs, a.flops, a.bytes_read, a.bytes_written, a.module_type,
             a.requires_grad, a.is_view, a.args, _base(a.name))
            == (b.role, b.target, b.input_infos, b.outputs, b.flops, b.bytes_read, b.bytes_written, b.module_type,
                b.requires_grad, b.is_view, b.args, _base(b.name))
            and _moved(b.module_path, path_b, path_a) == a.module_path
            and tuple(_moved(p, path_b, path_a) for p in b.module_stack) == a.module_stack)


def _reads_alike(sa: str, sb: str, k: int, block_of: dict, holder_of: dict) -> bool:
    """Layer ``k`` reads ``sb`` where layer ``k-1`` reads ``sa``: the same place relative to each."""
    if sb in block_of:
        kb, jb = block_of[sb]
        if kb == k:  # its own op: the same one in the layer before
            return block_of.get(sa) == (k - 1, jb)
        if kb != k - 1:  # a layer further back: the copies could not say which
            return False
        if k - 1 == 0:  # the first layer's input, from before the stack
            return sa not in block_of
        return block_of.get(sa) == (k - 2, jb)
    if sb in holder_of:
        kb, key = holder_of[sb]
        return kb == k and holder_of.get(sa) == (k - 1, key)
    return sa == sb
