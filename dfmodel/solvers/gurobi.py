"""Gurobi adapter (gurobipy >= 13, extra ``gurobi``), matrix API only.

The pip wheel carries a size-limited licence (at most 2000 variables and 2000 constraints;
beyond that ``optimize()`` raises GurobiError 10010, DESIGN.md section 6). :func:`licence`
probes which licence is present once per process.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import scipy.sparse as sp

from dfmodel.solvers.model import MILPModel, SolveResult, relative_gap

BACKEND = "gurobi"
#: Limits of the size-limited pip licence (variables, constraints of all kinds together).
LIMITED_MAX_VARS = 2000
LIMITED_MAX_CONSTRS = 2000


@functools.lru_cache(maxsize=1)
def licence() -> tuple[str, str]:
    """``(kind, reason)`` with kind ``"full"``, ``"limited"`` or ``"none"``; cached per process.

    Optimising an empty 2001-variable model is the cheapest probe: error 10010 means the
    size-limited licence, no error a full one; 10009 (expired) or any other error, no licence.
    """
    try:
        import gurobipy as gp
    except ImportError:
        return "none", "gurobipy is not installed (pip install 'dfmodel[gurobi]')"
    try:
        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
            m.addMVar(LIMITED_MAX_VARS + 1)
            m.optimize()
        return "full", ""
    except gp.GurobiError as e:  # licence errors come as GurobiError with an errno
        if e.errno == 10010:
            return "limited", (
                f"size-limited Gurobi licence: at most {LIMITED_MAX_VARS} variables and "
                f"{LIMITED_MAX_CONSTRS} constraints"
            )
        return "none", f"no usable Gurobi licence (error {e.errno}: {e})"


def constraint_count(model: MILPModel) -> int:
    """Constraints Gurobi sees: ranged rows are loaded as two inequalities."""
    return model.num_rows + model.num_ranged_rows


def fits_limited(model: MILPModel) -> bool:
    return model.num_vars <= LIMITED_MAX_VARS and constraint_count(model) <= LIMITED_MAX_CONSTRS


def solve(model: MILPModel, *, time_limit_s: float | None, mip_gap: float, threads: int | None = None) -> SolveResult:
    """Solve ``model`` with Gurobi; see :func:`dfmodel.solvers.solve` for the contract."""
    import gurobipy as gp
    from gurobipy import GRB

    t0 = time.perf_counter()
    A = sp.csr_matrix(model.A)
    lo, hi = model.row_lo, model.row_hi
    eq = np.isfinite(lo) & np.isfinite(hi) & (lo == hi)
    has_lo = np.isfinite(lo) & ~eq
    has_hi = np.isfinite(hi) & ~eq
    # one block per sense; a ranged row appears in both the >= and the <= block
    blocks = [(np.flatnonzero(eq), "=", lo), (np.flatnonzero(has_lo), ">", lo), (np.flatnonzero(has_hi), "<", hi)]
    with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(model.name, env=env) as m:
        vtype = np.where(model.integrality, GRB.INTEGER, GRB.CONTINUOUS)
        binary = model.integrality & (model.lb >= 0) & (model.ub <= 1)
        vtype = np.where(binary, GRB.BINARY, vtype)
        x = m.addMVar(
            model.num_vars,
            lb=np.where(np.isfinite(model.lb), model.lb, -GRB.INFINITY),
            ub=np.where(np.isfinite(model.ub), model.ub, GRB.INFINITY),
            obj=model.c,
            vtype=vtype,
        )
        m.ObjCon = float(model.offset)
        for rows, sense, rhs in blocks:
            if rows.size:
                m.addMConstr(A[rows], x, np.full(rows.size, sense), rhs[rows])
        m.Params.MIPGap = float(mip_gap)
        m.Params.Seed = 0
        if time_limit_s is not None:
            m.Params.TimeLimit = float(time_limit_s)
        if threads is not None:
            m.Params.Threads = int(threads)
        if model.warm_start is not None:
            start = np.where(np.isfinite(model.warm_start), model.warm_start, GRB.UNDEFINED)
            x.Start = start
        m.optimize()
        wall = time.perf_counter() - t0
        st = m.Status
        has_sol = m.SolCount > 0
        xv = np.asarray(x.X, dtype=float) if has_sol else None
        obj = float(m.ObjVal) if has_sol else None
        is_mip = bool(model.integrality.any())
        bound = float(m.ObjBound) if is_mip else obj
        if st == GRB.OPTIMAL:
            status, msg = "optimal", ""
        elif st == GRB.TIME_LIMIT:
            status, msg = "time_limit", f"time limit {time_limit_s:g} s reached"
        elif st in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
            status, msg, xv, obj = "infeasible", "Gurobi: model infeasible", None, None
        elif st == GRB.UNBOUNDED:
            status, msg = "unbounded", "Gurobi: model unbounded"
        else:
            status, msg = ("time_limit" if has_sol else "error"), f"Gurobi: status {st}"
        if bound is not None and not np.isfinite(bound):
            bound = None
        gap = relative_gap(obj, bound)
        if status == "optimal" and is_mip and has_sol:
            gap = float(m.MIPGap)
        nodes = int(m.NodeCount) if is_mip else 0
    return SolveResult(status, obj, bound, gap, xv, wall, BACKEND, msg, nodes)
