"""A loss that averages over valid targets, weighed as one process weighs it across micro-batches.

A Hugging Face model given ``labels=`` computes ``cross_entropy(..., ignore_index=-100)`` with the
mean over the targets that are not ignored (padding, a prompt's tokens in fine-tuning). A pipeline
runs the batch as micro-batches, and the mean of their means is the batch's mean only where every
micro-batch holds as many valid targets: with padding it is not (a micro-batch of short sequences
weighs as much as one of long ones). One process's loss is

    sum over micro-batches i of  mean_i * n_i / N       (n_i valid targets in i, N in the batch)

so each micro-batch's loss is scaled by ``n_i * M * dp / N`` before its backward: the schedule divides
the gradients by the ``M`` micro-batches and the data axis averages over the ``dp`` replicas, which
leaves exactly one process's gradients (torchtitan's pipeline counts the tokens over the whole batch
the same way).

The counts come from the traced graph, not from the model's name: :func:`token_mean` finds the output
the pipeline takes as the loss, follows it back through views and casts to an
``aten.cross_entropy_loss`` with the mean reduction and no class weights, and keeps the ops that make
that op's targets from the inputs alone (the labels' shift: a pad and a slice) as a small graph, run on
each micro-batch's inputs before the schedule starts. A loss that reads such a cross-entropy but is not
it alone (a cross-entropy plus an auxiliary term) cannot be so weighed: :class:`TokenMean` with
``exact=False`` says so, and the step refuses a batch whose micro-batches hold unequal counts.

>>> import torch
>>> counts = torch.tensor([3, 1])          # valid targets in two micro-batches
>>> scale_factors(counts, torch.tensor(4), micro_batches=2, replicas=1)
tensor([1.5000, 0.5000])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

__all__ = ["TokenMean", "token_mean", "scale_factors"]

_CROSS_ENTROPY = "aten.cross_entropy_loss.default"
# ops that pass the loss through unchanged in value (a view, a cast, a copy)
_SAME_VALUE = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.clone.default",
               "aten._to_copy.default", "aten.to.dtype", "aten.alias.default", "aten.detach.default",
               "aten.squeeze.default", "aten.squeeze.dim"}


@dataclass(frozen=True)
class TokenMean:
    """How to count a loss's valid targets. ``output``: the flat index of the loss among the graph's
    outputs; ``targets``: a graph of the inputs named ``inputs`` that gives the cross-entropy's
    targets; ``ignore_index``: the target that does not count; ``exact``: the loss is that
    cross-entropy alone (else it reads one beside other terms, and only equal counts keep it exact)."""

    output: int
    inputs: tuple[str, ...]
    targets: torch.fx.GraphModule
    ignore_index: int
    exact: bool

    def counts(self, inputs: dict[str, Any], micro_batches: int) -> torch.Tensor:
        """The valid targets of each micro-batch of ``inputs`` (this replica's rows): ``(micro_batches,)``
        int64, on the inputs' device (no host round trip)."""
        chunks = [torch.tensor_split(inputs[name], micro_batches) if isinstance(inputs[name], torch.Tensor)
                  else [inputs[name]] * micro_batches for name in self.inputs]
        return torch.stack([(self.targets(*parts) != self.ignore_index).sum() for parts in zip(*chunks)])


def scale_factors(counts: torch.Tensor, total: torch.Tensor, micro_batches: int, replicas: int) -> torch.Tensor:
    """What each micro-batch's mean loss is multiplied by (module docstring): ``n_i * M * dp / N``; a
    micro-batch with no valid target weighs 0."""
    return counts.to(torch.float32) * (micro_batches * replicas) / total.clamp(min=1).to(torch.float32)


def token_mean(exported: Any, loss_output: int) -> Optional[TokenMean]:
    """:class:`TokenMean` of the exported program's flat output ``loss_output``, or None where that
    output reads no mean cross-entropy with an ignored target (its micro-batches weigh alike)."""
    graph = exported.graph
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if not 0 <= loss_output < len(flat) or not isinstance(flat[loss_output], torch.fx.Node):
        return None
    node = flat[loss_output]
    while node.op == "call_function" and str(node.target) in _SAME_VALUE:
        node = node.args[0]
    exact = node.op == "call_function" and str(node.target) == _CROSS_ENTROPY and _counted(node)
    if not exact:
        found = [n for n in _ancestors(flat[loss_output]) if n.op == "call_function"
                 and str(n.target) == _CROSS_ENTROPY and _counted(n)]
        if len(found) != 1:
            return None  # no such cross-entropy (its micro-batches weigh alike), or several to tell apart
        node = found[0]
    made = _targets_graph(exported, node)
    if made is None:
        return None
    inputs, targets = made
    return TokenMean(loss_output, inputs, targets, _argument(node, "ignore_index", 4, -100), exact)


def _argument(node: torch.fx.Node, name: str, position: int, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def _counted(node: torch.fx.Node) -> bool:
    """A cross-entropy whose mean divides by its valid targets: the mean reduction (1), no class
    weights (with weights it divides by their sum)."""
    return _argument(node, "reduction", 3, 1) == 1 and _argument(node, "weight", 2, None) is None


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen: dict[torch.fx.Node, None] = {}
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen[n] = None
        todo.extend(n.all_input_nodes)
    return list(seen)


def _targets_graph(exported: Any, cross_entropy: torch.fx.Node) -> Optional[tuple[tuple[str, ...], torch.fx.GraphModule]]:
    """The ops that make ``cross_entropy``'s targets from the user's inputs alone, as a graph of those
    inputs (by name); None where the targets read a parameter, a buffer or a constant."""
    user = {spec.arg.name for spec in exported.graph_signature.input_specs if spec.kind.name == "USER_INPUT"}
    target = cross_entropy.args[1]
    needed = _ancestors(target)
    if any(n.op == "placeholder" and n.name not in user for n in needed):
        return None
    if any(n.op not in ("placeholder", "call_function") for n in needed):
        return None
    order = {n: i for i, n in enumerate(exported.graph.nodes)}
    needed.sort(key=order.__getitem__)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    names = []
    for n in needed:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            names.append(n.name)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[target])
    return tuple(names), torch.fx.GraphModule(torch.nn.Module(), g)
