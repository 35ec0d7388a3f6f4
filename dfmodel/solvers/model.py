"""Backend-neutral mixed-integer linear programs and solve results.

A :class:`MILPModel` is plain numpy/scipy data, built once (in blocks, no per-element modelling
layer) and handed unchanged to any back-end adapter (:mod:`dfmodel.solvers.highs`,
:mod:`dfmodel.solvers.gurobi`)::

    minimise  c @ x + offset
    s.t.      row_lo <= A @ x <= row_hi,   lb <= x <= ub,   x[j] integer where integrality[j]

Infinite row or column bounds are ``numpy.inf`` (a bound, never a coefficient: coefficients
must be finite and are expected to be scaled into roughly [1e-6, 1e7], DESIGN.md section 3).

>>> import numpy as np, scipy.sparse as sp
>>> m = MILPModel(c=np.array([1.0, 1.0]), A=sp.csr_matrix([[1.0, 2.0]]),
...               row_lo=np.array([3.0]), row_hi=np.array([np.inf]),
...               lb=np.zeros(2), ub=np.full(2, 10.0), integrality=np.array([True, True]))
>>> m.num_vars, m.num_rows
(2, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

#: Statuses a :class:`SolveResult` can carry.
STATUSES = ("optimal", "time_limit", "infeasible", "unbounded", "error")


@dataclass
class MILPModel:
    """A minimisation MILP in matrix form (see module docstring)."""

    c: np.ndarray
    A: sp.spmatrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    offset: float = 0.0
    names: list[str] | None = None
    warm_start: np.ndarray | None = None  # full or partial (NaN = unknown) start vector
    name: str = "milp"

    def __post_init__(self) -> None:
        self.c = np.asarray(self.c, dtype=float)
        n = self.c.shape[0]
        self.A = sp.csr_matrix(self.A, dtype=float)
        self.A.sum_duplicates()
        self.A.eliminate_zeros()  # explicit zeros are noise, and HiGHS's presolve mishandled them
        if self.A.shape[1] != n:
            raise ValueError(f"A has {self.A.shape[1]} columns, c has {n}")
        self.row_lo = np.asarray(self.row_lo, dtype=float)
        self.row_hi = np.asarray(self.row_hi, dtype=float)
        self.lb = np.asarray(self.lb, dtype=float)
        self.ub = np.asarray(self.ub, dtype=float)
        self.integrality = np.asarray(self.integrality, dtype=bool)
        for arr, size, what in (
            (self.row_lo, self.A.shape[0], "row_lo"),
            (self.row_hi, self.A.shape[0], "row_hi"),
            (self.lb, n, "lb"),
            (self.ub, n, "ub"),
            (self.integrality, n, "integrality"),
        ):
            if arr.shape != (size,):
                raise ValueError(f"{what} has shape {arr.shape}, expected ({size},)")
        if not (np.all(np.isfinite(self.c)) and np.all(np.isfinite(self.A.data))):
            raise ValueError("objective and matrix coefficients must be finite")
        if self.warm_start is not None:
            self.warm_start = np.asarray(self.warm_start, dtype=float)
            if self.warm_start.shape != (n,):
                raise ValueError(f"warm_start has shape {self.warm_start.shape}, expected ({n},)")

    @property
    def num_vars(self) -> int:
        return int(self.c.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.A.shape[0])

    @property
    def num_ranged_rows(self) -> int:
        """Rows with two distinct finite sides (a back-end without ranges needs two rows each)."""
        return int(np.sum(np.isfinite(self.row_lo) & np.isfinite(self.row_hi) & (self.row_lo < self.row_hi)))

    def objective(self, x: np.ndarray) -> float:
        return float(self.c @ x + self.offset)

    def max_violation(self, x: np.ndarray) -> float:
        """Largest violation of a row, bound or integrality by ``x`` (0 when feasible)."""
        ax = self.A @ x
        v = [
            np.max(self.row_lo - ax, initial=0.0),
            np.max(ax - self.row_hi, initial=0.0),
            np.max(self.lb - x, initial=0.0),
            np.max(x - self.ub, initial=0.0),
            np.max(np.abs(x[self.integrality] - np.round(x[self.integrality])), initial=0.0),
        ]
        return float(max(v))


@dataclass
class SolveResult:
    """What a back-end reports: proof status, incumbent, bound and relative gap.

    ``status`` is one of :data:`STATUSES`; ``objective``/``x`` are None when no solution was
    found; ``gap`` is ``|objective - bound| / max(|objective|, tiny)`` (0 when proven optimal).
    """

    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    x: np.ndarray | None
    wall_s: float
    backend: str
    message: str = ""
    nodes: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def proven_optimal(self) -> bool:
        return self.status == "optimal"

    @property
    def has_solution(self) -> bool:
        return self.x is not None


def relative_gap(objective: float | None, bound: float | None) -> float | None:
    """Relative gap between an incumbent and a lower bound, as both solvers define it."""
    if objective is None or bound is None or not np.isfinite(bound):
        return None
    return abs(objective - bound) / max(abs(objective), 1e-10)


def eliminate_fixed(model: MILPModel) -> tuple[MILPModel, np.ndarray, np.ndarray]:
    """Model without its fixed columns (``lb == ub``), plus ``(keep, values)`` to expand ``x``.

    Fixed columns are folded into the row bounds and the objective offset and empty rows are
    dropped: back-ends then see (and licences count) only real decisions.
    """
    fixed = np.isfinite(model.lb) & (model.lb == model.ub)
    if not fixed.any():
        return model, np.ones(model.num_vars, dtype=bool), model.lb.copy()
    keep = ~fixed
    A = sp.csc_matrix(model.A)
    shift = A[:, np.flatnonzero(fixed)] @ model.lb[fixed]
    A_keep = sp.csr_matrix(A[:, np.flatnonzero(keep)])
    A_keep.eliminate_zeros()
    nonempty = np.diff(A_keep.indptr) > 0
    lo = (model.row_lo - shift)[nonempty]
    hi = (model.row_hi - shift)[nonempty]
    empty_lo = (model.row_lo - shift)[~nonempty]
    empty_hi = (model.row_hi - shift)[~nonempty]
    if np.any(empty_lo > 1e-9) or np.any(empty_hi < -1e-9):
        # a row of constants only that fails: keep one infeasible row so the solver says so
        lo = np.append(lo, 1.0)
        hi = np.append(hi, np.inf)
        A_keep = sp.vstack([A_keep[nonempty], sp.csr_matrix((1, int(keep.sum())))]).tocsr()
    else:
        A_keep = A_keep[nonempty]
    ws = model.warm_start[keep] if model.warm_start is not None else None
    reduced = MILPModel(
        c=model.c[keep],
        A=A_keep,
        row_lo=lo,
        row_hi=hi,
        lb=model.lb[keep],
        ub=model.ub[keep],
        integrality=model.integrality[keep],
        offset=float(model.offset + model.c[fixed] @ model.lb[fixed]),
        names=[nm for nm, k in zip(model.names, keep) if k] if model.names else None,
        warm_start=ws,
        name=model.name,
    )
    return reduced, keep, model.lb.copy()
