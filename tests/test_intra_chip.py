"""Intra-chip partitioning: MILP == exact DP == brute force (with and without weight streaming),
closed form, infeasibility, known cases."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfmodel.errors import InfeasibleError, SolverError
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.intra_chip import CostModel, partition
from dfmodel.intra_chip import ideals as dpmod
from dfmodel.intra_chip.milp import build, solve_milp
from dfmodel.solvers import gurobi_licence
from dfmodel.system.processor import compute_time_s, memory_time_s
from test_intra_chip_support import MIB, chip, chips, dags, random_graph, streaming

REL = 1e-6  # the MILP works in microseconds with a 1e-6 relative gap
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PARTS = st.sampled_from([None, 1, 2, 3])


def _agree(graph, net, c, max_partitions, solver, stream=None):
    cm = CostModel(graph, c, net, **(stream or {}))
    brute = dpmod.brute_force(cm, max_partitions)
    exact = dpmod.solve_dp(cm, max_partitions)
    start = exact[0] if exact and max_partitions is None else None  # also exercise cold starts
    milp = solve_milp(cm, max_partitions, solver=solver, start=start)
    if brute is None:
        assert exact is None
        assert milp.status == "infeasible" and milp.plan is None and milp.message
        return
    assert exact is not None and milp.status == "optimal", milp.message
    assert exact[1] == pytest.approx(brute[1], rel=1e-12)
    assert milp.objective_s == pytest.approx(brute[1], rel=REL)
    # both plans are valid and cost what they claim under the one cost model
    for plan, value in ((exact[0], exact[1]), (milp.plan, milp.objective_s)):
        assert cm.check_plan(plan) is None
        assert cm.plan_time_s(plan) == pytest.approx(value, rel=REL)
        if max_partitions is not None and cm.dataflow:
            assert len(plan) <= max_partitions
    return cm, exact


@SETTINGS
@given(dags(), chips(), PARTS, streaming())
def test_milp_equals_dp_equals_brute_force_highs(g_net, c, max_partitions, stream):
    graph, net = g_net
    _agree(graph, net, c, max_partitions, "highs", stream)


@pytest.mark.skipif(gurobi_licence()[0] == "none", reason="no usable Gurobi licence")
@SETTINGS
@given(dags(), chips(), PARTS, streaming())
def test_milp_equals_dp_equals_brute_force_gurobi(g_net, c, max_partitions, stream):
    graph, net = g_net
    _agree(graph, net, c, max_partitions, "gurobi", stream)  # these models fit the size-limited licence


def test_oracles_agree_where_weights_must_stream():
    """Random graphs on chips too small for their weights: the oracles agree, streaming is
    chosen, and it is needed (the resident-only model finds no plan or a slower one)."""
    streamed = needed = slower = 0
    for seed in range(40):
        graph, net = random_graph(seed)
        c = chip(sram_mib=(8, 16, 32)[seed % 3], tiles=(3, 64)[seed % 2], bw=(1e12, 100e9)[seed % 2])
        out = _agree(graph, net, c, None, "highs")
        if out is None:
            continue
        cm, (plan, value) = out
        rows = cm.report_sets(plan)
        streamed += any(r["weights_streamed"] and r["tile_fraction"] < 1 for r in rows)
        resident = dpmod.solve_dp(CostModel(graph, c, net, weight_streaming=False))
        needed += resident is None
        slower += resident is not None and resident[1] > value * (1 + 1e-9)
    assert streamed >= 10 and needed >= 5 and slower >= 5, (streamed, needed, slower)


def _closed_form(graph, c, net):
    """Kernel-by-kernel time written out independently of the cost module."""
    total = 0.0
    for k in graph.kernels:
        reads = {(t.name, t.producer): t.bytes for t in graph.tensors if t.consumer == k.name}
        writes = {t.name: t.bytes for t in graph.tensors if t.producer == k.name}
        traffic = sum(reads.values()) + sum(writes.values()) + k.weight_bytes + k.extra_memory_bytes
        parts = (compute_time_s(c, k, "bf16"), memory_time_s(c, traffic), net.get(k.name, 0.0))
        total += (max(parts) if c.overlap else sum(parts)) + c.efficiency.kernel_overhead_s
    return total


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dags(), st.booleans(), st.sampled_from([None, 2]))
def test_kernel_by_kernel_is_the_closed_form(g_net, overlap, max_partitions):
    graph, net = g_net
    c = chip(execution="kernel_by_kernel", overlap=overlap, dram_gib=64)
    expect = _closed_form(graph, c, net)
    r = partition(graph, c, network_time_s=net, max_partitions=max_partitions)
    assert r.method == "closed_form" and r.proven_optimal
    assert [p.kernels for p in r.partitions] == [[k] for k in graph.topological_names()]
    assert r.time_s == pytest.approx(expect, rel=1e-12)
    for method in ("dp", "milp"):  # the searches agree: every order costs the same
        assert partition(graph, c, network_time_s=net, method=method).time_s == pytest.approx(expect, rel=REL)


# -- known cases ---------------------------------------------------------------------------------
def _two_matmuls():
    def mm(name):
        return Kernel(name, KernelKind.matmul, {"m": 4096, "n": 4096, "k": 4096}, flop=2 * 4096**3,
                      output_bytes=32 * MIB, weight_bytes=32 * MIB)
    return DataflowGraph([mm("mm1"), mm("mm2")], [
        Tensor("x", None, "mm1", 32 * MIB), Tensor("h", "mm1", "mm2", 32 * MIB), Tensor("y", "mm2", None, 32 * MIB),
    ], meta={"tile_rows": 4096})


@pytest.mark.parametrize("method", ["auto", "dp", "milp"])
def test_two_matmuls_that_fit_fuse(method):
    r = partition(_two_matmuls(), chip(sram_mib=256, bw=100e9), method=method)
    assert r.plan == [["mm1", "mm2"]] and r.proven_optimal
    p = r.partitions[0]
    assert p.memory_bytes == pytest.approx(2 * 32 * MIB + 2 * 32 * MIB)  # x, y and both weights; h stays
    assert p.tile_fraction == 1.0 and p.sram_bytes <= 256 * MIB
    assert sum(p.tiles_per_kernel.values()) == 64 and p.integer_tile_compute_s >= p.compute_s


@pytest.mark.parametrize("method", ["auto", "dp", "milp"])
def test_two_matmuls_split_when_sram_is_small(method):
    # each matmul's weight alone (32 MiB) fits 40 MiB, both together do not
    r = partition(_two_matmuls(), chip(sram_mib=40, bw=100e9), method=method)
    assert r.plan == [["mm1"], ["mm2"]] and r.proven_optimal
    assert all(p.sram_bytes <= 40 * MIB for p in r.partitions)


def test_smaller_tiles_are_used_only_when_needed():
    # fused SRAM = 2 x 32 MiB weights + tile x (h FIFO 32 + x, y double buffers 2 x 2 x 32) MiB:
    # the largest tile that fits 105 MiB is 1/4; memory-bound, so fusing beats splitting
    r = partition(_two_matmuls(), chip(sram_mib=105, bw=10e9), tile_overhead_s=1e-6)
    assert r.plan == [["mm1", "mm2"]]
    assert r.partitions[0].tile_fraction == 0.25
    assert r.partitions[0].sram_bytes == pytest.approx(64 * MIB + 0.25 * (32 + 4 * 32) * MIB)
    big = partition(_two_matmuls(), chip(sram_mib=1024, bw=10e9), tile_overhead_s=1e-6)
    assert big.partitions[0].tile_fraction == 1.0
    assert r.time_s - big.time_s == pytest.approx(1e-6 * (4 - 1))  # three more tiles streamed


# -- infeasibility -------------------------------------------------------------------------------
def test_weights_beyond_sram_are_infeasible_with_reason():
    c = chip(sram_mib=16)  # 32 MiB weights: infeasible without streaming
    with pytest.raises(InfeasibleError, match=r"kernel 'mm1'.*resident weights 32\.0 MiB.*16\.0 MiB"):
        partition(_two_matmuls(), c, weight_streaming=False)
    cm = CostModel(_two_matmuls(), c, weight_streaming=False)
    assert dpmod.solve_dp(cm) is None
    out = solve_milp(cm, solver="highs")
    assert out.status == "infeasible" and out.plan is None
    assert "kernel 'mm1'" in out.message and "MiB" in out.message
    assert partition(_two_matmuls(), c).partitions[0].weights_streamed  # streaming fits
    # streaming needs its double buffer: 1/16 of 32 MiB does not fit 1 MiB
    with pytest.raises(InfeasibleError, match=r"kernel 'mm1'.*streaming buffer.*1\.0 MiB"):
        partition(_two_matmuls(), chip(sram_mib=1))
    cm = CostModel(_two_matmuls(), chip(sram_mib=1))
    assert dpmod.solve_dp(cm) is None and dpmod.brute_force(cm) is None
    out = solve_milp(cm, solver="highs")
    assert out.status == "infeasible" and "streamed weight buffers" in out.message


def test_activations_beyond_sram_at_every_tile_are_infeasible():
    c = chip(sram_mib=40)  # weights fit (32 MiB) but the 32 MiB tensors' buffers do not at tile 1
    g = _two_matmuls()
    for method in ("dp", "milp"):
        with pytest.raises(InfeasibleError, match=r"kernel 'mm\d' needs .* MiB of SRAM"):
            partition(g, c, method=method, tile_fractions=[1.0])
    out = solve_milp(CostModel(g, c, tile_fractions_=[1.0]), solver="highs")
    assert out.status == "infeasible" and "SRAM" in out.message


# -- weight streaming ----------------------------------------------------------------------------
def _one_kernel(phase):
    """One kernel (4096 rows) reading x (32 MiB) and writing y (32 MiB; for a weight-gradient
    kernel the 64 MiB gradient): a matmul with a 64 MiB weight, or a weight-gradient kernel."""
    if phase == Phase.weight_grad:
        k = Kernel("wg", KernelKind.matmul, {"m": 4096, "n": 8192, "k": 4096}, flop=2 * 4096 * 4096 * 8192,
                   output_bytes=64 * MIB, phase=phase)
        ts = [Tensor("x", None, "wg", 32 * MIB), Tensor("dy", None, "wg", 32 * MIB), Tensor("g", "wg", None, 64 * MIB)]
    else:
        k = Kernel("mm", KernelKind.matmul, {"m": 4096, "n": 8192, "k": 4096}, flop=2 * 4096 * 4096 * 8192,
                   output_bytes=32 * MIB, weight_bytes=64 * MIB)
        ts = [Tensor("x", None, "mm", 32 * MIB), Tensor("y", "mm", None, 32 * MIB)]
    return DataflowGraph([k], ts, meta={"tile_rows": 4096})


@pytest.mark.parametrize("method", ["auto", "dp", "milp", "brute_force"])
def test_weight_beyond_sram_streams_and_rereads_it_per_row_tile(method):
    # SRAM 16 MiB < the 64 MiB weight. Streamed: f (2 x 32 + 2 x 32) + 64/16 MiB fits at f = 1/16
    # (12 MiB); every one of the 16 row tiles re-reads the weight: 64 / f MiB of weight traffic
    g, c = _one_kernel(Phase.forward), chip(sram_mib=16, bw=100e9)
    f = 1 / 16
    weight_traffic = 64 * MIB / f
    expect = memory_time_s(c, 64 * MIB + weight_traffic) + c.efficiency.kernel_overhead_s + 1e-6 / f
    if method == "brute_force":
        plan, value = dpmod.brute_force(CostModel(g, c, tile_overhead_s=1e-6))
        assert plan == [["mm"]] and value == pytest.approx(expect, rel=1e-12)
        return
    r = partition(g, c, method=method, tile_overhead_s=1e-6)
    p = r.partitions[0]
    assert r.proven_optimal and p.weights_streamed and p.tile_fraction == f
    assert p.memory_bytes == pytest.approx(64 * MIB + weight_traffic)  # x, y, and W / f
    assert p.stream_extra_bytes == pytest.approx(weight_traffic - 64 * MIB)
    assert p.sram_bytes == pytest.approx(f * 128 * MIB + 64 * MIB / 16)
    assert r.time_s == pytest.approx(expect, rel=REL) and p.memory_s > p.compute_s
    with pytest.raises(InfeasibleError, match="resident weights 64.0 MiB"):
        partition(g, c, method=method, weight_streaming=False)


def test_streamed_gradient_accumulator_is_read_and_written_per_row_tile():
    # the 64 MiB gradient sums over all rows: resident it needs 64 MiB of SRAM; streamed it stays
    # in DRAM and each row tile after the first reads and writes it back: 2 (1/f - 1) x 64 MiB more
    g, c = _one_kernel(Phase.weight_grad), chip(sram_mib=16, bw=100e9)
    f = 1 / 16
    for method in ("dp", "milp"):
        p = partition(g, c, method=method).partitions[0]
        assert p.weights_streamed and p.tile_fraction == f
        assert p.memory_bytes == pytest.approx((32 + 32 + 64) * MIB + 2 * (1 / f - 1) * 64 * MIB)
        assert p.sram_bytes == pytest.approx(f * 128 * MIB + 64 * MIB / 16)
    big = partition(g, chip(sram_mib=256, bw=100e9)).partitions[0]  # fits resident: no re-reads
    assert big.tile_fraction == 1.0 and not big.weights_streamed and big.memory_bytes == pytest.approx(128 * MIB)


def test_streaming_trades_sram_for_traffic():
    # fused two matmuls on 105 MiB: resident needs tile 1/4 (64 MiB weights + tile x 160 MiB);
    # streaming fits at tile 1/2 but re-reads 64 MiB of weights once more. Memory-bound, so the
    # resident plan wins; with 100x the bandwidth and costly tiles streaming wins
    g = _two_matmuls()
    slow = partition(g, chip(sram_mib=105, bw=10e9), tile_overhead_s=1e-6).partitions[0]
    assert not slow.weights_streamed and slow.tile_fraction == 0.25
    fast = partition(g, chip(sram_mib=105, bw=1e12, peak=1e15), tile_overhead_s=1e-3)
    p = fast.partitions[0]
    assert fast.plan == [["mm1", "mm2"]] and p.weights_streamed and p.tile_fraction == 0.5
    assert p.memory_bytes == pytest.approx((32 + 32 + 2 * 32 / 0.5) * MIB)
    assert partition(g, chip(sram_mib=105, bw=1e12, peak=1e15), tile_overhead_s=1e-3, method="milp").time_s \
        == pytest.approx(fast.time_s, rel=REL)


def test_too_few_partitions_is_infeasible():
    with pytest.raises(InfeasibleError, match="at most 1 partitions"):
        partition(_two_matmuls(), chip(sram_mib=40, bw=100e9), max_partitions=1, method="milp", weight_streaming=False)


def test_dram_capacity_reorders_or_fails():
    # two independent producers whose outputs wait for one consumer: both must be parked
    k = [Kernel(n, KernelKind.elementwise, {"m": 1, "n": 1}, flop=1e9, output_bytes=60 * MIB) for n in "abc"]
    t = [Tensor("ta", "a", "c", 60 * MIB), Tensor("tb", "b", "c", 60 * MIB), Tensor("tc", "c", None, 1 * MIB)]
    g = DataflowGraph(k, t)
    c = chip(execution="kernel_by_kernel", dram_gib=100 / 1024)
    with pytest.raises(InfeasibleError):
        partition(g, c)
    r = partition(g, chip(execution="kernel_by_kernel", dram_gib=1))
    assert r.peak_dram_live_bytes == pytest.approx(120 * MIB)


# -- interface -----------------------------------------------------------------------------------
def test_result_fields_and_serialisation():
    r = partition(_two_matmuls(), chip(sram_mib=256), network_time_s={"mm2": 1e-3})
    d = r.to_dict()
    assert d["partitions"][0]["network_s"] == pytest.approx(1e-3)
    assert r.time_s >= 1e-3 and r.gap == 0.0 and r.solver == "dp" and r.status == "optimal"
    assert math.isclose(r.time_s, sum(p.time_s for p in r.partitions))


def test_guards_send_large_graphs_to_the_milp():
    g = _two_matmuls()
    c = chip(sram_mib=256)
    r = partition(g, c, max_ideals=1)
    assert r.method == "milp" and r.proven_optimal and r.plan == [["mm1", "mm2"]]
    with pytest.raises(SolverError, match="too large for the exact DP"):
        partition(g, c, method="dp", max_ideals=1)


def test_max_partitions_is_respected_and_costs_more():
    chain = [Kernel(f"k{i}", KernelKind.matmul, {"m": 2048, "n": 2048, "k": 2048}, flop=2 * 2048**3,
                    output_bytes=8 * MIB, weight_bytes=20 * MIB) for i in range(6)]
    ts = [Tensor("x", None, "k0", 8 * MIB)] + [Tensor(f"t{i}", f"k{i}", f"k{i + 1}", 8 * MIB) for i in range(5)]
    ts.append(Tensor("y", "k5", None, 8 * MIB))
    g = DataflowGraph(chain, ts, meta={"tile_rows": 2048})
    c = chip(sram_mib=48, bw=50e9)  # two resident weights per partition at most
    free = partition(g, c)
    assert free.num_partitions == 3  # streamed at tile 1 (no re-reads) or resident at tile 1/8
    for P in (3, 4):
        assert partition(g, c, max_partitions=P, method="milp").time_s == pytest.approx(free.time_s, rel=REL)
    two = partition(g, c, max_partitions=2)  # >= three weights in a partition: streamed at tile < 1
    assert two.num_partitions == 2 and any(p.weights_streamed and p.tile_fraction < 1 for p in two.partitions)
    assert two.time_s > free.time_s
    assert partition(g, c, max_partitions=2, method="milp").time_s == pytest.approx(two.time_s, rel=REL)
    with pytest.raises(InfeasibleError):
        partition(g, c, max_partitions=2, weight_streaming=False)


def test_milp_coefficients_are_scaled():
    form = build(CostModel(_two_matmuls(), chip(sram_mib=100)), None)
    assert any(s for _, s in form.options) and form.y is not None  # streamed options are modelled
    for arr in (form.model.A.data, form.model.c[form.model.c != 0]):
        assert abs(arr).max() < 1e7 and abs(arr).min() > 1e-6


def test_gpt3_1t_tp8_layer_fits_sn30_only_by_streaming():
    # one fc1 / fc2 weight shard at TP 8 is 655 MB, over the chip's 640 MB of SRAM
    import dfmodel
    from dfmodel.graph.build import build_graph
    from dfmodel.inter_chip.sharding import TPGroup, shard
    from dfmodel.netmodels import CostTable
    from dfmodel.system.loader import load_system

    system = load_system("sn30")
    graph = build_graph(dfmodel.load_workload("gpt3_1t"), batch=1)
    out = shard(graph, system, TPGroup(8, (("x", 8),)), CostTable(system), sequence_parallel=True)
    g = out.graph
    assert max(k.weight_bytes for k in g.kernels) > system.chip.sram_bytes
    for forward in (True, False):
        names = [k.name for k in g.kernels if (k.phase == Phase.forward) == forward]
        sub = g.subgraph(names, name="fwd" if forward else "bwd")
        net = {n: out.network_time_s[n] for n in names if n in out.network_time_s}
        with pytest.raises(InfeasibleError, match="resident weights"):
            partition(sub, system, network_time_s=net, weight_streaming=False)
        r = partition(sub, system, network_time_s=net)
        assert r.proven_optimal and any(p.weights_streamed for p in r.partitions)
        assert all(p.sram_bytes <= system.chip.sram_bytes for p in r.partitions)
        if forward:
            m = partition(sub, system, network_time_s=net, method="milp", solver="highs")
            assert m.proven_optimal and m.time_s == pytest.approx(r.time_s, rel=REL)


def test_transition_structure_cache_gives_the_same_edges():
    """The pairs of a lattice are cached across graphs of the same shape; the edges (and so the
    DP's plan) equal those computed from scratch."""
    import numpy as np

    from dfmodel.intra_chip import ideals

    for cm in [c for c in _structure_cache_cases()]:
        lat = ideals.enumerate_ideals(cm)
        ideals._STRUCTURES.clear()
        cold = ideals.transitions(cm, lat)
        warm = ideals.transitions(cm, lat)  # from the cache
        screened = ideals._pairs_screened(cm, lat, cm.tiles if cm.dataflow else cm.n,
                                          cm.min_sram_bytes(lat.bits) if cm.dataflow else np.zeros(lat.size), 10**9)
        for e in (warm,):
            assert np.array_equal(e.src, cold.src) and np.array_equal(e.dst, cold.dst)
            assert np.allclose(e.cost_s, cold.cost_s)
        assert set(zip(cold.src.tolist(), cold.dst.tolist())) <= set(zip(screened[0].tolist(), screened[1].tolist()))


def _structure_cache_cases():
    from dfmodel.graph.workload import load_workload
    from dfmodel.graph.build import build_graphs
    from dfmodel.system import load_system

    g = build_graphs(load_workload("tiny_mlp")).layer
    for preset in ("sn30", "wse2", "dgx_a100"):
        yield CostModel(g, load_system(preset))


def random_ideal_bits(n: int, *, seed: int, limit: int):
    """Ideals (down-closed sets) of a random DAG on ``n`` kernels, each with up to two
    predecessors, walked breadth-first from the empty set until about ``limit`` are found: one
    row per ideal (kernel membership), ordered by size then members, as a lattice keeps them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pred = [set(rng.choice(k, size=min(k, 2), replace=False).tolist()) if k else set() for k in range(n)]
    seen, frontier = {frozenset()}, [frozenset()]
    while frontier and len(seen) < limit:
        frontier = [s | {k} for s in frontier for k in range(n) if k not in s and pred[k] <= s]
        frontier = [s for s in dict.fromkeys(frontier) if s not in seen]
        seen.update(frontier)
    order = sorted(seen, key=lambda s: (len(s), sorted(s)))
    bits = np.zeros((len(order), n), bool)
    for r, s in enumerate(order):
        bits[r, list(s)] = True
    return bits


def test_pair_structure_blocks_keep_the_per_ideal_order(monkeypatch):
    """pair_structure tests the ideals of one size a block at a time (ideals._superset_pairs): the
    same (src, dst) pairs, in the same order (src, then dst: the DP's ties go to the first edge),
    as testing each ideal against the next ``max_size`` sizes, on 70 kernels (two words) and with
    blocks of a few ideals (the chunking)."""
    import numpy as np

    from dfmodel.intra_chip import ideals

    n = 70
    bits = random_ideal_bits(n, seed=1, limit=1500)
    lat = ideals.Lattice(bits)
    packed, sizes = ideals._pack(bits), bits.sum(axis=1)
    monkeypatch.setattr(ideals, "_PAIR_BLOCK", 64)
    for max_size in (1, 3, n):
        want = [(i, int(j)) for i in range(lat.size)
                for j in np.flatnonzero(ideals.supersets_in(packed, i, np.searchsorted(sizes, sizes[i], side="right"),
                                                            np.searchsorted(sizes, sizes[i] + max_size, side="right")))
                + np.searchsorted(sizes, sizes[i], side="right")]
        ideals._STRUCTURES.clear()
        src, dst, _, _ = ideals.pair_structure(lat, max_size, 10**7)
        assert list(zip(src.tolist(), dst.tolist())) == want and want


def _permuted_dag_lattice(n: int, seed: int, chain: bool):
    """(packed words, sizes) of a lattice of a random DAG on ``n`` kernels whose labels are
    shuffled (so no topological order is the index order): every ideal, or (``chain``) the
    prefixes of one topological order, sorted as ``ideals._lattice`` sorts them."""
    import random

    import numpy as np

    from dfmodel.algorithms import ideal_masks
    from dfmodel.intra_chip import ideals

    rng = random.Random(seed)
    label = list(range(n))
    rng.shuffle(label)
    pred = [0] * n  # kernel k (topological position) -> its producers among the last few, by label
    for k in range(n):
        for p in rng.sample(range(max(0, k - 4), k), min(k, rng.randint(1, 2))):
            pred[label[k]] |= 1 << label[p]
    if chain:
        masks, acc = [0], 0
        for k in range(n):
            acc |= 1 << label[k]
            masks.append(acc)
    else:
        masks = ideal_masks(n, pred)
    masks = sorted(masks, key=lambda m: (m.bit_count(), m))
    bits = ideals._unpack(np.array(masks, dtype=np.uint64).reshape(-1, 1), n)
    return ideals._pack(bits), bits.sum(axis=1)


@pytest.mark.parametrize("n, seed, chain", [(12, 1, False), (20, 2, False), (30, 3, False), (45, 4, False),
                                             (63, 5, False), (40, 6, True), (64, 7, True)])
def test_superset_pairs_by_covers_equal_the_candidate_test(n, seed, chain, monkeypatch):
    """The cover walk (ideals._superset_pairs_by_covers, large one-word lattices) finds the very
    pairs the candidate test finds, in the same order (src, then dst: the DP's ties go to the
    first edge), at every size limit, on DAGs whose labels are no topological order, on every
    ideal and on one order's prefixes; both refuse past the same limit."""
    import numpy as np

    from dfmodel.intra_chip import ideals

    packed, sizes = _permuted_dag_lattice(n, seed, chain)
    assert sizes.size > 20
    for max_size in (1, 2, 4, n):
        monkeypatch.setattr(ideals, "_COVER_MIN_IDEALS", 10**9)
        want_s, want_d = ideals._superset_pairs(packed, sizes, max_size, 10**8)
        monkeypatch.setattr(ideals, "_COVER_MIN_IDEALS", 0)
        got_s, got_d = ideals._superset_pairs(packed, sizes, max_size, 10**8)
        want = (np.concatenate(want_s), np.concatenate(want_d))
        got = (np.concatenate(got_s), np.concatenate(got_d))
        assert want[0].size and np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert ideals._superset_pairs(packed, sizes, max_size, want[0].size - 1) == (None, None)
        assert ideals._superset_pairs(packed, sizes, max_size, want[0].size)[0] is not None


def test_sram_screen_skipped_only_where_it_keeps_every_pair(monkeypatch):
    """transitions skips the per-pair SRAM screen where the largest one-kernel bounds prove it
    keeps every pair (ideals._every_set_fits_sram): the same edges and costs as screening, on
    random DAGs at SRAM sizes where the proof holds and where the screen drops pairs; both
    happen."""
    import numpy as np

    from dfmodel.intra_chip import ideals

    outcomes = set()
    for seed in range(12):
        g, net = random_graph(seed, 7)
        for sram_mib in (8.0, 24.0, 256.0):
            cm = CostModel(g, chip(sram_mib=sram_mib, tiles=3), net)
            lat = ideals.enumerate_ideals(cm)
            skipped = ideals._every_set_fits_sram(cm, cm.tiles)
            fast = ideals.transitions(cm, lat)
            with monkeypatch.context() as mp:
                mp.setattr(ideals, "_every_set_fits_sram", lambda *a: False)
                screened = ideals.transitions(cm, lat)
            assert np.array_equal(fast.src, screened.src) and np.array_equal(fast.dst, screened.dst)
            assert np.array_equal(fast.cost_s, screened.cost_s)
            weights = cm.min_sram_bytes(lat.bits)
            dropped = bool((weights[screened.dst] - weights[screened.src] > cm.sram_bytes * (1 + 1e-12)).any()
                           or np.isinf(screened.cost_s).any())
            outcomes.add((skipped, dropped))
    assert (True, False) in outcomes and (False, True) in outcomes
