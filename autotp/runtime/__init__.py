"""Runtime: a Plan, its graph and a device mesh in, the parallel module out.

The third stage. It rewrites the exported graph into one rank's graph on local shards, with the
plan's collectives as graph nodes (modules of :mod:`autotp.local`), and wraps it as a module that
behaves like the model it stands for. It reads the plan and never solves (except for the graph of a
mode not traced yet, which it asks the planner for, with every weight kept where it is).

- ``rewrite``       the exported graph and its plan -> one rank's ``torch.fx`` graph
- ``interface``     ``Parallelized``: what ``parallelize`` returns, either kind (plan, layout, step, ...)
- ``module``        ``ParallelModule``: one graph per mode, ``train``/``eval``, graphs for other sizes
- ``state``         a rank's pieces of the model's tensors on the module, and graphs over them
- ``agreement``     what every rank must hold the same (the plan, the dropout seed), from the first
- ``shards``        a rank's piece of a tensor, and the DTensor that holds it
- ``guard``         the input check: shapes the plan can run, on the rank's device, the same on every rank
- ``devices``       each rank's device of the mesh; ranks of one host on one GPU refused
- ``recompute``     recomputed layers as checkpointed submodules
- ``pipeline/``     a three-dimensional plan's stages of this rank under a pipelining schedule, with
                    a data axis: ``PipelineModule.step`` (its package docstring lists its modules)
- ``data_parallel`` a layout's data axis over a rank's modules (pipeline stages, or a ``ParallelModule``):
                    ZeRO 0's bucketed all-reduce, or FSDP2 for ZeRO 1 and 3
- ``bucket_reducer`` a data axis's gradients under ZeRO 0 averaged in DDP's buckets, during the backward
- ``generation``    ``generate()``: its graphs (prompt and token; encoder, first and later decoder step),
                    planned with the caches split like the attention, and the decoding loop
- ``static_cache``  copies of a Hugging Face model whose KV cache is a set of buffers, to trace
- ``generate_options`` one call's choices, and the next token as Hugging Face's processors pick it
"""
