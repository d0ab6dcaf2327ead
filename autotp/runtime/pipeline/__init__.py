"""The pipeline's runtime: a three-dimensional plan (pipeline x data x tensor) in, this rank's stages
under a pipelining schedule out.

- ``module``        ``PipelineModule``: this rank's stages, the schedule, the data axis
                    (``autotp.runtime.data_parallel``): ``PipelineModule.step``
- ``stage_graphs``  the rewritten graph cut into stage graphs, and the values crossing the cuts
- ``stage_units``   a stage's layers as submodules, for recompute and FSDP2's per-layer units
- ``token_counts``  a loss that averages over valid targets, weighed across micro-batches by their
                    counts, as one process weighs it
"""
