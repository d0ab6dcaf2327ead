"""Tracing: a PyTorch model and example inputs in, an :class:`~autotp.tracing.graph.OpGraph` out.

The first stage. It runs ``torch.export`` on the model and turns the exported program into the
graph every later stage reads: each node's op, arguments, shapes, dtypes, FLOPs, bytes and module
path, and which placeholder is which parameter. It refuses, by name, what no plan could place.
It imports nothing from the later stages.

- ``export``     ``capture(model, inputs)``: export, inline, describe; ``CaptureError``
- ``inputs``     what the trace is given: the example inputs, the model's mode, its device
- ``graph``      ``OpGraph``, ``OpNode``, ``TensorInfo``: the graph as data
- ``arguments``  an op's arguments by schema name (``OpArgs``, ``TensorArg``, ``SizeArg``)
- ``dynamic``    dynamic dims: the input sizes a graph accepts, and what a plan requires of them
- ``regions``    ``no_grad`` and autocast-off blocks, inlined into the graph
- ``masks``      attention masks proven causal / windowed / padded from the graph, replaced by their
                 description (``is_causal``, ``autotp::masked_attention``), their ``S x S`` subgraph removed
- ``refusals``   constructs a plan cannot place, each refused with what to do
- ``aliasing``   views and writes in place: which tensors must share one storage
- ``repeats``    stacks of alike layers traced at three layers and unrolled (for planning)
- ``loss``       ``WithLoss``: the model and its loss traced as one module, under the model's names
- ``heap``       the garbage collector kept off the objects alive before a trace or a plan starts
"""
