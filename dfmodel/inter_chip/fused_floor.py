"""A phase's floor on a dataflow chip with few compute tiles: the cheapest partition plan of the
*unsharded* phase under a relaxed cost (search bounds, issue 12).

:mod:`.dataflow_floor` bounds a phase by its compute and the DRAM traffic no plan avoids
(weights once, the phase's inputs and outputs). On a chip whose partitions hold few kernels
(``compute_tiles``: 4 on the Groq-like dragonfly chip, ``intra_chip.cost``: a partition needs
``|S| <= compute_tiles``) most tensors between kernels must cross DRAM too, and that floor was
below half of the solved phases (Llama-3 70B on 512 dragonfly chips: bound / evaluation 0.41 at
the median, 75 % of the evaluated candidates' time in memory).

This floor solves the partition problem itself, exactly, on a relaxation:

- the phase's kernels before sharding, one micro-batch: a sharded chip runs a copy of every
  kernel (``sharding.shard``) plus communication kernels, so restricting a plan of the sharded
  phase to the original kernels gives a plan of the unsharded one with no more kernels per
  partition (communication kernels take tiles too). A tensor ``u -> v`` internal to a sharded
  partition is internal to the restricted one (the kernels between ``u`` and ``v`` in the
  sharded graph sit between them in every topological order, so in the same partition);
  one that crosses in the unsharded plan crosses in the sharded one (directly or on one side
  of its conversion kernel), at no less than ``1 / tp`` of its bytes
  (``strategies.local_fraction``); weights (one read per name per partition) likewise;
- each partition costs ``max(k C, s (k A + F)) / tp`` (``C + s (k A + F)`` without overlap):
  ``C`` its FLOP at the achieved rate without tile padding, ``A`` the activation bytes it
  reads and writes (``CostModel._terms``' crossing tensors and ``extra_memory_bytes``), which
  grow at least ``k``-fold with the micro-batch, ``F`` its weights and weight gradients,
  which do not (as :class:`.dataflow_floor.PhaseFloor`); SRAM, tile fractions, streaming
  re-reads and DRAM capacity are dropped (they only add time or remove plans);
- SRAM (:meth:`PlanFloor.best_s` with ``tp`` and the chip's SRAM): a partition runs at one
  option (row-tile fraction ``f``, weights resident or streamed; ``CostModel.option_table``)
  whose SRAM ``f X + c F`` fits (``c = 1`` resident, ``STREAM_BUFFER_FRACTION`` streamed;
  ``X`` the row-scaled bytes at ``f = 1``, at least ``k``-fold with the micro-batch, ``F``
  weights and fixed tensors) and a streamed one re-reads ``(1 / f - 1) Q`` bytes (``Q`` twice
  its weights and accumulators). The restriction of a sharded partition holds no more of each
  (at no less than ``1 / tp`` of its bytes, as above), so a set costs at least its cheapest
  option of every fraction ``2^-j`` (``tile_fractions`` gives at most 12) whose relaxed SRAM
  ``(f k X + c F) / tp`` fits, and a set no option fits is no partition. On the dragonfly chip
  (220 MiB) the attention partitions run at ``f = 1/16`` and re-read their weights 15 times;
- plus at least ``ceil(n / compute_tiles)`` partitions' fixed overheads (kernel overhead and
  one tile's start-up), and the phase's TP collectives ``N`` as :class:`PhaseFloor` takes
  them: ``sum_p max(c_p, m_p, n_p) >= max(sum_p max(c_p, m_p), N)``.

On a graph whose communication kernels carry their network seconds (the layer as sharded on
the mapping's TP group, :func:`.dataflow_floor.sharded_layer_floor`, at factor 1) each set also
takes at least its network (:attr:`PlanFloor.N`): a partition runs ``max(c, m, n)``, so a plan
pays its collectives *and* the busy time of the partitions that hold none (DeepSeek-V3's MoE
forward at TP 64 on dragonfly: 0.038 -> 0.061 s, solved 0.061). A phase whose lattice is too
large (that layer's backward, ~20k ideals) is floored on its heaviest kernels
(:func:`reduced_plan_floor`, :func:`restricted_phase`): a plan of the phase restricted to them
is a plan of the restricted phase costing no more.

The minimum over plans is a shortest path over the ideals of the phase's DAG
(:mod:`dfmodel.intra_chip.ideals`, DESIGN.md section 5), edges limited to ``compute_tiles``
kernels: built once per (block, phase) and re-costed per micro-batch (a few milliseconds).
It is used where the phase has more kernels than the chip has tiles, or few kernels
(``SMALL_PHASE_KERNELS``: one partition may hold them all, but not always their SRAM), and
the lattice is small.
tests/test_fused_floor.py checks it against brute force on small graphs and below every solved
phase of the shipped layers on the dragonfly chip.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from dfmodel.algorithms import TooLarge
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase, Tensor
from dfmodel.inter_chip.sharding import is_weight_gradient
from dfmodel.intra_chip import ideals as _dp
from dfmodel.intra_chip.cost import STREAM_BUFFER_FRACTION, CostModel, tensor_boundary
from dfmodel.system.processor import achieved_rate_Fps
from dfmodel.system.schema import System

#: (ideal, superset) pairs a floor may keep: beyond, the phase keeps the closed-form floor
MAX_FLOOR_PAIRS = 400_000

#: ideals a floor's lattice may have: beyond, the phase keeps the closed-form floor
MAX_FLOOR_IDEALS = 20_000

#: a phase of at most this many kernels gets a plan floor even when one partition may hold it
#: all (its SRAM may not: the LM head's 1.9 GB of weights on 8 dragonfly chips is streamed and
#: re-read per row tile); its lattice has at most 2^8 ideals. Larger phases that one partition
#: may hold (SN30, WSE-2) keep the closed form, their lattices being large.
SMALL_PHASE_KERNELS = 8

#: every row-tile fraction a partition may run at: ``tile_fractions`` halves from 1 and stops at
#: 12 fractions (a superset of any graph's list: the floor's options include the solver's)
RELAXED_FRACTIONS = tuple(2.0 ** -j for j in range(12))
_FRACTIONS_ARRAY = np.array(RELAXED_FRACTIONS)  # (largest first: PlanFloor._option_floor)
_REREADS = 1.0 / _FRACTIONS_ARRAY - 1.0  # a streamed set's extra row tiles at each fraction


@dataclass
class PlanFloor:
    """Distinct candidate partitions of one unsharded phase (one micro-batch) and the ideal
    pairs that use them: ``C`` seconds, ``A`` activation bytes, ``F`` fixed bytes per set."""

    C: np.ndarray
    A: np.ndarray
    F: np.ndarray
    src: np.ndarray  # ideal index of each pair's start
    dst: np.ndarray
    inverse: np.ndarray  # set index of each pair
    level: np.ndarray  # size of each ideal (ideals sorted by size)
    min_partitions: int
    # per set: row-scaled SRAM bytes at tile fraction 1 (X), fixed SRAM bytes (weights and
    # fixed tensors, Fs) and streamed re-read bytes per extra row tile (Q): CostModel._terms
    X: np.ndarray | None = None
    Fs: np.ndarray | None = None
    Q: np.ndarray | None = None
    # per set: the network seconds of its kernels (a partition's network is the sum of its
    # kernels', ``intra_chip.cost``), on a graph whose communication kernels carry them (the
    # layer as sharded on the mapping's TP group: :func:`.dataflow_floor.sharded_layer_floor`),
    # at that graph's own micro-batch: such a floor is asked at factor ``k = 1`` only
    N: np.ndarray | None = None
    sets: np.ndarray | None = None  # (the distinct sets, boolean rows over the phase's kernels: N is summed on them)
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # (replace() starts a new one)

    def best_s(self, k: int, s_per_byte: float, overlap: bool, tp: int = 1,
               sram_bytes: float | None = None) -> float:
        """Least ``sum_p max(k C_p, s (k A_p + F_p))`` (the sum without overlap) over every plan
        of partitions of at most ``compute_tiles`` kernels (before dividing by ``tp``). With
        ``sram_bytes``: each set at its cheapest option that fits the SRAM on a TP group of
        ``tp`` (module doc), plus its streamed re-reads. With network seconds per set (``N``) on
        an overlapping chip: each set at least its network too (a partition takes
        ``max(c, m, n)``), so a plan pays its collectives *and* the busy time of the partitions
        holding none; without overlap ``N`` adds the same to every plan and is left to the
        caller (:func:`.dataflow_floor.with_network_s`)."""
        key = (k, s_per_byte, overlap, tp, sram_bytes)
        if key not in self._memo:
            C, mem = k * self.C, (k * self.A + self.F) * s_per_byte
            if sram_bytes is None or self.X is None:
                per_set = np.maximum(C, mem) if overlap else C + mem
            else:
                per_set = self._option_floor(C, mem, k, s_per_byte, overlap, tp, float(sram_bytes))
            if self.N is not None and overlap:
                if k != 1 or tp != 1:
                    raise ValueError(f"a plan floor with network seconds holds at factor 1 on its own graph, asked k={k}, tp={tp}")
                per_set = np.maximum(per_set, self.N)
            self._memo[key] = self._shortest_of(per_set, (k, s_per_byte, overlap, sram_bytes))
        return self._memo[key]

    def _shortest_of(self, per_set: np.ndarray, knobs: tuple) -> float:
        """The shortest path at the set costs ``per_set``, reused where the first TP degree asked
        at the same other ``knobs`` gave the very same costs: the TP degree only moves which
        options fit the SRAM, and between degrees the same sets usually fit (DeepSeek-V3 / 8192
        dragonfly: 1850 of 5019 shortest paths repeated one of another degree, 0.4 of 1.1 CPU s).
        Exact: the costs are compared element by element, one array kept per ``knobs``."""
        first = self._memo.get(("costs",) + knobs)
        if first is not None and np.array_equal(first[0], per_set):
            return first[1]
        out = self._order.shortest_s(per_set, self._sorted_sets)
        if first is None:
            self._memo[("costs",) + knobs] = (per_set, out)
        return out

    @property
    def _order(self) -> "_LevelOrder":
        """The edges sorted once for :meth:`_LevelOrder.shortest_s` (built on first use, shared
        by every floor on the same lattice structure: :func:`_level_order`)."""
        if "order" not in self._memo:
            self._memo["order"] = _level_order(self.level, self.src, self.dst)
        return self._memo["order"]

    @property
    def _sorted_sets(self) -> list:
        """The set index of each edge in :attr:`_order`'s order (``inverse[order]``), split per
        level (:meth:`_LevelOrder.level_sets`), once."""
        if "sorted_sets" not in self._memo:
            self._memo["sorted_sets"] = self._order.level_sets(self.inverse[self._order.order])
        return self._memo["sorted_sets"]

    def _option_floor(self, C: np.ndarray, mem: np.ndarray, k: int, s_per_byte: float, overlap: bool,
                      tp: int, sram_bytes: float) -> np.ndarray:
        """Per set: the least relaxed time over the options that fit (inf where none does).

        Two options stand for all (the same floating-point values as trying each): the relaxed
        SRAM ``(f k X + c F) / tp`` grows with ``f`` (X, F >= 0; rounding is monotone), so a
        resident set fits at some fraction iff at the smallest, and a streamed set's time
        ``mem + (1/f - 1) Q s`` falls as ``f`` grows, so its best option is the largest ``f``
        that fits (a streamed f = 1 costs what a resident one does). Trying all 24 options was
        8% of DeepSeek-V3 / 512 dragonfly's serial search."""
        fr = _FRACTIONS_ARRAY
        resident = (fr[-1] * k * self.X + self.Fs) / tp <= sram_bytes
        fits = ((fr * k)[:, None] * self.X + STREAM_BUFFER_FRACTION * self.Fs) / tp <= sram_bytes
        first = fits.argmax(axis=0)  # (the largest fitting fraction; 0 where none fits: masked below)
        streamed = fits[first, np.arange(first.size)]
        m = mem + _REREADS[first] * self.Q * s_per_byte
        t_stream = np.maximum(C, m) if overlap else C + m
        t_res = np.maximum(C, mem + 0.0 * self.Q * s_per_byte) if overlap else C + (mem + 0.0 * self.Q * s_per_byte)
        best = np.where(resident, t_res, np.inf)
        return np.where(streamed, np.minimum(best, t_stream), best)


class _LevelOrder:
    """:func:`_shortest_s` with its edge order computed once per lattice: edges sorted by their
    destination's level, then destination; per level one slice, per destination one run, so a
    level is relaxed by one ``minimum.reduceat`` instead of a mask over every edge and an
    unbuffered ``minimum.at`` (the same minima: min is exact)."""

    def __init__(self, level: np.ndarray, src: np.ndarray, dst: np.ndarray):
        self.size = level.size
        order = np.lexsort((dst, level[dst]))
        self.order, self.src, dst = order, src[order], dst[order]
        edge_level = level[dst]
        self.levels = []  # (destinations, run starts relative to the level's slice, slice, its sources)
        bounds = np.searchsorted(edge_level, np.arange(1, int(level[-1]) + 2))
        for lv in range(1, int(level[-1]) + 1):
            a, b = int(bounds[lv - 1]), int(bounds[lv])
            if a == b:
                continue
            d = dst[a:b]
            starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
            self.levels.append((d[starts], starts, slice(a, b), self.src[a:b]))

    def level_sets(self, sorted_sets: np.ndarray) -> list:
        """``sorted_sets`` (a set index per edge, in this order) as one array per level: each
        level's edge costs are then one gather from the sets' costs, not a slice of a gather
        over every edge (30 % of :meth:`shortest_s` on DeepSeek-V3's 2,669-ideal lattice)."""
        return [sorted_sets[sl] for _, _, sl, _ in self.levels]

    def shortest_s(self, set_cost: np.ndarray, level_sets: list) -> float:
        """Shortest path with edge ``e`` (in this order) costing ``set_cost[sorted_sets[e]]``,
        ``sorted_sets`` given split per level (``level_sets``: :meth:`level_sets`). Every
        edge into an ideal lies in that ideal's level, so each ideal is relaxed once, from inf:
        the run minimum is its distance (the same minima as ``minimum(dist, run minimum)``)."""
        dist = np.full(self.size, np.inf)
        dist[0] = 0.0
        for (dsts, starts, _, src), sets in zip(self.levels, level_sets):
            edge = dist.take(src)  # (take, then an in-place add: the same sums, ~15 % faster than dist[src] + ...)
            edge += set_cost.take(sets)
            dist[dsts] = np.minimum.reduceat(edge, starts)
        return float(dist[-1])


#: level orders of recent lattice structures, keyed by the ids of their (held) edge arrays: the
#: structures are cached (``ideals.pair_structure``), so floors of the same phase shape at other
#: micro-batches, TP groups and placements share one sort (3 % of DeepSeek-V3/8192 dragonfly)
_LEVEL_ORDERS: "OrderedDict[tuple, tuple]" = OrderedDict()
_LEVEL_ORDERS_KEPT = 32


def _level_order(level: np.ndarray, src: np.ndarray, dst: np.ndarray) -> _LevelOrder:
    """:class:`_LevelOrder` of the edges, memoised on the arrays' identity (and checked equal
    levels: a lattice's level array is rebuilt per floor)."""
    key = (id(src), id(dst))
    hit = _LEVEL_ORDERS.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst and np.array_equal(hit[2], level):
        _LEVEL_ORDERS.move_to_end(key)
        return hit[3]
    out = _LevelOrder(level, src, dst)
    _LEVEL_ORDERS[key] = (src, dst, level, out)
    while len(_LEVEL_ORDERS) > _LEVEL_ORDERS_KEPT:
        _LEVEL_ORDERS.popitem(last=False)
    return out


def _shortest_s(level: np.ndarray, src: np.ndarray, dst: np.ndarray, cost: np.ndarray) -> float:
    """Shortest path from ideal 0 (empty) to the last (full) over edges from a smaller ideal to
    a larger one: relax level by level (``level``: each ideal's size; every edge's source lies
    on a lower level than its destination, so it is final when its level is relaxed)."""
    dist = np.full(level.size, np.inf)
    dist[0] = 0.0
    edge_level = level[dst]
    for lv in range(1, int(level[-1]) + 1):
        sel = edge_level == lv
        np.minimum.at(dist, dst[sel], dist[src[sel]] + cost[sel])
    return float(dist[-1])


def phase_graph(graph: DataflowGraph, names: set[str], stash_free: bool) -> DataflowGraph:
    """The phase ``names`` of ``graph`` as a graph of its own (as ``DataflowGraph.subgraph``);
    ``stash_free``: tensors from a forward kernel to a later-phase one are left out (the on-chip
    stash keeps them in SRAM: neither written nor read)."""
    kinds = {k.name: k for k in graph.kernels}

    def stash(t: Tensor) -> bool:
        p, c = kinds.get(t.producer), kinds.get(t.consumer)
        return p is not None and c is not None and p.phase == Phase.forward and c.phase != Phase.forward

    kept = [t for t in graph.tensors if not (stash_free and stash(t))]
    return DataflowGraph(graph.kernels, kept, name=graph.name, meta=graph.meta, check=False).subgraph(names)


def plan_floor(graph: DataflowGraph, system: System, names: set[str], stash_free: bool,
               max_pairs: int = MAX_FLOOR_PAIRS, max_ideals: int = MAX_FLOOR_IDEALS,
               network_s: dict[str, float] | None = None) -> PlanFloor | None:
    """:class:`PlanFloor` of the phase ``names`` of ``graph`` (one micro-batch, unsharded), or
    None when its kernels fit one partition (nothing to gain) or its ideals are too many.
    ``network_s``: network seconds per kernel of a graph whose communication kernels carry
    them (:attr:`PlanFloor.N`). Memoised per (graph, phase, chip, network): the search asks
    again at every TP degree."""
    chip = system.chip
    if chip.execution != "dataflow" or SMALL_PHASE_KERNELS < len(names) <= chip.compute_tiles:
        return None
    net = tuple(sorted((n, float(v)) for n, v in (network_s or {}).items() if n in names and v))
    key = (id(graph), frozenset(names), stash_free, max_pairs, max_ideals, chip.model_dump_json(), net)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is graph:  # (the graph is held: its id is not reused meanwhile)
        _PLANS.move_to_end(key)
        return hit[1]
    out = _plan_floor(graph, system, names, stash_free, max_pairs, max_ideals, dict(net))
    _PLANS[key] = (graph, out)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return out


#: recent plan floors, oldest first: key -> (graph, PlanFloor or None)
_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()
_PLANS_KEPT = 256


def _plan_floor(graph: DataflowGraph, system: System, names: set[str], stash_free: bool,
                max_pairs: int, max_ideals: int, network_s: dict[str, float]) -> PlanFloor | None:
    sub = phase_graph(graph, names, stash_free)
    key = (sub.content_key, system.chip.model_dump_json(), max_pairs, max_ideals)
    hit = _BY_CONTENT.get(key)
    if hit is None:
        hit = _BY_CONTENT[key] = _network_free_plan_floor(sub, system, max_pairs, max_ideals)
        while len(_BY_CONTENT) > _BY_CONTENT_KEPT:
            _BY_CONTENT.popitem(last=False)
    else:
        _BY_CONTENT.move_to_end(key)
    base, kernel_names = hit
    if base is None or not network_s:
        return base
    return replace(base, N=_per_set(base.sets, np.array([network_s.get(n, 0.0) for n in kernel_names])))


#: plan floors without network seconds by the content of their phase graph, oldest first: the
#: layer as sharded on TP groups placed differently (DeepSeek-V3 on 8192 dragonfly chips) has
#: the same kernels and tensors and differs only in its collectives' seconds (``N``), so its
#: lattice, sets and their terms are built once
_BY_CONTENT: "OrderedDict[tuple, tuple]" = OrderedDict()
_BY_CONTENT_KEPT = 4096


def _network_free_plan_floor(sub: DataflowGraph, system: System, max_pairs: int,
                             max_ideals: int) -> tuple[PlanFloor | None, list[str]]:
    """(:class:`PlanFloor` of the phase graph ``sub`` without ``N``, or None past the limits;
    its kernel names in set-column order)."""
    cm = CostModel(sub, system)
    names = [k.name for k in cm.kernels]
    try:
        lat = _dp.enumerate_ideals(cm, max_ideals=max_ideals)
    except TooLarge:
        return None, names
    st = _dp.pair_structure(lat, cm.tiles, max_pairs // 4)
    if st is None or st[0].size > max_pairs:
        return None, names
    src, dst, sets, inverse = st
    C, A, F = _set_terms(cm, sub, sets)
    terms = cm.terms_of(np.asarray(sets, dtype=bool))
    return PlanFloor(C, A, F, src, dst, inverse, lat.bits.sum(axis=1), math.ceil(cm.n / cm.tiles),
                     terms["sram_scaled"], terms["sram_fixed"], terms["stream_bytes"], sets=sets), names


def _per_set(S: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``S @ values`` over the boolean set rows without a float copy of ``S`` (a lattice's sets
    run to ~10^5 rows: the copy was 8 % of DeepSeek-V3/8192 dragonfly's search), as
    ``CostModel.terms_of`` sums its per-kernel terms."""
    return np.einsum("ij,j->i", np.asarray(S, dtype=bool), np.asarray(values, dtype=float))


def _set_terms(cm: CostModel, graph: DataflowGraph, S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per set: compute seconds at the achieved rate without padding, activation bytes and fixed
    bytes crossing its boundary (``CostModel.terms_of``'s crossing rule, split)."""
    precision = graph.meta.get("precision", "bf16")
    rate_free = np.array([0.0 if k.kind == KernelKind.comm or not k.flop else k.flop / achieved_rate_Fps(cm.chip, k, precision)
                          for k in cm.kernels])
    C = _per_set(S, rate_free)
    A = _per_set(S, cm.extra_bytes)
    F = np.zeros(S.shape[0])
    fixed_names = set()
    for t in graph.tensors:
        pk = graph.kernel(t.producer) if t.producer is not None else None
        if pk is not None and (pk.phase == Phase.weight_grad or is_weight_gradient(pk, t)):
            fixed_names.add((t.name, cm.index[t.producer]))
    none = np.zeros(S.shape[0], dtype=bool)
    for t in cm.tensors:
        enters, leaves, _, _ = tensor_boundary(S, t, none)
        crossing = enters | leaves
        if (t.name, t.producer) in fixed_names:
            F += t.bytes * crossing
        else:
            A += t.bytes * crossing
    for w in cm.weights:
        used = none
        for k in w.kernels:
            used = used | S[:, k]
        F += w.bytes * used
    return C, A, F


__all__ = ["PlanFloor", "plan_floor", "phase_graph"]


#: kernels a reduced phase (:func:`reduced_plan_floor`) keeps at most, trying fewer until its
#: lattice has at most the caller's ideals
REDUCED_MAX_KERNELS = 20


def reduced_plan_floor(graph: DataflowGraph, system: System, names: set[str], stash_free: bool,
                       max_ideals: int, network_s: dict[str, float] | None = None) -> PlanFloor | None:
    """:func:`plan_floor` of the phase restricted to its heaviest kernels (:func:`restricted_phase`),
    for a phase whose own lattice is too large (DeepSeek-V3's sharded MoE backward: ~20k ideals):
    the most kernels (at most :data:`REDUCED_MAX_KERNELS`, by :func:`_kernel_weight_s`) whose
    lattice has at most ``max_ideals`` ideals. Valid because every plan of the phase restricts
    to a plan of the restricted phase that costs no more (:func:`restricted_phase`)."""
    sub = phase_graph(graph, names, stash_free)
    net = {n: v for n, v in (network_s or {}).items() if n in names}
    cm = CostModel(sub, system, net)
    order = sorted(range(cm.n), key=lambda i: -_kernel_weight_s(cm, i))
    for n in range(min(REDUCED_MAX_KERNELS, cm.n - 1), system.chip.compute_tiles, -2):
        small = restricted_phase(sub, {cm.names[i] for i in order[:n]})
        try:
            _dp.enumerate_ideals(CostModel(small, system), max_ideals=max_ideals)
        except TooLarge:
            continue
        kept = {k.name for k in small.kernels}
        return plan_floor(small, system, kept, False, max_ideals=max_ideals,
                          network_s={n: v for n, v in net.items() if n in kept})
    return None


def _kernel_weight_s(cm: CostModel, i: int) -> float:
    """A kernel's own seconds, to pick which a reduced phase keeps (any choice is valid): the
    largest of its compute, network, and DRAM time for its weights, extra bytes and output."""
    k = cm.kernels[i]
    own = float(k.weight_bytes) + float(k.extra_memory_bytes) + float(k.output_bytes)
    return max(float(cm.compute_s[i]), float(cm.network_s[i]), own * cm.s_per_byte)


def restricted_phase(phase: DataflowGraph, keep: set[str]) -> DataflowGraph:
    """The phase graph ``phase`` restricted to the kernels ``keep``: the tensors between kept
    kernels and the phase's own inputs and outputs they read or write, and a zero-byte edge
    ``u -> v`` for every path from kept ``u`` to kept ``v`` through dropped kernels only (the
    order stays as narrow). A plan of the phase restricted to ``keep`` (each partition's kept
    kernels, in the same order) is a plan of this graph with no more kernels per partition; each
    restricted partition's compute and network are a part of the partition's, its weights and
    extra bytes too, and a tensor crossing it crosses the partition (the same producer and
    consumers inside or outside, and fewer consumers: a tensor leaves a partition that lacks
    some consumer), its SRAM likewise; so every restricted plan floor is below every plan."""
    tensors = [t for t in phase.tensors if (t.producer is None or t.producer in keep)
               and (t.consumer is None or t.consumer in keep)]
    succ: dict[str, set[str]] = {}
    for t in phase.tensors:
        if t.producer is not None and t.consumer is not None:
            succ.setdefault(t.producer, set()).add(t.consumer)
    for u in (k.name for k in phase.kernels if k.name in keep):
        seen, stack = set(), [w for w in succ.get(u, ()) if w not in keep]
        reached = set()
        while stack:
            w = stack.pop()
            if w in seen:
                continue
            seen.add(w)
            for x in succ.get(w, ()):
                (reached.add(x) if x in keep else stack.append(x))
        tensors += [Tensor(f"<order {u}->{v}>", u, v, 0.0) for v in sorted(reached)]
    kernels = [k for k in phase.kernels if k.name in keep]
    return DataflowGraph(kernels, tensors, name=f"{phase.name}[restricted]", meta=phase.meta, check=False)


__all__ += ["reduced_plan_floor", "restricted_phase"]
