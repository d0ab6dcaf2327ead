"""``autotp profile``: measure collectives and the device, write a hardware profile.

In: a mesh shape and the sweep's options; out: a ``cost_models.HardwareProfile`` JSON that
``hardware=`` and ``--hardware`` read. It stands beside the pipeline and imports none of its stages.

Modules, in the order data flows through them:

- ``config``       sizes (``1K``, ``64M``), mesh shapes (``2x4``), :class:`ProfileConfig`
- ``sizes``        the sizes timed besides the grid: held-out sizes (never fitted) and refinements
- ``dtypes``       the dtypes measured, and which of them the device only emulates
- ``command``      argparse options and orchestration (``add_arguments``, ``run``)
- ``launch``       start N local ranks, watchdog: a rank that dies or hangs stops the run
- ``heartbeat``    rank-side progress reports for the watchdog; fault-injection hook
- ``worker``       one rank: join the group, sweep, measure the device, write the profile
- ``mesh``         mesh axes as row-major rank groups (like DeviceMesh)
- ``collectives``  the five collectives: buffers, bus factors, result checks
- ``sweep``        timing loop over axes x kinds x sizes (max over ranks of the mean)
- ``fit``          piecewise alpha-beta least-squares fit (size ranges chosen from the data),
                   errors on held-out sizes (never fitted) and leave-one-out errors
- ``device``       matmul FLOP/s per dtype, memory bandwidth, kernel overhead
- ``table``        nccl-tests style tables, fit summary, progress line
- ``hardware``     measurements -> ``cost_models.HardwareProfile`` JSON
"""
