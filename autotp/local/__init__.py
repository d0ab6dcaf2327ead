"""Local execution: how an op runs on a rank's pieces; autograd-aware collectives and the modules
op families run inside themselves.

Below planning and above tracing: the op families of :mod:`autotp.planning.rules` import what their
local execution runs from here, and the runtime's rewrite builds the graph of one rank with them.
Nothing here plans or rewrites; each module is a ``torch.nn.Module`` (or a function) a graph node
calls on local tensors, but ``site``, the interface every op family's local execution takes.

- ``site``          ``LocalSite``: what a local execution is handed (the node, the strategy chosen, this
                    rank's place on the mesh, the op's local arguments, the means to emit calls) and
                    ``Call``, what it may return
- ``collectives``   autograd-aware collectives, one module per redistribution step; the masked
                    lookup of a row-split embedding
- ``dropout``       dropout masks and random draws on shards (one mask where ranks hold the same values)
- ``batch_norm``    batch norm on a split batch or split space: statistics all-reduced inside
- ``losses``        cross-entropy on logits split by vocabulary: two all-reduces of per-row numbers
- ``experts``       a grouped matmul on the rows of this rank's experts, the others zero
- ``attention``     causal attention on a rank's query rows computed as two balanced chunks,
                    queries and outputs exchanged by all-to-all
- ``ring``          attention of a rank's chunk of the sequence, the key/value chunks passed
                    around the ranks and merged by their log-sum-exp (ring attention)
- ``dispatch``      routed rows sent to their experts' ranks and back (two all-to-alls), the
                    grouped matmuls between on this rank's experts
- ``outputs``       an output a pipeline's step does not read, returned as the plan holds it (a DTensor)
"""
