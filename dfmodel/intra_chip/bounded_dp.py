"""Exact intra-chip partitioning over the ideal lattice, pruned by an additive floor.

:func:`dfmodel.intra_chip.ideals.solve_dp` costs every pair of ideals ``I < J`` (partition
``J - I``). An MoE layer's backward on a TP group (DeepSeek-V3 at TP 4/8: 42-47 kernels,
13,000-22,000 ideals) has tens of millions of such pairs, so it went to the MILP, which took
7-27 CPU s per layer on sn30/wse2 and sometimes stopped with a 99 % gap at the call's time limit
although the optimum is one or a few partitions.

This is the same shortest path, settled ideal-size by ideal-size, that only expands an ideal
``I`` when ``dist(I) + h(I)`` can still beat the best plan known, and only costs a pair when
``dist(I) + floor(J - I) + h(J)`` can. ``floor(S)`` (:func:`floor_s`) is a true lower bound of
any partition containing exactly ``S``, and ``h(I) = floor(V - I)`` a true lower bound of any
plan of the kernels still to run: every term of a partition's time (:meth:`CostModel.evaluate`)
is at least an additive quantity (compute and network seconds per kernel, extra bytes per
kernel, a weight's bytes once in whichever partition reads it, a tensor crossing the set's
boundary once, one kernel overhead and one tile overhead per partition), and ``sum_j max(a_j, b_j) >= max(sum a_j, sum b_j)``. Pruning with a
true bound against a plan actually found never drops a strictly better plan, so the result is
the DP optimum (equal cost; among equal-cost plans it may pick another than the full DP).
"""

from __future__ import annotations

import numpy as np

from dfmodel.algorithms import TooLarge
from dfmodel.intra_chip.cost import CostModel, combine_times
from dfmodel.intra_chip.ideals import Lattice, _pack
from dfmodel.solvers.deadline import check as check_deadline

#: relative slack of the pruning test (costs are sums of floats: a plan equal to the bound
#: must not be pruned by rounding)
_SLACK = 1e-9
_CHUNK = 65_536


def floor_s(cm: CostModel, S: np.ndarray) -> np.ndarray:
    """Lower bound of the time of any sequence of partitions covering exactly each row of ``S``
    (dataflow chips), and so of one partition ``S``: ``S``'s compute, network and DRAM bytes as
    one resident partition at the largest tile (:meth:`CostModel._terms`), combined as the chip
    combines them, plus one partition's overheads. 0 for an empty row.

    Why it is below every plan of ``S`` split into parts: compute, network and extra bytes are
    sums over kernels; a weight read in ``S`` is read by at least one part; a tensor entering
    ``S`` (producer outside, a consumer inside) enters the first part holding a consumer, and one
    leaving ``S`` (a consumer or the graph output outside) leaves the part holding its producer;
    streaming and smaller tiles only add time; and ``sum_j max(a_j, b_j) >= max(sum_j a_j, ...)``.
    """
    S = np.asarray(S, dtype=bool)
    ev = cm._terms(S)
    t = combine_times(ev["compute_s"], ev["memory_s"], ev["network_s"], cm.overlap)
    t = t + cm.kernel_overhead_s + cm.tile_overhead_s
    return np.where(ev["count"] > 0, t, 0.0)


def solve_bounded(
    cm: CostModel, lat: Lattice, incumbent: tuple[list[list[str]], float] | None, *, max_pairs: int
) -> tuple[list[list[str]], float] | None:
    """Optimal plan over ``lat`` (all ideals: exact) without a partition-count limit; ``incumbent``
    a feasible plan and its time (or None). Returns the incumbent when nothing beats it, None
    when no plan fits. TooLarge when more than ``max_pairs`` pairs survive the floors."""
    if not cm.dataflow:
        raise ValueError("solve_bounded is for dataflow chips")
    bits, N, n = lat.bits, lat.size, cm.n
    if N == 1:
        return [], 0.0
    packed = _pack(bits)
    sizes = bits.sum(axis=1)
    starts = np.searchsorted(sizes, np.arange(n + 2))
    h = floor_s(cm, ~bits)
    ub = incumbent[1] if incumbent is not None else np.inf
    dist = np.full(N, np.inf)
    dist[0] = 0.0
    pred = np.full(N, -1, dtype=np.int64)
    seen = 0
    for s in range(n):
        layer = np.arange(starts[s], starts[s + 1])
        layer = layer[dist[layer] + h[layer] <= ub * (1 + _SLACK)]
        if layer.size == 0:
            continue
        src, dst = _supersets(packed, starts, layer, s, min(n, s + cm.tiles))
        sets = bits[dst] & ~bits[src]
        keep = dist[src] + floor_s(cm, sets) + h[dst] <= ub * (1 + _SLACK)
        src, dst, sets = src[keep], dst[keep], sets[keep]
        seen += src.size
        if seen > max_pairs:
            raise TooLarge(f"more than {max_pairs} (ideal, superset) pairs above the floor")
        for a in range(0, src.size, _CHUNK):
            check_deadline()
            sl = slice(a, a + _CHUNK)
            _relax(cm, bits, dist, pred, src[sl], dst[sl], sets[sl])
        ub = min(ub, dist[N - 1])
    if not np.isfinite(dist[N - 1]) or (incumbent is not None and dist[N - 1] >= incumbent[1]):
        return incumbent
    return _walk(cm, bits, pred, N - 1), float(dist[N - 1])


def _supersets(packed: np.ndarray, starts: np.ndarray, layer: np.ndarray, s: int, top: int):
    """(src, dst) of every ideal ``J`` strictly above each ideal of ``layer`` (all of size
    ``s``) with at most ``top`` kernels."""
    lo, hi = starts[s + 1], starts[top + 1]
    src_l, dst_l = [], []
    for k, i in enumerate(layer):
        if k % 256 == 0:
            check_deadline()
        js = np.flatnonzero(np.all((packed[i] & ~packed[lo:hi]) == 0, axis=1)) + lo
        src_l.append(np.full(js.size, i, dtype=np.int64))
        dst_l.append(js)
    return np.concatenate(src_l), np.concatenate(dst_l)


def _relax(cm: CostModel, bits, dist, pred, src, dst, sets) -> None:
    """Cost partitions ``sets`` (``dst - src``) and lower ``dist[dst]`` through them."""
    if src.size == 0:
        return
    ev = cm.evaluate(sets)
    ok = ev["feasible"]
    if cm.dram_check:  # lifetimes depend on the pair, not only on the set
        ok &= cm.dram_fits(cm.live_bytes(bits[src], bits[dst]))
    cand = np.where(ok, dist[src] + np.nan_to_num(ev["time_s"], nan=np.inf), np.inf)
    old = dist.copy()
    np.minimum.at(dist, dst, cand)
    won = (cand < old[dst]) & (cand == dist[dst])
    pred[dst[won]] = src[won]


def _walk(cm: CostModel, bits, pred, full: int) -> list[list[str]]:
    chain = [full]
    while chain[-1] != 0:
        chain.append(int(pred[chain[-1]]))
    chain.reverse()
    return [[cm.names[int(k)] for k in np.flatnonzero(bits[b] & ~bits[a])] for a, b in zip(chain, chain[1:])]
