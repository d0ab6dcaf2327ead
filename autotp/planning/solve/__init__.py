"""The integer program: strategies and their costs in, one consistent choice per node out.

- ``formulation``   the variables, rows and objective: one-hot choice per node, a redistribution
                    cost per edge, the memory budget, the recompute counts
- ``solver``        the solve, and the least-memory fallback when no plan fits the budget
- ``ilp``           the solvers behind one call (HiGHS, CBC as the fallback)
"""
