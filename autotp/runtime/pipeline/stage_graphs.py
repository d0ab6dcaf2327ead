"""A rewritten graph cut into pipeline stages, and the values that cross the cuts.

:func:`split_stages` cuts the whole graph, rewritten for the tensor-parallel sub-mesh, where a
plan's stages end (:mod:`autotp.runtime.pipeline.module` says how): each node goes with the unit it was
emitted for, a parameter's read with every stage that reads it. A stage's graph receives what
crosses the cut in front of it and returns what crosses the cut after it.
:func:`planned_values` gives the shape, dtype and gradient of each crossing value from the plan
alone; :func:`example_values` finds them by one run of the whole graph, where the plan does not
describe one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx
from torch import nn

from autotp.runtime.devices import mesh_device
from autotp.runtime.pipeline.stage_units import reads_state

__all__ = ["StageGraph", "attribute", "example_values", "planned_values", "split_stages",
           "stage_of_units"]


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph: the names of the values it receives (positional, in order) and returns (in
    order); every stage also takes the model's inputs by keyword (``keywords``), reading those it uses."""

    index: int
    module: torch.fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    keywords: tuple[str, ...]
    shared: Mapping[str, tuple[int, ...]]  # a parameter this stage holds with others -> the stages holding it


def stage_of_units(stages: Sequence[Any], n_layers: int) -> list[int]:
    """The stage of each unit (0 before the stack, ``1 + i`` layer ``i``, ``n_layers + 1`` after),
    from the plan's :class:`autotp.planning.search.pipeline_search.StageChoice` list."""
    of = [-1] * (n_layers + 2)
    for s in stages:
        for i in range(s.first_layer, s.end_layer):
            of[1 + i] = s.index
        if s.before:
            of[0] = s.index
        if s.after:
            of[n_layers + 1] = s.index
    if -1 in of:
        raise ValueError(f"the plan's stages do not cover every unit: {[(s.first_layer, s.end_layer) for s in stages]}")
    return of


def _node_stages(gm: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                 unit_stage: Sequence[int]) -> dict[torch.fx.Node, int]:
    """Each fx node's stage: that of the graph op it was emitted for; a node emitted for none (a
    parameter's read, a size, the outputs' redistribution) with its first reader, or where nothing
    reads it, with its last input."""
    nodes = list(gm.graph.nodes)
    stage: dict[torch.fx.Node, int] = {}
    last = max(unit_stage)
    for n in nodes:
        if n.op == "placeholder":
            stage[n] = 0  # the model's inputs: every stage is given them (by keyword), none sends them
        elif n.name in origin and origin[n.name] in unit:
            stage[n] = unit_stage[unit[origin[n.name]]]
    for n in reversed(nodes):  # by readers, from the end
        if n in stage or n.op == "placeholder":
            continue
        readers = [stage[u] for u in n.users if u in stage]
        if n.op == "output":
            stage[n] = last
        elif readers:
            stage[n] = min(readers)
    for n in nodes:  # nothing reads it: with its inputs
        if n not in stage:
            inputs = [stage[a] for a in n.all_input_nodes if a in stage]
            stage[n] = max(inputs) if inputs else 0
    return stage


def split_stages(gm: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                 unit_stage: Sequence[int]) -> list[StageGraph]:
    """The rewritten graph ``gm`` cut into one graph per stage (module docstring). ``origin``: fx node
    name -> graph op (:attr:`autotp.runtime.rewrite.GraphRewrite.origin`); ``unit``: graph op ->
    unit; ``unit_stage``: unit -> stage."""
    stage = _node_stages(gm, origin, unit, unit_stage)
    n_stages = max(unit_stage) + 1
    nodes = [n for n in gm.graph.nodes]
    # a read of a parameter or buffer (and its local shard) goes into every stage that uses it: a
    # weight two stages read (an embedding tied to the head) is held by both, never sent
    needed: dict[torch.fx.Node, set[int]] = {}
    for n in reversed(nodes):
        if reads_state(n):
            needed[n] = set().union(*(needed[u] if u in needed else {stage[u]} for u in n.users)) or {stage[n]}
    for n in nodes:
        for a in n.all_input_nodes:
            if stage[a] > stage[n] and a.op != "placeholder" and a not in needed:
                raise NotImplementedError(f"{n.name} (stage {stage[n]}) reads {a.name}, made in the later stage "
                                          f"{stage[a]}: the graph cannot be cut into stages in this order")
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]  # crossing[k]: made <= k, read > k
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in nodes:
        if n.op in ("output", "placeholder") or n in needed:
            continue
        later = [stage[u] for u in n.users if stage[u] > stage[n]]
        for k in range(stage[n], max(later, default=stage[n])):
            crossing[k].append(n)
    shared = {n.target: tuple(sorted(needed[n])) for n in needed
              if n.op == "get_attr" and len(needed[n]) > 1 and isinstance(attribute(gm, n.target), nn.Parameter)}
    out = []
    for k in range(n_stages):
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs = [] if k == 0 else crossing[k - 1]
        for n in inputs + placeholders:
            env[n] = g.placeholder(n.name)
        for n in nodes:
            here = k in needed[n] if n in needed else stage[n] == k
            if not here or n.op in ("placeholder", "output") or n in env:
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
        if k == n_stages - 1:
            (result,) = [n for n in nodes if n.op == "output"]
            g.output(torch.fx.node.map_arg(result.args[0], lambda a: env[a]))
            outputs: tuple[str, ...] = ()
        else:
            # what crosses the cut is sent as it is, and a send takes contiguous memory only (GPT-J's
            # rotary tables are strided views): a copy where the value is not contiguous, none where it is
            g.output(tuple(g.call_method("contiguous", (env[n],)) for n in crossing[k]))
            outputs = tuple(n.name for n in crossing[k])
        out.append(StageGraph(k, torch.fx.GraphModule(gm, g, class_name=f"AutotpStage{k}"),
                              tuple(n.name for n in inputs), outputs, tuple(n.name for n in placeholders),
                              {t: where for t, where in shared.items() if k in where}))
    return out


def attribute(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def example_values(gm: torch.fx.GraphModule, stages: Sequence[StageGraph], example_flat: Sequence[Any],
                    out_spec: Any) -> dict[str, Any]:
    """Each value that crosses a cut, as one micro-batch makes it on this rank (its shape and dtype
    are what the stages exchange), and the model's output tensors under ``"<output>"``: the whole
    graph run once over this rank's tensor-parallel group (every rank of the
    mesh runs it, each with its group), with the random streams it drew from set back."""
    wanted = {n for s in stages for n in (*s.inputs, *s.outputs)}
    seen: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            if n.name in wanted:
                seen[n.name] = _detached(value)
            return value

    with torch.enable_grad():  # whether each value needs a gradient is part of what the stages exchange
        flat = Recorder(gm).run(*example_flat)
    for m in gm.modules():  # dropout and random streams count their calls: this run is not one
        if hasattr(m, "calls"):
            m.calls = 0
    bad = sorted(n for n in wanted if not isinstance(seen.get(n), torch.Tensor))
    if bad:
        raise NotImplementedError(f"values that are not tensors cross a cut between stages: {bad}; autotp's "
                                  f"pipeline runtime sends tensors only")
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    tensors = tuple(_detached(x) for x in flat if isinstance(x, torch.Tensor))
    seen["<output>"] = tensors[0] if len(tensors) == 1 else tensors
    return seen


def planned_values(graph: Any, plan: Any, tp_mesh: Any, rewrite: Any, stages: Sequence[StageGraph]
                    ) -> Optional[dict[str, Any]]:
    """What :func:`example_values` finds by a run, from the plan alone: each value crossing a cut is
    an op's local output (its shape this rank's piece of the op's output as the plan places it, its
    dtype the op's, a gradient where the op carries one), and the model's outputs are whole. None
    where a crossing value is something else (a redistribution made for a reader)."""
    from autotp.placement import local_shape

    of_node = {fx.name: op for op, fx in rewrite.local.items()}
    mesh_shape, coordinate = tuple(int(x) for x in tp_mesh.mesh.shape), tp_mesh.get_coordinate()
    device = mesh_device(tp_mesh)

    def empty(info: Any, placements: Any, requires_grad: bool) -> torch.Tensor:
        shape = local_shape(info.shape, placements, mesh_shape, coordinate) if placements else info.shape
        t = torch.empty(shape, dtype=getattr(torch, info.dtype), device=device)
        return t.requires_grad_(requires_grad and t.is_floating_point())

    seen: dict[str, Any] = {}
    for s in stages:
        for name in (*s.inputs, *s.outputs):
            op = of_node.get(name)
            if op is None or op not in graph or len(graph[op].outputs) != 1:
                return None
            node = graph[op]
            seen[name] = empty(node.outputs[0], plan.strategy(op).output, bool(node.requires_grad) and plan.mode == "train")
    outs = [graph[o] for o in graph.outputs]
    if any(len(n.outputs) != 1 for n in outs):
        return None
    tensors = tuple(empty(n.outputs[0], None, bool(n.requires_grad)) for n in outs)
    seen["<output>"] = tensors[0] if len(tensors) == 1 else tensors
    return seen


def _detached(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)
