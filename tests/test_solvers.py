"""The uniform solver interface: both back-ends agree, statuses, warm starts, licence logic."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import dfmodel.solvers as solvers
from dfmodel.errors import SolverError
from dfmodel.solvers import MILPModel, choose_backend, gurobi_licence, solve
from dfmodel.solvers import gurobi as grb
from dfmodel.solvers.model import eliminate_fixed

HAS_GUROBI = gurobi_licence()[0] != "none"
BACKENDS = ["highs"] + (["gurobi"] if HAS_GUROBI else [])


def knapsack(n=30, seed=0, **kw) -> MILPModel:
    """max value s.t. weight <= cap, written as a minimisation."""
    rng = np.random.default_rng(seed)
    value, weight = rng.integers(5, 50, n).astype(float), rng.integers(3, 30, n).astype(float)
    return MILPModel(c=-value, A=sp.csr_matrix(weight[None, :]), row_lo=np.array([-np.inf]),
                     row_hi=np.array([weight.sum() / 3]), lb=np.zeros(n), ub=np.ones(n),
                     integrality=np.ones(n, dtype=bool), **kw)


def assignment(n=6, seed=1) -> MILPModel:
    """n x n assignment with a ranged row and an equality block (integral LP, exercises all senses)."""
    rng = np.random.default_rng(seed)
    cost = rng.random((n, n)) * 10
    rows, cols = [], []
    for i in range(n):
        rows += [i] * n
        cols += [i * n + j for j in range(n)]
    for j in range(n):
        rows += [n + j] * n
        cols += [i * n + j for i in range(n)]
    A = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(2 * n, n * n))
    A = sp.vstack([A, sp.csr_matrix(np.ones((1, n * n)))])
    lo = np.r_[np.ones(2 * n), n - 0.5]
    hi = np.r_[np.ones(n), np.full(n, np.inf), n + 0.5]
    return MILPModel(c=cost.ravel(), A=A, row_lo=lo, row_hi=hi, lb=np.zeros(n * n), ub=np.ones(n * n),
                     integrality=np.ones(n * n, dtype=bool), offset=1.5)


@pytest.mark.parametrize("make", [knapsack, assignment, lambda: knapsack(40, seed=3)])
def test_backends_agree_on_fixed_models(make):
    results = [solve(make(), b) for b in BACKENDS]
    for r in results:
        assert r.status == "optimal" and r.proven_optimal and r.gap <= 1e-6
        assert make().max_violation(r.x) < 1e-6
        assert make().objective(r.x) == pytest.approx(r.objective)
    assert len({round(r.objective, 6) for r in results}) == 1
    assert {r.backend for r in results} == set(BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_model(backend):
    m = knapsack(5)
    m.row_lo[0] = m.row_hi[0] + 1  # weight >= cap + 1 and <= cap
    r = solve(m, backend)
    assert r.status == "infeasible" and r.x is None and r.objective is None and "infeasible" in r.message


def test_time_limit_reports_gap():
    m = knapsack(400, seed=7)
    # a hard-ish instance with a tiny budget: either proven already or stopped with a gap
    r = solve(m, "highs", time_limit_s=0.01, mip_gap=0.0)
    assert r.status in ("optimal", "time_limit")
    if r.status == "time_limit" and r.objective is not None:
        assert r.bound <= r.objective + 1e-9 and r.gap is not None and r.gap >= 0


def test_partial_warm_start_is_completed():
    m = assignment()
    best = solve(m, "highs")
    start = np.full(m.num_vars, np.nan)
    start[m.integrality] = np.round(best.x[m.integrality])
    m.warm_start = start
    full = solvers.complete_warm_start(m)
    assert full is not None and m.max_violation(full) < 1e-9
    assert solve(m, "highs").objective == pytest.approx(best.objective)


def test_fixed_columns_are_eliminated():
    m = knapsack(10)
    m.lb[:3] = m.ub[:3] = 1.0
    red, keep, values = eliminate_fixed(m)
    assert red.num_vars == 7 and keep.sum() == 7
    r = solve(m, "highs")
    assert np.all(r.x[:3] == 1.0) and r.extra["num_vars"] == 7
    # everything fixed: no back-end call, the constant model is checked directly
    m.lb[:] = m.ub[:] = 0.0
    assert solve(m, "highs").status == "optimal"


def test_auto_choice_follows_the_licence(monkeypatch):
    small, big = knapsack(10), knapsack(2500)
    monkeypatch.setattr(grb, "licence", lambda: ("none", "no licence"))
    assert choose_backend(small) == "highs"
    with pytest.raises(SolverError, match="unavailable"):
        choose_backend(small, "gurobi")
    monkeypatch.setattr(grb, "licence", lambda: ("limited", "size-limited licence"))
    assert choose_backend(small) == "gurobi" and choose_backend(big) == "highs"
    with pytest.raises(SolverError, match="2500 variables"):
        choose_backend(big, "gurobi")
    monkeypatch.setattr(grb, "licence", lambda: ("full", ""))
    assert choose_backend(big) == "gurobi"
    assert choose_backend(big, "highs") == "highs"
    with pytest.raises(SolverError, match="unknown solver"):
        choose_backend(small, "cplex")


def test_limited_licence_counts_ranged_rows_twice():
    m = assignment(n=3)
    assert grb.constraint_count(m) == m.num_rows + 1


@pytest.mark.skipif(gurobi_licence()[0] != "limited", reason="needs the pip size-limited licence")
def test_size_limited_licence_is_detected_and_honoured():
    assert choose_backend(knapsack(2001)) == "highs"
    assert solve(knapsack(50), "auto").backend == "gurobi"


def test_bad_models_are_rejected():
    with pytest.raises(ValueError, match="finite"):
        MILPModel(c=np.array([np.inf]), A=sp.csr_matrix((0, 1)), row_lo=np.zeros(0), row_hi=np.zeros(0),
                  lb=np.zeros(1), ub=np.ones(1), integrality=np.zeros(1, bool))
    with pytest.raises(ValueError, match="shape"):
        MILPModel(c=np.zeros(2), A=sp.csr_matrix((1, 2)), row_lo=np.zeros(2), row_hi=np.zeros(1),
                  lb=np.zeros(2), ub=np.ones(2), integrality=np.zeros(2, bool))
