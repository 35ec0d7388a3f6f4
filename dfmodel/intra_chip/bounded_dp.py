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
from dfmodel.intra_chip.cost import PACKED_MIN_ROWS, CostModel, combine_times
from dfmodel.intra_chip.ideals import Lattice, _pack, supersets_in
from dfmodel.intra_chip.packed import ChunkSum, Items, all_bits, any_bits, joined_items, pack_rows, unpack_fortran
from dfmodel.solvers.deadline import check as check_deadline

#: relative slack of the pruning test (costs are sums of floats: a plan equal to the bound
#: must not be pruned by rounding)
_SLACK = 1e-9
_CHUNK = 65_536


def floor_s(cm: CostModel, S: np.ndarray, terms: dict | None = None) -> np.ndarray:
    """Lower bound of the time of any sequence of partitions covering exactly each row of ``S``
    (dataflow chips), and so of one partition ``S``: the largest of :func:`additive_floor_s`,
    :func:`heavy_floor_s` and :func:`memory_floor_s`. 0 for an empty row. ``terms``:
    ``cm._terms(S)`` when already computed."""
    S = np.asarray(S, dtype=bool)
    return np.maximum(np.maximum(additive_floor_s(cm, S, terms), heavy_floor_s(cm, S)), memory_floor_s(cm, S))


def additive_floor_s(cm: CostModel, S: np.ndarray, terms: dict | None = None) -> np.ndarray:
    """``S``'s compute, network and DRAM bytes as one resident partition at the largest tile
    (:meth:`CostModel._terms`), combined as the chip combines them, plus one partition's
    overheads; 0 for an empty row.

    Why it is below every plan of ``S`` split into parts: compute, network and extra bytes are
    sums over kernels; a weight read in ``S`` is read by at least one part; a tensor entering
    ``S`` (producer outside, a consumer inside) enters the first part holding a consumer, and one
    leaving ``S`` (a consumer or the graph output outside) leaves the part holding its producer;
    streaming and smaller tiles only add time; and ``sum_j max(a_j, b_j) >= max(sum_j a_j, ...)``.
    ``terms``: ``cm._terms(S)`` when already computed.
    """
    ev = cm._terms(S) if terms is None else terms
    t = combine_times(ev["compute_s"], ev["memory_s"], ev["network_s"], cm.overlap)
    t = t + cm.kernel_overhead_s + cm.tile_overhead_s
    return np.where(ev["count"] > 0, t, 0.0)


def relaxed_floor_s(cm: CostModel, S: np.ndarray, outside: np.ndarray | None = None, ev: dict | None = None) -> np.ndarray:
    """Per row ``B`` of ``S``, a lower bound of the time of every partition that holds all of
    ``B`` and none of the kernels of the same row of ``outside`` (inf where none fits): the
    fastest option of :meth:`CostModel.option_table` for ``B`` with only what any such superset
    has at least -- its compute and network, its weights and extra bytes read, the tensors it
    certainly moves (:func:`certain_crossing`), its weights and accumulators as streamed bytes,
    SRAM ``f T_B + c F_B`` (``T_B`` the row-scaled bytes it touches, plus once more those it
    certainly moves: a crossing tensor is double-buffered, ``2 f`` bytes; ``F_B`` its weights
    and accumulators: a superset touches more, and a set's scaled SRAM is at least what it
    touches, see :meth:`CostModel.min_sram_bytes`). Every term of such a superset at every
    option is at least this one's and its options that fit are among these, so its fastest is
    no faster. ``ev``: ``_relaxed_terms(cm, S, outside)`` when already computed."""
    times, fits, _ = cm.option_table(_relaxed_terms(cm, S, outside) if ev is None else ev)
    return np.where(fits, times, np.inf).min(axis=1)


def relaxed_memory_floor_s(cm: CostModel, S: np.ndarray, outside: np.ndarray | None = None,
                           ev: dict | None = None) -> np.ndarray:
    """Per row ``B`` of ``S``, a lower bound of the DRAM seconds plus partition overheads of
    every partition holding ``B`` and none of ``outside`` (inf where none fits): the least over
    the options that fit the relaxed terms of :func:`relaxed_floor_s` (the same argument: a
    superset's option that fits fits here, and its bytes are at least these). A partition's
    time is at least this (its memory time is one of the terms ``combine_times`` takes).
    ``ev``: ``_relaxed_terms(cm, S, outside)`` when already computed."""
    ev = _relaxed_terms(cm, S, outside) if ev is None else ev
    _, fits, _ = cm.option_table(ev)
    out = np.full(S.shape[0], np.inf)
    for i, (f, streamed) in enumerate(cm.options):
        extra = (1.0 / f - 1.0) * ev["stream_bytes"] if streamed else 0.0
        t = (ev["memory_bytes"] + extra) * cm.s_per_byte + cm.kernel_overhead_s + cm.tile_overhead_s / f
        out = np.where(fits[:, i], np.minimum(out, t), out)
    return out


def _relaxed_terms(cm: CostModel, S: np.ndarray, outside: np.ndarray | None) -> dict[str, np.ndarray]:
    """``cm._terms(S)`` with only what every partition holding ``S`` and none of ``outside``
    has at least (see :func:`relaxed_floor_s`)."""
    ev = dict(cm._terms(S))
    weights_read = np.zeros(S.shape[0])
    support = S.any(axis=0)
    for w in cm.weights:
        if support[list(w.kernels)].any():  # (else it adds zeros: x + 0.0 is x)
            weights_read += w.bytes * S[:, list(w.kernels)].any(axis=1)
    moved_bytes, moved_scaled_bytes = certain_crossing(cm, S, outside)
    ev["memory_bytes"] = S.astype(float) @ cm.extra_bytes + weights_read + moved_bytes
    ev["memory_s"] = ev["memory_bytes"] * cm.s_per_byte
    ev["sram_scaled"] = ev["sram_touched"] + moved_scaled_bytes
    return ev


def certain_crossing(cm: CostModel, S: np.ndarray, outside: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, row-scaled bytes) per row of ``S`` of the tensors ``S`` touches that cross the
    boundary of every partition holding ``S`` and none of ``outside`` (rows of kernels known to
    run in other partitions; None: no such knowledge): a graph input or output, or a tensor
    with its producer or a consumer in ``outside``. Such a tensor enters (a consumer inside,
    the producer not) or leaves (the producer inside, a consumer or the output not), see
    :func:`~dfmodel.intra_chip.cost.tensor_boundary`: its bytes move once and, row-scaled, it
    takes ``2 f`` bytes of SRAM."""
    m = S.shape[0]
    moved, scaled = np.zeros(m), np.zeros(m)
    out = np.zeros_like(S, dtype=bool) if outside is None else np.asarray(outside, dtype=bool)
    support = S.any(axis=0)
    for t in cm.tensors:
        ends = _ends(t)
        if not support[ends].any():  # untouched by every row: it would add zeros (x + 0.0 is x)
            continue
        touched = S[:, ends].any(axis=1)
        certain = t.producer < 0 or t.is_output
        cross = touched & (certain | out[:, ends].any(axis=1))
        moved += t.bytes * cross
        if t.row_scaled:
            scaled += t.bytes * cross
    return moved, scaled


#: kernels (largest :func:`relaxed_floor_s` alone first) whose splits :func:`heavy_floor_s` tries
HEAVY_KERNELS = 8


def heavy_floor_s(cm: CostModel, S: np.ndarray) -> np.ndarray:
    """Lower bound of any plan covering each row of ``S``: its heavy kernels (the
    :data:`HEAVY_KERNELS` with the largest :func:`relaxed_floor_s` alone) lie in some parts,
    each part takes at least the relaxed floor of the heavy kernels it holds, so the plan takes
    at least the cheapest split of them into groups. An SRAM-bound kernel that must stream at a
    small row tile (an MoE expert GEMM whose weights exceed the SRAM: DeepSeek-V3 on sn30) is
    where this binds and :func:`additive_floor_s` is loose."""
    heavy, table, _ = _heavy_table(cm)
    if S.shape[0] == 0:
        return np.zeros(0)
    code = _heavy_codes(S, heavy)
    return table[code]


def memory_floor_s(cm: CostModel, S: np.ndarray) -> np.ndarray:
    """Lower bound of any plan covering each row of ``S``: DRAM seconds add up over the parts.
    The parts holding heavy kernels take at least the cheapest split of the heavy kernels of
    ``S`` into groups under :func:`relaxed_memory_floor_s` (which charges each group its
    weights, extra bytes, streamed re-reads and the tensors it certainly moves, and its
    overheads), and on top of that come bytes no group charges (:func:`light_bytes`). Where the
    light kernels' own traffic is a sizeable share of the time (small micro-batches) this is
    what binds: DeepSeek-V3's MoE backward at TP 8 on sn30, micro-batch 15: 0.129 -> 0.152 s
    against an optimum of 0.162 s."""
    heavy, _, table = _heavy_table(cm)
    if S.shape[0] == 0:
        return np.zeros(0)
    code = _heavy_codes(S, heavy)
    return table[code] + light_bytes(cm, S) * cm.s_per_byte


def light_bytes(cm: CostModel, S: np.ndarray) -> np.ndarray:
    """DRAM bytes every plan covering exactly a row of ``S`` moves and no heavy group of
    :func:`memory_floor_s` charges: the extra bytes of its light kernels, weights no heavy kernel
    reads (read once by some part), and tensors no heavy kernel touches that cross the part
    holding their end in ``S`` (a graph input or output, or one end outside ``S``)."""
    if S.shape[0] >= PACKED_MIN_ROWS and _light_chunks(cm) is not None:
        return _light_chunks(cm)(pack_rows(S))[0]
    extra, weights, tensors = _light_items(cm)
    S = np.asfortranarray(S, dtype=bool)  # column reads below are then contiguous
    out = np.zeros(S.shape[0])
    for k in np.flatnonzero(extra):
        out += extra[k] * S[:, k]
    for kernels, nbytes in weights:
        out += nbytes * _any(S, kernels)
    for ends, nbytes, certain in tensors:
        inside = _any(S, ends)
        out += nbytes * (inside if certain else inside & ~_all(S, ends))
    return out


def _light_items(cm: CostModel):
    """(extra bytes per kernel, zero at heavy ones; (readers, bytes) of the weights only light
    kernels read; (ends, bytes, crosses whatever the split) of the tensors only light kernels
    touch) for :func:`light_bytes`, computed once per cost model."""
    hit = cm.__dict__.get("_light_items")
    if hit is None:
        heavy, _, _ = _heavy_table(cm)
        light = np.ones(cm.n, dtype=bool)
        light[heavy] = False
        weights = [(list(w.kernels), w.bytes) for w in cm.weights if light[list(w.kernels)].all()]
        tensors = [(_ends(t), t.bytes, t.producer < 0 or t.is_output) for t in cm.tensors if light[_ends(t)].all()]
        hit = cm.__dict__["_light_items"] = (np.where(light, cm.extra_bytes, 0.0), weights, tensors)
    return hit


def _light_chunks(cm: CostModel) -> ChunkSum | None:
    """:func:`light_bytes` over 64-bit set masks by chunk tables (:mod:`.packed`; exact: its
    items are integer bytes), or None where :attr:`CostModel.packed_terms` is None."""
    if "_light_chunks" not in cm.__dict__:
        cm.__dict__["_light_chunks"] = ChunkSum(cm.n, *_light_mask_items(cm)) if cm.packed_terms is not None else None
    return cm.__dict__["_light_chunks"]


def _light_mask_items(cm: CostModel) -> Items:
    """(masks, evaluate) of the items :func:`light_bytes` sums, for a :class:`ChunkSum`."""
    extra, weights, tensors = _light_items(cm)
    items = [((1 << int(k)), float(extra[k]), "kernel") for k in np.flatnonzero(extra)]
    items += [(_mask(kernels), nbytes, "any") for kernels, nbytes in weights]
    items += [(_mask(ends), nbytes, "any" if certain else "cross") for ends, nbytes, certain in tensors]

    def evaluate(codes: np.ndarray, which: list[int]) -> np.ndarray:
        out = np.zeros((codes.size, 1))
        for i in which:
            mask, nbytes, kind = items[i]
            inside = any_bits(codes, mask)
            out[:, 0] += nbytes * (inside if kind != "cross" else inside & ~all_bits(codes, mask))
        return out

    return [it[0] for it in items], evaluate


def _floor_chunks(cm: CostModel) -> ChunkSum:
    """Chunk tables of (compute seconds, network seconds, memory bytes, :func:`light_bytes`)
    per set mask, for :meth:`_State._rough_floor` (the seconds rounded in another order)."""
    if "_floor_chunks" not in cm.__dict__:
        parts = [(cm.seconds_items(), [0, 1]), (cm.byte_items(), [2, 3, 4, 5, 6]), (_light_mask_items(cm), [7])]
        masks, evaluate = joined_items(parts, 8)
        cm.__dict__["_floor_chunks"] = ChunkSum(cm.n, masks, lambda codes, which: evaluate(codes, which)[:, [0, 1, 2, 7]])
    return cm.__dict__["_floor_chunks"]


#: relative margin within which :meth:`_State._within` decides on the exact floor: the rough one
#: is off by at most ``2 n u`` (< 1.5e-14 for 64 kernels) of the seconds' totals
_ROUGH_MARGIN = 1e-12


def _mask(kernels) -> int:
    return sum(1 << int(k) for k in set(kernels))


def _any(S: np.ndarray, cols: list[int]) -> np.ndarray:
    """Per row of ``S``, whether it holds any of the kernels ``cols``."""
    out = S[:, cols[0]].copy()
    for c in cols[1:]:
        out |= S[:, c]
    return out


def _all(S: np.ndarray, cols: list[int]) -> np.ndarray:
    """Per row of ``S``, whether it holds every kernel of ``cols``."""
    out = S[:, cols[0]].copy()
    for c in cols[1:]:
        out &= S[:, c]
    return out


def _heavy_codes(S: np.ndarray, heavy: np.ndarray) -> np.ndarray:
    """Per row of ``S``, the bitmask of the heavy kernels it holds (bit i: ``heavy[i]``), the
    index into the tables of :func:`_heavy_table`."""
    return S[:, heavy].astype(np.int64) @ (np.int64(1) << np.arange(heavy.size, dtype=np.int64))


def _ends(t) -> list[int]:
    """The kernels a tensor joins: its producer (none for a graph input) and its consumers."""
    return ([t.producer] if t.producer >= 0 else []) + list(t.consumers)


def _heavy_table(cm: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(heavy kernel indices, cheapest grouping floor of every subset of them by bitmask under
    :func:`relaxed_floor_s`, and under :func:`relaxed_memory_floor_s`)."""
    hit = cm.__dict__.get("_heavy_table")
    if hit is None:
        alone = relaxed_floor_s(cm, np.eye(cm.n, dtype=bool))
        heavy = np.argsort(-np.where(np.isfinite(alone), alone, np.inf), kind="stable")[: min(HEAVY_KERNELS, cm.n)]
        rows, outside = _heavy_groups(cm, heavy)
        ev = _relaxed_terms(cm, rows, outside)  # (both floors read the same terms)
        tables = (_cheapest_split(relaxed_floor_s(cm, rows, outside, ev)),
                  _cheapest_split(relaxed_memory_floor_s(cm, rows, outside, ev)))
        hit = cm.__dict__["_heavy_table"] = (heavy, *tables)
    return hit


def _heavy_groups(cm: CostModel, heavy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every group of the heavy kernels, by bitmask, as kernel rows; per group the other heavy
    kernels, which run in other parts) for the grouping tables."""
    m = heavy.size
    rows = np.zeros((1 << m, cm.n), dtype=bool)
    rows[:, heavy] = (np.arange(1 << m)[:, None] >> np.arange(m)) & 1
    outside = np.zeros_like(rows)
    outside[:, heavy] = ~rows[:, heavy]
    return rows, outside


def expand_heavy_table(cm: CostModel) -> None:
    """Tighten the time table of :func:`_heavy_table` (and so :func:`heavy_floor_s` and
    :func:`floor_s` from now on) to groups under :func:`expanded_floor_s`. Costs ~0.1 CPU s on a
    45-kernel graph, so :func:`solve_bounded` asks for it only after a first pass that the
    plain floors did not settle (on wse2 DeepSeek-V3's MoE layers settle in one pass of one pair)."""
    heavy, _, memory = _heavy_table(cm)
    if cm.__dict__.get("_heavy_expanded"):
        return
    rows, outside = _heavy_groups(cm, heavy)
    cm.__dict__["_heavy_table"] = (heavy, _cheapest_split(expanded_floor_s(cm, rows, outside)), memory)
    cm.__dict__["_heavy_expanded"] = True


#: neighbours of a group whose in-or-out choices :func:`expanded_floor_s` enumerates per step
#: (at most ``2 ** EXPAND_NEIGHBOURS`` cases a step), the steps, and the cases per group at most:
#: on DeepSeek-V3's MoE backward at TP 8 on sn30 (8 heavy kernels, 256 groups) 4/2/64 gives a
#: floor within 0.03 % of 8/3/1024's in 0.1 CPU s (against 2.9 s)
EXPAND_NEIGHBOURS = 4
EXPAND_DEPTH = 2
EXPAND_ROWS = 64


def expanded_floor_s(cm: CostModel, S: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """Per row ``B`` of ``S``, a lower bound of every partition holding ``B`` and none of the same
    row of ``outside``, at least :func:`relaxed_floor_s`: the least relaxed floor over the ways
    such a partition ``P`` can treat ``B``'s undecided neighbours ``N`` (kernels sharing a tensor
    with ``B``, the :data:`EXPAND_NEIGHBOURS` sharing the most bytes): ``P`` holds some ``N'`` of
    them and none of the rest, so ``P`` holds ``B | N'`` and none of ``outside | (N - N')``; and
    so on for the neighbours of ``B | N'``, :data:`EXPAND_DEPTH` times (while a row's cases stay
    within :data:`EXPAND_ROWS`).

    Why it binds: a tensor between ``B`` and a neighbour is either a crossing (DRAM bytes, a
    double buffer) or internal, and then the neighbour's own tensors are touched too; the relaxed
    floor alone assumes the cheaper of both for every tensor at once. DeepSeek-V3's MoE backward
    at TP 8 on sn30: ``bwd.fc2`` (1.75 GiB of expert weights, streamed) 0.40 -> 0.78 s alone,
    against 0.81 s in the optimum's partition."""
    B, O = np.asarray(S, dtype=bool), np.asarray(outside, dtype=bool)
    root = np.arange(B.shape[0])
    if B.shape[0] == 0:
        return np.zeros(0)
    adjacent = _adjacency_bytes(cm)
    for _ in range(EXPAND_DEPTH):
        B, O, root = _expand_step(B, O, root, adjacent, S.shape[0])
    lb = relaxed_floor_s(cm, B, O)
    out = np.full(S.shape[0], np.inf)
    np.minimum.at(out, root, lb)
    return out


def _expand_step(B: np.ndarray, O: np.ndarray, root: np.ndarray, adjacent: np.ndarray, roots: int):
    """One step of :func:`expanded_floor_s`: each row ``r`` becomes ``2**k`` rows, one per
    in-or-out choice of its ``k`` undecided neighbours sharing the most bytes (ties: lower
    index), ``k`` at most :data:`EXPAND_NEIGHBOURS` and less while its root's rows would pass
    :data:`EXPAND_ROWS`; the rows of ``r`` in the order of the choices' bitmasks."""
    shared = _shared_bytes(B, adjacent)
    shared[B | O] = 0.0
    cases = np.bincount(root, minlength=roots)[root]
    k = np.minimum(EXPAND_NEIGHBOURS, (shared > 0).sum(axis=1))
    for _ in range(EXPAND_NEIGHBOURS):
        k = np.where((k > 0) & ((cases << k) > EXPAND_ROWS), k - 1, k)
    nb = np.argsort(-shared, axis=1, kind="stable")[:, :EXPAND_NEIGHBOURS]
    parent = np.repeat(np.arange(B.shape[0]), 1 << k)
    choice = np.arange(parent.size) - np.repeat(np.cumsum(1 << k) - (1 << k), 1 << k)
    B, O = B[parent], O[parent]
    for i in range(nb.shape[1]):
        rows = np.flatnonzero(i < k[parent])
        cols, bit = nb[parent[rows], i], ((choice[rows] >> i) & 1).astype(bool)
        B[rows, cols] |= bit
        O[rows, cols] |= ~bit
    return B, O, root[parent]


def _shared_bytes(B: np.ndarray, adjacent: np.ndarray) -> np.ndarray:
    """``B[r] @ adjacent`` per row: by one matrix product where the bytes are whole numbers (any
    order of addition is exact), else row by row as the first version added them."""
    if np.all(adjacent == np.round(adjacent)) and adjacent.sum() < 2.0**52:
        return B.astype(float) @ adjacent
    return np.array([row.astype(float) @ adjacent for row in B]).reshape(B.shape[0], adjacent.shape[1])


def _adjacency_bytes(cm: CostModel) -> np.ndarray:
    """``(n, n)``: bytes of the tensors each pair of kernels shares (0 on the diagonal)."""
    a = np.zeros((cm.n, cm.n))
    for t in cm.tensors:
        ends = _ends(t)
        for i in ends:
            for j in ends:
                if i != j:
                    a[i, j] += t.bytes
    return a


def _cheapest_split(group: np.ndarray) -> np.ndarray:
    """``g(T) = min over groups B of T holding T's lowest member of group[B] + g(T - B)`` for
    every bitmask ``T`` (``group`` indexed by bitmask). Settled by popcount: ``T - B`` has fewer
    members than ``T``, so its entry is final when ``T``'s level is taken, and a level is one
    gather, add and ``minimum.reduceat`` over its (T, B) pairs (:func:`_split_pairs`; the same
    sums as a loop over the pairs, and min is exact)."""
    table = np.zeros(group.size)
    for codes, starts, grp, rest in _split_pairs(group.size):
        table[codes] = np.minimum.reduceat(group[grp] + table[rest], starts)
    return table


_SPLIT_PAIRS: dict[int, list] = {}


def _split_pairs(size: int) -> list:
    """Per popcount level 1, 2, ... of the bitmasks below ``size`` (a power of two): (the level's
    codes ``T``, each code's first pair, and per pair ``(T, B)`` of :func:`_cheapest_split` the
    group ``B`` and the rest ``T - B``). Depends on the size alone: computed once."""
    hit = _SPLIT_PAIRS.get(size)
    if hit is None:
        by_level: dict[int, tuple[list, list, list, list]] = {}
        for code in range(1, size):
            codes, starts, grp, rest = by_level.setdefault(bin(code).count("1"), ([], [], [], []))
            low = code & -code
            others, sub = code ^ low, code ^ low
            codes.append(code)
            starts.append(len(grp))
            while True:  # every subset of the others, with the lowest member added
                grp.append(sub | low)
                rest.append(others ^ sub)
                if sub == 0:
                    break
                sub = (sub - 1) & others
        hit = _SPLIT_PAIRS[size] = [tuple(np.asarray(a, dtype=np.int64) for a in by_level[lv]) for lv in sorted(by_level)]
    return hit


def solve_bounded(
    cm: CostModel, lat: Lattice, incumbent: tuple[list[list[str]], float] | None, *, max_pairs: int
) -> tuple[list[list[str]], float] | None:
    """Optimal plan over ``lat`` (all ideals: exact) without a partition-count limit; ``incumbent``
    a feasible plan and its time (or None). Returns the incumbent when nothing beats it, None
    when no plan fits. TooLarge when more than ``max_pairs`` pairs survive the floors in all.

    Iterative deepening on the cutoff: a pass with cutoff ``U`` keeps every path whose floor is
    within ``U``, so it finds the optimum whenever the optimum is at most ``U``, and costs
    little when ``U`` is near the floor. The cutoff starts :data:`FIRST_SLACK` above the floor
    of the whole graph and its excess over the floor grows :data:`SLACK_GROWTH`-fold per pass
    until a pass finds a plan or reaches the incumbent's time (a loose incumbent keeps many
    more pairs: DeepSeek-V3's MoE backward at TP 8 on sn30 keeps 5.3 M pairs at its seed's
    time, 4 % above the optimum, and 1.0 M at 1 % above the floor)."""
    if not cm.dataflow:
        raise ValueError("solve_bounded is for dataflow chips")
    if lat.size == 1:
        return [], 0.0
    st = _State(cm, lat, max_pairs)
    best = incumbent[1] if incumbent is not None else np.inf
    floor = float(st.h(np.zeros(1, dtype=np.int64))[0])
    slack = FIRST_SLACK
    cutoff = floor * (1 + slack) if incumbent is not None else np.inf
    while True:
        bound = min(cutoff, best)
        found = st.search(bound)
        if found is not None and found[1] < best:
            if found[1] <= bound * (1 + _SLACK):
                return found  # no plan within the cutoff is cheaper, and none outside it is
            incumbent, best = found, found[1]  # a plan, but one beyond the cutoff: not proven
        if cutoff >= best:
            return incumbent
        if not cm.__dict__.get("_heavy_expanded"):  # not settled at once: tighter floors from here on
            expand_heavy_table(cm)
            seen, st = st.seen, _State(cm, lat, max_pairs)
            st.seen = seen
            floor = max(floor, float(st.h(np.zeros(1, dtype=np.int64))[0]))
        slack *= SLACK_GROWTH
        cutoff = floor * (1 + slack)
        if cutoff - floor >= (best - floor) / 2:  # a pass this close to the incumbent costs
            cutoff = best  # about as much as one at it, and may well fail


#: first cutoff of :func:`solve_bounded`, relative to the floor of the whole graph, and the
#: factor by which its excess over the floor grows after a pass that found no plan (0.1 %,
#: 0.2 %, 0.4 %, ...). The pairs kept grow steeply with the cutoff (DeepSeek-V3's MoE backward
#: at TP 8 on sn30, optimum 0.22 % above the expanded floor: 0.18 M pairs at 0.2 %, 2.3 M at
#: 0.4 %, 8.1 M at 1 %), so a cutoff that overshoots the optimum by a factor 5 costs more
#: than the small passes before it
FIRST_SLACK = 0.001
SLACK_GROWTH = 2.0


class _State:
    """The lattice's packed rows, sizes and floors, shared by the passes of one solve."""

    def __init__(self, cm: CostModel, lat: Lattice, max_pairs: int):
        self.cm, self.bits, self.max_pairs = cm, lat.bits, max_pairs
        self.packed = _pack(lat.bits)
        self.sizes = lat.bits.sum(axis=1)
        self.starts = np.searchsorted(self.sizes, np.arange(cm.n + 2))
        self._h = np.full(lat.size, np.nan)  # floor of the rest after each ideal, on demand
        heavy, self._table, self._memory_table = _heavy_table(cm)
        self._code = _heavy_codes(lat.bits, heavy)
        self._all = (1 << heavy.size) - 1
        #: the ideals as 64-bit masks, when the chunk tables apply (else sets go as boolean rows)
        self.masks = self.packed[:, 0] if cm.n <= 64 and cm.packed_terms is not None else None
        self._seconds_total = float(np.abs(cm.compute_s).sum() + np.abs(cm.network_s).sum())
        if not np.isfinite(self._seconds_total):
            self.masks = None
        self.seen = 0

    def h(self, idx: np.ndarray) -> np.ndarray:
        """:func:`floor_s` of the kernels after each ideal of ``idx`` (computed once per ideal)."""
        missing = np.unique(idx[np.isnan(self._h[idx])])
        if missing.size:
            if self.masks is None:
                self._h[missing] = floor_s(self.cm, ~self.bits[missing])
            else:
                rest = self.masks[missing] ^ np.uint64((1 << self.cm.n) - 1)
                self._h[missing] = self._floor(rest, self._all ^ self._code[missing])[0]
        return self._h[idx]

    def _floor(self, masks: np.ndarray, heavy_code: np.ndarray, many: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
        """(:func:`floor_s`, the sets as boolean rows, their terms) of the sets ``masks`` whose
        heavy kernels are ``heavy_code``: the same sums as :func:`floor_s` of them (the byte
        terms by the chunk tables, exact), or with ``many`` of a larger matrix holding them
        (:meth:`_terms`), without building the rows more than once."""
        cm = self.cm
        sets, terms = self._terms(masks, many)
        memory = self._memory_table[heavy_code] + _light_chunks(cm)(masks)[0] * cm.s_per_byte
        floor = np.maximum(np.maximum(additive_floor_s(cm, sets, terms), self._table[heavy_code]), memory)
        return floor, sets, terms

    def h_cheap(self, idx: np.ndarray) -> np.ndarray:
        """:func:`heavy_floor_s` of the kernels after each ideal (a table look-up, <= :meth:`h`)."""
        return self._table[self._all ^ self._code[idx]]

    def _terms(self, masks: np.ndarray, many: bool) -> tuple[np.ndarray, dict]:
        """(the sets ``masks`` as column-major boolean rows, their :meth:`CostModel._terms`).
        einsum adds the seconds of a column-major matrix of two or more rows kernel by kernel,
        and those of a single row as a dot product, in another order: ``many`` (the sets were
        picked from a larger matrix, whose sums the caller reproduces) pads a single row."""
        pad = many and masks.size == 1
        codes = np.append(masks, np.uint64(0)) if pad else masks
        sets = unpack_fortran(codes, self.cm.n)
        terms = self.cm.terms_of_codes(codes, sets)
        if pad:
            return sets[:1], {k: v[:1] for k, v in terms.items()}
        return sets, terms

    def _survivors(self, src, dst, heavy_code, dist, limit_s: float):
        """(src, dst, sets, terms) of the pairs whose ``dist + floor_s + h`` is within
        ``limit_s``, with the sets' rows and :meth:`CostModel._terms` (the floor's own terms)."""
        cm = self.cm
        if self.masks is None or not np.isfinite(limit_s) or src.size == 1:  # (one set: see _floor)
            sets = np.asfortranarray(self.bits[dst] & ~self.bits[src])  # column-major: _terms reads by kernel
            terms = cm._terms(sets)  # once: for the floor and for the cost of the survivors
            keep = dist[src] + floor_s(cm, sets, terms) + self.h(dst) <= limit_s
            return src[keep], dst[keep], sets[keep], {k: v[keep] for k, v in terms.items()}
        # the floor test below implies this one (floor_s >= the heavy table): the same survivors
        # out of a third of the sets (DeepSeek-V3 / sn30: 6.5 M of 19.6 M). h is asked for the
        # same ideals at the same time as the boolean path does: einsum sums a batch of one
        # rest in another order than a larger batch, so an ideal's h depends on its batch
        tight = dist[src] + self._table[heavy_code] + self.h(dst) <= limit_s
        src, dst, heavy_code = src[tight], dst[tight], heavy_code[tight]
        masks = self.masks[dst] & ~self.masks[src]
        keep = self._within(masks, heavy_code, dist[src], self.h(dst), limit_s)
        sets, terms = self._terms(masks[keep], many=True)  # most sets fail the floor: only the survivors' terms
        return src[keep], dst[keep], sets, terms

    def _within(self, masks, heavy_code, dist_s, h_s, limit_s: float) -> np.ndarray:
        """``dist_s + floor_s(masks) + h_s <= limit_s`` per set, exactly as :meth:`_floor` says,
        deciding most sets on :meth:`_rough_floor`: it differs from :func:`floor_s` only by the
        order in which compute and network seconds are added, below 2 n u of their totals
        (``u`` = 2**-53; Higham, Accuracy and Stability of Numerical Algorithms, sec. 4.2) plus a
        few roundings of a sum near ``limit_s``, far within :data:`_ROUGH_MARGIN`. Sets that
        close to the limit go through the exact floor."""
        lhs = dist_s + self._rough_floor(masks, heavy_code) + h_s
        margin = _ROUGH_MARGIN * (limit_s + self._seconds_total)
        keep = lhs <= limit_s - margin
        unsure = np.flatnonzero(~keep & (lhs <= limit_s + margin))
        if unsure.size:
            exact = self._floor(masks[unsure], heavy_code[unsure], many=True)[0]
            keep[unsure] = dist_s[unsure] + exact + h_s[unsure] <= limit_s
        return keep

    def _rough_floor(self, masks, heavy_code) -> np.ndarray:
        """:meth:`_floor` of the sets ``masks`` with compute and network seconds summed by chunk
        tables (another order of the same additions; the byte terms are exact)."""
        cm = self.cm
        compute_s, network_s, memory_bytes, light = _floor_chunks(cm)(masks)
        t = combine_times(compute_s, memory_bytes * cm.s_per_byte, network_s, cm.overlap)
        additive = np.where(masks != 0, t + cm.kernel_overhead_s + cm.tile_overhead_s, 0.0)
        memory = self._memory_table[heavy_code] + light * cm.s_per_byte
        return np.maximum(np.maximum(additive, self._table[heavy_code]), memory)

    def search(self, cutoff: float) -> tuple[list[list[str]], float] | None:
        """Cheapest plan among those whose every prefix's ``dist + h`` is within ``cutoff``
        (the optimum when it is at most ``cutoff``); None if no such plan."""
        cm, bits, n = self.cm, self.bits, self.cm.n
        N = bits.shape[0]
        dist = np.full(N, np.inf)
        dist[0] = 0.0
        pred = np.full(N, -1, dtype=np.int64)
        ub = cutoff
        for s in range(n):
            layer = np.arange(self.starts[s], self.starts[s + 1])
            layer = layer[np.isfinite(dist[layer])]
            layer = layer[dist[layer] + self.h(layer) <= ub * (1 + _SLACK)]
            if layer.size == 0:
                continue
            src, dst = _supersets(self.packed, self.starts, layer, s, min(n, s + cm.tiles))
            # cheap first: heavy_floor_s of dst - src, whose heavy kernels are dst's less src's
            heavy_code = self._code[dst] ^ self._code[src]
            keep = dist[src] + self._table[heavy_code] + self.h_cheap(dst) <= ub * (1 + _SLACK)
            src, dst, sets, terms = self._survivors(src[keep], dst[keep], heavy_code[keep], dist, ub * (1 + _SLACK))
            self.seen += src.size
            if self.seen > self.max_pairs:
                raise TooLarge(f"more than {self.max_pairs} (ideal, superset) pairs above the floor")
            for a in range(0, src.size, _CHUNK):
                check_deadline()
                sl = slice(a, a + _CHUNK)
                _relax(cm, bits, dist, pred, src[sl], dst[sl], sets[sl], {k: v[sl] for k, v in terms.items()})
            ub = min(ub, dist[N - 1])
        if not np.isfinite(dist[N - 1]):
            return None
        return _walk(cm, bits, pred, N - 1), float(dist[N - 1])


def _supersets(packed: np.ndarray, starts: np.ndarray, layer: np.ndarray, s: int, top: int):
    """(src, dst) of every ideal ``J`` strictly above each ideal of ``layer`` (all of size
    ``s``) with at most ``top`` kernels."""
    lo, hi = starts[s + 1], starts[top + 1]
    src_l, dst_l = [], []
    for k, i in enumerate(layer):
        if k % 256 == 0:
            check_deadline()
        js = np.flatnonzero(supersets_in(packed, i, lo, hi)) + lo
        src_l.append(np.full(js.size, i, dtype=np.int64))
        dst_l.append(js)
    return np.concatenate(src_l), np.concatenate(dst_l)


def _relax(cm: CostModel, bits, dist, pred, src, dst, sets, terms) -> None:
    """Cost partitions ``sets`` (``dst - src``; ``terms`` their ``cm._terms``) and lower
    ``dist[dst]`` through them."""
    if src.size == 0:
        return
    ev = cm.evaluate(sets, terms=terms)
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
