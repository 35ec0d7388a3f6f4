"""The dataflow-chip floor of the search's bounds (issue 12, dfmodel/inter_chip/dataflow_floor.py):
a closed form on a tiny graph, below every solved phase of shipped blocks on SN30 and WSE-2
(off-chip and on-chip stash), below every candidate's evaluation, and what it prunes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.inter_chip import dataflow_floor as dff
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel, _is_attention_core
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.intra_chip import partition
from dfmodel.intra_chip.cost import DEFAULT_TILE_OVERHEAD_S
from tests.test_inter_chip import SMALL_LLM, small_system


def _dataflow_system(**kw):
    s = small_system(4, 2, **kw)
    s["chip"]["execution"] = "dataflow"
    s["chip"]["overlap"] = True
    return s


def test_closed_form_on_two_fused_matmuls():
    """Two forward matmuls with weights W1, W2 on a chip whose SRAM holds everything: the one
    fused partition reads x and both weights and writes z once; the floor is exactly its time."""
    sysd = load_system(_dataflow_system(capacity="80 GiB"))
    mm = lambda n, w: Kernel(n, KernelKind.matmul, {"m": 256, "n": 256, "k": 256}, flop=2 * 256**3,  # noqa: E731
                             output_bytes=2 * 256**2, weight_bytes=w, phase=Phase.forward)
    g = DataflowGraph([mm("a", 1e6), mm("b", 3e6)], [Tensor("x", None, "a", 131072), Tensor("y", "a", "b", 131072),
                                                      Tensor("z", "b", None, 131072)])
    fl = dff.dataflow_block_floor(g, sysd, 1, _is_attention_core)
    chip = sysd.chip
    bw = chip.memory.bandwidth_Bps * chip.efficiency.memory
    rate = chip.peak("bf16") * chip.efficiency.matmul
    mem_s, comp_s = (4e6 + 2 * 131072) / bw, 2 * 2 * 256**3 / rate
    want = max(mem_s, comp_s) + chip.efficiency.kernel_overhead_s + DEFAULT_TILE_OVERHEAD_S
    assert fl.phase_s(fl.fwd, 1) == pytest.approx(want, rel=1e-12)
    assert fl.phase_s(fl.bwd, 1) == 0.0  # no backward kernels: no partition, no overhead
    solved = partition(g, sysd)
    assert solved.plan == [["a", "b"]]
    assert solved.time_s == pytest.approx(want, rel=1e-9)
    # twice the micro-batch: x and z double, the weights do not
    assert fl.phase_s(fl.fwd, 2) == pytest.approx(max((4e6 + 4 * 131072) / bw, 2 * comp_s)
                                                  + chip.efficiency.kernel_overhead_s + DEFAULT_TILE_OVERHEAD_S)


def _group(system: str, tp: int):
    return ((("x" if system == "sn30" else "swarmx"), tp),) if tp > 1 else ()


@pytest.mark.parametrize("system,tp", [("sn30", 1), ("sn30", 8), ("wse2", 1), ("wse2", 4)])
@pytest.mark.parametrize("workload", ["gpt3_13b", "llama3_70b", "mixtral_8x7b", "vit_g14_images"])
def test_floor_below_every_solved_phase(workload, system, tp):
    """Forward, backward and attention-core floors <= the solved phases (and <= the on-chip
    stash variants) of every block, at micro-batches 1 and 2; and the floor is not vacuous."""
    model = LLMModel(load_workload(workload), load_system(system))
    for mb in (1, 2):
        for which in ("layer", "embedding", "head"):
            blk = model.block(which, mb, tp, _group(system, tp), tp > 1)
            graph = getattr(model.graphs(1), which)
            if blk is None or graph is None:
                continue
            fl = dff.dataflow_block_floor(graph, model.system, tp, _is_attention_core)
            f, b, c = fl.phase_s(fl.fwd, mb), fl.phase_s(fl.bwd, mb), fl.phase_s(fl.core, mb)
            assert f <= blk.fwd.time_s * (1 + 1e-9)
            assert b <= blk.bwd.time_s * (1 + 1e-9)
            assert c <= blk.attention_core.time_s * (1 + 1e-9)
            if blk.onchip is not None:
                assert f <= blk.onchip.fwd_s * (1 + 1e-9) and b <= blk.onchip.bwd_s * (1 + 1e-9)
            # through DRAM the stash is written and read: the off-chip phases pay it
            assert fl.phase_s(fl.fwd_dram, mb) <= blk.fwd.time_s * (1 + 1e-9)
            assert fl.phase_s(fl.bwd_dram, mb) <= blk.bwd.time_s * (1 + 1e-9)
            for rc in ("none", "selective", "full"):
                assert fl.dram_kernels_s(mb, rc) <= (blk.fwd.time_s + blk.backward_s(rc)) * (1 + 1e-9)
            if which == "layer":  # the stash floor is below the sharded layer's stash
                assert mb * fl.stash_bytes <= (blk.onchip.stash_bytes if blk.onchip is not None else float("inf")) * (1 + 1e-9)
                sram = float(model.system.chip.sram_bytes)
                for layers, stages, rc in ((80, 1, "none"), (80, 4, "none"), (10, 2, "full")):
                    most = fl.max_layers_on_chip(mb, sram, layers, stages, rc)
                    if blk.onchip is not None:
                        per_stage = blk.onchip.layers_on_chip(sram, layers // stages, 1, full_recompute=rc == "full",
                                                             checkpoint_bytes=0.0)
                        assert stages * per_stage <= most
            for rc in ("none", "selective", "full"):
                assert fl.kernels_s(mb, rc) <= (blk.fwd.time_s + blk.backward_s(rc)) * (1 + 1e-9)
            if which == "layer":
                assert fl.kernels_s(mb, "none") >= 0.05 * (blk.fwd.time_s + blk.bwd.time_s)  # (0.06-0.85 measured: loosest at tp 1 on SN30, where the weights exceed SRAM)


@pytest.mark.parametrize("workload,knobs,step", [
    (SMALL_LLM, Knobs(), 2),
    (SMALL_LLM, Knobs(recompute="full", sequence_parallel=True), 2),
    (SMALL_LLM, Knobs(tp_comm_overlap=True, recompute="selective"), 2),
])
def test_bound_below_every_candidates_evaluation_on_a_dataflow_chip(workload, knobs, step):
    """lower_bound_s (with the dataflow floor) <= evaluate on every candidate, and it is
    tighter than the compute-only floor on some."""
    model = LLMModel(load_workload(workload), load_system(_dataflow_system()))
    cands = list(llm_candidates(model, knobs))
    tighter = 0
    for m in cands[::step]:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        tighter += model.pass_floor_s(m) / m.pp > model.compute_floor_s(m.micro_batch, m.recompute) / (m.tp * m.cp * m.pp)
    assert tighter > 0


def test_search_equals_exhaustive_on_a_dataflow_chip():
    """The pruning the floor adds keeps the optimum: search == exhaustive enumeration."""
    w, s = load_workload(SMALL_LLM), load_system(_dataflow_system())
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


@pytest.mark.parametrize("overlap", [True, False])
def test_pairs_equal_the_per_pair_floors(overlap):
    """DataflowBlockFloor.pairs_s (each phase's busy time once, then every network pair) gives the
    very numbers kernels_s / dram_kernels_s give pair by pair, for every recompute and userbuffers."""
    s = load_system("dragonfly").model_dump()
    s["chip"]["overlap"] = overlap
    sysd = load_system(s)
    model = LLMModel(load_workload("deepseek_v3"), sysd)
    fl = dff.dataflow_block_floor(model.graphs(1, 1, 64).layer, sysd, 8, _is_attention_core)  # (ep 64: it fits)
    nets = [(0.0, 0.0), (0.01, 0.5), (2.0, 0.003), (40.0, 40.0)]
    assert all(map(math.isfinite, fl.pairs_s(1, "none", nets[:1])[0]))
    for k in (1, 3):
        for rc in ("none", "selective", "full"):
            for hidden in (False, True):
                want = tuple((fl.kernels_s(k, rc, n, hidden), fl.dram_kernels_s(k, rc, n, hidden)) for n in nets)
                assert fl.pairs_s(k, rc, nets, hidden) == want
    assert len(set(fl.pairs_s(1, "none", nets))) == len(nets)  # (the network pairs do change the floor)


@pytest.mark.parametrize("overlap", [True, False])
def test_pair_arrays_of_every_recompute_at_once_equal_one_by_one(overlap):
    """pair_arrays_by_recompute (each phase's array once for all recomputes, as the search's
    pair memo asks a layer's) gives exactly pair_arrays' numbers per recompute, with the sharded
    floor beside (``also``) or not."""
    s = load_system("dragonfly").model_dump()
    s["chip"]["overlap"] = overlap
    sysd = load_system(s)
    model = LLMModel(load_workload("deepseek_v3"), sysd)
    graph = model.graphs(1, 1, 64).layer
    fl = dff.dataflow_block_floor(graph, sysd, 8, _is_attention_core)
    other = dff.dataflow_block_floor(graph, sysd, 4, _is_attention_core)  # (any floor of the block)
    nets = [(0.0, 0.0), (0.01, 0.5), (2.0, 0.003), (40.0, 40.0)]
    rcs = ("none", "selective", "full")
    fresh = dff.dataflow_block_floor(graph, sysd, 8, _is_attention_core)  # (its own busy memos)
    for k in (1, 3):
        for hidden in (False, True):
            for also in (None, (other, k)):
                both = fl.pair_arrays_by_recompute(k, rcs, nets, hidden, also)
                for rc in rcs:
                    one = fresh.pair_arrays(k, rc, nets, hidden, also)
                    assert all(np.array_equal(a, b) for a, b in zip(both[rc], one)), (k, rc, hidden)
