"""A pipeline stage's layers as units: the submodules its recompute and FSDP2 wrap.

A stage's graph (:mod:`autotp.runtime.pipeline.module`) is one flat ``torch.fx`` graph. The layout's
recompute and FSDP2 (ZeRO 1 and 3 over the data axis) both need each layer of the stack as a module
the graph calls: :func:`group_stage_layers` moves each layer's nodes there
(:func:`autotp.runtime.recompute.group_layers`), with the parameters and buffers only that layer
reads when FSDP2 is to shard it, so FSDP2 gathers one layer at a time, as torchtitan wraps each
block (:func:`autotp.runtime.data_parallel.shard_over_replicas` then shards those units and the rest
of the stage), and :func:`model_name` reads a moved tensor's name in the model back.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx

__all__ = ["group_stage_layers", "model_name", "reads_state"]


def reads_state(n: torch.fx.Node) -> bool:
    """A parameter's or buffer's read, or the local shard of one (nothing computed, nothing sent)."""
    from autotp.local.collectives import to_local

    return n.op == "get_attr" or (n.op == "call_function" and n.target is to_local
                                  and len(n.all_input_nodes) == 1 and n.all_input_nodes[0].op == "get_attr")


def _state_of_one_layer(gm: torch.fx.GraphModule, layer_of: Mapping[torch.fx.Node, str]) -> dict[torch.fx.Node, str]:
    """The reads of parameters and buffers (and their local shards) that only one layer's nodes use,
    with that layer."""
    mine: dict[torch.fx.Node, str] = {}
    for n in reversed(list(gm.graph.nodes)):
        if reads_state(n) and n.users:
            layers = {layer_of.get(u) or mine.get(u) for u in n.users}
            if len(layers) == 1 and None not in layers:
                mine[n] = layers.pop()
    return mine


def group_stage_layers(sg: torch.fx.GraphModule, origin: Mapping[str, str], unit: Mapping[str, int],
                       layer_paths: Sequence[str], recompute: bool, with_state: bool) -> None:
    """Each layer of the stack in the stage's graph ``sg`` moved into a submodule its graph calls
    (``origin``, ``unit``: as for :func:`autotp.runtime.pipeline.stage_graphs.split_stages`): a ``Recompute``
    where the layout recomputes, else a ``Layer``. ``with_state``: the parameters and buffers only that layer reads move with it
    (FSDP2 then shards each layer as a unit); they are named ``autotp_pipeline_..._i.body.<name in the
    model>`` (:func:`model_name` reads the model's name back)."""
    from autotp.runtime.recompute import Layer, Recompute, group_layers

    layer_of = {}
    for n in sg.graph.nodes:
        u = unit.get(origin.get(n.name, ""), 0)
        if 1 <= u <= len(layer_paths) and n.op in ("call_function", "call_module") and not reads_state(n):
            layer_of[n] = layer_paths[u - 1]
    if with_state:
        layer_of.update(_state_of_one_layer(sg, layer_of))
    group_layers(sg, layer_of, "autotp_pipeline_recompute_" if recompute else "autotp_pipeline_layer_",
                 Recompute if recompute else Layer)


def model_name(name: str) -> str:
    """A stage's parameter or buffer under its name in the model: without the layer's submodule
    (``autotp_pipeline_layer_3.body.``) that holds it when the stage runs its layers as units."""
    head, _, rest = name.partition(".")
    if head.startswith(("autotp_pipeline_layer_", "autotp_pipeline_recompute_")) and rest.startswith("body."):
        return rest[len("body."):]
    return name
