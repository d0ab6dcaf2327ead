"""What a choice costs: strategies, a mesh and a hardware profile in, seconds and bytes out.

- ``costing``           seconds of compute and communication, and bytes of memory, per choice
- ``redistribute``      the collectives that turn one placement into another, and their cost
- ``program``           the collectives and copies a plan runs, in order: read by the planner's
                        time, the report and the runtime alike
- ``saved``             what autograd keeps for the backward, and what a forward holds at once
- ``recompute``         which layers may recompute their activations
- ``recompute_counts``  how many layers of each stack recompute: the counts tried
- ``buckets``           a data axis's gradient buckets (DDP's), and the part of their all-reduces left exposed
"""
