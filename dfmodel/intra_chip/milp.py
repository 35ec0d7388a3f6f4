"""The intra-chip partitioning MILP in the tight prefix form of DESIGN.md section 5.

Variables (P partitions, n kernels in topological order):

- ``z[k,p]`` binary, 1 iff kernel k runs in partitions ``0..p``; ``z[k,P-1] = 1``,
  ``z[k,p] <= z[k,p+1]``, and ``z[v,p] <= z[u,p]`` for every edge u->v. The assignment is the
  expression ``A[k,p] = z[k,p] - z[k,p-1]`` (no variable needed);
- ``B[t,p]`` (internal, the AND) for a tensor with one consumer v: ``B <= A[u,p]``,
  ``B <= A[v,p]``. Every use of B rewards a larger value (it saves DRAM traffic, SRAM and
  DRAM lifetime), so the third AND inequality ``B >= A[u]+A[v]-1`` is implied at any optimum
  and left out; leaving/entering (C, two linear halves) are the expressions ``A[u,p] - B``
  and ``A[v,p] - B``. Tensors read by several kernels (deduplicated per name) get their own
  ``enter >= A[v,p] - A[u,p]``, ``leave >= A[u,p] - A[v,p]``, ``internal >= A[u,p]+A[v,p]-1``;
- lifetimes (D), only when DRAM could bind: ``L[t,p] >= z[u,p] - z[v,p-1] - B[t,p]``;
- weights shared by several kernels: ``W[w,p] >= A[k,p]`` (read once per partition);
- ``used[p]`` = some kernel is not in partitions ``< p``: ``used[p] >= 1 - z[s,p-1]`` for every
  sink s; symmetry breaking: ``sum_k A[k,p] >= used[p]`` (used partitions come first, no empty
  partition in the middle);
- option choice ``y[p,o]`` binary over the options ``o = (f_o, mode_o)`` of
  :attr:`CostModel.options` (tile fraction, resident or streamed weights), ``sum_o y[p,o] =
  used[p]``; SRAM ``f_o X[p] + c_o F[p] <= SRAM + M_o (1 - y[p,o])`` with ``c_o = 1``
  (resident) or ``phi`` (streamed) and ``M_o`` the largest possible excess;
- streamed re-reads ``E[p] >= 0``: ``E[p] >= (1/f_o - 1) Q[p] - (1/f_o - 1) Q_max (1 - y[p,o])``
  for every streamed option with ``f_o < 1``, ``Q[p]`` the partition's weight bytes (read once
  per weight, as in the memory term) plus twice the accumulator bytes its kernels produce;
- ``time[p] >= compute[p], memory[p] + E[p], network[p]`` (or their sum without overlap).

Options that can never be the fastest fitting one are left out, which does not change the
optimum: past the first tile at which an option's SRAM always fits, smaller tiles of that mode
only cost more; ``(1, resident)`` when streaming is allowed (``(1, streamed)`` has the same time
and needs less SRAM); and every streamed option when no weight or accumulator exists.

Objective: ``sum_p time[p] + kernel_overhead * sum_p used[p] + tile_overhead * sum y/f``.
All linear. Units: microseconds and MiB (DESIGN.md section 3).

The sum-of-max objective has a weak LP bound (the relaxation spreads every kernel thinly over
all partitions, so no tensor ever crosses a boundary and every weight is read once). Two
families of valid inequalities make HiGHS prove the GPT-3 layer in seconds:

- capacity separations (:func:`separations`): if the kernels on the paths from u to v cannot
  share a partition, then ``z[v,p] <= z[u,p-1]``; their tensors cross (``B = 0``), shared
  weights and tensors are read once per separated reader, and ``z`` is fixed where chains of
  separations force it;
- no mergeable neighbours (:meth:`CostModel.max_useful_partitions`): when merging two
  consecutive partitions that fit never costs more, some optimal plan has none, so
  ``U(p-1) + U(p) >= used[p]`` (additive SRAM charges over the capacity, plus kernel counts over
  the tiles), which also caps the partitions worth modelling.

>>> from dfmodel.graph.build import build_graphs
>>> from dfmodel.intra_chip.cost import CostModel
>>> from dfmodel.intra_chip.ideals import solve_dp
>>> from dfmodel.system import load_system
>>> cm = CostModel(build_graphs("tiny_mlp").layer, load_system("sn30"))
>>> out = solve_milp(cm, max_partitions=4)
>>> out.status, abs(out.objective_s - solve_dp(cm)[1]) <= 1e-6 * out.objective_s   # the DP is the oracle
('optimal', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from dfmodel.intra_chip.cost import CostModel
from dfmodel.solvers import MILPModel, SolveResult, solve

US = 1e6  # microseconds per second
MIB = float(2**20)  # bytes per MiB


class _Builder:
    """Columns and rows collected as numpy blocks, assembled once into a :class:`MILPModel`."""

    def __init__(self, P: int):
        self.P = P
        self.ncols = 0
        self.lb: list[np.ndarray] = []
        self.ub: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.cost: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.nrows = 0

    def var(self, shape, lb=0.0, ub=1.0, integer=False, cost=0.0) -> np.ndarray:
        size = int(np.prod(shape))
        idx = np.arange(self.ncols, self.ncols + size).reshape(shape)
        self.ncols += size
        self.lb.append(np.broadcast_to(np.asarray(lb, float), (size,)).copy())
        self.ub.append(np.broadcast_to(np.asarray(ub, float), (size,)).copy())
        self.integer.append(np.full(size, bool(integer)))
        self.cost.append(np.broadcast_to(np.asarray(cost, float), (size,)).copy())
        return idx

    def rows_p(self, terms: list[tuple[np.ndarray, np.ndarray | float]], lo, hi, *, skip_first: bool = False) -> None:
        """One row per partition: ``lo[p] <= sum_terms coef[p] * x[cols[p]] <= hi[p]``.

        ``cols[p] = -1`` marks an absent term (e.g. ``z[k,-1]``); ``skip_first`` leaves out the
        row of partition 0 (where it would be trivial).
        """
        P = self.P
        first = 1 if skip_first else 0
        r = np.full(P, -1)
        r[first:] = np.arange(self.nrows, self.nrows + P - first)
        for cols, coef in terms:
            cols = np.asarray(cols)
            coef = np.broadcast_to(np.asarray(coef, float), (P,))
            m = (cols >= 0) & (coef != 0) & (r >= 0)
            self.rows.append(r[m])
            self.cols.append(cols[m])
            self.vals.append(coef[m])
        self.row_lo.extend(np.broadcast_to(np.asarray(lo, float), (P,))[first:])
        self.row_hi.extend(np.broadcast_to(np.asarray(hi, float), (P,))[first:])
        self.nrows += P - first

    def row(self, cols: np.ndarray, coefs, lo: float, hi: float) -> None:
        """One row over the given columns."""
        cols = np.asarray(cols).ravel()
        self.rows.append(np.full(cols.size, self.nrows))
        self.cols.append(cols)
        self.vals.append(np.broadcast_to(np.asarray(coefs, float), cols.shape).copy())
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        self.nrows += 1

    def model(self, name: str) -> MILPModel:
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, int)
        cols = np.concatenate(self.cols) if self.cols else np.zeros(0, int)
        vals = np.concatenate(self.vals) if self.vals else np.zeros(0)
        A = sp.csr_matrix((vals, (rows, cols)), shape=(self.nrows, self.ncols))
        A.sum_duplicates()
        A.eliminate_zeros()  # cancelled terms (e.g. +z -z): explicit zeros upset some presolvers
        return MILPModel(
            c=np.concatenate(self.cost),
            A=A,
            row_lo=np.array(self.row_lo, float),
            row_hi=np.array(self.row_hi, float),
            lb=np.concatenate(self.lb),
            ub=np.concatenate(self.ub),
            integrality=np.concatenate(self.integer),
            name=name,
        )


def _shift(cols: np.ndarray) -> np.ndarray:
    """``out[p] = cols[p-1]`` and ``out[0] = -1`` (absent): the previous partition's column."""
    out = np.empty_like(cols)
    out[0] = -1
    out[1:] = cols[:-1]
    return out


@dataclass
class Formulation:
    """A built model and the column blocks needed to warm-start and decode it."""

    model: MILPModel
    P: int
    z: np.ndarray  # (n, P) column indices
    used: np.ndarray  # (P,)
    y: np.ndarray | None  # (P, options) or None when the option is fixed
    options: tuple[tuple[float, bool], ...]  # (tile fraction, streamed) the model chooses from
    stats: dict = field(default_factory=dict)


def build(cm: CostModel, max_partitions: int | None = None) -> Formulation:
    """The MILP for ``cm`` with at most ``max_partitions`` partitions (default: one per kernel).

    Kernel-by-kernel chips get exactly one kernel per partition (``P = n``): their objective is
    then a constant and only DRAM lifetimes constrain the order.
    """
    n = cm.n
    P = n if (max_partitions is None or not cm.dataflow) else max(1, min(max_partitions, n))
    m_max = cm.max_useful_partitions()
    if m_max is not None:  # some optimal plan has no more partitions (see CostModel)
        P = min(P, m_max)
    b = _Builder(P)

    # prefix variables. z[k,p] = 1 is forced where a later partition is impossible: with used
    # partitions first, k sits at most after the n - 1 - (#descendants) other kernels, and at
    # least `height` separated partitions must follow it; z[k,p] = 0 where `depth` separated
    # partitions must precede it
    ndesc = [d.bit_count() for d in _descendants(cm)]
    sep = separations(cm)
    z = b.var((n, P), integer=True)
    lbz, ubz = np.zeros((n, P)), np.ones((n, P))
    lbz[:, P - 1] = 1.0
    for k in range(n):
        lbz[k, max(0, min(n - 1 - ndesc[k], P - 1 - sep.height[k])) :] = 1.0
        ubz[k, : min(sep.depth[k], P)] = 0.0
    b.lb[-1], b.ub[-1] = lbz.ravel(), ubz.ravel()

    def A(k):  # assignment A[k,p] = z[k,p] - z[k,p-1] as expression terms
        return [(z[k], 1.0), (_shift(z[k]), -1.0)]

    def neg(terms):
        return [(c, -np.asarray(v, float)) for c, v in terms]

    # precedence and monotonicity
    for k in range(n):
        if P > 1:
            b.rows_p([(z[k], 1.0), (_shift(z[k]), -1.0)], 0.0, np.inf, skip_first=True)  # z[k,p] >= z[k,p-1]
    edges = sorted({(t.producer, v) for t in cm.tensors if t.producer >= 0 for v in t.consumers})
    for u, v in edges:
        if not sep.strict[u, v]:
            b.rows_p([(z[u], 1.0), (z[v], -1.0)], 0.0, np.inf)  # z[v,p] <= z[u,p]
    for u, v in sep.minimal:  # v strictly after u: z[v,p] <= z[u,p-1]
        b.rows_p([(_shift(z[u]), 1.0), (z[v], -1.0)], 0.0, np.inf)

    # used partitions first
    ko = cm.kernel_overhead_s * US if cm.dataflow else 0.0
    used_block = len(b.cost)
    used = b.var((P,), lb=np.r_[1.0, np.zeros(P - 1)], cost=ko)
    for s in cm.sinks:
        b.rows_p([(used, 1.0), (_shift(z[s]), 1.0)], 1.0, np.inf, skip_first=True)
    all_A = [term for k in range(n) for term in A(k)]
    b.rows_p(all_A + [(used, -1.0)], 0.0, np.inf)  # sum_k A[k,p] >= used[p]
    if m_max is not None and P > 1:
        # restrict to plans where no two consecutive partitions could be merged (one of them is
        # optimal): their additive SRAM charges or kernel counts exceed the chip's
        u = cm.additive_sram_bytes() / cm.sram_bytes + 1.0 / cm.tiles
        pair = [(c, u[k] * w) for k in range(n) for c, w in A(k)]
        pair += [(_shift(c), u[k] * w) for k in range(n) for c, w in A(k)]  # A[k,p-1]
        b.rows_p(pair + [(used, -1.0)], 0.0, np.inf, skip_first=True)

    stats = {"P": P, "max_useful_partitions": m_max, "separated_pairs": int(sep.strict.sum()), "separation_rows": len(sep.minimal)}
    if not cm.dataflow:
        # one kernel per partition; each kernel costs its stand-alone time wherever it runs
        b.rows_p(all_A, -np.inf, 1.0)
        offset = float(np.sum(cm.singleton_time_s()) * US)
        if cm.dram_check:
            _lifetimes(b, cm, z, lambda t, j: None, P)
        f = b.model("intra_chip_kbk")
        f.offset = offset
        return Formulation(f, P, z, used, None, ((1.0, False),), stats)

    # -- per-tensor terms: memory expression pieces and SRAM pieces ----------------------------
    tpb = cm.s_per_byte * US  # microseconds per byte of DRAM traffic
    mem_terms: list = []  # microseconds
    X_terms: list = []  # SRAM at tile fraction 1 that scales with the tile (MiB)
    F_terms: list = []  # SRAM that does not (MiB)
    Q_terms: list = []  # bytes re-read per extra row tile when streamed (MiB)
    X_max = F_max = Q_max = 0.0
    B_of: dict[tuple[int, int], np.ndarray] = {}  # (tensor idx, consumer) -> B columns
    for ti, t in enumerate(cm.tensors):
        u, V, by = t.producer, t.consumers, t.bytes
        mib = by / MIB
        if u < 0:  # graph input: read by the partitions holding a consumer
            if len(V) == 1:
                enter = A(V[0])
            else:
                e = b.var((P,))
                for v in V:
                    b.rows_p([(e, 1.0)] + neg(A(v)), 0.0, np.inf)
                enter = [(e, 1.0)]
                b.row(e, 1.0, float(sep.chain(V)), np.inf)  # read once per separated reader
            leave, internal = [], []
        elif not V:  # graph output only
            enter, leave, internal = [], A(u), []
        elif len(V) == 1:
            v = V[0]
            bt = b.var((P,), ub=0.0 if sep.strict[u, v] else 1.0)
            B_of[(ti, v)] = bt
            b.rows_p([(bt, 1.0)] + neg(A(u)), -np.inf, 0.0)
            b.rows_p([(bt, 1.0)] + neg(A(v)), -np.inf, 0.0)
            enter = A(v) + [(bt, -1.0)]
            leave = A(u) if t.is_output else A(u) + [(bt, -1.0)]
            internal = [(bt, 1.0)]
        else:
            e = b.var((P,))
            for v in V:
                b.rows_p([(e, 1.0)] + neg(A(v)) + A(u), 0.0, np.inf)
            enter = [(e, 1.0)]
            far = [v for v in V if sep.strict[u, v]]
            if far:  # read from DRAM by every separated consumer's partition
                b.row(e, 1.0, float(sep.chain(far)), np.inf)
            if t.is_output:
                leave = A(u)
            else:
                lv = b.var((P,))
                for v in V:
                    b.rows_p([(lv, 1.0)] + neg(A(u)) + A(v), 0.0, np.inf)
                leave = [(lv, 1.0)]
                if far:  # written to DRAM once
                    b.row(lv, 1.0, 1.0, np.inf)
            it = b.var((P,), ub=0.0 if len(far) == len(V) else 1.0)
            for v in V:
                b.rows_p([(it, 1.0)] + neg(A(u)) + neg(A(v)), -1.0, np.inf)
            internal = [(it, 1.0)]
        mem_terms += [(c, tpb * by * np.asarray(w, float)) for c, w in enter + leave]
        if t.row_scaled:
            X_terms += [(c, mib * np.asarray(w, float)) for c, w in internal]
            X_terms += [(c, 2 * mib * np.asarray(w, float)) for c, w in enter + leave]
            # internal + 2 enter + 2 leave <= 3 (enter and leave exclude each other); a tensor
            # with one consumer and no graph output is either internal or crossing: <= 2
            X_max += (2 if len(V) == 1 and not t.is_output else 3) * mib
        else:
            touch = b.var((P,))
            for k in ([u] if u >= 0 else []) + list(V):
                b.rows_p([(touch, 1.0)] + neg(A(k)), 0.0, np.inf)
            F_terms.append((touch, mib))
            F_max += mib
            Q_terms += [(c, 2 * mib * np.asarray(w, float)) for c, w in A(u)]  # produced here: read + write
            Q_max += 2 * mib
    for w in cm.weights:
        if len(w.kernels) == 1:
            wt = A(w.kernels[0])
        else:
            wv = b.var((P,))
            for k in w.kernels:
                b.rows_p([(wv, 1.0)] + neg(A(k)), 0.0, np.inf)
            wt = [(wv, 1.0)]
            b.row(wv, 1.0, float(sep.chain(w.kernels)), np.inf)  # read once per separated reader
        mem_terms += [(c, tpb * w.bytes * np.asarray(x, float)) for c, x in wt]
        F_terms += [(c, w.bytes / MIB * np.asarray(x, float)) for c, x in wt]
        Q_terms += [(c, w.bytes / MIB * np.asarray(x, float)) for c, x in wt]
        F_max += w.bytes / MIB
        Q_max += w.bytes / MIB
    for k in range(n):
        if cm.extra_bytes[k]:
            mem_terms += [(c, tpb * cm.extra_bytes[k] * w) for c, w in A(k)]

    # -- time per partition ------------------------------------------------------------------------
    # -- option choice: tile fraction and resident/streamed weights --------------------------------
    sram = cm.sram_bytes / MIB
    options: list[tuple[float, bool]] = []
    modes = (False, True) if (cm.streaming and F_max > 0) else (False,)
    for s_ in modes:
        c_s = cm.phi if s_ else 1.0
        for f in cm.fractions:
            if not (s_ is False and True in modes and f == 1.0):  # dominated by (1, streamed)
                options.append((f, s_))
            if f * X_max + c_s * F_max <= sram:  # this tile always fits: smaller ones never pay off
                break
    tpm = tpb * MIB  # microseconds per MiB of DRAM traffic
    E = None
    if any(s_ and f < 1.0 for f, s_ in options):
        E = b.var((P,), lb=0.0, ub=np.inf)
        mem_terms.append((E, 1.0))

    time = b.var((P,), lb=0.0, ub=np.inf, cost=1.0)
    comp = [(c, cm.compute_s[k] * US * w) for k in range(n) for c, w in A(k)]
    net = [(c, cm.network_s[k] * US * w) for k in range(n) for c, w in A(k) if cm.network_s[k]]
    if cm.overlap:
        b.rows_p([(time, 1.0)] + neg(comp), 0.0, np.inf)
        b.rows_p([(time, 1.0)] + neg(mem_terms), 0.0, np.inf)
        if net:
            b.rows_p([(time, 1.0)] + neg(net), 0.0, np.inf)
    else:
        b.rows_p([(time, 1.0)] + neg(comp) + neg(mem_terms) + neg(net), 0.0, np.inf)
    # a partition's kernels each need a compute tile
    if n > cm.tiles:
        b.rows_p(all_A, -np.inf, float(cm.tiles))

    # -- SRAM, streamed re-reads and the option choice -------------------------------------------
    tau = cm.tile_overhead_s * US
    y = None

    def sram_row(f, s_, relax):
        c_s = cm.phi if s_ else 1.0
        M = max(0.0, f * X_max + c_s * F_max - sram)
        if M == 0.0:
            return
        terms = [(c, f * np.asarray(w, float)) for c, w in X_terms] + [(c, c_s * np.asarray(w, float)) for c, w in F_terms]
        if relax is None:
            b.rows_p(terms, -np.inf, sram)
        else:
            b.rows_p(terms + [(relax, M)], -np.inf, sram + M)

    def stream_row(f, s_, relax):
        if not s_ or f >= 1.0:
            return
        k = 1.0 / f - 1.0
        terms = [(E, 1.0)] + [(c, -k * tpm * np.asarray(w, float)) for c, w in Q_terms]
        if relax is None:
            b.rows_p(terms, 0.0, np.inf)
        else:
            M = k * tpm * Q_max
            b.rows_p(terms + [(relax, -M)], -M, np.inf)

    if len(options) == 1:
        f, s_ = options[0]
        b.cost[used_block] = b.cost[used_block] + tau / f  # one option: a fixed cost per partition
        sram_row(f, s_, None)
        stream_row(f, s_, None)
    else:
        J = len(options)
        y = b.var((P, J), integer=True, cost=np.tile([tau / f for f, _ in options], P))
        b.rows_p([(y[:, j], 1.0) for j in range(J)] + [(used, -1.0)], 0.0, 0.0)
        for j, (f, s_) in enumerate(options):
            sram_row(f, s_, y[:, j])
            stream_row(f, s_, y[:, j])

    if cm.dram_check:
        _lifetimes(b, cm, z, lambda ti, v: B_of.get((ti, v)), P)

    stats.update(options=len(options))
    return Formulation(b.model("intra_chip"), P, z, used, y, tuple(options), stats)


def _lifetimes(b: _Builder, cm: CostModel, z: np.ndarray, B_of, P: int) -> None:
    """D: bytes live in DRAM during each partition plus all weights fit the DRAM capacity."""
    live_terms = []
    for ti, t in enumerate(cm.tensors):
        if t.producer < 0 or not t.consumers:
            continue
        u = t.producer
        lt = b.var((P,))
        for v in t.consumers:
            bt = B_of(ti, v)
            if bt is None and cm.dataflow:
                # several consumers: B for this edge (only upper bounds: a larger B is better)
                bt = b.var((P,))
                for k in (u, v):
                    b.rows_p([(bt, 1.0), (z[k], -1.0), (_shift(z[k]), 1.0)], -np.inf, 0.0)
            terms = [(lt, 1.0), (z[u], -1.0), (_shift(z[v]), 1.0)]
            if bt is not None:
                terms.append((bt, 1.0))
            b.rows_p(terms, 0.0, np.inf)  # L >= z[u,p] - z[v,p-1] - B[p]
        live_terms.append((lt, t.bytes / MIB))
    cap = (cm.dram_bytes - cm.all_weight_bytes) / MIB
    b.rows_p(live_terms, -np.inf, cap)


def _descendants(cm: CostModel) -> list[int]:
    """Bitmask of every kernel's descendants."""
    desc = [0] * cm.n
    for k in range(cm.n - 1, -1, -1):
        m = 0
        for s in cm.successors[k]:
            m |= (1 << s) | desc[s]
        desc[k] = m
    return desc


@dataclass
class Separations:
    """Pairs of kernels that can never share a partition, from capacity alone.

    If u reaches v, a partition holding both holds every kernel on a path between them
    (partitions are convex), so if that interval cannot fit (:meth:`CostModel.must_split`:
    more kernels than tiles, or more weights and weight-gradient accumulators than SRAM at any
    tile) then v runs in a strictly later partition than u. These valid inequalities cut off the
    relaxation's favourite trick of spreading every kernel thinly over all partitions.
    """

    strict: np.ndarray  # strict[u, v]: v runs in a later partition than u
    minimal: list[tuple[int, int]]  # strict pairs not implied by others and precedence
    depth: np.ndarray  # longest chain of strict pairs ending at k (partitions before k)
    height: np.ndarray  # longest chain starting at k (partitions after k)

    def chain(self, ks) -> int:
        """Longest chain of mutually strict kernels among ``ks`` (>= 1 if non-empty)."""
        ks = sorted(ks)
        best = {}
        for i, k in enumerate(ks):
            best[k] = 1 + max((best[j] for j in ks[:i] if self.strict[j, k]), default=0)
        return max(best.values(), default=0)


def separations(cm: CostModel) -> Separations:
    n = cm.n
    desc = _descendants(cm)
    reach = np.array([[(desc[u] >> v) & 1 for v in range(n)] for u in range(n)], dtype=bool).reshape(n, n)
    strict = np.zeros((n, n), dtype=bool)
    us, vs = np.nonzero(reach)
    if us.size and cm.dataflow:
        eye = np.eye(n, dtype=bool)
        hulls = (reach | eye)[us] & (reach | eye).T[vs]  # kernels on some path from u to v
        strict[us, vs] = cm.must_split(hulls)
    adj = np.zeros((n, n), dtype=np.int64)
    for u in range(n):
        adj[u, cm.successors[u]] = 1
    si = strict.astype(np.int64)
    # (u, v) is implied by (s, v) for a successor s of u, or by (u, q) for a producer q of v
    implied = ((adj @ si) > 0) | ((si @ adj) > 0)
    minimal = [(int(u), int(v)) for u, v in zip(*np.nonzero(strict & ~implied))]
    depth = np.zeros(n, dtype=int)
    for k in range(n):  # topological order
        before = np.flatnonzero(strict[:k, k])
        depth[k] = depth[before].max() + 1 if before.size else 0
    height = np.zeros(n, dtype=int)
    for k in range(n - 1, -1, -1):
        after = np.flatnonzero(strict[k, k + 1 :]) + k + 1
        height[k] = height[after].max() + 1 if after.size else 0
    return Separations(strict, minimal, depth, height)


def warm_start(form: Formulation, cm: CostModel, plan: list[list[str]]) -> np.ndarray | None:
    """Start vector (integer entries; continuous ones NaN, completed by the solver layer)."""
    if len(plan) > form.P:
        return None
    x = np.full(form.model.num_vars, np.nan)
    part = {k: p for p, ks in enumerate(plan) for k in ks}
    for k, name in enumerate(cm.names):
        x[form.z[k]] = (np.arange(form.P) >= part[name]).astype(float)
    if form.y is not None:
        # each partition takes the fastest of the model's options that fits (the cost model's
        # choice, or one as fast when the model left that option out as dominated)
        x[form.y.ravel()] = 0.0
        S, _ = cm.plan_matrices(plan)
        times, fits, _ = cm.option_table(cm._terms(S))
        cols = [cm.options.index(o) for o in form.options]
        masked = np.where(fits[:, cols], times[:, cols], np.inf)
        for p in range(S.shape[0]):
            j = int(np.argmin(masked[p]))
            if not np.isfinite(masked[p, j]):
                return None
            x[form.y[p, j]] = 1.0
    return x


def decode(form: Formulation, cm: CostModel, x: np.ndarray) -> list[list[str]]:
    """Partition sequence (kernel names, empty partitions dropped) from a solution vector."""
    zv = x[form.z] > 0.5
    first = np.argmax(zv, axis=1)
    plan = []
    for p in range(form.P):
        ks = [cm.names[k] for k in range(cm.n) if first[k] == p]
        if ks:
            plan.append(ks)
    return plan


@dataclass
class MilpOutcome:
    """Result of the MILP: the plan (None if none found), its model objective and proof."""

    plan: list[list[str]] | None
    objective_s: float | None
    bound_s: float | None
    status: str
    gap: float | None
    backend: str
    wall_s: float
    message: str
    solve: SolveResult | None = None
    stats: dict = field(default_factory=dict)


def solve_milp(
    cm: CostModel,
    max_partitions: int | None = None,
    *,
    start: list[list[str]] | None = None,
    solver: str = "auto",
    time_limit_s: float | None = None,
    mip_gap: float = 1e-6,
) -> MilpOutcome:
    """Build, warm-start (with ``start`` when it has at most P partitions) and solve the MILP.

    An infeasible model comes back with ``status="infeasible"`` and a one-line reason.
    """
    form = build(cm, max_partitions)
    if start is not None:
        if form.stats.get("max_useful_partitions") is not None:
            start = cm.merge_adjacent(start)  # the model only admits plans that cannot merge
        form.model.warm_start = warm_start(form, cm, start)
    res = solve(form.model, solver, time_limit_s=time_limit_s, mip_gap=mip_gap)
    stats = dict(form.stats, **res.extra)
    if res.status == "infeasible":
        return MilpOutcome(None, None, None, "infeasible", None, res.backend, res.wall_s,
                           cm.infeasibility_reason(form.P if max_partitions is not None else None), res, stats)
    if res.x is None:
        return MilpOutcome(None, None, _s(res.bound), res.status, None, res.backend, res.wall_s, res.message, res, stats)
    plan = decode(form, cm, res.x)
    return MilpOutcome(plan, res.objective / US, _s(res.bound), res.status, res.gap, res.backend, res.wall_s,
                       res.message, res, stats)


def _s(v: float | None) -> float | None:
    return None if v is None else v / US
