"""Floor-pruned DP over the ideal lattice (dfmodel.intra_chip.bounded_dp): its floors are true
lower bounds of every plan (brute force), and its plan costs what the full DP's costs (random
small DAGs, streaming on and off, DRAM that binds; and a 12-kernel DAG with ~1,000 ideals)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dfmodel.intra_chip import CostModel, partition
from dfmodel.intra_chip import ideals as dpmod
from dfmodel.intra_chip import api
from dfmodel.intra_chip.bounded_dp import floor_s, solve_bounded
from test_intra_chip_support import chip, chips, dags, random_graph, streaming

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _dataflow(c):
    return c.execution == "dataflow"


@SETTINGS
@given(dags(), chips(execution="dataflow"), streaming())
def test_bounded_equals_full_dp_and_brute_force(g_net, c, stream):
    graph, net = g_net
    cm = CostModel(graph, c, net, **(stream or {}))
    lat = dpmod.enumerate_ideals(cm)
    brute = dpmod.brute_force(cm)
    full = dpmod.solve_dp(cm)
    for seed in (None, dpmod.solve_dp(cm, None, lattice=dpmod.chain_lattice(cm))):
        got = solve_bounded(cm, lat, seed, max_pairs=10**7)
        if brute is None:
            assert got is None and full is None
            continue
        assert got[1] == pytest.approx(brute[1], rel=1e-9) and full[1] == pytest.approx(brute[1], rel=1e-9)
        assert cm.check_plan(got[0]) is None
        assert cm.plan_time_s(got[0]) == pytest.approx(got[1], rel=1e-9)


def _row(cm, mask):
    return np.array([[(mask >> k) & 1 for k in range(cm.n)]], dtype=bool)


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("heavy", [2, 8])
@pytest.mark.parametrize("seed", range(40))
def test_floor_below_every_plan_of_every_remainder(seed, heavy, expand, monkeypatch):
    """h(I) = floor(V - I) is below every feasible plan of the kernels after ideal I, and
    floor(S) below every single partition S (brute force over all chains from every ideal);
    with 2 heavy kernels the others are light (memory_floor_s adds their bytes); with the
    heavy groups' floors expanded (expand_heavy_table) or not."""
    from dfmodel.intra_chip import bounded_dp
    monkeypatch.setattr(bounded_dp, "HEAVY_KERNELS", heavy)
    for cm, plan, blocks, ev in _evaluated_plans(seed):
        if expand:
            bounded_dp.expand_heavy_table(cm)
        full = (1 << cm.n) - 1
        assert np.all(floor_s(cm, blocks)[ev["feasible"]] <= ev["time_s"][ev["feasible"]] * (1 + 1e-12))
        if not ev["feasible"].all():
            continue
        # every suffix of the plan is a plan of the kernels after its first ideal
        for j, (placed, _) in enumerate(plan):
            rest = float(ev["time_s"][j:].sum())
            assert floor_s(cm, _row(cm, full & ~placed))[0] <= rest * (1 + 1e-12)


def _evaluated_plans(seed):
    """(cost model, plan, its blocks as rows, its evaluation) for every ordered plan of a random
    5-kernel graph on three chips (plenty of SRAM, 8 MiB, no overlap)."""
    graph, net = random_graph(seed, n=5)
    for c in (chip(), chip(sram_mib=8), chip(overlap=False)):
        cm = CostModel(graph, c, net)
        for plan in dpmod.ordered_plans(cm):
            blocks = np.vstack([_row(cm, b) for _, b in plan])
            yield cm, plan, blocks, cm.evaluate(blocks, np.vstack([_row(cm, p) for p, _ in plan]))


def _wide_graph():
    """Two independent 6-kernel chains joined at the end: 7 x 7 ideals + 1, enough for the
    bounded path through partition()."""
    from dfmodel.graph.graph import DataflowGraph
    from dfmodel.graph.kernel import Kernel, KernelKind, Tensor
    MIB = 2**20
    ks, ts = [], []
    for chain in "ab":
        for i in range(6):
            name = f"{chain}{i}"
            ks.append(Kernel(name, KernelKind.matmul, {"m": 1024, "n": 1024, "k": 1024},
                             flop=(1 + i + (chain == "b")) * 1e11, output_bytes=(4 + i) * MIB,
                             weight_bytes=(2 + i) * MIB))
            ts.append(Tensor(f"in{name}", None if i == 0 else f"{chain}{i - 1}", name, (4 + i) * MIB))
    ks.append(Kernel("z", KernelKind.elementwise, {"m": 1024, "n": 1024}, flop=1e9, output_bytes=8 * MIB))
    ts += [Tensor("ea", "a5", "z", 9 * MIB), Tensor("eb", "b5", "z", 9 * MIB), Tensor("out", "z", None, 8 * MIB)]
    return DataflowGraph(ks, ts, name="wide", meta={"tile_rows": 1024})


@pytest.mark.parametrize("sram_mib", [16, 48, 512])
def test_partition_through_bounded_path_equals_full_dp(monkeypatch, sram_mib):
    g = _wide_graph()
    c = chip(sram_mib=sram_mib, tiles=64)
    cm = CostModel(g, c)
    full = dpmod.solve_dp(cm)
    monkeypatch.setattr(api, "BOUNDED_MIN_IDEALS", 10)
    r = partition(g, c)
    assert dpmod.enumerate_ideals(cm).size == 50
    assert r.method == "dp" and r.proven_optimal
    assert r.time_s == pytest.approx(full[1], rel=1e-9)
    assert cm.plan_time_s(r.plan) == pytest.approx(full[1], rel=1e-9)


@pytest.mark.parametrize("tiles", [2, 4, 64])
def test_pair_estimate_is_exact_when_every_ideal_is_sampled(tiles):
    g = _wide_graph()
    cm = CostModel(g, chip(tiles=tiles))
    lat = dpmod.enumerate_ideals(cm)
    exact = dpmod.pair_structure(lat, tiles, 10**7)[0].size
    assert dpmod.estimate_pairs(lat, tiles, samples=lat.size) == pytest.approx(exact)
    assert exact > 0


@pytest.mark.parametrize("floor", ["relaxed", "expanded1", "expanded8"])
@pytest.mark.parametrize("seed", range(30))
def test_relaxed_floor_with_outside_below_every_partition(seed, floor, monkeypatch):
    """relaxed_floor_s(B, outside) and expanded_floor_s (one neighbour enumerated, or all) are
    below the time of every feasible partition P holding B and none of ``outside`` (every P, B
    inside P, outside inside the complement of P; brute force), with SRAM small enough that the
    tile, streaming and double buffers bind; the expanded floor is at least the relaxed one."""
    from dfmodel.intra_chip import bounded_dp
    monkeypatch.setattr(bounded_dp, "EXPAND_NEIGHBOURS", 1 if floor == "expanded1" else 8)
    relaxed_floor_s = bounded_dp.relaxed_floor_s if floor == "relaxed" else bounded_dp.expanded_floor_s
    graph, net = random_graph(seed, n=5)
    checked = 0
    for c in (chip(), chip(sram_mib=8), chip(sram_mib=2), chip(overlap=False)):
        cm = CostModel(graph, c, net)
        full = (1 << cm.n) - 1
        P_rows, B_rows, O_rows = [], [], []
        for P in range(1, full + 1):
            rest = full & ~P
            B = P
            while B:
                O = rest
                while True:
                    P_rows.append(P), B_rows.append(B), O_rows.append(O)
                    if O == 0:
                        break
                    O = (O - 1) & rest
                B = (B - 1) & P
        rows = lambda ms: np.array([[(m >> k) & 1 for k in range(cm.n)] for m in ms], dtype=bool)
        ev = cm.evaluate(rows(P_rows))
        lb = relaxed_floor_s(cm, rows(B_rows), rows(O_rows))
        assert np.all(lb >= bounded_dp.relaxed_floor_s(cm, rows(B_rows), rows(O_rows)) * (1 - 1e-12))
        ok = ev["feasible"]
        checked += ok.sum()
        assert np.all(lb[ok] <= ev["time_s"][ok] * (1 + 1e-12))
    assert checked > 0


def test_heavy_floor_binds_on_crossing_double_buffers():
    """A kernel whose input and output cross every partition holding it (graph input and output)
    double-buffers both: the floor sees the 2 f bytes and is the kernel's own time."""
    from dfmodel.graph.graph import DataflowGraph
    from dfmodel.graph.kernel import Kernel, KernelKind, Tensor
    from dfmodel.intra_chip.bounded_dp import heavy_floor_s
    MIB = 2**20
    k = Kernel("a", KernelKind.matmul, {"m": 4096, "n": 4096, "k": 4096}, flop=1e12, output_bytes=64 * MIB,
               weight_bytes=32 * MIB)
    g = DataflowGraph([k], [Tensor("x", None, "a", 64 * MIB), Tensor("y", "a", None, 64 * MIB)],
                      name="one", meta={"tile_rows": 4096})
    cm = CostModel(g, chip(sram_mib=40))
    one = np.ones((1, 1), dtype=bool)
    assert heavy_floor_s(cm, one)[0] == pytest.approx(cm.evaluate(one)["time_s"][0], rel=1e-12)


@pytest.mark.parametrize("heavy", [0, 2, 8])
@pytest.mark.parametrize("seed", range(40))
def test_memory_floor_below_the_memory_of_every_plan(seed, heavy, monkeypatch):
    """memory_floor_s(V - I) is below the summed DRAM seconds plus partition overheads of every
    feasible plan of the kernels after every ideal I (brute force): the oracle is the memory
    term alone, so a byte charged that a plan need not move shows."""
    from dfmodel.intra_chip import bounded_dp
    monkeypatch.setattr(bounded_dp, "HEAVY_KERNELS", heavy)
    checked = 0
    for cm, plan, _, ev in _evaluated_plans(seed):
        if not ev["feasible"].all():
            continue
        full = (1 << cm.n) - 1
        f = np.asarray(cm.fractions)[ev["tile"]]
        mem = ev["memory_s"] + cm.kernel_overhead_s + cm.tile_overhead_s / f
        for j, (placed, _) in enumerate(plan):
            lb = bounded_dp.memory_floor_s(cm, _row(cm, full & ~placed))[0]
            assert lb <= mem[j:].sum() * (1 + 1e-12)
            checked += 1
    assert checked > 0


def _set_partitions(items):
    """Every partition of the list ``items`` into non-empty groups (brute force)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def test_cheapest_split_is_the_least_grouping_by_brute_force():
    """_cheapest_split (settled by popcount level) equals the least sum of group costs over every
    partition of each bitmask's members into groups, infinite groups included."""
    from dfmodel.intra_chip.bounded_dp import _cheapest_split

    rng = np.random.default_rng(7)
    for n in (1, 3, 5):
        for _ in range(5):
            group = rng.random(1 << n)
            group[rng.random(1 << n) < 0.25] = np.inf
            table = _cheapest_split(group)
            for code in range(1, 1 << n):
                members = [i for i in range(n) if code >> i & 1]
                best = min(sum(group[sum(1 << i for i in g)] for g in part) for part in _set_partitions(members))
                assert table[code] == pytest.approx(best) or (np.isinf(best) and np.isinf(table[code]))
            assert table[0] == 0.0
