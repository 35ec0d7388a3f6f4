"""Exact minimisation of a sum of unary and pairwise terms over small finite domains.

``minimise(domains, unary, pairs)`` finds ``x`` minimising
``sum_i unary[i][x_i] + sum_(i,j) pairs[i, j][x_i, x_j]`` (``inf`` marks a forbidden value or
pair) by variable elimination (bucket elimination, Dechter 1999): eliminate one variable at a
time, replacing the terms that mention it by their minimum over it, then read the argmins back.
The cost is exponential only in the induced width of the elimination order, which the greedy
min-weight order keeps small on layer graphs (chains of kernels with a few skip connections).
When a table would exceed ``max_table`` entries it raises :class:`TooLarge` and the caller
falls back to a MILP.

Ties go to the lowest index (``numpy.argmin``), so callers list preferred values first.

>>> import numpy as np
>>> # x0 in {0,1}, x1 in {0,1,2}: pay 1 unless x1 == x0 + 1
>>> cost = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
>>> x, v = minimise([2, 3], [np.array([0.0, 0.5]), np.zeros(3)], {(0, 1): cost})
>>> x, v
([0, 1], 0.0)
"""

from __future__ import annotations

import math

import numpy as np

from dfmodel.algorithms import TooLarge

#: largest table (entries) one elimination step may build before giving up
DEFAULT_MAX_TABLE = 1 << 16


def _aligned(vars_: tuple[int, ...], table: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """``table`` over ``vars_`` with its axes moved to their places in ``order`` (others size 1)."""
    pos = sorted(range(len(vars_)), key=lambda a: order.index(vars_[a]))
    t = np.transpose(table, pos) if pos != list(range(len(vars_))) else table
    shape = [1] * len(order)
    for v in vars_:
        shape[order.index(v)] = table.shape[vars_.index(v)]
    return t.reshape(shape)


def minimise(domains: list[int], unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
             *, max_table: int = DEFAULT_MAX_TABLE) -> tuple[list[int], float]:
    """Optimal assignment (index per variable) and its value (``inf``: nothing feasible)."""
    n = len(domains)
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((i,), np.asarray(unary[i], float)) for i in range(n)]
    for (i, j), t in pairs.items():
        if i == j:
            raise ValueError("a pairwise term needs two distinct variables")
        factors.append(((i, j), np.asarray(t, float)))
    constant = 0.0
    alive = set(range(n))
    trail: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    while alive:
        nbrs = {v: set() for v in alive}
        for vs, _ in factors:
            for v in vs:
                nbrs[v].update(vs)
        # min-weight greedy order: the variable whose elimination builds the smallest table
        x = min(alive, key=lambda v: (math.prod(domains[u] for u in nbrs[v]), v))
        rest = tuple(sorted(nbrs[x] - {x}))
        order = rest + (x,)
        size = math.prod(domains[u] for u in order)
        if size > max_table:
            raise TooLarge(f"elimination table of {size} entries (> {max_table})")
        joint = np.zeros([domains[u] for u in order])
        kept = []
        for vs, t in factors:
            if x in vs:
                joint = joint + _aligned(vs, t, order)
            else:
                kept.append((vs, t))
        arg = np.argmin(joint, axis=-1)
        low = np.take_along_axis(joint, arg[..., None], axis=-1)[..., 0]
        trail.append((x, rest, arg))
        if rest:
            kept.append((rest, low))
        else:
            constant += float(low)
        factors = kept
        alive.discard(x)
    assignment = [0] * n
    for x, rest, arg in reversed(trail):
        assignment[x] = int(arg[tuple(assignment[u] for u in rest)]) if rest else int(arg)
    return assignment, constant
