"""The searches above one plan: a device count in, the mesh or the pipeline layout that plans fastest out.

- ``mesh_search``       every mesh shape of a device count planned, the fastest kept
- ``pipeline_search``   layouts of pipeline stages x data x expert x context x tensor parallelism priced,
                        the fastest kept
- ``stages``            a plan's costs by layer of a stack, and the stack cut into balanced stages
- ``schedules``         pipeline schedules as orders per rank, and their step replayed
- ``expert_axis``       which weights an expert axis splits: the routed experts, found from the graph
- ``step_reads``        what a pipeline's step reads of the model's outputs: the loss alone
- ``layer_kinds``       a stack of layers of a few kinds, priced from one layer of each kind
- ``context_axis``      the plan on a context axis: the inputs split by sequence, the weights whole
"""
