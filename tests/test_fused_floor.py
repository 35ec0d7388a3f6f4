"""The relaxed-plan floor of a dataflow phase (dfmodel/inter_chip/fused_floor.py, issue 12):
its shortest path equals brute force over every plan on small random DAGs, it lies below every
solved phase of shipped layers on the few-tile dragonfly chip, it is tighter than the
closed-form floor there, and the search keeps the exhaustive optimum on a few-tile chip."""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache

import numpy as np
import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InfeasibleError
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.inter_chip import dataflow_floor as dff
from dfmodel.inter_chip import fused_floor as ff
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel, _is_attention_core
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.intra_chip import partition
from dfmodel.intra_chip.cost import CostModel
from tests.test_inter_chip import SMALL_LLM, small_system


def _few_tile_system(tiles: int, **kw):
    s = small_system(4, 2, **kw)
    s["chip"].update(execution="dataflow", overlap=True, compute_tiles=tiles)
    return s


def _random_dag(seed: int, n: int) -> DataflowGraph:
    rng = random.Random(seed)
    ks = [Kernel(f"k{i}", KernelKind.matmul if rng.random() < 0.6 else KernelKind.elementwise,
                 {"m": 128, "n": 128, "k": 128}, flop=rng.choice([1e8, 1e9, 4e9]), output_bytes=1e6,
                 weight_bytes=rng.choice([0.0, 2e6, 8e6]), phase=Phase.forward) for i in range(n)]
    ts = [Tensor("x", None, "k0", rng.choice([1e6, 5e6]))]
    for v in range(1, n):
        for u in rng.sample(range(v), min(v, rng.choice([1, 1, 2]))):
            ts.append(Tensor(f"t{u}", f"k{u}", f"k{v}", rng.choice([1e5, 1e6, 2e7])))
    ts += [Tensor(f"t{u}", f"k{u}", None, 3e6) for u in range(n) if not any(t.producer == f"k{u}" for t in ts)]
    return DataflowGraph(ks, ts)


def _brute_force_s(graph: DataflowGraph, system, k: int, tiles: int, network_s: dict[str, float] | None = None) -> float:
    """Least sum of max(k C, s (k A + F)[, N]) over every sequence of partitions of at most
    ``tiles`` kernels whose prefixes are down-sets (every order-respecting plan); with
    ``network_s`` (seconds per kernel) each partition also takes at least its kernels' network."""
    cm = CostModel(graph, system)
    n = cm.n
    full = (1 << n) - 1
    index = {kn.name: i for i, kn in enumerate(cm.kernels)}

    def cost(mask: int) -> float:
        S = np.array([[(mask >> i) & 1 for i in range(n)]], dtype=bool)
        C, A, F = ff._set_terms(cm, graph, S)
        nw = sum(v for name, v in (network_s or {}).items() if (mask >> index[name]) & 1)
        return float(max(k * C[0], (k * A[0] + F[0]) * cm.s_per_byte, nw))

    @lru_cache(maxsize=None)
    def rest(placed: int) -> float:
        if placed == full:
            return 0.0
        free = [i for i in range(n) if not (placed >> i) & 1]
        best = float("inf")
        for sub in range(1, 1 << len(free)):
            mask = sum(1 << free[j] for j in range(len(free)) if (sub >> j) & 1)
            if bin(mask).count("1") > tiles:
                continue
            if any(((mask >> i) & 1) and (cm.pred_mask[i] & ~(placed | mask)) for i in range(n)):
                continue  # some kernel's producer is neither placed nor in the partition
            best = min(best, cost(mask) + rest(placed | mask))
        return best

    return rest(0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tiles", [1, 2, 3])
def test_shortest_path_equals_brute_force(seed, tiles):
    system = load_system(_few_tile_system(tiles))
    g = _random_dag(seed, 6)
    pf = ff.plan_floor(g, system, {k.name for k in g.kernels}, stash_free=False)
    assert pf is not None and pf.min_partitions == -(-6 // tiles)
    s = CostModel(g, system).s_per_byte
    for k in (1, 3):
        assert pf.best_s(k, s, True) == pytest.approx(_brute_force_s(g, system, k, tiles), rel=1e-12)


def test_small_phase_plan_floor_without_sram_is_the_closed_form():
    """A phase of no more kernels than tiles: one partition can hold it, so without the SRAM the
    plan floor is the closed form (one set); a large phase one partition may hold gets none."""
    g = _random_dag(0, 4)
    system = load_system(_few_tile_system(4))
    pf = ff.plan_floor(g, system, {k.name for k in g.kernels}, False)
    cm = CostModel(g, system)
    C, A, F = ff._set_terms(cm, g, np.ones((1, 4), dtype=bool))
    for k in (1, 3):
        assert pf.best_s(k, cm.s_per_byte, True) == pytest.approx(max(k * C[0], (k * A[0] + F[0]) * cm.s_per_byte))
    big = _random_dag(0, ff.SMALL_PHASE_KERNELS + 1)
    assert ff.plan_floor(big, load_system(_few_tile_system(16)), {k.name for k in big.kernels}, False) is None


@pytest.mark.parametrize("tp,group", [(1, ()), (8, (("local", 8),)), (16, (("local", 8), ("global", 2)))])
@pytest.mark.parametrize("workload", ["gpt3_13b", "llama3_70b"])
def test_floor_below_every_solved_phase_on_few_tiles(workload, tp, group):
    """On the dragonfly chip (4 tiles): forward/backward floors (on-chip and DRAM stash) <= the
    solved phases at micro-batches 1 and 2, and strictly tighter than the closed form."""
    model = LLMModel(load_workload(workload), load_system("dragonfly", num_chips=64))
    tighter = checked = 0
    for mb in (1, 2):
        try:
            blk = model.block("layer", mb, tp, group, tp > 1)
        except InfeasibleError:  # (Llama-3 70B's softmax alone needs more SRAM at TP 1)
            continue
        checked += 1
        graph = model.graphs(1).layer
        fl = dff.dataflow_block_floor(graph, model.system, tp, _is_attention_core)
        assert fl.fwd.plan is not None and fl.bwd_dram.plan is not None
        f, b = fl.phase_s(fl.fwd, mb), fl.phase_s(fl.bwd, mb)
        fd, bd = fl.phase_s(fl.fwd_dram, mb), fl.phase_s(fl.bwd_dram, mb)
        assert fd <= blk.fwd.time_s * (1 + 1e-9) and bd <= blk.bwd.time_s * (1 + 1e-9)
        if blk.onchip is not None:
            assert f <= blk.onchip.fwd_s * (1 + 1e-9) and b <= blk.onchip.bwd_s * (1 + 1e-9)
        for rc in ("none", "selective", "full"):
            assert fl.dram_kernels_s(mb, rc) <= (blk.fwd.time_s + blk.backward_s(rc)) * (1 + 1e-9)
        closed = dff.PhaseFloor(fl.bwd_dram.compute_s, fl.bwd_dram.act_bytes, fl.bwd_dram.fixed_bytes,
                                fl.bwd_dram.kernels)
        tighter += bd > fl.phase_s(closed, mb) * 1.05
    assert tighter > 0 or not checked
    assert checked or (workload, tp) == ("llama3_70b", 1)


def test_search_equals_exhaustive_on_a_few_tile_chip():
    """The pruning the relaxed-plan floor adds keeps the optimum: search == exhaustive
    enumeration on a 3-tile dataflow chip, and the bound is below every evaluation."""
    w, s = load_workload(SMALL_LLM), load_system(_few_tile_system(3))
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_full_recompute_layers_on_chip_count_their_checkpoints():
    """Full recompute keeps a stage's stash on chip only when S + n ckpt fits: with 10 layers
    over 2 stages, SRAM 100, S 20 and 16 per checkpoint, at most 2 x 5 = 10 layers; with 20
    per checkpoint, 2 x 4 = 8."""
    zero = dff.PhaseFloor(0.0, 0.0, 0.0, 0)
    fl = dff.DataflowBlockFloor(zero, zero, zero, 1.0, 0.0, True, stash_bytes=20.0)
    assert fl.max_layers_on_chip(1, 100.0, 10, 2, "full", 16.0) == 10
    assert fl.max_layers_on_chip(1, 100.0, 10, 2, "full", 20.0) == 8
    assert fl.max_layers_on_chip(1, 100.0, 10, 2, "full") == 10
    assert fl.max_layers_on_chip(6, 100.0, 10, 2, "full", 1.0) == 0  # 6 x 20 > SRAM


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("sram", ["24 MiB", "48 MiB"])
def test_sram_aware_floor_below_the_exact_solve_on_small_sram(seed, sram):
    """With the chip's SRAM (row tiles and streamed re-reads, fused_floor module doc): the
    floor of a random 7-kernel DAG (tensors up to 20 MB, weights up to 8 MB) on a 3-tile chip
    stays below the exact intra-chip solve; it never drops below the SRAM-blind floor."""
    sys_ = _few_tile_system(3)
    sys_["chip"]["sram_bytes"] = sram
    system = load_system(sys_)
    g = _random_dag(100 + seed, 7)
    for k in (1, 2):
        gk = _scaled(g, k)
        try:
            exact = partition(gk, system).time_s
        except InfeasibleError:
            continue
        pf = ff.plan_floor(g, system, {x.name for x in g.kernels}, stash_free=False)
        s = CostModel(g, system).s_per_byte
        aware = pf.best_s(k, s, True, 1, float(system.chip.sram_bytes))
        assert pf.best_s(k, s, True) <= aware <= exact * (1 + 1e-9)


def _scaled(g: DataflowGraph, k: int) -> DataflowGraph:
    """``g`` at micro-batch ``k``: activation tensors and FLOP ``k``-fold, weights not."""
    ks = [Kernel(x.name, x.kind, x.dims, flop=k * x.flop, output_bytes=k * x.output_bytes, weight_bytes=x.weight_bytes,
                 phase=x.phase) for x in g.kernels]
    ts = [Tensor(t.name, t.producer, t.consumer, k * t.bytes) for t in g.tensors]
    return DataflowGraph(ks, ts)


@pytest.mark.parametrize("ep,whole,mb", [(64, False, 1), (64, False, 3), (256, False, 2), (16, True, 3)])
def test_deepseek_v3_layer_floor_with_sram_on_dragonfly(ep, whole, mb):
    """DeepSeek-V3's MoE layer at TP 8 on the dragonfly chip (220 MiB SRAM): the SRAM-aware
    DRAM-stash floors stay below the solved phases, within 15 % of them; with whole experts
    (expert TP 1: 8 of them per chip) the SRAM binds and the SRAM-blind floor was 0.34 s
    against 0.49 s solved at micro-batch 3."""
    model = LLMModel(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512))
    blk = model.block("layer", mb, 8, (("local", 8),), True, 1, ep, whole)
    fl = dff._block_floor_of(model.graphs(1, 1, ep).layer, model.system, 8, True, False, _is_attention_core)
    fd, bd = fl.phase_s(fl.fwd_dram, mb), fl.phase_s(fl.bwd_dram, mb)
    assert fd <= blk.fwd.time_s * (1 + 1e-9) and bd <= blk.bwd.time_s * (1 + 1e-9)
    blind = dataclasses.replace(fl, fwd_dram=dataclasses.replace(fl.fwd_dram, sram_bytes=None),
                                bwd_dram=dataclasses.replace(fl.bwd_dram, sram_bytes=None))
    blind_s = blind.phase_s(blind.fwd_dram, mb) + blind.phase_s(blind.bwd_dram, mb)
    assert fd + bd >= (1.2 if whole else 1.0) * blind_s
    assert fd + bd >= 0.85 * (blk.fwd.time_s + blk.bwd.time_s)


@pytest.mark.parametrize("mb", [1, 3])
def test_deepseek_v3_head_floor_with_sram_on_dragonfly(mb):
    """The LM head (few kernels, 1.9 GB of weights: 232 MB a chip at TP 8, beyond the 220 MiB
    SRAM) on the dragonfly chip: streamed, its weights re-read per row tile. The SRAM-aware
    floors stay below the solved phases and well above the SRAM-blind closed form."""
    model = LLMModel(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512))
    blk = model.block("head", mb, 8, (("local", 8),), True)
    fl = dff._block_floor_of(model.graphs(1).head, model.system, 8, True, False, _is_attention_core)
    f, b = fl.phase_s(fl.fwd_dram, mb), fl.phase_s(fl.bwd_dram, mb)  # (evaluate's head: stash through DRAM)
    assert f <= blk.fwd.time_s * (1 + 1e-9) and b <= blk.backward_s("none") * (1 + 1e-9)
    closed = dataclasses.replace(fl.bwd_dram, plan=None)
    assert b >= 1.5 * fl.phase_s(closed, mb)


def test_infinite_floor_only_where_no_plan_fits():
    """A phase no option of any plan fits (DeepSeek-V3's experts at low TP x EP on 220 MiB)
    gets an infinite floor, never NaN (0 layers x inf), and such mappings are infeasible."""
    import math

    assert dff._times(0, math.inf) == 0.0 and dff._times(2, 1.5) == 3.0
    model = LLMModel(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512))
    cands = [m for i, m in enumerate(llm_candidates_of(model)) if i % 97 == 0][:120]
    bounds = [model.lower_bound_s(m) for m in cands]
    assert not any(math.isnan(b) for b in bounds)
    infinite = [m for m, b in zip(cands, bounds) if math.isinf(b)]
    assert infinite
    for m in infinite[::max(1, len(infinite) // 4)][:4]:
        with pytest.raises(InfeasibleError):
            model.evaluate(m)


def llm_candidates_of(model):
    from dfmodel.inter_chip.llm_space import llm_candidates
    return llm_candidates(model, Knobs(micro_batch=1))


@pytest.mark.parametrize("seed", range(4))
def test_level_order_equals_the_masked_relaxation(seed):
    """fused_floor._LevelOrder (edges sorted once, one reduceat per level) gives the very shortest
    path of the level-by-level masked relaxation (_shortest_s), on random costs with some
    infinite (sets no option fits)."""
    system = load_system(_few_tile_system(3))
    g = _random_dag(seed, 9)
    pf = ff.plan_floor(g, system, {k.name for k in g.kernels}, stash_free=False)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        cost = rng.uniform(0.0, 1.0, pf.src.size)
        cost[rng.uniform(size=cost.size) < 0.3] = np.inf
        want = ff._shortest_s(pf.level, pf.src, pf.dst, cost)
        lo = ff._LevelOrder(pf.level, pf.src, pf.dst)
        assert lo.shortest_s(cost, lo.level_sets(lo.order)) == want  # (edge e in sorted order costs cost[order[e]])
        # per set, as best_s asks it: the shared order of the same structure, the same path
        set_cost = rng.uniform(0.0, 1.0, int(pf.inverse.max()) + 1)
        assert (ff._level_order(pf.level, pf.src, pf.dst).shortest_s(set_cost, lo.level_sets(pf.inverse[lo.order]))
                == ff._shortest_s(pf.level, pf.src, pf.dst, set_cost[pf.inverse]))


def _every_option_floor(pf, C, mem, k, s_per_byte, overlap, tp, sram_bytes):
    """PlanFloor._option_floor as first written: every (fraction, resident / streamed) option."""
    best = np.full(C.shape, np.inf)
    for f in ff.RELAXED_FRACTIONS:
        for c, rereads in ((1.0, 0.0), (ff.STREAM_BUFFER_FRACTION, 1.0 / f - 1.0)):
            fits = (f * k * pf.X + c * pf.Fs) / tp <= sram_bytes
            m = mem + rereads * pf.Q * s_per_byte
            t = np.maximum(C, m) if overlap else C + m
            best = np.where(fits, np.minimum(best, t), best)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("overlap", [True, False])
def test_option_floor_equals_every_option(seed, overlap):
    """PlanFloor._option_floor's two options (resident at the smallest fraction, streamed at the
    largest that fits) give the very values of trying all 24, on random sets where some fit no
    option, some only streamed, some only resident at a small fraction."""
    rng = np.random.default_rng(seed)
    n = 400
    pf = ff.PlanFloor(rng.uniform(0, 1e-3, n), rng.uniform(0, 1e6, n), rng.uniform(0, 1e6, n),
                      np.zeros(1, int), np.zeros(1, int), np.zeros(1, int), np.zeros(1, int), 1,
                      X=rng.choice([0.0, 1e3, 1e6, 1e8, 1e9], n) * rng.uniform(0.5, 1.5, n),
                      Fs=rng.choice([0.0, 1e5, 1e7, 3e8, 2e9], n) * rng.uniform(0.5, 1.5, n),
                      Q=rng.choice([0.0, 1e4, 1e7], n) * rng.uniform(0.5, 1.5, n))
    seen = []
    for k, tp, sram in ((1, 1, 2.2e8), (4, 8, 2.2e8), (16, 2, 1e8), (1, 64, 1e6), (64, 1, 2.2e8)):
        C, mem = k * pf.C, (k * pf.A + pf.F) * 2.5e-11
        want = _every_option_floor(pf, C, mem, k, 2.5e-11, overlap, tp, sram)
        assert np.array_equal(pf._option_floor(C, mem, k, 2.5e-11, overlap, tp, sram), want)
        seen.append(want)
    assert np.isinf(seen).any() and np.isfinite(seen).any()
    assert len({float(x) for w in seen for x in w}) > 2 * n  # (streamed sets at several fractions)


def _network_s(graph: DataflowGraph, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    return {k.name: rng.choice([0.0, 0.0, 1e-4, 2e-3]) for k in graph.kernels}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tiles", [2, 3])
def test_network_plan_floor_equals_brute_force_and_is_below_the_solve(seed, tiles):
    """With network seconds per kernel (PlanFloor.N), the shortest path equals brute force over
    every plan of sum max(C, s (A + F), N) at factor 1, is at least the network-blind floor and
    at least the phase's total network, and is below the exact solve of the phase with that network."""
    system = load_system(_few_tile_system(tiles))
    g = _random_dag(seed, 6)
    net = _network_s(g, seed)
    names = {k.name for k in g.kernels}
    pf = ff.plan_floor(g, system, names, stash_free=False, network_s=net)
    blind = ff.plan_floor(g, system, names, stash_free=False)
    s = CostModel(g, system).s_per_byte
    assert pf.best_s(1, s, True) == pytest.approx(_brute_force_s(g, system, 1, tiles, net), rel=1e-12)
    assert pf.best_s(1, s, True) >= blind.best_s(1, s, True) and pf.best_s(1, s, True) >= sum(net.values()) * (1 - 1e-12)
    solved = partition(g, system, network_time_s=net)
    assert pf.best_s(1, s, True, 1, float(system.chip.sram_bytes)) <= solved.time_s * (1 + 1e-9)
    with pytest.raises(ValueError):
        pf.best_s(2, s, True)


def test_network_plan_floor_binds_on_deepseek_v3_tp64_forward():
    """DeepSeek-V3's MoE forward at TP 64 (ep 8, micro-batch 6) on 512 dragonfly chips: with
    its collectives' seconds per set, the sharded forward's floor is its network-blind one
    (0.038 s, its total network) raised to within 1 % of the solve (0.0606 s), and below it."""
    model = LLMModel(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512))
    group = (("local", 8), ("global", 8))
    sh = model._shard_block(model.graphs(6, 1, 8).layer, 64, group, True, False)
    fwd = {k.name for k in sh.graph.kernels if k.phase == Phase.forward}
    nf = sum(v for n, v in sh.network_time_s.items() if n in fwd)
    blind = dff.dataflow_block_floor(sh.graph, model.system, 1, _is_attention_core, dff.SHARDED_MAX_IDEALS)
    aware = dff.dataflow_block_floor(sh.graph, model.system, 1, _is_attention_core, dff.SHARDED_MAX_IDEALS,
                                     sh.network_time_s)
    solved = model.block("layer", 6, 64, group, True, 1, 8, False).fwd.time_s
    assert blind.phase_s(blind.fwd_dram, 1, nf) < 0.7 * solved
    assert 0.99 * solved <= aware.phase_s(aware.fwd_dram, 1, nf) <= solved * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("tiles", [2, 3])
def test_restricted_phase_floor_is_below_the_exact_solve(seed, tiles):
    """The plan floor of a phase restricted to some of its kernels (reduced_plan_floor, forced
    by a small ideal cap; and restricted_phase on random kernel subsets) is below the exact solve
    of the whole phase with its network, SRAM-aware, on random DAGs."""
    system = load_system(_few_tile_system(tiles, ))
    g = _random_dag(seed, 9)
    net = _network_s(g, seed)
    names = {k.name for k in g.kernels}
    solved = partition(g, system, network_time_s=net).time_s
    sram = float(system.chip.sram_bytes)
    s = CostModel(g, system).s_per_byte
    red = ff.reduced_plan_floor(g, system, names, False, 12, net)
    floors = [] if red is None else [red]
    rng = random.Random(seed)
    for _ in range(4):
        keep = set(rng.sample(sorted(names), rng.choice([tiles + 1, 5, 7])))
        small = ff.restricted_phase(ff.phase_graph(g, names, False), keep)
        pf = ff.plan_floor(small, system, keep, False, network_s={n: v for n, v in net.items() if n in keep})
        if pf is not None:
            floors.append(pf)
    assert floors
    for pf in floors:
        assert pf.best_s(1, s, True, 1, sram) <= solved * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_plan_floor_shared_by_content_equals_a_fresh_build(seed):
    """A plan floor reused for a graph of the same content (fused_floor._BY_CONTENT: the layer
    sharded on differently placed TP groups) with other network seconds gives the very floor a
    fresh build gives, and the network-free one is unchanged by the network of another."""
    system = load_system(_few_tile_system(3))
    names_of = lambda g: {k.name for k in g.kernels}  # noqa: E731
    a, b = _random_dag(seed, 9), _random_dag(seed, 9)  # (two graph objects, one content)
    net_a, net_b = _network_s(a, seed), _network_s(a, seed + 100)
    got = [ff.plan_floor(g, system, names_of(g), False, network_s=n) for g, n in ((a, net_a), (b, net_b), (b, None))]
    ff._BY_CONTENT.clear()
    ff._PLANS.clear()
    fresh = [ff.plan_floor(_random_dag(seed, 9), system, names_of(a), False, network_s=n) for n in (net_a, net_b, None)]
    for g, f in zip(got, fresh):
        assert (g is None) == (f is None)
        if g is not None:
            assert g.best_s(1, 1e-12, True) == f.best_s(1, 1e-12, True)
            assert (g.N is None and f.N is None) or np.array_equal(g.N, f.N)


@pytest.mark.parametrize("moe", [False, True])
def test_staged_micro_batch_refine_below_the_full_one_and_every_leaf(moe):
    """On dataflow chips a micro-batch group refines in the stages of ``_DATAFLOW_REFINES``
    (without the plan floors, then with them; neither with the TP collectives), each left for
    when the group is still below the cutoff: each stage <= the next, all are below every leaf
    group's bound under it, and each later stage raises some group (else it would never be
    worth asking)."""
    from dfmodel.inter_chip.llm_space import _DATAFLOW_REFINES, LLMSpace, leaf_nodes
    from test_moe_physics import moe_workload

    w = load_workload(moe_workload(first_dense_layers=1) if moe else SMALL_LLM)
    model = LLMModel(w, load_system(_few_tile_system(3, ib_bw="2 GB/s")))
    space = LLMSpace(model, Knobs(micro_batch=1 if moe else None))
    checked, raised = 0, [0] * (len(_DATAFLOW_REFINES) - 1)
    for root in space.roots():
        for group in root.expand():
            stages = []
            while group.refine is not None:  # (as the search asks them: each stage sets the next)
                refine, group.refine = group.refine, None
                stages.append(refine())
            assert len(stages) == len(_DATAFLOW_REFINES), group.knobs
            for i, (lo, hi) in enumerate(zip(stages, stages[1:])):
                assert lo <= hi * (1 + 1e-12), (group.knobs, stages)
                raised[i] += hi > lo * (1 + 1e-9)
            for leaf in leaf_nodes(group):
                if leaf.bound_s > 0:  # (a leaf's own bound: the model's lower_bound_s)
                    assert stages[-1] <= leaf.bound_s * (1 + 1e-12), (group.knobs, leaf.knobs)
                    checked += 1
    assert checked > 20 and all(raised), (checked, raised)


@pytest.mark.parametrize("moe", [False, True])
def test_staged_sub_group_refine_reaches_the_full_one_below_every_leaf(moe):
    """On dataflow chips a sub group (recompute, SP, ...) refines in the stages of
    ``_DATAFLOW_SUB_REFINES`` (without the TP collectives, then with them): each stage <= the
    next, the last is the full refine (what one refine gave before, and still gives on GPUs),
    all are below every leaf group's bound under it, and the collectives raise some group."""
    from dfmodel.inter_chip.llm_space import _DATAFLOW_SUB_REFINES, LLMSpace, leaf_nodes
    from test_moe_physics import moe_workload

    w = load_workload(moe_workload(first_dense_layers=1) if moe else SMALL_LLM)
    model = LLMModel(w, load_system(_few_tile_system(3, ib_bw="2 GB/s")))
    space = LLMSpace(model, Knobs(micro_batch=1 if moe else None))
    checked = raised = 0
    for root in space.roots():
        for group in root.expand():
            for sub in group.expand():
                full = sub.refine.func()  # (stage None: the full floor in one step)
                stages = []
                while sub.refine is not None:  # (as the search asks them: each stage sets the next)
                    refine, sub.refine = sub.refine, None
                    stages.append(refine())
                assert len(stages) == len(_DATAFLOW_SUB_REFINES) and stages[-1] == full, (sub.knobs, stages)
                assert stages[0] <= stages[1] * (1 + 1e-12), (sub.knobs, stages)
                raised += stages[1] > stages[0] * (1 + 1e-9)
                for leaf in leaf_nodes(sub):
                    if leaf.bound_s > 0:
                        assert full <= leaf.bound_s * (1 + 1e-12), (sub.knobs, leaf.knobs)
                        checked += 1
    assert checked > 20 and raised > 0, (checked, raised)


def test_closed_form_pass_floor_below_the_plan_floors_one():
    """``pass_floor_s(plans=False)`` (every phase at its closed form, without the plan floors'
    shortest paths: the first stage of a dataflow group's refine) is a weaker floor: at most
    the full one on every candidate of a few-tile chip, with and without the TP collectives,
    and below it on some (else the plan floors would prune nothing more)."""
    w = load_workload(SMALL_LLM)
    model = LLMModel(w, load_system(_few_tile_system(3, ib_bw="2 GB/s")))
    lower = 0
    for m in [m for i, m in enumerate(llm_candidates_of(model)) if i % 7 == 0][:300]:
        for comm in (False, True):
            closed, full = model.pass_floor_s(m, comm=comm, plans=False), model.pass_floor_s(m, comm=comm)
            assert closed <= full * (1 + 1e-12), m
            lower += closed < full * (1 - 1e-9)
    assert lower > 0


@pytest.mark.parametrize("moe", [False, True])
def test_search_equals_exhaustive_on_a_few_tile_chip_with_slow_links(moe):
    """The staged refine keeps the optimum where the TP collectives weigh (a slow inter-node
    link): search == exhaustive enumeration, dense and MoE. (The MoE search there refuses a
    large sharded lattice; intra_chip.ideals caches that refusal without its traceback, whose
    frames once kept the model alive: test_search's test_a_finished_search_keeps_no_model_alive.)"""
    from test_moe_physics import moe_workload

    w = load_workload(moe_workload(first_dense_layers=1) if moe else SMALL_LLM)
    s = load_system(_few_tile_system(3, ib_bw="2 GB/s"))
    knobs = Knobs(micro_batch=1) if moe else Knobs()
    fast = solve_llm(w, s, knobs)
    full = solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"



def test_plan_floor_reused_across_tp_equals_a_fresh_floor(monkeypatch):
    """PlanFloor.best_s reuses a shortest path where another TP degree gave the very same set
    costs (:meth:`~dfmodel.inter_chip.fused_floor.PlanFloor._shortest_of`): asked at TP 1, 2, 4
    and 8 in turn on one floor, each value equals a fresh floor's asked at that degree alone,
    on random DAGs with SRAM tight enough that the degree moves the floor on some of them, and
    some paths are reused (fewer shortest paths than questions)."""
    paths = [0]
    shortest = ff._LevelOrder.shortest_s

    def counted(self, *a):
        paths[0] += 1
        return shortest(self, *a)

    monkeypatch.setattr(ff._LevelOrder, "shortest_s", counted)
    sys_ = _few_tile_system(3)
    sys_["chip"]["sram_bytes"] = "12 MiB"
    system = load_system(sys_)
    moved = reused = 0
    for seed in range(8):
        g = _random_dag(200 + seed, 7)
        pf = ff.plan_floor(g, system, {x.name for x in g.kernels}, stash_free=False)
        s, sram = CostModel(g, system).s_per_byte, float(system.chip.sram_bytes)
        for k in (1, 3):
            before, values = paths[0], []
            for tp in (1, 2, 4, 8):
                values.append(pf.best_s(k, s, True, tp, sram))
            reused += 4 - (paths[0] - before)
            for tp, value in zip((1, 2, 4, 8), values):
                assert value == dataclasses.replace(pf).best_s(k, s, True, tp, sram)  # (a new memo)
            moved += len(set(values)) > 1
    assert moved and reused
