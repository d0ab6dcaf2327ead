"""Planning: an OpGraph, a mesh and a hardware profile in, a :class:`~autotp.planning.plan.Plan` out.

The second stage: every node's possible placements, priced, and one consistent choice made by an
integer linear program. It reads the graph from :mod:`autotp.tracing` and never runs the model.

- ``planner``           ``autotp.plan`` and ``plan_graph``: the stages below, in order
- ``mesh_search``       given a device count, every mesh shape of it planned, the fastest kept
- ``pipeline_search``   layouts of pipeline stages x data x tensor parallelism priced, the fastest kept
- ``buckets``           a data axis's gradient buckets (DDP's), and the part of their all-reduces left exposed
- ``stages``            a plan's costs by layer of a stack, and the stack cut into balanced stages
- ``schedules``         pipeline schedules as orders per rank, and their step replayed
- ``strategies``        per node, the strategies it can take on each mesh axis
- ``rules/``            autotp's sharding rules by op family, and the user's (``register_rule``)
- ``dtensor_rules``     DTensor's op-strategy registry, behind one adapter, for the ops left over
- ``costing``           seconds of compute and communication, and bytes of memory, per choice
- ``saved``             what autograd keeps for the backward, and what a forward holds at once
- ``redistribute``      the collectives that turn one placement into another, and their cost
- ``tying``             repeated layers found, to share one set of ILP variables
- ``followers``         views merged into the op they follow, before the ILP
- ``recompute``         which layers may recompute their activations
- ``recompute_counts``  how many layers of each stack recompute: the counts tried
- ``formulation``       the ILP's variables, rows and objective
- ``solver``, ``ilp``   the solve (HiGHS, CBC as the fallback)
- ``program``           the collectives and copies a plan runs, in order: read by the planner's
                        time, the report and the runtime alike
- ``plan``              the ``Plan``: placements, collectives, time, memory; JSON
- ``report``            the plan as text, JSON or HTML
- ``explain``           each placement a module's weight could have, solved again and priced
- ``errors``            ``PlanError``, ``MemoryBudgetError``
"""
