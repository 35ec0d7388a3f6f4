"""HiGHS adapter (highspy, always installed): the default back-end.

The model is loaded in one call (``passModel`` with a column-wise matrix), the warm start with
``setSolution``; output is off and the run deterministic (fixed seed).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from dfmodel.solvers.model import MILPModel, SolveResult, relative_gap

BACKEND = "highs"


def _load(model: MILPModel, lb: np.ndarray | None = None, ub: np.ndarray | None = None, *, integer: bool = True):
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    A = sp.csc_matrix(model.A)
    A.sort_indices()
    lb = model.lb if lb is None else lb
    ub = model.ub if ub is None else ub
    inf = highspy.kHighsInf
    integrality = model.integrality.astype(np.int32) if integer else np.zeros(model.num_vars, dtype=np.int32)
    h.passModel(
        model.num_vars,
        model.num_rows,
        int(A.nnz),
        int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize),
        float(model.offset),
        model.c,
        np.where(np.isfinite(lb), lb, -inf),
        np.where(np.isfinite(ub), ub, inf),
        np.where(np.isfinite(model.row_lo), model.row_lo, -inf),
        np.where(np.isfinite(model.row_hi), model.row_hi, inf),
        A.indptr.astype(np.int32),
        A.indices.astype(np.int32),
        A.data.astype(float),
        integrality,
    )
    return h


def solve_lp_fixed(model: MILPModel, fixed: np.ndarray) -> np.ndarray | None:
    """Solve the LP left when the integer variables are fixed to ``fixed`` (their values).

    Used to complete a partial warm start (only integer values known). None if infeasible.
    """
    import highspy

    lb, ub = model.lb.copy(), model.ub.copy()
    ints = model.integrality
    lb[ints] = ub[ints] = np.round(fixed[ints])
    h = _load(model, lb, ub, integer=False)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return np.asarray(h.getSolution().col_value, dtype=float)


def solve(model: MILPModel, *, time_limit_s: float | None, mip_gap: float, threads: int | None = None) -> SolveResult:
    """Solve ``model`` with HiGHS; see :func:`dfmodel.solvers.solve` for the contract."""
    import highspy

    t0 = time.perf_counter()
    h = _load(model)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    if model.warm_start is not None and np.all(np.isfinite(model.warm_start)):
        h.setSolution(model.num_vars, np.arange(model.num_vars, dtype=np.int32), model.warm_start)
    h.run()
    S = highspy.HighsModelStatus
    if h.getModelStatus() in (S.kInfeasible, S.kUnboundedOrInfeasible) and model.integrality.any():
        # highspy 1.15.1's MIP presolve has declared feasible models infeasible (seen on this
        # project's partitioning models, which a warm start or presolve=off then solved):
        # confirm any infeasibility without presolve before reporting it
        left = None if time_limit_s is None else max(0.0, time_limit_s - (time.perf_counter() - t0))
        h.setOptionValue("presolve", "off")
        if left is not None:
            h.setOptionValue("time_limit", float(left))
        h.run()
    wall = time.perf_counter() - t0
    st = h.getModelStatus()
    info = h.getInfo()
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_sol else None
    obj = float(info.objective_function_value) if has_sol else None
    is_mip = bool(model.integrality.any())
    bound = float(info.mip_dual_bound) if is_mip else obj
    if st == S.kOptimal:
        status, msg = "optimal", ""
        if not is_mip:
            bound = obj
    elif st == S.kTimeLimit:
        status, msg = "time_limit", f"time limit {time_limit_s:g} s reached"
    elif st in (S.kInfeasible, S.kUnboundedOrInfeasible):
        status, msg, x, obj = "infeasible", "HiGHS: model infeasible", None, None
    elif st == S.kUnbounded:
        status, msg = "unbounded", "HiGHS: model unbounded"
    else:
        status, msg = ("time_limit" if has_sol else "error"), f"HiGHS: {h.modelStatusToString(st)}"
    if bound is not None and not np.isfinite(bound):
        bound = None
    gap = 0.0 if status == "optimal" and not is_mip else relative_gap(obj, bound)
    if status == "optimal" and is_mip:
        gap = float(info.mip_gap) if np.isfinite(info.mip_gap) else gap
    return SolveResult(
        status=status,
        objective=obj,
        bound=bound,
        gap=gap,
        x=x,
        wall_s=wall,
        backend=BACKEND,
        message=msg,
        nodes=int(info.mip_node_count) if is_mip else 0,
    )
