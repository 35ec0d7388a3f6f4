"""Uniform MILP solving: one model description, two back-ends (HiGHS default, Gurobi optional).

Build a :class:`MILPModel` once (numpy/scipy.sparse blocks) and call :func:`solve`. Both the
intra-chip and inter-chip passes use this package.

>>> import numpy as np, scipy.sparse as sp
>>> m = MILPModel(c=np.array([1.0, 1.0]), A=sp.csr_matrix([[1.0, 2.0]]),
...               row_lo=np.array([3.0]), row_hi=np.array([np.inf]),
...               lb=np.zeros(2), ub=np.full(2, 10.0), integrality=np.array([True, True]))
>>> r = solve(m, solver="highs")
>>> r.status, r.objective
('optimal', 2.0)
"""

from __future__ import annotations

import numpy as np

from dfmodel.errors import SolverError
from dfmodel.solvers import gurobi as _gurobi
from dfmodel.solvers import highs as _highs
from dfmodel.solvers.deadline import clamp, interruptible
from dfmodel.solvers.model import STATUSES, MILPModel, SolveResult, eliminate_fixed, relative_gap

__all__ = ["MILPModel", "SolveResult", "STATUSES", "solve", "choose_backend", "check_available", "gurobi_licence", "relative_gap"]

#: Default relative MIP gap: "proven optimal" means within this fraction of the bound.
DEFAULT_MIP_GAP = 1e-6


def gurobi_licence() -> tuple[str, str]:
    """``("full"|"limited"|"none", reason)``, probed once per process."""
    return _gurobi.licence()


def check_available(solver: str) -> None:
    """Raise the SolverError :func:`choose_backend` would for ``solver`` regardless of the model
    (unknown name, Gurobi asked but not installed or unlicensed). For passes that may answer
    without a MILP (exact sharding): asking for Gurobi still needs Gurobi."""
    if solver in ("auto", "highs"):
        return
    if solver != "gurobi":
        raise SolverError(f"unknown solver {solver!r}: use auto, highs or gurobi")
    kind, reason = gurobi_licence()
    if kind == "none":
        raise SolverError(f"solver 'gurobi' unavailable: {reason}")


def choose_backend(model: MILPModel, solver: str = "auto") -> str:
    """Back-end name for ``solver`` on ``model``; raises SolverError if Gurobi is asked and can't.

    ``auto``: Gurobi with a full licence, or with the size-limited one when the model fits
    (<= 2000 variables and <= 2000 constraints); HiGHS otherwise.
    """
    if solver == "highs":
        return "highs"
    if solver not in ("auto", "gurobi"):
        raise SolverError(f"unknown solver {solver!r}: use auto, highs or gurobi")
    kind, reason = gurobi_licence()
    fits = kind == "full" or (kind == "limited" and _gurobi.fits_limited(model))
    if solver == "auto":
        return "gurobi" if fits else "highs"
    if kind == "none":
        raise SolverError(f"solver 'gurobi' unavailable: {reason}")
    if not fits:
        raise SolverError(
            f"solver 'gurobi': model has {model.num_vars} variables and "
            f"{_gurobi.constraint_count(model)} constraints, over the {reason}"
        )
    return "gurobi"


def complete_warm_start(model: MILPModel) -> np.ndarray | None:
    """Full start vector from a partial one whose integer entries are all known.

    The continuous entries marked NaN are found by solving the LP with the integers fixed
    (HiGHS, milliseconds). None when there is no start, or it is infeasible.
    """
    w = model.warm_start
    if w is None:
        return None
    if np.all(np.isfinite(w)):
        return w
    if not np.all(np.isfinite(w[model.integrality])):
        return None
    return _highs.solve_lp_fixed(model, w)


def solve(
    model: MILPModel,
    solver: str = "auto",
    *,
    time_limit_s: float | None = None,
    mip_gap: float = DEFAULT_MIP_GAP,
    threads: int | None = None,
) -> SolveResult:
    """Solve ``model`` on the chosen back-end.

    ``solver``: ``"auto"`` | ``"highs"`` | ``"gurobi"`` (see :func:`choose_backend`).
    ``time_limit_s`` bounds the wall time (None = no limit); ``mip_gap`` is the relative gap at
    which a solution counts as proven optimal. Fixed columns are eliminated first (so the
    licence check counts real decisions) and a partial warm start (NaN for continuous entries)
    is completed by an LP. The result's ``status`` is ``optimal``, ``time_limit`` (with
    the incumbent, bound and gap if any), ``infeasible``, ``unbounded`` or ``error``.
    """
    time_limit_s = clamp(time_limit_s)  # never past the caller's whole-call deadline
    reduced, keep, values = eliminate_fixed(model)
    backend = choose_backend(reduced, solver)
    if reduced.num_vars == 0:  # every decision fixed: nothing for a back-end to do
        ok = bool(np.all(reduced.row_lo <= 1e-9) and np.all(reduced.row_hi >= -1e-9))
        obj = float(reduced.offset) if ok else None
        return SolveResult("optimal" if ok else "infeasible", obj, obj, 0.0 if ok else None,
                           values.copy() if ok else None, 0.0, backend, "" if ok else "fixed model infeasible")
    if reduced.warm_start is not None and not np.all(np.isfinite(reduced.warm_start)):
        reduced.warm_start = complete_warm_start(reduced)
    adapter = _gurobi if backend == "gurobi" else _highs
    try:
        with interruptible():  # (stops at the caller's deadline: clamp above)
            res = adapter.solve(reduced, time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads)
    except ImportError as e:  # gurobipy vanished between probe and use
        raise SolverError(f"solver {backend!r} unavailable: {e}") from e
    except Exception as e:
        if type(e).__name__ == "GurobiError":
            raise SolverError(f"Gurobi failed: {e}") from e
        raise
    if res.x is not None:
        x = values.copy()
        x[keep] = res.x
        res.x = x
    res.extra.update(num_vars=reduced.num_vars, num_rows=reduced.num_rows,
                     num_integer=int(reduced.integrality.sum()))
    return res
