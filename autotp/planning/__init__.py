"""Planning: an OpGraph, a mesh and a hardware profile in, a :class:`~autotp.planning.result.plan.Plan` out.

The second stage: every node's possible placements, priced, and one consistent choice made by an
integer linear program. It reads the graph from :mod:`autotp.tracing` and never runs the model.

- ``planner``   ``autotp.plan`` and ``plan_graph``: the stages below, in order
- ``choices/``  what an op can take: strategies per node, DTensor's rules, followers, layer tying
- ``rules/``    the op families: each one's sharding rule and how a node runs on its local pieces;
                the user's (``register_rule``)
- ``costs/``    what a choice costs: compute, communication, memory, saved tensors, recompute,
                the program of collectives a plan runs, gradient buckets
- ``solve/``    the integer program: formulation, solver, ILP back ends
- ``search/``   the searches over mesh shapes and pipeline layouts, stages, schedules
- ``result/``   the plan as a value: ``Plan``, its report, explain
- ``errors``    ``PlanError``, ``MemoryBudgetError``
"""
