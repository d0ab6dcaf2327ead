"""Blocks of ``forward()`` run under another grad mode, or with autocast switched off.

``torch.export`` keeps ``with torch.no_grad():`` / ``torch.set_grad_enabled(...)`` as the
higher-order op ``wrap_with_set_grad_enabled(enabled, body, *operands)`` and ``with
torch.autocast(..., enabled=False):`` as ``wrap_with_autocast(device, dtype, False, cache, body,
*operands)``. Their bodies are subgraphs autotp could not place (routers that pick experts under
``no_grad``, as PhiMoE's; rotary tables computed in float32 with autocast off).
:func:`inline_regions` puts the body's ATen ops in the graph in their place, so they are planned and
placed like any other.

- **Gradients off.** What ``no_grad`` means is kept in the graph itself: every tensor operand of
  the region is read through ``aten.detach`` first. For ATen ops this computes what the region
  computes, and no gradient flows back through it: the region's outputs do not require a gradient,
  and what they were computed from gets none from them. A write in place inside the region lands in
  the same storage through the detached alias, as it would under ``no_grad``, and where the region
  hands such a written operand on (``h.clamp_()``), the rest of the graph reads the operand itself,
  its gradient history kept. Export does not nest grad modes: ``torch.enable_grad()`` inside
  ``torch.no_grad()`` comes out as regions one after another, each under one mode.
- **Gradients on**, and **autocast off**: the body is inlined as it is. The trace records every op
  with the dtypes it ran in, so a region that turns autocast off computes what it computed, as long
  as the parallel module is not itself run under autocast (autotp plans the traced dtypes).

Regions inside a region are inlined first. A region autocast is on in (it would change the dtypes
of the ops in it when run), and other higher-order ops, are refused at capture: outside a region by
``autotp.capture``, inside one here (:class:`RegionError`).
"""

from __future__ import annotations

import torch
import torch.fx

from autotp.tracing.aliasing import writes_first_argument

__all__ = ["inline_regions", "RegionError"]

GRAD = "wrap_with_set_grad_enabled"
AUTOCAST = "wrap_with_autocast"


class RegionError(ValueError):
    """A region :func:`inline_regions` cannot inline (capture reports it as a ``CaptureError``)."""


def _higher_order(node: torch.fx.Node) -> str | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.target.name()
    return None


def _region(node: torch.fx.Node) -> tuple[bool, torch.fx.Node, list] | None:
    """``(gradients off, body node, operands)`` of a region this module inlines, else None."""
    kind = _higher_order(node)
    if kind == GRAD:
        enabled, body, *operands = node.args
        return not enabled, body, operands
    if kind == AUTOCAST and not node.args[2]:  # (device, dtype, enabled, cache, body, *operands)
        return False, node.args[4], list(node.args[5:])
    return None


def inline_regions(gm: torch.fx.GraphModule) -> dict[str, str | None]:
    """Replace every region node of ``gm``'s graph (module doc) by its body's ops, in place. Returns,
    per name of a node that read a region's output and is gone, the name of the node that now stands
    for it (None for a value that is not a node)."""
    regions = [n for n in gm.graph.nodes if _region(n) is not None]
    renamed: dict[str, str | None] = {}
    for region in regions:
        _inline(gm, region, renamed)
    if regions:
        for node in list(gm.graph.nodes):  # the bodies, now unread
            if node.op == "get_attr" and not node.users and isinstance(getattr(gm, node.target, None),
                                                                       torch.fx.GraphModule):
                target = node.target
                gm.graph.erase_node(node)
                if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
                    delattr(gm, target)
        gm.recompile()
    return renamed


def _inline(gm: torch.fx.GraphModule, region: torch.fx.Node, renamed: dict[str, str | None]) -> None:
    graph = gm.graph
    detach, body_node, operands = _region(region)
    body: torch.fx.GraphModule = getattr(gm, body_node.target)
    inline_regions(body)  # regions inside this one first (no_grad around an autocast-off block)
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise RegionError(f"{_higher_order(region)} node {region.name}: {len(operands)} operands for a body of "
                          f"{len(placeholders)} inputs")
    outputs: tuple = ()
    with graph.inserting_before(region):
        for ph, operand in zip(placeholders, operands):
            env[ph] = operand
            if detach and isinstance(operand, torch.fx.Node) and isinstance(operand.meta.get("val"), torch.Tensor):
                detached = graph.call_function(torch.ops.aten.detach.default, (operand,))
                detached.meta = {k: v for k, v in region.meta.items() if k != "val"}
                detached.meta["val"] = operand.meta["val"].detach()
                env[ph] = detached
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = tuple(node.args[0]) if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
                continue
            if node.op == "get_attr" and isinstance(getattr(body, node.target, None), torch.fx.GraphModule):
                continue  # the body of a region inside this one, which is refused just below
            if node.op != "call_function" or _higher_order(node):
                raise RegionError(f"the {_higher_order(region)} region {region.name} holds {node.op} {node.name} "
                                  f"({_higher_order(node) or node.target}): autotp inlines a region of ATen ops "
                                  f"and regions it inlines, not other higher-order ops inside one")
            env[node] = graph.node_copy(node, lambda n: env[n])
    mapped = [_seen_outside(o, env, dict(zip(placeholders, operands))) for o in outputs]
    for user in list(region.users):
        if user.op == "call_function" and user.target.__name__ == "getitem" and isinstance(user.args[1], int):
            user.replace_all_uses_with(mapped[user.args[1]])
            renamed[user.name] = mapped[user.args[1]].name if isinstance(mapped[user.args[1]], torch.fx.Node) else None
            graph.erase_node(user)
        else:
            raise RegionError(f"{_higher_order(region)} node {region.name} is read whole by {user.name}; "
                              f"expected getitem")
    graph.erase_node(region)


def _seen_outside(output, env: dict, operands: dict):
    """What the rest of the graph reads for the region's ``output``: its inlined node, but where it is
    an operand written in place (``h.clamp_()`` under ``no_grad``: the same tensor, its gradient history
    kept), the operand itself, whose storage the write reached through the detached alias."""
    if not isinstance(output, torch.fx.Node):
        return output
    node = output
    while node.op == "call_function" and writes_first_argument(str(node.target)) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node not in operands or not _same_layout(output, operands[node]):
        return env[output]  # a write that reshaped the alias (unsqueeze_, t_) is seen through the alias only
    return operands[node]


def _same_layout(a: torch.fx.Node, b) -> bool:
    va, vb = a.meta.get("val"), getattr(b, "meta", {}).get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.stride() == vb.stride() and va.storage_offset() == vb.storage_offset())
