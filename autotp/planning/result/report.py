"""Report: the plan as a person reads it (text table, JSON, or HTML).

Sections: per module its style, the placements of weight, input and output, and whether it
recomputes its activations (a run of a stack's alike layers once, as ``model.layers.{0..79}``); the collectives of one step by kind and phase with bytes; the inputs' dynamic dims and what the plan needs of them;
predicted compute and communication time; memory per device against the budget (with
``pipeline=True`` the chosen layout's, the stage plan's own figure after it, labelled); which layers
recompute and what that frees and costs; where gradients pass on as partial sums (``Rg``); per
kind of routed MoE layer, where its experts went and the best plan with each other placement
(:mod:`autotp.planning.result.expert_choice`); how the solve went.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from autotp.layout import TENSOR
from autotp.placement import format_placements
from autotp.planning.result.expert_choice import expert_lines
from autotp.planning.result.explain import explain_replicated
from autotp.tracing.dynamic import in_input_terms
from autotp.units import format_bytes

if TYPE_CHECKING:
    from autotp.planning.result.plan import Plan

__all__ = ["render"]


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return out


def _collective_rows(plan: "Plan") -> list[list[str]]:
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for c in plan.collective_list:
        groups[(c.phase, c.kind, c.mesh_axis)].append(c.bytes)
    order = {"forward": 0, "backward": 1, "recompute": 2}
    return [[phase, kind, axis, str(len(b)), format_bytes(sum(b))]
            for (phase, kind, axis), b in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1:]))]


_NUMBERED = re.compile(r"(.+?)\.(\d+)(?:\.|$)")  # "model.layers.3.mlp" -> ("model.layers", 3)


def per_block_lines(plan: "Plan") -> list[str]:
    """Per stack of numbered blocks (``model.layers.0``, ``model.layers.1``, ...), the collectives one
    block runs in a step, by phase and kind, as most of its blocks run them (the blocks that run
    others, the recomputed ones, counted apart); from the module of the node each collective is at."""
    module_of = {n.name: n.module for n in plan.nodes}
    blocks: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for c in plan.collective_list:
        found = _NUMBERED.match(module_of.get(c.at, ""))
        if found:
            blocks[found.group(1)][int(found.group(2))][(c.phase, c.kind)] += 1
    lines = []
    for stack, per in blocks.items():
        if len(per) < 2:
            continue
        order = {"forward": 0, "backward": 1, "recompute": 2}
        kinds = Counter(tuple(sorted(counts.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][1])))
                        for counts in per.values())
        usual, many = kinds.most_common(1)[0]
        text = "; ".join(f"{phase} {n} {kind}" for (phase, kind), n in usual) or "none"
        other = len(per) - many
        lines.append(f"per block of {stack} ({len(per)} blocks): {text}" +
                     (f" ({other} of them {'runs' if other == 1 else 'run'} others)" if other else ""))
    return lines


def partial_gradient_lines(plan: "Plan") -> list[str]:
    """One line per kind of op whose output the plan leaves ``Rg`` (its gradient passed on to its
    inputs as partial sums), by module, repeated layers counted once with how many there are."""
    seen: Counter = Counter()
    for n in plan.nodes:
        if any(p.grad_partial for p in plan.strategy(n.name).output):
            module = re.sub(r"\.\d+(?=\.|$)", ".*", n.module) or "(top level)"
            seen[(module, n.target, n.shape)] += 1
    return [f"{module}: {target} {list(shape)}" + (f" (x{count})" if count > 1 else "")
            for (module, target, shape), count in seen.items()]


def dynamic_lines(plan: "Plan") -> list[str]:
    """One line per dynamic dim (its range, and the multiple the plan needs), then any other size
    the plan splits, written in the inputs' dims."""
    names = {d.symbol: f"{d.input}.size({d.dim})" for d in plan.dynamic_dims}
    multiple = {r.expression: r.divisor for r in plan.divisibility}
    lines = []
    for d in plan.dynamic_dims:
        bound = f"any size >= {d.minimum}" + (f" and <= {d.maximum}" if d.maximum is not None else "")
        need = f", a multiple of {multiple[d.symbol]}" if d.symbol in multiple else ""
        lines.append(f"{d.input} dim {d.dim}: example {d.example}, {bound}{need}")
    for r in plan.divisibility:
        if r.expression not in names:
            text = in_input_terms(r.expression, names)
            lines.append(f"{text}: a multiple of {r.divisor} (the plan splits tensor {r.tensor} of that size)")
    return lines


def _recomputed(plan: "Plan", module: str) -> str:
    """"yes" for a module inside a layer that recomputes its activations."""
    return "yes" if any(module == p or module.startswith(p + ".") for p in plan.recompute) else ""


def alike_layers(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` (the first cell a module's or parameter's name) with each run of alike layers of a stack
    shown once: where layers ``a`` to ``b`` of ``model.layers`` have the same rows (the layer's index
    aside), their rows are given once under ``model.layers.{a..b}``. A layer unlike its neighbours (one
    that recomputes where they do not) starts a run of its own, so nothing the rows say is lost."""
    # the rows of each numbered layer, by stack: where each starts, and what it holds apart from its index
    layers: dict[str, dict[int, list[tuple[str, tuple[str, ...]]]]] = defaultdict(lambda: defaultdict(list))
    where: list[tuple[str, int, str] | None] = []
    for row in rows:
        found = _NUMBERED.match(row[0])
        if found:
            stack, index, rest = found.group(1), int(found.group(2)), row[0][found.end(2):]
            layers[stack][index].append((rest, tuple(row[1:])))
            where.append((stack, index, rest))
        else:
            where.append(None)
    run_of: dict[tuple[str, int], tuple[int, int]] = {}  # (stack, layer) -> its run's first and last layer
    for stack, per in layers.items():
        order = sorted(per)
        start = 0
        for k in range(1, len(order) + 1):
            if k == len(order) or order[k] != order[k - 1] + 1 or per[order[k]] != per[order[start]]:
                for index in order[start:k]:
                    run_of[stack, index] = (order[start], order[k - 1])
                start = k
    out = []
    for row, at in zip(rows, where):
        if at is None:
            out.append(row)
            continue
        stack, index, rest = at
        first, last = run_of[stack, index]
        if index == first:
            out.append([f"{stack}.{{{first}..{last}}}{rest}" if last > first else row[0], *row[1:]])
    return out


def _module_rows(plan: "Plan") -> list[list[str]]:
    return alike_layers([[m.module or "(root)", m.style, m.op, m.weight, m.input, m.output,
                          _recomputed(plan, m.module)] for m in plan.modules])


_MODULE_HEADERS = ["module", "style", "op", "weight", "input", "output", "recompute"]


def recompute_line(plan: "Plan") -> str:
    """What recompute does in this plan: which layers, what it frees and what it costs."""
    if not plan.recompute:
        return "Recompute: none (every layer keeps its activations for the backward)"
    again = [c for c in plan.collective_list if c.phase == "recompute"]
    n = len(plan.recompute)
    layers = f"{n} layers ({', '.join(plan.recompute)}) run their" if n > 1 else f"1 layer ({plan.recompute[0]}) runs its"
    return (f"Recompute: {layers} forward again in the "
            f"backward; frees {format_bytes(plan.memory.recompute_saved_bytes)} of activations per device, costs "
            f"{_t(plan.time.recompute_s)} per step (forward compute again and {len(again)} collectives)")


def header_lines(plan: "Plan") -> list[str]:
    """The plan's first lines: the model, mesh and mode; the hardware profile and where it came from;
    how the model was traced (its mode, static or dynamic sizes)."""
    traced = {True: "in train mode", False: "in eval mode", None: "in an unrecorded mode"}[plan.training]
    sizes = ("sizes static (the example's; autotp.parallelize traces the batch and sequence dims as dynamic "
             "by default)" if not plan.dynamic_dims else
             f"{len(plan.dynamic_dims)} dynamic dims (below), the others static")
    inputs = ", ".join(f"{i.name} {list(i.shape)} {i.dtype}" for i in plan.inputs)
    where = (f"{plan.pipeline.devices} devices laid out as {plan.pipeline.chosen.describe()}, each stage's plan "
             f"on mesh {plan.mesh}" if plan.pipeline is not None else f"mesh {plan.mesh}")
    return [
        f"autotp plan: {plan.model_type} on {where}, {plan.mode} mode",
        f"Hardware: {plan.hardware.name}, {plan.hardware_source}",
        f"Traced: the model {traced}, {sizes}" + (f"; inputs {inputs}" if inputs else ""),
    ]


def memory_lines(plan: "Plan") -> list[str]:
    """Memory per device against the budget. With ``pipeline=True`` that is the chosen layout's peak,
    as the layout search computed it (its stages' state, the gradients and activations its schedule
    holds); the stage plan's own figure (every layer, one micro-batch, on the tensor axis alone)
    follows, labelled as such."""
    budget = f" of {format_bytes(plan.memory.budget_bytes)} budget" if plan.memory.budget_bytes else ""
    if plan.pipeline is None:
        return [memory_line(plan, "Memory per device: ", budget)]
    c = plan.pipeline.chosen
    return [f"Memory per device: {format_bytes(c.peak_bytes)}{budget} at its peak, the chosen layout's ({c.describe()}: "
            f"its stages' state, the gradients and activations its schedule holds)",
            memory_line(plan, "The stage plan alone (every layer on the tensor axis, one micro-batch; not what a "
                              "device of the layout holds): ", "")]


def memory_line(plan: "Plan", label: str, budget: str) -> str:
    """``label``, then the plan's memory per device, ``budget`` after its total, and its parts."""
    mem = plan.memory
    buffers = f", buffers {format_bytes(mem.buffers_bytes)}" if mem.buffers_bytes else ""
    if plan.mode != "train":  # no backward: no gradients, no optimizer, activations only while they are read
        return (f"{label}{format_bytes(mem.total_bytes)}{budget} (parameters "
                f"{format_bytes(mem.parameters_bytes)}, activations {format_bytes(mem.activations_bytes)}{buffers}; "
                f"inference: no gradients, no optimizer state)")
    phases = mem.phases()
    other = next(p for p in phases if p != mem.peak_phase)
    return (f"{label}{format_bytes(mem.total_bytes)}{budget} at its peak, the {mem.peak_phase} (parameters "
            f"{format_bytes(mem.parameters_bytes)}, gradients {format_bytes(mem.gradients_bytes)}, optimizer "
            f"{format_bytes(mem.optimizer_bytes)} ({plan.optimizer.describe()}), activations kept for the backward "
            f"{format_bytes(mem.activations_bytes)}, the backward's first gradients {format_bytes(mem.transient_bytes)}, "
            f"the step's temporaries {format_bytes(mem.step_temporary_bytes)}{buffers}); {other} "
            f"{format_bytes(phases[other])}")


def buffer_lines(plan: "Plan") -> list[str]:
    """The buffers the plan stores split (a KV cache by heads), grouped by placement."""
    if not plan.buffer_placements:
        return []
    by: dict[str, list[str]] = defaultdict(list)
    for name, text in plan.buffer_placements.items():
        by[text].append(name)
    return ["Buffers stored split (each rank holds its piece): " + "; ".join(
        f"{text}: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"
        for text, names in by.items())]


def mesh_search_lines(plan: "Plan") -> list[str]:
    """Given a device count: the mesh shapes planned, best first, and why each lost."""
    if not plan.mesh_search:
        return []
    devices = plan.mesh.size
    lines = ["", f"Mesh search: {len(plan.mesh_search)} shapes of {devices} devices "
             f"({plan.hardware.devices_per_node} per node), best first; build the chosen one with "
             f"init_device_mesh(..., {tuple(plan.mesh.shape)}, mesh_dim_names={tuple(plan.mesh.axis_names)})"]
    rows = []
    for c in plan.mesh_search:
        step = "-" if c.step_s is None else _t(c.step_s)
        comm = "-" if c.communication_s is None else _t(c.communication_s)
        peak = "-" if c.peak_bytes is None else format_bytes(c.peak_bytes)
        rows.append(["x".join(map(str, c.shape)), " / ".join(l.replace("_node", "") for l in c.links), step, comm,
                     peak, c.why or "chosen"])
    lines += _table(["mesh", "links", "step", "communication", "memory", "why not"], rows)
    return lines


def pipeline_lines(plan: "Plan") -> list[str]:
    """With ``pipeline=True``: the layout chosen, its stages, and the layouts priced, best first."""
    pc = plan.pipeline
    if pc is None:
        return []
    c, layout = pc.chosen, pc.layout
    axes = [a for a, size in layout.sizes.items() if size > 1] or [TENSOR]  # the axes of more than one rank
    links = ", ".join(f"{axis} {link.replace('_node', '')}" for axis, link in pc.links if axis in axes)
    shape, names = layout.mesh_shape, layout.axis_names
    lines = ["", f"Layout search: {pc.priced} layouts of {pc.devices} devices ({pc.devices_per_node} per node) "
             f"priced, {pc.global_batch} samples per step" + (f", in {pc.search_s:.1f} s" if pc.search_s else ""),
             f"Chosen: {c.describe()}: step {_t(c.step_s)} (compute {_t(c.compute_s)}, communication "
             f"{_t(c.communication_s)}, bubble {_t(c.bubble_s)}: {c.bubble_fraction:.0%}), {format_bytes(c.peak_bytes)} "
             f"per device at its peak; links: {links}",
             f"Mesh: {layout}, init_device_mesh(..., {shape}, mesh_dim_names={names}) for autotp.parallelize; "
             f"this plan is each stage's on the tensor axis, for one micro-batch"]
    if plan.unread_outputs:  # autotp/planning/search/step_reads.py
        shapes = {n.name: list(n.shape) for n in plan.nodes}
        held = ", ".join(f"{name} {shapes.get(name)} as {format_placements(plan.strategy(name).output)}"
                         for name in plan.unread_outputs)
        lines.append(f"Outputs: a step returns the loss alone; the model's other outputs ({held}) stay as the plan "
                     f"holds them, never gathered in a step (forward, or a step with a loss_fn of its own, gathers "
                     f"them whole)")
    lines.append(f"Stages (cut between the layers of {pc.stack}, {pc.layers} layers, balanced by predicted time)")
    rows = []
    for s in pc.stages:
        parts = ([f"before {pc.stack}"] if s.before else []) + [
            f"layers {s.first_layer}-{s.end_layer - 1}" if s.end_layer - s.first_layer > 1 else f"layer {s.first_layer}"
        ] + ([f"after {pc.stack}"] if s.after else [])
        rows.append([str(s.index), str(s.rank), ", ".join(parts), _t(s.forward_s), _t(s.backward_s),
                     format_bytes(s.send_bytes) if s.send_bytes else "-", format_bytes(s.state_bytes)])
    lines += _table(["stage", "rank", "runs", "forward", "backward", "sends on", "state"], rows)
    lines += [f"Layouts priced, best {len(pc.candidates)} of {pc.priced}"]
    rows = []
    for x in pc.candidates:
        rows.append([x.describe(), "-" if x.step_s is None else _t(x.step_s),
                     "-" if x.bubble_fraction is None else f"{x.bubble_fraction:.0%}", format_bytes(x.peak_bytes),
                     x.why or "chosen"])
    lines += _table(["layout", "step", "bubble", "memory", "why not"], rows)
    return lines


def _text(plan: "Plan") -> str:
    t, st = plan.time, plan.stats
    rows = _module_rows(plan)
    lines = header_lines(plan) + mesh_search_lines(plan) + pipeline_lines(plan) + ["", "Modules" + (
        " (a run of alike layers of a stack shown once: NAME.{a..b} stands for layers a to b)" if len(rows) < len(plan.modules)
        else "")]
    lines += _table(_MODULE_HEADERS, rows)
    lines += ["", "Collectives per step"]
    rows = _collective_rows(plan)
    lines += _table(["phase", "kind", "axis", "count", "bytes"], rows) if rows else ["(none: every rank works alone)"]
    lines += per_block_lines(plan)
    if plan.uneven:
        lines += ["", "Uneven splits (whole heads or rows the ranks do not divide)"]
        lines += [f"  {name}{rest}" for name, rest in alike_layers(
            [[u.parameter, u.describe()[len(u.parameter):]] for u in plan.uneven])]
    partial = partial_gradient_lines(plan)
    if partial:
        lines += ["", "Gradients passed on as partial sums (Rg: these ops run replicated and hand the sum to "
                  "their inputs' reads)"]
        lines += [f"  {line}" for line in partial]
    lines += expert_lines(plan)
    if plan.dynamic_dims:
        lines += ["", "Dynamic dims (sizes other than the example's run without planning again)"]
        lines += [f"  {line}" for line in dynamic_lines(plan)]
    step = "step (forward and backward)" if plan.mode == "train" else "forward"
    if plan.pipeline is not None:
        step = "forward and backward of one micro-batch through every layer, on the tensor axis alone (the step is above),"
    lines += [
        "",
        f"Predicted {step} time: {_t(t.total_s)} (compute {_t(t.compute_s)}, communication {_t(t.communication_s)}, "
        f"local copies included)",
        *memory_lines(plan),
        *buffer_lines(plan),
        *([recompute_line(plan)] if plan.mode == "train" else []),
        f"Solve: {st.solver}, {st.status}; {st.variables} variables, {st.constraints} constraints, "
        f"{st.representatives} of {st.nodes} nodes to decide after layer tying and merging; " + (
            f"capture {st.capture_s:.2f} s, strategies {st.strategies_s:.2f} s, solve {st.solve_s:.2f} s"
            if st.solve_s is not None else "timings not recorded (loaded plan)") + (
            f"; traced at 3 layers and unrolled: {', '.join(st.unrolled)}" if st.unrolled else ""),
    ]
    return "\n".join(lines)


def _html(plan: "Plan") -> str:
    def table(headers: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    text = _text(plan).split("\n")
    summary = "".join(f"<p>{html.escape(line)}</p>" for line in text if line.startswith(("Predicted", "Memory", "The stage plan", "Recompute", "Solve")))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>autotp plan</title></head><body>"
        f"<h1>{html.escape(text[0])}</h1>" + "".join(f"<p>{html.escape(line)}</p>" for line in text[1:3])
        + "<h2>Modules</h2>"
        + table(_MODULE_HEADERS, _module_rows(plan))
        + "<h2>Collectives per step</h2>" + table(["phase", "kind", "axis", "count", "bytes"], _collective_rows(plan))
        + summary + "</body></html>"
    )


def render(plan: "Plan", fmt: str = "text", explain: bool = False) -> str:
    """``fmt``: "text" (the table a person reads), "json" (the saved plan) or "html"; ``explain``: the
    text ends with why the replicated modules are (:func:`autotp.planning.result.explain.explain_replicated`)."""
    if fmt == "text":
        if explain:
            why = explain_replicated(plan)
            return _text(plan) + "\n\nWhy these modules stay replicated\n" + (
                "\n".join(str(e) for e in why) if why else "(no module with weights is replicated)")
        return _text(plan)
    if fmt == "json":
        return json.dumps(plan.to_dict(), indent=1)
    if fmt == "html":
        return _html(plan)
    raise ValueError(f"report format {fmt!r}: expected 'text', 'json' or 'html'")
