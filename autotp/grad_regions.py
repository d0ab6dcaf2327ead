"""Blocks run under ``torch.no_grad()`` or ``torch.set_grad_enabled()`` inside ``forward()``.

``torch.export`` keeps such a block as the higher-order op ``wrap_with_set_grad_enabled(enabled,
body, *operands)``, whose body is a subgraph autotp could not place (routers that pick experts under
``no_grad``, as PhiMoE's, do this). :func:`inline_grad_regions` puts the body's ATen ops in the
graph in its place, so they are planned and placed like any other. What ``no_grad`` means is kept
in the graph itself: every tensor operand of a region with gradients off is read through
``aten.detach`` first. For ATen ops this computes what the region computes, and no gradient flows
back through it: the region's outputs do not require a gradient, and what they were computed from
gets none from them. A write in place inside the region lands in the same storage through the
detached alias, as it would under ``no_grad``, and where the region hands such a written operand on
(``h.clamp_()``), the rest of the graph reads the operand itself, its gradient history kept. A region with gradients on is inlined as it is.
Export does not nest regions: ``torch.enable_grad()`` inside ``torch.no_grad()`` comes out as
regions one after another, each under one mode.
"""

from __future__ import annotations

import torch
import torch.fx

from autotp.aliasing import writes_first_argument

__all__ = ["inline_grad_regions"]

NAME = "wrap_with_set_grad_enabled"


def _is_region(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and node.target.name() == NAME)


def inline_grad_regions(gm: torch.fx.GraphModule) -> dict[str, str | None]:
    """Replace every ``wrap_with_set_grad_enabled`` node of ``gm``'s graph by its body's ops, in place
    (module doc). Returns, per name of a node that read a region's output and is gone, the name of the
    node that now stands for it (None for a value that is not a node)."""
    regions = [n for n in gm.graph.nodes if _is_region(n)]
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
    enabled, body_node, *operands = region.args
    body: torch.fx.GraphModule = getattr(gm, body_node.target)
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise RuntimeError(f"{NAME} node {region.name}: {len(operands)} operands for a body of "
                           f"{len(placeholders)} inputs")
    outputs: tuple = ()
    with graph.inserting_before(region):
        for ph, operand in zip(placeholders, operands):
            env[ph] = operand
            if not enabled and isinstance(operand, torch.fx.Node) and isinstance(operand.meta.get("val"),
                                                                                 torch.Tensor):
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
            if node.op != "call_function" or _is_region(node):
                raise RuntimeError(f"{NAME} node {region.name} holds {node.op} {node.name}; expected ATen ops "
                                   "only (export writes nested grad modes as regions one after another)")
            env[node] = graph.node_copy(node, lambda n: env[n])
    mapped = [_seen_outside(o, env, dict(zip(placeholders, operands))) for o in outputs]
    for user in list(region.users):
        if user.op == "call_function" and user.target.__name__ == "getitem" and isinstance(user.args[1], int):
            user.replace_all_uses_with(mapped[user.args[1]])
            renamed[user.name] = mapped[user.args[1]].name if isinstance(mapped[user.args[1]], torch.fx.Node) else None
            graph.erase_node(user)
        else:
            raise RuntimeError(f"{NAME} node {region.name} is read whole by {user.name}; expected getitem")
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
    return operands[node] if node in operands else env[output]

