"""Exact intra-chip partitioning by dynamic programming over the ideals of the DAG, and brute force.

(Formerly ``intra_chip/dp.py``: "DP" here is dynamic programming, not data parallelism.)

A partition sequence is a chain of down-sets (ideals) ``{} = I_0 < I_1 < ... < I_m = V`` of the
DAG; partition ``j`` is ``I_j - I_{j-1}`` and its cost depends only on that set (and, for the
DRAM capacity check, on ``I_{j-1}``). The optimum of the sum objective is therefore a shortest
path from the empty ideal to the full one in the lattice of ideals (DESIGN.md section 5); with
a partition-count limit, a shortest path over ``(ideal, partitions used)``. Transformer layers
are narrow DAGs with few ideals, so this is exact and fast; a guard on the number of ideals and
of (ideal, superset) pairs sends larger graphs to the MILP.

>>> from dfmodel.graph.build import build_graphs
>>> from dfmodel.intra_chip.cost import CostModel
>>> from dfmodel.system import load_system
>>> cm = CostModel(build_graphs("tiny_mlp").layer, load_system("sn30"))
>>> plan, t = solve_dp(cm)
>>> sorted(k for part in plan for k in part) == sorted(cm.names)   # every kernel in one partition
True
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dfmodel.algorithms import DEFAULT_MAX_IDEALS, TooLarge, ideal_masks  # noqa: F401 -- re-exported
from dfmodel.intra_chip.cost import CostModel
from dfmodel.solvers.deadline import check as check_deadline
from dfmodel.solvers.deadline import deadline

#: Above this many (ideal, larger ideal) pairs the DP is not attempted.
DEFAULT_MAX_PAIRS = 8_000_000
_CHUNK = 65_536  # rows costed per vectorised call (bounds memory)


@dataclass
class Lattice:
    """Ideals as boolean rows (``bits[i, k]``: kernel k in ideal i), sorted by size."""

    bits: np.ndarray

    @property
    def size(self) -> int:
        return int(self.bits.shape[0])


def enumerate_ideals(cm: CostModel, max_ideals: int = DEFAULT_MAX_IDEALS) -> Lattice:
    """All down-sets of the DAG (kernels closed under producers); TooLarge past ``max_ideals``.

    Memoised by the DAG's shape (its producer masks): a layer at every micro-batch, TP degree
    and placement has the same lattice, and a DAG that is too large is refused at once next
    time instead of being enumerated up to the guard again. The lattice is shared: read only."""
    key = (cm.n, tuple(cm.pred_mask), max_ideals)
    hit = _LATTICES.get(key)
    if hit is None:
        check_deadline()
        try:
            hit = _lattice(cm, ideal_masks(cm.n, cm.pred_mask, max_ideals))
        except TooLarge as e:  # kept as its message: the exception's traceback would keep the
            hit = TooLarge(str(e))  # frames (and the model that called) alive as long as the cache
        _LATTICES[key] = hit
        while len(_LATTICES) > 1 and (len(_LATTICES) > _LATTICES_KEPT or sum(
                v.bits.nbytes for v in _LATTICES.values() if isinstance(v, Lattice)) > _LATTICES_MAX_BYTES):
            _LATTICES.popitem(last=False)
    else:
        _LATTICES.move_to_end(key)
    if isinstance(hit, TooLarge):
        raise TooLarge(str(hit))
    return hit


#: lattices (or the TooLarge refusal) of recently seen DAG shapes, oldest first
_LATTICES: "OrderedDict[tuple, Lattice | TooLarge]" = OrderedDict()
_LATTICES_KEPT = 64
_LATTICES_MAX_BYTES = 64 * 2**20  # (50,000 ideals of a 100-kernel DAG: 5 MB)


def chain_lattice(cm: CostModel, order: list[int] | None = None) -> Lattice:
    """The prefixes of one topological order: a sub-lattice whose DP is a cheap exact heuristic
    (optimal among plans that cut this order into consecutive runs)."""
    order = list(range(cm.n)) if order is None else order
    masks, acc = [0], 0
    for k in order:
        acc |= 1 << k
        masks.append(acc)
    return _lattice(cm, masks)


def _lattice(cm: CostModel, masks) -> Lattice:
    masks = sorted(masks, key=lambda m: (m.bit_count(), m))
    if cm.n <= 64:  # one 64-bit word per ideal: unpacked at once (a Python loop per bit took 0.25 s for 21,592 ideals)
        words = np.array(masks, dtype=np.uint64).reshape(len(masks), 1)
        return Lattice(np.ascontiguousarray(_unpack(words, cm.n)))
    bits = np.zeros((len(masks), cm.n), dtype=bool)
    for i, m in enumerate(masks):
        for k in range(cm.n):
            if (m >> k) & 1:
                bits[i, k] = True
    return Lattice(bits)


def _pack(bits: np.ndarray) -> np.ndarray:
    """Rows of booleans as uint64 words (for fast subset tests): bit ``k % 64`` of word ``k // 64``
    is column ``k``. By ``packbits`` (little-endian bit and byte order), not a 64-fold uint64
    product summed per word: the same words, ~10x less time (2 % of DeepSeek-V3 / 512 dragonfly)."""
    n = bits.shape[1]
    words = max(1, -(-n // 64))
    as_bytes = np.zeros((bits.shape[0], words * 8), dtype=np.uint8)
    as_bytes[:, : -(-n // 8)] = np.packbits(np.asarray(bits, dtype=bool), axis=1, bitorder="little")
    return as_bytes.view("<u8").astype(np.uint64, copy=False)


def _pack_by_product(bits: np.ndarray) -> np.ndarray:
    """:func:`_pack` as first written (the tests' oracle)."""
    n = bits.shape[1]
    words = max(1, -(-n // 64))
    padded = np.zeros((bits.shape[0], words * 64), dtype=bool)
    padded[:, :n] = bits
    weights = (np.uint64(1) << np.arange(64, dtype=np.uint64)).astype(np.uint64)
    return (padded.reshape(bits.shape[0], words, 64).astype(np.uint64) * weights).sum(axis=2, dtype=np.uint64)


@dataclass
class Edges:
    """Feasible transitions ``ideal I -> ideal J`` (partition ``J - I``) and their costs."""

    src: np.ndarray  # int index of I
    dst: np.ndarray  # int index of J
    cost_s: np.ndarray
    #: the edges come grouped by destination (by its size, then its index), each destination's
    #: in their pair order (:func:`_by_destination`): :func:`shortest_plan` needs no sort then
    by_destination: bool = False


def transitions(
    cm: CostModel, lat: Lattice, *, max_pairs: int = DEFAULT_MAX_PAIRS, singletons: bool = False
) -> Edges:
    """Every feasible partition ``J - I`` between two ideals, costed by :class:`CostModel`.

    ``singletons`` keeps only one-kernel partitions (kernel-by-kernel execution). Pairs that
    cannot fit (more kernels than tiles; more SRAM than the chip has at every option, using the
    subadditive lower bound ``lb(J) - lb(I) <= lb(J - I)`` of :meth:`CostModel.min_sram_bytes`)
    are dropped before costing, and each distinct set ``J - I`` is costed once (many pairs share
    it). Each set takes its fastest fitting option (tile, resident or streamed weights).

    The pairs and their distinct sets depend only on the lattice and the size limit, not on the
    sizes of the tensors: they are computed once per lattice shape (:func:`pair_structure`) and
    reused by every graph of the same shape (a layer at every micro-batch, TP degree and
    placement), which only re-applies the SRAM screen and costs the sets it keeps.
    """
    max_size = cm.tiles if cm.dataflow else cm.n
    if singletons:
        max_size = 1
    st = pair_structure(lat, max_size, max_pairs)
    screen = None  # the pairs the SRAM screen keeps (None: all of them)
    if st is None:  # too many structural pairs to keep: screen row by row (no reuse)
        weights = cm.min_sram_bytes(lat.bits) if cm.dataflow else np.zeros(lat.size)
        src, dst, sets, inverse = _pairs_screened(cm, lat, max_size, weights, max_pairs)
    else:
        sets = st[2]
        src, dst, inverse = _by_destination(st, lat) or (st[0], st[1], st[3])
        kept = src.size
        if cm.dataflow and not _every_set_fits_sram(cm, max_size):
            weights = cm.min_sram_bytes(lat.bits)
            screen = weights.take(dst) - weights.take(src) <= cm.sram_bytes * (1 + 1e-12)  # (take: faster than [], the same)
            kept = int(np.count_nonzero(screen))
        if kept > max_pairs:
            raise TooLarge(f"more than {max_pairs} (ideal, superset) pairs")
        if kept == src.size:
            screen = None
    if inverse.size == 0 or (screen is not None and not screen.any()):
        return Edges(np.zeros(0, int), np.zeros(0, int), np.zeros(0))
    cost = _set_costs(cm, sets, None if screen is None else inverse[screen])
    edge_cost = cost.take(inverse)
    if screen is not None:
        edge_cost[~screen] = np.inf
    if cm.dram_check:  # lifetimes depend on the pair, not only on the set
        at = np.flatnonzero(np.isfinite(edge_cost))
        for a in range(0, at.size, _CHUNK):
            pos = at[a : a + _CHUNK]
            fits = cm.dram_fits(cm.live_bytes(lat.bits[src.take(pos)], lat.bits[dst.take(pos)]))
            edge_cost[pos[~fits]] = np.inf
    return _finite_edges(src, dst, edge_cost, by_destination=st is not None and dst is not st[1])


def _every_set_fits_sram(cm: CostModel, max_size: int) -> bool:
    """Whether the SRAM screen of :func:`transitions` keeps every pair: its ``lb(J) - lb(I)``
    is at most ``lb(J - I)`` (:meth:`CostModel.min_sram_bytes`, subadditive), and ``lb`` of a
    set of at most ``max_size`` kernels at most the sum of its kernels' own (each tensor or
    weight it touches, one of its kernels touches), so at most the ``max_size`` largest one-
    kernel bounds. True in 297 of DeepSeek-V3 / 512 dragonfly's 298 solves, where computing the
    bound of every ideal and the difference over ~1.8 M pairs to learn so was 5 % of the search."""
    one = cm.min_sram_bytes(np.eye(cm.n, dtype=bool))
    return float(np.sort(one)[-max_size:].sum()) <= cm.sram_bytes


#: an edge list keeps its infeasible edges (at an infinite cost) when at most this share of
#: them is infeasible: gathering the kept ones out of the pair structure's millions was half of
#: the transitions of DeepSeek-V3 / 512 dragonfly, where the SRAM screen keeps ~all pairs
_INF_EDGES_KEPT_SHARE = 0.5


def _finite_edges(src: np.ndarray, dst: np.ndarray, cost: np.ndarray, by_destination: bool) -> Edges:
    """:class:`Edges` of the finite-cost edges. Where most are finite the infinite ones stay in,
    the structure's arrays shared (no copy): :func:`shortest_plan` finds the same distances and
    plan with them (an infinite edge lowers no distance and is tight into no reachable ideal,
    and the finite edges keep their order) and only pays for relaxing them."""
    finite = np.isfinite(cost)
    n_finite = int(np.count_nonzero(finite))
    if n_finite >= cost.size * (1 - _INF_EDGES_KEPT_SHARE):
        return Edges(src, dst, cost, by_destination=by_destination)
    pos = np.flatnonzero(finite)
    return Edges(src.take(pos), dst.take(pos), cost.take(pos), by_destination=by_destination)


def _set_costs(cm: CostModel, sets: np.ndarray, used: np.ndarray | None) -> np.ndarray:
    """Per distinct set: its time at its fastest fitting option (:meth:`CostModel.evaluate`),
    inf where none fits or where no pair of ``used`` (set indices; None: every set, each
    being some pair's) needs it (not costed)."""
    if used is None:
        idx = np.arange(sets.shape[0])
    else:
        needed = np.zeros(sets.shape[0], dtype=bool)
        needed[used] = True
        idx = np.flatnonzero(needed)
    cost = np.full(sets.shape[0], np.inf)
    for a in range(0, idx.size, _CHUNK):
        check_deadline()
        rows = idx[a : a + _CHUNK]
        ev = cm.evaluate(sets[rows])
        cost[rows] = np.where(ev["feasible"], ev["time_s"], np.inf)
    return cost


#: :func:`_by_destination`'s reordered pairs of recent structures, keyed by the id of their
#: (held) ``dst`` array, oldest first
_BY_DESTINATION: "OrderedDict[int, tuple]" = OrderedDict()
_BY_DESTINATION_KEPT = 16
#: ... and at most this many pairs in all; a larger structure is not grouped (a copy of its
#: arrays would double its memory: DeepSeek-V3's 33-kernel backward on SN30 has 16.5 M pairs)
_BY_DESTINATION_MAX_PAIRS = 8_000_000


def _by_destination(st: tuple, lat: Lattice) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(src, dst, inverse)`` of the structure ``st`` (:func:`pair_structure`) grouped by
    destination: by its size, then its index, each destination's pairs in the structure's
    order (a stable sort). :func:`shortest_plan` relaxed the edges in this order after a
    stable sort by destination size per solve, and took the first tight edge into each ideal:
    the same edge, as it only compares edges into one ideal, whose order is kept. Sorted once
    per structure (the sort, the gathers and the tight edges' ``unique`` were ~40 % of the
    block solves of DeepSeek-V3 / 512 dragonfly). The ideals are sorted by size (:class:`Lattice`),
    so a stable sort by destination index groups them so (radix-sorted as 16-bit keys). None
    past :data:`_BY_DESTINATION_MAX_PAIRS` (then :func:`shortest_plan` sorts per solve)."""
    src, dst, _, inverse = st
    hit = _BY_DESTINATION.get(id(dst))
    if hit is not None and hit[0] is dst:
        _BY_DESTINATION.move_to_end(id(dst))
        return hit[1]
    if dst.size > _BY_DESTINATION_MAX_PAIRS // 2:
        return None
    sizes = lat.bits.sum(axis=1)
    if np.any(sizes[1:] < sizes[:-1]):  # (a lattice built out of size order: sort by size first)
        order = np.lexsort((dst, sizes[dst]))
    else:
        order = np.argsort(dst.astype(np.uint16) if lat.size < 2**16 else dst, kind="stable")
    out = (src[order], dst[order], inverse[order])
    _BY_DESTINATION[id(dst)] = (dst, out)
    while len(_BY_DESTINATION) > 1 and (len(_BY_DESTINATION) > _BY_DESTINATION_KEPT or
                                        sum(v[0].size for v in _BY_DESTINATION.values()) > _BY_DESTINATION_MAX_PAIRS):
        _BY_DESTINATION.popitem(last=False)
    return out


#: structural pairs of recently seen lattices: (shape, bits, max_size) -> (src, dst, sets, inverse)
_STRUCTURES: "OrderedDict[tuple, tuple]" = OrderedDict()
_STRUCTURES_KEPT = 64
#: ... and at most this many pairs in all (a 33-kernel backward layer has 3.7 M; ~70 MB)
_STRUCTURES_MAX_PAIRS = 16_000_000


def pair_structure(lat: Lattice, max_size: int, max_pairs: int):
    """(src, dst, distinct sets, set index of each pair) of every ideal pair ``I < J`` with
    ``|J - I| <= max_size``; cached by lattice. None past ``4 max_pairs`` pairs (not kept)."""
    key = (lat.bits.shape, lat.bits.tobytes(), max_size)
    hit = _STRUCTURES.get(key)
    if hit is not None:
        _STRUCTURES.move_to_end(key)
        return hit
    packed = _pack(lat.bits)
    src_l, dst_l = _superset_pairs(packed, lat.bits.sum(axis=1), max_size, 4 * max_pairs)
    if src_l is None:
        return None
    if not src_l:
        out = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, lat.bits.shape[1]), bool), np.zeros(0, np.int64))
    else:
        src, dst = np.concatenate(src_l), np.concatenate(dst_l)
        sets, inverse = _distinct_sets(packed[dst] & ~packed[src], lat.bits.shape[1])
        out = (src, dst, sets, inverse)
    _STRUCTURES[key] = out
    while len(_STRUCTURES) > 1 and (len(_STRUCTURES) > _STRUCTURES_KEPT or
                                    sum(v[0].size for v in _STRUCTURES.values()) > _STRUCTURES_MAX_PAIRS):
        _STRUCTURES.popitem(last=False)
    return out


#: (ideal, candidate superset) tests per vectorised block of :func:`_superset_pairs` (bounds memory)
_PAIR_BLOCK = 1 << 22


def _superset_pairs(packed: np.ndarray, sizes: np.ndarray, max_size: int, limit: int):
    """The pairs ``I < J`` of :func:`pair_structure` (``|J - I| <= max_size``) as lists of (src,
    dst) arrays in order of ``src`` then ``dst``, or (None, None) past ``limit`` pairs. The ideals
    are sorted by size, so the ideals of one size share their candidate supersets (the next
    ``max_size`` sizes): tested a block of them at a time, not one ideal at a time (the loop
    over ideals was 5 % of DeepSeek-V3 / 512 dragonfly's serial search); ``nonzero`` keeps the
    order the loop had."""
    if packed.shape[1] == 1 and sizes.size >= _COVER_MIN_IDEALS:
        return _superset_pairs_by_covers(packed[:, 0], max_size, limit)
    src_l, dst_l = [], []
    total = 0
    starts = np.flatnonzero(np.r_[True, sizes[1:] != sizes[:-1]])
    buffers = _TestBuffers()
    for a, b in zip(starts, np.r_[starts[1:], sizes.size]):
        lo = int(b)
        hi = int(np.searchsorted(sizes, sizes[a] + max_size, side="right"))
        if lo >= hi:
            continue
        missing = ~packed[lo:hi]
        step = max(1, _PAIR_BLOCK // ((hi - lo) * packed.shape[1]))
        for c in range(int(a), int(b), step):
            check_deadline()
            rows = packed[c : min(c + step, int(b))]
            if packed.shape[1] == 1:  # (one word: a 2-D test, no reduction over the words)
                sub = buffers.one_word_test(rows[:, 0], missing[:, 0])
            else:
                sub = np.all((rows[:, None, :] & missing[None, :, :]) == 0, axis=2)
            i, j = np.nonzero(sub)
            if i.size:
                i, j = i.astype(np.int64, copy=False), j.astype(np.int64, copy=False)
                i += c
                j += lo
                src_l.append(i)
                dst_l.append(j)
                total += i.size
                if total > limit:
                    return None, None
    return src_l, dst_l


#: ideals from which :func:`_superset_pairs` walks covers instead of testing every candidate
#: superset (on DeepSeek-V3 / 512 dragonfly's lattices the walk is slower below ~5k ideals, about
#: twice as fast at ~20k, where the test checks ~26 candidates per pair it finds)
_COVER_MIN_IDEALS = 8_000


def _superset_pairs_by_covers(words: np.ndarray, max_size: int, limit: int):
    """:func:`_superset_pairs` of a lattice of one-word ideals (``words``, sorted by size) that
    holds every ideal of a DAG (:func:`enumerate_ideals`) or the prefixes of one topological
    order (:func:`chain_lattice`), found by adding kernels instead of testing candidates.

    A kernel's rank orders it by the size of its down-closure (the AND of the ideals holding
    it), a linear extension of the DAG (of the chain's order, for prefixes). Adding the kernels
    of ``J - I`` to ``I`` in rank order passes through ideals of the lattice only (each added
    kernel's producers are in ``I`` or added before it), so every pair ``I < J`` is reached along
    exactly one path of covers (``I + {k}`` in the lattice) with ranks increasing, and each level
    extends the last by the covers of higher rank: work in proportion to the pairs found. The
    same pairs in the same order (by ``src``, then ``dst``); (None, None) past ``limit``."""
    n = words.size
    order = np.argsort(words, kind="stable")
    sorted_words = words[order]
    present = int(np.bitwise_or.reduce(words)) if n else 0
    kernels = [b for b in range(64) if present >> b & 1]
    if not kernels or max_size < 1:
        return [], []
    one = np.uint64(1)
    holds = [(words >> np.uint64(b)) & one == one for b in kernels]
    closure = [int(np.bitwise_and.reduce(words[h])).bit_count() for h in holds]
    by_rank = sorted(range(len(kernels)), key=lambda i: (closure[i], kernels[i]))
    # the covers (ideal, ideal + kernel, the kernel's rank), grouped by ideal, ranks ascending
    c_src, c_dst, c_rank = [], [], []
    for rank, i in enumerate(by_rank):
        free = np.flatnonzero(~holds[i])
        grown = words[free] | (one << np.uint64(kernels[i]))
        at = np.minimum(np.searchsorted(sorted_words, grown), n - 1)
        found = sorted_words[at] == grown
        c_src.append(free[found])
        c_dst.append(order[at[found]])
        c_rank.append(np.full(c_src[-1].size, rank, dtype=np.int64))
    c_src, c_dst, c_rank = (np.concatenate(a) for a in (c_src, c_dst, c_rank))
    by_src = np.argsort(c_src, kind="stable")
    c_src, c_dst, c_rank = c_src[by_src], c_dst[by_src], c_rank[by_src]
    first = np.searchsorted(c_src, np.arange(n + 1))
    # above[i, r]: index of ideal i's first cover of rank >= r (its covers below rank r skipped)
    ranks = len(kernels)
    above = np.bincount(c_src * (ranks + 1) + c_rank + 1, minlength=n * (ranks + 1)).reshape(n, ranks + 1)
    above = np.cumsum(above, axis=1) + first[:-1, None]
    keys_l = []
    src, cur, next_rank = np.arange(n), np.arange(n), np.zeros(n, dtype=np.int64)
    total = 0
    for step in range(max_size):
        check_deadline()
        start = above[cur, next_rank]
        count = first[cur + 1] - start
        m = int(count.sum())
        if m == 0:
            break
        total += m
        if total > limit:
            return None, None
        edge = np.arange(m) + np.repeat(start - (np.cumsum(count) - count), count)
        src, cur = np.repeat(src, count), c_dst[edge]
        keys_l.append(src * n + cur)
        if step + 1 < max_size:
            next_rank = c_rank[edge] + 1
    if not keys_l:
        return [], []
    keys = np.sort(np.concatenate(keys_l))
    src = keys // n
    return [src], [keys - src * n]


class _TestBuffers:
    """The one-word subset test of :func:`_superset_pairs` into buffers kept across its blocks:
    a fresh 32 MB temporary per block (the AND of every row with every candidate's missing
    kernels, then its comparison) was a quarter of the test's time on DeepSeek-V3's ~20k-ideal
    backward lattices, in page faults. The same booleans."""

    def __init__(self):
        self.words = np.empty(0, dtype=np.uint64)
        self.hits = np.empty(0, dtype=bool)

    def one_word_test(self, rows: np.ndarray, missing: np.ndarray) -> np.ndarray:
        shape = (rows.size, missing.size)
        n = shape[0] * shape[1]
        if n > self.words.size:
            self.words, self.hits = np.empty(n, dtype=np.uint64), np.empty(n, dtype=bool)
        both = np.bitwise_and(rows[:, None], missing[None, :], out=self.words[:n].reshape(shape))
        return np.equal(both, 0, out=self.hits[:n].reshape(shape))


def supersets_in(packed: np.ndarray, i: int, lo: int, hi: int) -> np.ndarray:
    """Which of the packed rows ``lo:hi`` hold every kernel of row ``i`` (boolean per row)."""
    return np.all((packed[i] & ~packed[lo:hi]) == 0, axis=1)


def estimate_pairs(lat: Lattice, max_size: int, samples: int = 64) -> float:
    """Estimated count of pairs ``I < J`` with ``|J - I| <= max_size`` (what :func:`pair_structure`
    enumerates): the mean superset count of ``samples`` evenly spaced ideals times the ideals."""
    packed = _pack(lat.bits)
    sizes = lat.bits.sum(axis=1)
    idx = np.unique(np.linspace(0, lat.size - 1, min(samples, lat.size)).astype(np.int64))
    total = 0
    for i in idx:
        lo = np.searchsorted(sizes, sizes[i], side="right")
        hi = np.searchsorted(sizes, sizes[i] + max_size, side="right")
        total += int(supersets_in(packed, i, lo, hi).sum())
    return total * lat.size / idx.size


def _distinct_sets(words: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of packed sets as boolean rows, and each row's index among them."""
    if words.shape[1] == 1:  # up to 64 kernels: integer keys sort much faster than byte strings
        uniq, inverse = _unique_chunked(words[:, 0])
        return _unpack(uniq[:, None], n), inverse
    keys = np.ascontiguousarray(words).view(np.dtype((np.void, words.dtype.itemsize * words.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return _unpack(words[first], n), inverse.ravel()


def _unique_chunked(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` in chunks, checking the deadline between them
    (a 33-kernel backward layer has tens of millions of pairs: one sort would run for seconds
    past a time limit). Unique per chunk, unique of those, then each chunk's index by binary
    search: the same sorted values and inverse as one ``np.unique``. About twice the CPU of one
    sort (16.5 M pairs of a DeepSeek-V3 layer on sn30, 3.2 M distinct: 8.9 s against 4.8 s), so
    only under a deadline."""
    if keys.size <= _UNIQUE_CHUNK or deadline() is None:
        return _unique_hashed(keys)
    parts = []
    for a in range(0, keys.size, _UNIQUE_CHUNK):
        check_deadline()
        parts.append(np.unique(keys[a : a + _UNIQUE_CHUNK], return_inverse=True))
    uniq = np.unique(np.concatenate([u for u, _ in parts]))
    inverse = np.empty(keys.size, dtype=np.intp)
    for c, (local, local_inverse) in enumerate(parts):
        a = c * _UNIQUE_CHUNK
        inverse[a : a + local_inverse.size] = np.searchsorted(uniq, local)[local_inverse.ravel()]
    return uniq, inverse


def _unique_hashed(keys: np.ndarray, bits: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` of 64-bit keys by hashing: the pairs of a large
    lattice are millions with ~10^4 distinct sets (DeepSeek-V3's sharded backward: 1.8 M, 12.8 k),
    whose sort was half of building its pair structure. Each key's bucket (multiplicative hash,
    ``2^bits`` buckets) keeps its first key; keys unlike their bucket's (collisions) are
    uniqued by sorting, they are few; only the distinct keys are sorted. The same sorted values
    and inverse as ``np.unique``, which sorts them all where collisions are many (distinct keys
    in the millions: a 33-kernel backward on SN30)."""
    keys = np.asarray(keys)
    if keys.size < 1 << 16 or keys.dtype != np.uint64:
        uniq, inverse = np.unique(keys, return_inverse=True)
        return uniq, inverse.ravel()
    h = ((keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)).astype(np.intp)
    first = np.full(1 << bits, keys.size, dtype=np.intp)
    np.minimum.at(first, h, np.arange(keys.size, dtype=np.intp))
    bad = keys[first[h]] != keys  # (a key unlike its bucket's first; no other bucket holds it)
    if np.count_nonzero(bad) > keys.size // 8:
        uniq, inverse = np.unique(keys, return_inverse=True)
        return uniq, inverse.ravel()
    buckets = np.flatnonzero(first < keys.size)
    slot = np.zeros(1 << bits, dtype=np.intp)
    slot[buckets] = np.arange(buckets.size)
    rest, rest_inverse = np.unique(keys[bad], return_inverse=True)
    distinct = np.concatenate([keys[first[buckets]], rest])
    order = np.argsort(distinct)
    rank = np.empty(order.size, dtype=np.intp)
    rank[order] = np.arange(order.size)
    inverse = rank[slot[h]]
    inverse[bad] = rank[buckets.size + rest_inverse.ravel()]
    return distinct[order], inverse


#: keys sorted per deadline check by :func:`_unique_chunked` (~0.2 s of sorting)
_UNIQUE_CHUNK = 1 << 21


def _pairs_screened(cm: CostModel, lat: Lattice, max_size: int, weights: np.ndarray, max_pairs: int):
    """The pairs of :func:`pair_structure` with the SRAM screen applied row by row (large lattices)."""
    packed = _pack(lat.bits)
    sizes = lat.bits.sum(axis=1)
    src_l, dst_l = [], []
    total = 0
    for i in range(lat.size):
        lo = np.searchsorted(sizes, sizes[i], side="right")
        hi = np.searchsorted(sizes, sizes[i] + max_size, side="right")
        if lo >= hi:
            continue
        ok = supersets_in(packed, i, lo, hi)
        ok &= weights[lo:hi] - weights[i] <= cm.sram_bytes * (1 + 1e-12)
        js = np.flatnonzero(ok) + lo
        if js.size:
            src_l.append(np.full(js.size, i, dtype=np.int64))
            dst_l.append(js)
            total += js.size
            if total > max_pairs:
                raise TooLarge(f"more than {max_pairs} (ideal, superset) pairs")
    if not src_l:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, cm.n), bool), z
    src, dst = np.concatenate(src_l), np.concatenate(dst_l)
    sets, inverse = _distinct_sets(packed[dst] & ~packed[src], cm.n)
    return src, dst, sets, inverse


def _unpack(words: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`_pack`: boolean rows of length ``n``."""
    as_bytes = np.ascontiguousarray(words.astype("<u8")).view(np.uint8).reshape(words.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :n].astype(bool)


def shortest_plan(
    cm: CostModel, lat: Lattice, edges: Edges, max_partitions: int | None = None
) -> tuple[list[list[str]], float] | None:
    """Cheapest chain from the empty to the full ideal using at most ``max_partitions`` steps.

    None if no chain exists (infeasible). Ties go to fewer partitions, then to the first edge.
    """
    N = lat.size
    full = N - 1
    if N == 1:  # empty graph
        return [], 0.0
    src, dst, cost = edges.src, edges.dst, edges.cost_s
    if (max_partitions is None or max_partitions >= cm.n) and edges.by_destination:
        dist, pred = _settle_by_destination(lat, src, dst, cost)
        if not np.isfinite(dist[full]):
            return None
        layers = None
    elif max_partitions is None or max_partitions >= cm.n:
        # unconstrained: edges go to larger ideals, so settle destinations by ideal size
        dist = np.full(N, np.inf)
        dist[0] = 0.0
        sizes = lat.bits.sum(axis=1)
        # (a stable sort of small integers: numpy radix-sorts 8/16-bit keys, the same order as the
        # comparison sort of the int64 sizes, ~10x faster on the millions of a layer's backward)
        order = np.argsort(sizes[dst].astype(np.uint16 if cm.n < 2**16 else np.int64), kind="stable")
        src, dst, cost = src[order], dst[order], cost[order]
        bounds = np.searchsorted(sizes[dst], np.arange(cm.n + 2))
        for s in range(1, cm.n + 1):
            a, b = bounds[s], bounds[s + 1]
            if a < b:
                np.minimum.at(dist, dst[a:b], dist[src[a:b]] + cost[a:b])
        if not np.isfinite(dist[full]):
            return None
        layers = None
        pred = _first_tight_edge(src, dst, cost, dist, N)
    else:
        layers = [np.full(N, np.inf)]
        layers[0][0] = 0.0
        for _ in range(max_partitions):
            nxt = np.full(N, np.inf)
            np.minimum.at(nxt, dst, layers[-1][src] + cost)
            layers.append(nxt)
        finals = np.array([lay[full] for lay in layers])
        if not np.isfinite(finals).any():
            return None
        best = float(np.min(finals))
        steps = int(np.flatnonzero(finals == best)[0])
    # walk back along edges that achieve the stored distances
    plan_ideals = [full]
    node = full
    if layers is None:
        while node != 0:
            node = int(src[pred[node]])
            plan_ideals.append(node)
        total = float(dist[full])
    else:
        total = best
        for c in range(steps, 0, -1):
            hit = np.flatnonzero((dst == node) & (layers[c - 1][src] + cost == layers[c][node]))
            node = int(src[hit[0]])
            plan_ideals.append(node)
    plan_ideals.reverse()
    plan = []
    for a, b in zip(plan_ideals, plan_ideals[1:]):
        idx = np.flatnonzero(lat.bits[b] & ~lat.bits[a])
        plan.append([cm.names[int(i)] for i in idx])
    return plan, total


class _RunTightEdges:
    """``pred[ideal]``: the first edge of the ideal's run (edges grouped by destination) that
    achieves its settled distance (``dist[src] + cost == dist[ideal]``), -1 where none does,
    found when asked: the walk back of :func:`shortest_plan` asks it of the plan's ideals only
    (tens), where finding it for every ideal took a pass over the millions of edges of a large
    lattice (40 % of :func:`_settle_by_destination` on DeepSeek-V3 / 512 dragonfly)."""

    def __init__(self, dist: np.ndarray, src: np.ndarray, cost: np.ndarray, heads: np.ndarray,
                 starts: np.ndarray, ends: np.ndarray, run_of: np.ndarray | None = None):
        self.dist, self.src, self.cost, self.starts, self.ends = dist, src, cost, starts, ends
        if run_of is None:
            run_of = np.full(dist.size, -1, dtype=np.int64)
            run_of[heads] = np.arange(heads.size)
        self.run_of = run_of  # (each ideal's run: shared by the solves of one edge array, read only)

    def __getitem__(self, ideal: int) -> int:
        r = int(self.run_of[ideal])
        if r < 0:
            return -1
        a, b = int(self.starts[r]), int(self.ends[r])
        tight = np.flatnonzero(self.dist[self.src[a:b]] + self.cost[a:b] == self.dist[ideal])
        return a + int(tight[0]) if tight.size else -1


def _settle_by_destination(lat: Lattice, src: np.ndarray, dst: np.ndarray,
                           cost: np.ndarray) -> tuple[np.ndarray, "np.ndarray | _RunTightEdges"]:
    """(distance of every ideal from the empty one, its first tight edge) over edges grouped by
    destination (:attr:`Edges.by_destination`): a destination's distance is the minimum over
    its run of edges (``minimum.reduceat``; every source lies on a lower size, settled before),
    and its first tight edge the first of its run achieving it (:class:`_RunTightEdges`, found
    when asked): the values and edges of the sorted relaxation with ``minimum.at`` and
    :func:`_first_tight_edge`."""
    dist = np.full(lat.size, np.inf)
    dist[0] = 0.0
    if dst.size == 0:
        return dist, np.full(lat.size, -1, dtype=np.int64)
    starts, ends, heads, levels, run_of = _runs(lat, dst)
    for a, b, r0, r1, rel in levels:
        edge = dist.take(src[a:b])  # (take, then an in-place add: the same sums)
        edge += cost[a:b]
        dist[heads[r0:r1]] = np.minimum.reduceat(edge, rel)
    return dist, _RunTightEdges(dist, src, cost, heads, starts, ends, run_of)


def _runs(lat: Lattice, dst: np.ndarray) -> tuple:
    """The runs of edges per destination of ``dst`` (grouped by destination), grouped per level:
    (run starts, run ends, each run's destination, per level (edge slice, run slice, run starts
    within the slice), each ideal's run or -1). Kept per shared edge array (one of
    :func:`_by_destination`'s): every block solve of a lattice shape finds the same runs (their
    search over ~1 M edges per solve was ~1.5 % of DeepSeek-V3 / 512 dragonfly)."""
    hit = _RUNS.get(id(dst))
    if hit is not None and hit[0] is dst:
        return hit[1]
    starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    ends = np.r_[starts[1:], dst.size]
    heads = dst[starts]
    level_of_run = lat.bits.sum(axis=1)[heads]
    bounds = np.searchsorted(level_of_run, np.arange(int(level_of_run[-1]) + 2))
    levels = []
    for lv in range(int(level_of_run[0]), int(level_of_run[-1]) + 1):
        r0, r1 = int(bounds[lv]), int(bounds[lv + 1])
        if r0 != r1:
            a = int(starts[r0])
            levels.append((a, int(ends[r1 - 1]), r0, r1, starts[r0:r1] - a))
    run_of = np.full(lat.size, -1, dtype=np.int64)
    run_of[heads] = np.arange(heads.size)
    out = (starts, ends, heads, levels, run_of)
    shared = {id(v[1][1]) for v in _BY_DESTINATION.values()}
    if id(dst) in shared:  # (a compacted edge list is a solve's own)
        for key in [k for k in _RUNS if k not in shared]:  # (their arrays left _BY_DESTINATION: not kept alive here)
            del _RUNS[key]
        _RUNS[id(dst)] = (dst, out)
    return out


#: :func:`_runs` of the shared edge arrays, keyed by the id of their (held) ``dst`` array
_RUNS: "OrderedDict[int, tuple]" = OrderedDict()


def _first_tight_edge(src: np.ndarray, dst: np.ndarray, cost: np.ndarray, dist: np.ndarray, n: int) -> np.ndarray:
    """Per ideal, the index of the first edge (in the given order) into it that achieves its
    settled distance (``dist[src] + cost == dist[dst]``): the edge the walk back from the full
    ideal takes, found for every ideal in one pass over the edges (the walk used to scan all
    of them once per partition of the plan: 9 % of DeepSeek-V3/512 dragonfly's search)."""
    tight = np.flatnonzero(dist[src] + cost == dist[dst])
    first = np.full(n, -1, dtype=np.int64)
    ends, at = np.unique(dst[tight], return_index=True)  # (first occurrence of each ideal)
    first[ends] = tight[at]
    return first


def count_ideals(cm: CostModel, limit: int) -> int | None:
    """Number of ideals, or None when above ``limit``."""
    try:
        return enumerate_ideals(cm, limit).size
    except TooLarge:
        return None


def solve_dp(
    cm: CostModel,
    max_partitions: int | None = None,
    *,
    max_ideals: int = DEFAULT_MAX_IDEALS,
    max_pairs: int = DEFAULT_MAX_PAIRS,
    lattice: Lattice | None = None,
) -> tuple[list[list[str]], float] | None:
    """Optimal plan and objective (seconds) over ``lattice`` (default: all ideals; exact).

    Raises TooLarge past the guards; returns None if no plan fits. Kernel-by-kernel chips only
    take one-kernel partitions (their ``max_partitions`` is the kernel count).
    """
    lat = lattice if lattice is not None else enumerate_ideals(cm, max_ideals)
    singletons = not cm.dataflow
    edges = transitions(cm, lat, max_pairs=max_pairs, singletons=singletons)
    return shortest_plan(cm, lat, edges, None if singletons else max_partitions)


def ordered_plans(cm: CostModel, max_partitions: int | None = None):
    """Every ordered partition of the kernels that respects precedence, as lists of
    ``(placed_before, block)`` bitmasks: any non-empty subset of the kernels not yet placed is a
    block when its producers are placed or in the block (single kernels only off dataflow chips),
    at most ``max_partitions`` blocks on dataflow chips. Exponential: for graphs of a few kernels
    (the oracle of :func:`brute_force` and of the floor tests)."""
    n, pred = cm.n, cm.pred_mask
    full = (1 << n) - 1
    limit = n if (max_partitions is None or not cm.dataflow) else max_partitions

    def rec(placed: int, seq: list[tuple[int, int]]):
        if placed == full:
            yield list(seq)
            return
        if len(seq) >= limit:
            return
        rest = full & ~placed
        sub = rest
        while sub:
            block = sub
            sub = (sub - 1) & rest
            if not cm.dataflow and block.bit_count() != 1:
                continue
            if all(not (pred[k] & ~(placed | block)) for k in range(n) if (block >> k) & 1):
                seq.append((placed, block))
                yield from rec(placed | block, seq)
                seq.pop()

    yield from rec(0, [])


def brute_force(cm: CostModel, max_partitions: int | None = None) -> tuple[list[list[str]], float] | None:
    """Test oracle: every ordered partition of the kernels (:func:`ordered_plans`), each block
    costed with the same :class:`CostModel`; returns the cheapest. Exponential: for graphs of a
    few kernels.
    """
    n = cm.n
    seqs = list(ordered_plans(cm, max_partitions))
    if n == 0:
        return [], 0.0
    pairs = sorted({p for s in seqs for p in s})
    if not pairs:
        return None
    where = {p: i for i, p in enumerate(pairs)}
    bits = np.array([[(m >> k) & 1 for k in range(n)] for p in pairs for m in p], dtype=bool).reshape(len(pairs), 2, n)
    ev = cm.evaluate(bits[:, 1], bits[:, 0])
    cost = np.where(ev["feasible"], ev["time_s"], np.inf)
    best, best_seq = math.inf, None
    for s in seqs:
        total = float(sum(cost[where[p]] for p in s))
        if total < best:
            best, best_seq = total, s
    if best_seq is None:
        return None
    plan = [[cm.names[k] for k in range(n) if (b >> k) & 1] for _, b in best_seq]
    return plan, best
