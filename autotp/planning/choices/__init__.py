"""What an op can take: a traced graph in, each node's strategies (placements of its inputs and
output on every mesh axis) out, with the nodes that share variables found.

- ``strategies``     per node, the strategies it can take on each mesh axis: the user's rules, the
                     op families' rules (``autotp/planning/rules/``), DTensor's for the rest
- ``dtensor_rules``  DTensor's op-strategy registry, behind one adapter, for the ops left over
- ``followers``      views merged into the op they follow, before the integer program
- ``tying``          repeated layers found, to share one set of the integer program's variables
- ``expert_lists``   experts written as a list of alike modules, stacked: named in a warning, as
                     their weights have no expert dim to place whole on ranks
- ``expert_placements`` routed MoE layers found from their grouped matmuls, how a strategy places
                     their experts, and strategies narrowed to one placement (priced in the report)
- ``check``          ``check_rule`` (``autotp.check_rule``): an op's strategies checked on data, each
                     rank's pieces against the op's output
"""
