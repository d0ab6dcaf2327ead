"""The searches above one plan: a device count in, the mesh or the pipeline layout that plans fastest out.

- ``mesh_search``       every mesh shape of a device count planned, the fastest kept
- ``pipeline_search``   layouts of pipeline stages x data x tensor parallelism priced, the fastest kept
- ``stages``            a plan's costs by layer of a stack, and the stack cut into balanced stages
- ``schedules``         pipeline schedules as orders per rank, and their step replayed
- ``layer_kinds``       a stack of layers of a few kinds (dense, then experts) priced from one layer of each
- ``expert_axis``       the expert axis of a layout: which models get one, and its sizes and pins
"""
