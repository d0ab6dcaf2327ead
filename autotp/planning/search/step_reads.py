"""What a pipeline's training step reads of the model's outputs: the loss alone.

``PipelineModule.step`` returns the mean of the micro-batches' losses and nothing else, so where the
model computes its own loss (``labels=``: a float scalar among its outputs that needs a gradient),
its other outputs of more than one element (the logits) are read by nothing in a step. Gathering
them whole for every micro-batch, as a module that returns them must, costs a step what a model's
output costs: at DeepSeek-V3's vocabulary, 16.9 GB of logits for 16 sequences of 4096 on every
rank of an expert axis. The layout search plans its graphs with those outputs in
:attr:`autotp.tracing.graph.OpGraph.unread_outputs`: the ILP leaves them as it places them, the
program lists no collective for them, and the memory figure does not hold them whole. The runtime
agrees (:mod:`autotp.runtime.pipeline.module`): the last stage returns them as the plan holds them
and a step drops them; ``forward`` and a step with a ``loss_fn`` of its own, which read them,
gather them then, a cost the plan does not price.
"""

from __future__ import annotations

import dataclasses

from autotp.planning.costs.saved import returned_outputs
from autotp.tracing.graph import OpGraph

__all__ = ["step_unread_outputs", "for_a_step"]


def step_unread_outputs(graph: OpGraph) -> tuple[str, ...]:
    """The outputs of ``graph`` a step never reads: none where no output is a loss (a step's
    ``loss_fn`` reads them); else every output of more than one element."""
    outputs = [o for o in graph.outputs if o in graph]
    if not any(graph[o].output.numel == 1 for o in returned_outputs(graph)):  # no loss among them
        return ()
    return tuple(dict.fromkeys(o for o in outputs if graph[o].outputs and graph[o].outputs[0].numel > 1
                               and not graph[o].is_placeholder))


def for_a_step(graph: OpGraph) -> OpGraph:
    """``graph`` with the outputs a step does not read marked unread (:func:`step_unread_outputs`)."""
    unread = step_unread_outputs(graph)
    return dataclasses.replace(graph, unread_outputs=unread) if unread else graph
