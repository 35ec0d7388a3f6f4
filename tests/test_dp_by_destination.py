"""The intra-chip DP's edges grouped by destination once per lattice structure (issue 12: the
per-solve sort, gathers and tight-edge ``unique`` were a third of DeepSeek-V3 / 512 dragonfly's
block solves): the same edges, and the same plan and time, as the per-solve sorted relaxation
over the edges in the structure's order."""

from __future__ import annotations

import numpy as np
import pytest

from dfmodel.graph.build import build_graphs
from dfmodel.graph.kernel import Phase
from dfmodel.graph.workload import load_workload
from dfmodel.intra_chip import ideals
from dfmodel.intra_chip.cost import CostModel
from dfmodel.system import load_system


def _in_structure_order(cm: CostModel, lat: ideals.Lattice) -> ideals.Edges:
    """:func:`ideals.transitions` as it was: the structure's (source-major) order, unsorted."""
    st = ideals.pair_structure(lat, cm.tiles if cm.dataflow else cm.n, ideals.DEFAULT_MAX_PAIRS)
    src, dst, sets, inverse = st
    weights = cm.min_sram_bytes(lat.bits) if cm.dataflow else np.zeros(lat.size)
    screen = weights[dst] - weights[src] <= cm.sram_bytes * (1 + 1e-12)
    src, dst, inverse = src[screen], dst[screen], inverse[screen]
    ev = cm.evaluate(sets)
    keep = ev["feasible"][inverse]
    if cm.dram_check:
        keep &= cm.dram_fits(cm.live_bytes(lat.bits[src], lat.bits[dst]))
    return ideals.Edges(src[keep], dst[keep], ev["time_s"][inverse][keep])


def _cases():
    tiny = build_graphs(load_workload("tiny_mlp")).layer
    for preset in ("sn30", "wse2", "dragonfly"):
        yield tiny, preset
    layer = build_graphs(load_workload("gpt3_13b"), batch=1).layer
    fwd = [k.name for k in layer.kernels if k.phase == Phase.forward]
    yield layer.subgraph(fwd, name="fwd"), "dragonfly"
    yield layer.subgraph(fwd, name="fwd"), "sn30"


@pytest.mark.parametrize("case", range(5))
def test_grouped_edges_give_the_sorted_relaxations_plan(case):
    graph, preset = list(_cases())[case]
    cm = CostModel(graph, load_system(preset))
    lat = ideals.enumerate_ideals(cm)
    grouped = ideals.transitions(cm, lat)
    plain = _in_structure_order(cm, lat)
    assert grouped.by_destination and not plain.by_destination
    # the same edges, grouped by destination (sizes non-decreasing), each one's in the old order
    sizes = lat.bits.sum(axis=1)
    assert np.all(np.diff(grouped.dst) >= 0) and np.all(np.diff(sizes[grouped.dst]) >= 0)
    order = np.argsort(plain.dst, kind="stable")
    assert np.array_equal(grouped.src, plain.src[order]) and np.array_equal(grouped.dst, plain.dst[order])
    assert np.array_equal(grouped.cost_s, plain.cost_s[order])
    assert ideals.shortest_plan(cm, lat, grouped) == ideals.shortest_plan(cm, lat, plain)


def test_structure_is_grouped_once(monkeypatch):
    """A lattice's structure is grouped by destination once (one sort), however many graphs of
    its shape solve: no sort per solve."""
    calls = []
    real = np.argsort
    monkeypatch.setattr(ideals.np, "argsort", lambda *a, **k: calls.append(1) or real(*a, **k))
    graph = build_graphs(load_workload("tiny_mlp")).layer
    ideals._BY_DESTINATION.clear()
    ideals._STRUCTURES.clear()
    for preset in ("sn30", "sn30", "sn30"):
        cm = CostModel(graph, load_system(preset))
        ideals.shortest_plan(cm, ideals.enumerate_ideals(cm), ideals.transitions(cm, ideals.enumerate_ideals(cm)))
    assert len(ideals._BY_DESTINATION) == 1 and len(calls) == 1


@pytest.mark.parametrize("bits", [20, 12, 6, 1])
def test_hashed_unique_equals_numpy_unique(bits):
    """The pair structure's distinct sets by hashing (:func:`ideals._unique_hashed`): the same
    sorted keys and inverse as ``np.unique``, with many collisions too (few buckets)."""
    rng = np.random.default_rng(bits)
    for _ in range(5):
        distinct = rng.integers(0, 2**63, size=int(rng.integers(1, 30_000)), dtype=np.uint64) << np.uint64(1)
        keys = distinct[rng.integers(0, distinct.size, size=int(rng.integers(1 << 16, 1 << 19)))]
        got, inverse = ideals._unique_hashed(keys, bits)
        want, want_inverse = np.unique(keys, return_inverse=True)
        assert np.array_equal(got, want) and np.array_equal(inverse, want_inverse.ravel())


def test_pair_structure_sets_are_hashed(monkeypatch):
    """A large lattice's distinct sets are found by hashing, not by sorting every pair."""
    sorted_sizes = []
    real = np.unique
    monkeypatch.setattr(ideals.np, "unique", lambda a, *x, **k: sorted_sizes.append(np.size(a)) or real(a, *x, **k))
    layer = build_graphs(load_workload("deepseek_v3"), batch=1).layer  # (its backward: ~10^6 pairs)
    bwd = [k.name for k in layer.kernels if k.phase != Phase.forward]
    cm = CostModel(layer.subgraph(bwd, name="bwd"), load_system("dragonfly"))
    lat = ideals.enumerate_ideals(cm)
    ideals._STRUCTURES.clear()
    src, _, sets, _ = ideals.pair_structure(lat, cm.tiles, ideals.DEFAULT_MAX_PAIRS)
    assert src.size >= 1 << 16 and max(sorted_sizes) < src.size


def test_large_structure_is_not_grouped(monkeypatch):
    """A structure past the grouping's pair budget keeps its order (no copy): the per-solve sort,
    the same plan."""
    graph = build_graphs(load_workload("gpt3_13b"), batch=1).layer
    fwd = [k.name for k in graph.kernels if k.phase == Phase.forward]
    cm = CostModel(graph.subgraph(fwd, name="fwd"), load_system("dragonfly"))
    lat = ideals.enumerate_ideals(cm)
    grouped = ideals.transitions(cm, lat)
    ideals._BY_DESTINATION.clear()
    monkeypatch.setattr(ideals, "_BY_DESTINATION_MAX_PAIRS", 2)
    plain = ideals.transitions(cm, lat)
    assert grouped.by_destination and not plain.by_destination and not ideals._BY_DESTINATION
    assert ideals.shortest_plan(cm, lat, grouped) == ideals.shortest_plan(cm, lat, plain)


@pytest.mark.parametrize("n", [40, 70])
def test_superset_pairs_one_word_and_many(n):
    """The pairs ``I < J``, ``|J - I| <= max_size``, in (src, dst) order, on one 64-bit word per
    ideal (its 2-D test) and on two, against testing each ideal one by one."""
    from test_intra_chip import random_ideal_bits

    bits = random_ideal_bits(n, seed=n, limit=1200)
    packed, sizes = ideals._pack(bits), bits.sum(axis=1)
    for max_size in (1, 4):
        want = [(i, j) for i in range(len(bits)) for j in range(i + 1, len(bits))
                if sizes[i] < sizes[j] <= sizes[i] + max_size and not np.any(bits[i] & ~bits[j])]
        src, dst = ideals._superset_pairs(packed, sizes, max_size, 10**9)
        assert list(zip(np.concatenate(src).tolist(), np.concatenate(dst).tolist())) == want


def test_ideals_by_size_equal_the_depth_first_walk():
    """The lattice's ideals one size at a time on 64-bit words (:func:`algorithms.ideal_masks`,
    up to 64 kernels) are the depth-first walk's, and refused past the same guard."""
    import random

    from dfmodel import algorithms

    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(0, 64)
        density = rng.choice([0.02, 0.1, 0.3])
        preds = [sum(1 << j for j in range(k) if rng.random() < density) for k in range(n)]
        limit = rng.choice([50, 1000, 20_000])
        outcomes = []
        for f in (algorithms._ideal_masks_by_size, algorithms._ideal_masks_dfs):
            try:
                outcomes.append(f(n, preds, limit))
            except algorithms.TooLarge:
                outcomes.append("too large")
        assert outcomes[0] == outcomes[1]



def _small_sram_cases():
    """The cases of :func:`_cases`, and the dragonfly forward at 30 % and 10 % of its SRAM: pairs
    the SRAM screen or every option drops (the latter: no plan at all)."""
    yield from _cases()
    layer = build_graphs(load_workload("gpt3_13b"), batch=1).layer
    fwd = layer.subgraph([k.name for k in layer.kernels if k.phase == Phase.forward], name="fwd")
    base = load_system("dragonfly")
    for share in (0.3, 0.1):
        chip = base.chip.model_copy(update={"sram_bytes": base.chip.sram_bytes * share})
        yield fwd, base.model_copy(update={"chip": chip})


@pytest.mark.parametrize("case", range(7))
def test_infinite_edges_kept_give_the_compacted_plan(case, monkeypatch):
    """:func:`ideals.transitions` keeps the infeasible edges at an infinite cost where they are
    few (:data:`ideals._INF_EDGES_KEPT_SHARE`): the finite edges are the compacted list's, in
    its order, and the plan and time are the same (None where no plan fits)."""
    graph, system = list(_small_sram_cases())[case]
    cm = CostModel(graph, load_system(system) if isinstance(system, str) else system)
    lat = ideals.enumerate_ideals(cm)
    monkeypatch.setattr(ideals, "_INF_EDGES_KEPT_SHARE", 1.0)
    kept = ideals.transitions(cm, lat)
    monkeypatch.setattr(ideals, "_INF_EDGES_KEPT_SHARE", 0.0)
    compact = ideals.transitions(cm, lat)
    finite = np.isfinite(kept.cost_s)
    assert np.all(np.isfinite(compact.cost_s)) and (case < 5 or not finite.all())
    assert np.array_equal(kept.src[finite], compact.src) and np.array_equal(kept.dst[finite], compact.dst)
    assert np.array_equal(kept.cost_s[finite], compact.cost_s)
    assert ideals.shortest_plan(cm, lat, kept) == ideals.shortest_plan(cm, lat, compact)
    for limit in (1, 2, 3):
        assert ideals.shortest_plan(cm, lat, kept, limit) == ideals.shortest_plan(cm, lat, compact, limit)


def _transitions_by_share(case: int, shares: tuple[float, ...]) -> tuple:
    """The lattice of small-SRAM case ``case`` and its transitions with infinite edges kept
    below each share of :data:`ideals._INF_EDGES_KEPT_SHARE` (0: always compacted, 1: always kept)."""
    graph, system = list(_small_sram_cases())[case]
    cm = CostModel(graph, load_system(system) if isinstance(system, str) else system)
    lat = ideals.enumerate_ideals(cm)
    out = []
    for share in shares:
        ideals._INF_EDGES_KEPT_SHARE, before = share, ideals._INF_EDGES_KEPT_SHARE
        try:
            out.append(ideals.transitions(cm, lat))
        finally:
            ideals._INF_EDGES_KEPT_SHARE = before
    return lat, out


@pytest.mark.parametrize("case", range(7))
def test_tight_edges_found_when_asked_equal_every_ideals_first(case):
    """:class:`ideals._RunTightEdges` (the first tight edge of an ideal's run, found when the
    walk back asks) gives, for every ideal, the first edge into it achieving its distance over
    all edges (``_first_tight_edge``), -1 where none does, infinite edges kept or not."""
    lat, by_share = _transitions_by_share(case, (0.0, 1.0))
    for e in by_share:
        if e.src.size == 0:
            continue
        dist, pred = ideals._settle_by_destination(lat, e.src, e.dst, e.cost_s)
        want = ideals._first_tight_edge(e.src, e.dst, e.cost_s, dist, lat.size)
        reachable = np.flatnonzero(np.isfinite(dist))
        assert reachable.size > 1
        assert [pred[int(i)] for i in reachable] == want[reachable].tolist()


def _settle_as_first_written(lat: ideals.Lattice, src, dst, cost) -> np.ndarray:
    """:func:`ideals._settle_by_destination`'s distances as first written: the runs found per
    solve, ``dist[src] + cost`` per level."""
    dist = np.full(lat.size, np.inf)
    dist[0] = 0.0
    starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    ends = np.r_[starts[1:], dst.size]
    heads = dst[starts]
    level_of_run = lat.bits.sum(axis=1)[heads]
    bounds = np.searchsorted(level_of_run, np.arange(int(level_of_run[-1]) + 2))
    for lv in range(int(level_of_run[0]), int(level_of_run[-1]) + 1):
        r0, r1 = int(bounds[lv]), int(bounds[lv + 1])
        if r0 != r1:
            a, b = int(starts[r0]), int(ends[r1 - 1])
            dist[heads[r0:r1]] = np.minimum.reduceat(dist[src[a:b]] + cost[a:b], starts[r0:r1] - a)
    return dist


@pytest.mark.parametrize("case", range(7))
def test_runs_kept_per_shared_edges_give_the_same_distances(case):
    """:func:`ideals._runs` keeps a shared edge array's runs (:func:`ideals._by_destination`'s)
    across solves, never a compacted list's: cold, warm and compacted, the distances are the
    per-solve runs' and the tight edges every ideal's first."""
    lat, by_share = _transitions_by_share(case, (1.0, 0.0))
    for e in by_share:
        if e.src.size == 0:
            continue
        shared = any(v[1][1] is e.dst for v in ideals._BY_DESTINATION.values())
        ideals._RUNS.clear()
        want = _settle_as_first_written(lat, e.src, e.dst, e.cost_s)
        for _ in range(2):  # (cold, then warm where shared)
            dist, pred = ideals._settle_by_destination(lat, e.src, e.dst, e.cost_s)
            assert np.array_equal(dist, want)
            assert (id(e.dst) in ideals._RUNS) == shared
        first = ideals._first_tight_edge(e.src, e.dst, e.cost_s, dist, lat.size)
        reachable = np.flatnonzero(np.isfinite(dist))
        assert [pred[int(i)] for i in reachable] == first[reachable].tolist()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 63, 64, 65, 100, 128, 130])
def test_pack_by_packbits_equals_the_product(n):
    """:func:`ideals._pack` (by ``packbits``) gives the words, shape and dtype of the 64-fold
    product it replaced, on C and Fortran ordered rows."""
    rng = np.random.default_rng(n)
    for m in (0, 1, 5, 300):
        bits = rng.random((m, n)) < 0.5
        for b in (bits, np.asfortranarray(bits)):
            got, want = ideals._pack(b), ideals._pack_by_product(b)
            assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 22])
def test_superset_pairs_in_small_blocks_reuse_the_test_buffers(block, monkeypatch):
    """:func:`ideals._superset_pairs` with blocks of every size (the one-word test's buffers kept
    across blocks of different shapes, grown when a block needs more): the pairs of testing
    each ideal one by one, in (src, dst) order."""
    from test_intra_chip import random_ideal_bits

    monkeypatch.setattr(ideals, "_PAIR_BLOCK", block)
    bits = random_ideal_bits(12, seed=3, limit=1200)
    packed, sizes = ideals._pack(bits), bits.sum(axis=1)
    want = [(i, j) for i in range(len(bits)) for j in range(i + 1, len(bits))
            if sizes[i] < sizes[j] <= sizes[i] + 3 and not np.any(bits[i] & ~bits[j])]
    src, dst = ideals._superset_pairs(packed, sizes, 3, 10**9)
    assert list(zip(np.concatenate(src).tolist(), np.concatenate(dst).tolist())) == want


def test_runs_are_kept_only_for_edge_arrays_still_grouped(monkeypatch):
    """:data:`ideals._RUNS` holds no edge array that :data:`ideals._BY_DESTINATION` has let go
    (it would keep millions of pairs alive): after the grouped structures are evicted, the next
    kept runs drop theirs."""
    graph, system = list(_small_sram_cases())[0]
    cm = CostModel(graph, load_system(system) if isinstance(system, str) else system)
    lat = ideals.enumerate_ideals(cm)
    e = ideals.transitions(cm, lat)
    ideals._settle_by_destination(lat, e.src, e.dst, e.cost_s)
    assert id(e.dst) in ideals._RUNS
    monkeypatch.setattr(ideals, "_BY_DESTINATION", type(ideals._BY_DESTINATION)())
    monkeypatch.setattr(ideals, "_STRUCTURES", type(ideals._STRUCTURES)())
    other, system2 = list(_small_sram_cases())[2]
    cm2 = CostModel(other, load_system(system2) if isinstance(system2, str) else system2)
    lat2 = ideals.enumerate_ideals(cm2)
    e2 = ideals.transitions(cm2, lat2)
    ideals._settle_by_destination(lat2, e2.src, e2.dst, e2.cost_s)
    assert id(e2.dst) in ideals._RUNS and id(e.dst) not in ideals._RUNS
