"""Running a PuLP problem: HiGHS (through ``highspy``) first, CBC as the fallback.

The planner's formulation lives in :mod:`autotp.planning.solve.solver`; this module only hands a built problem to
the solvers, with the options every solve uses (one thread, the relative gap ``MIP_GAP``, a time
limit) and HiGHS' banner kept off stdout. ``AUTOTP_SOLVER_LOG=1`` shows the solver's log.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Callable, Optional

import pulp

__all__ = ["MIP_GAP", "SolverError", "solve_with_first_solver"]

# Relative optimality gap at which the MIP stops; the report says "optimal" only within this gap.
# 1e-5, not a looser 1e-3: alternatives such as a weight kept whole against one stored split and
# gathered (all_reduce against all_gather + reduce_scatter of the same bytes) differ by a few
# latencies, 0.01% of a step, and a looser gap returns whichever the search met first. The tight
# gap cost no measurable time on the 8B and 70B shapes (benchmarks/plan_time.py).
MIP_GAP = float(os.environ.get("AUTOTP_MIP_GAP", "1e-5"))


class SolverError(RuntimeError):
    """No ILP solver is installed, or every one failed on the problem."""


def solve_with_first_solver(prob: pulp.LpProblem, time_limit_s: float,
                            problem: Callable[[pulp.LpProblem], Optional[str]]) -> str:
    """Solve ``prob`` with the first solver that works and return its name.

    After each solve, ``problem(prob)`` says what is wrong with the result (``None`` if nothing: the
    result is kept), and may raise to stop at once; a solver that raises or leaves a problem makes
    way for the next one.
    """
    last_error: Optional[str] = None
    for name, solver in _solvers(time_limit_s):
        try:
            with (_quiet_stdout() if not os.environ.get("AUTOTP_SOLVER_LOG") else contextlib.nullcontext()):
                prob.solve(solver)
        except Exception as err:  # noqa: BLE001 - try the next solver
            last_error = f"{name}: {err}"
            continue
        wrong = problem(prob)
        if wrong is None:
            return name
        last_error = f"{name}: {wrong}"
    raise SolverError(f"the ILP solvers failed: {last_error}")


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner from C when it starts, whatever its options say; keep stdout clean."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _solvers(time_limit_s: float) -> list[tuple[str, pulp.LpSolver]]:
    out = []
    # strong branching dominates HiGHS' time on these models; trusting pseudo-costs from the start
    # reaches the same optimum sooner. Presolve off: on the 70B shape on (8, 8) it took 1.7 s of
    # HiGHS' 2.2 s and the LP relaxation (tight: one node) solves the whole model in 0.6 s without it
    highs = pulp.HiGHS(msg=bool(os.environ.get("AUTOTP_SOLVER_LOG")), timeLimit=time_limit_s, threads=1,
                       gapRel=MIP_GAP, mip_pscost_minreliable=0, presolve="off")
    if highs.available():
        out.append(("HiGHS", highs))
    with warnings.catch_warnings():  # PuLP 3 deprecates its bundled CBC in favour of an installed one
        warnings.simplefilter("ignore", DeprecationWarning)
        for cls in (getattr(pulp, "COIN_CMD", None), getattr(pulp, "PULP_CBC_CMD", None)):
            cbc = cls(msg=False, timeLimit=time_limit_s, threads=1, gapRel=MIP_GAP) if cls else None
            if cbc is not None and cbc.available():
                out.append(("CBC", cbc))
                break
    if not out:
        raise SolverError("no ILP solver available: install highspy (pip install highspy) or pulp with CBC")
    return out
