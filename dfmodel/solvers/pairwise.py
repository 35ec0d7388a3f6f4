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
from functools import lru_cache

import numpy as np

from dfmodel.algorithms import TooLarge

#: largest table (entries) one elimination step may build before giving up
DEFAULT_MAX_TABLE = 1 << 16


def _placement(vars_: tuple[int, ...], order: tuple[int, ...], domains: tuple[int, ...]):
    """How a table over ``vars_`` lines up with ``order``: its axis permutation and the shape
    (size 1 for the variables it lacks) it broadcasts as."""
    perm = tuple(sorted(range(len(vars_)), key=lambda a: order.index(vars_[a])))
    shape = tuple(domains[u] if u in vars_ else 1 for u in order)
    return (None if perm == tuple(range(len(vars_))) else perm), shape


@lru_cache(maxsize=512)
def _schedule(domains: tuple[int, ...], scopes: tuple[tuple[int, ...], ...], max_table: int):
    """The elimination order and the bookkeeping of every step, for tables of these shapes.

    Depends only on the domain sizes and the scopes of the terms, so the many problems of one
    shape (a layer at every micro-batch and placement) plan it once. Each step: the variable
    ``x``, the variables ``rest`` of the table it leaves, which current terms it consumes (their
    ids: the terms' positions in ``scopes``, then ``len(scopes) + k`` for the table step ``k``
    leaves) with their axis permutations and broadcast shapes, and the joint table shape.
    """
    live = dict(enumerate(scopes))  # id -> scope, in creation order
    alive = set(range(len(domains)))
    steps = []
    while alive:
        nbrs = {v: set() for v in alive}
        for vs in live.values():
            for v in vs:
                nbrs[v].update(vs)
        # min-weight greedy order: the variable whose elimination builds the smallest table
        x = min(alive, key=lambda v: (math.prod(domains[u] for u in nbrs[v]), v))
        rest = tuple(sorted(nbrs[x] - {x}))
        order = rest + (x,)
        size = math.prod(domains[u] for u in order)
        if size > max_table:
            raise TooLarge(f"elimination table of {size} entries (> {max_table})")
        taken = tuple(i for i, vs in live.items() if x in vs)
        places = tuple(_placement(live[i], order, domains) for i in taken)
        for i in taken:
            del live[i]
        if rest:
            live[len(scopes) + len(steps)] = rest
        steps.append((x, rest, taken, places, tuple(domains[u] for u in order)))
        alive.discard(x)
    return tuple(steps)


def minimise(domains: list[int], unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
             *, max_table: int = DEFAULT_MAX_TABLE) -> tuple[list[int], float]:
    """Optimal assignment (index per variable) and its value (``inf``: nothing feasible)."""
    n = len(domains)
    if any(i == j for i, j in pairs):
        raise ValueError("a pairwise term needs two distinct variables")
    scopes = tuple((i,) for i in range(n)) + tuple(pairs)
    tables = dict(enumerate([np.asarray(u, float) for u in unary] + [np.asarray(t, float) for t in pairs.values()]))
    steps = _schedule(tuple(domains), scopes, max_table)
    constant = 0.0
    trail = []
    for k, (x, rest, taken, places, shape) in enumerate(steps):
        joint = None  # (the taken tables span ``order``: their broadcast sum has the joint shape)
        for i, (perm, bshape) in zip(taken, places):
            t = tables.pop(i)
            t = (t if perm is None else np.transpose(t, perm)).reshape(bshape)
            joint = t if joint is None else joint + t
        if joint.shape != shape:  # (never on schedules of pairwise terms: kept for safety)
            joint = np.broadcast_to(joint, shape)
        arg = np.argmin(joint, axis=-1)
        low = joint.min(axis=-1)  # (the value at ``arg``: min is exact)
        trail.append((x, rest, arg))
        if rest:
            tables[len(scopes) + k] = low
        else:
            constant += float(low)
    assignment = [0] * n
    for x, rest, arg in reversed(trail):
        assignment[x] = int(arg[tuple(assignment[u] for u in rest)]) if rest else int(arg)
    return assignment, constant
