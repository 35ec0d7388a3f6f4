"""The (MoE) layer's floor on its *sharded* graph (dfmodel/inter_chip/dataflow_floor.py,
``sharded_layer_floor``, issue 12): the per-chip graph the block solve partitions, floored at
``tp = 1``, holds what the 1/tp floor of the unsharded layer relaxes away (replicated inputs of
column-split GEMMs, the communication kernels each taking one of a few compute tiles).

Oracles: every phase floor is below the exact solve of the same sharded phase (DRAM and on-chip
stash, attention core) on a small MoE model on few-tile dataflow chips, over every TP degree,
placement, micro-batch and expert layout of its space; the shard bound that uses it is below
every evaluation; the search with it equals exhaustive enumeration; and on DeepSeek-V3 at TP 64 on
the dragonfly chip it is several times the 1/tp floor."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InfeasibleError
from dfmodel.graph.kernel import Phase
from dfmodel.inter_chip import dataflow_floor as dff
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel, _is_attention_core
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from test_inter_chip import small_system
from test_moe_physics import moe_workload

TOL = 1 + 1e-9


def _dataflow_moe(sram: str, tiles: int):
    s = small_system(4, 2)
    s["chip"].update(execution="dataflow", overlap=True, sram_bytes=sram, compute_tiles=tiles)
    return load_workload(moe_workload(first_dense_layers=1)), load_system(s)


def _nets(blk) -> tuple[float, float]:
    fwd = {k.name for k in blk.sharded.graph.kernels if k.phase == Phase.forward}
    net = blk.sharded.network_time_s
    return sum(v for n, v in net.items() if n in fwd), sum(v for n, v in net.items() if n not in fwd)


def _solved_layers(model):
    """(mapping, solved layer block) for each distinct sharded layer (TP > 1) of the space at
    micro-batches 1 and 2; blocks that cannot be solved (SRAM) are skipped."""
    seen = set()
    for mb in (1, 2):
        for m in llm_candidates(model, Knobs(micro_batch=mb)):
            key = model._block_key("layer", m)
            if m.tp <= 1 or key in seen:
                continue
            seen.add(key)
            try:
                yield m, model.block("layer", m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel, m.cp,
                                     m.ep_outside_tp, whole_experts=m.whole_experts)
            except InfeasibleError:
                continue


@pytest.mark.parametrize("sram,tiles", [("24 MiB", 3), ("64 MiB", 4)])
def test_sharded_floor_below_every_solved_phase(sram, tiles):
    w, s = _dataflow_moe(sram, tiles)
    model = LLMModel(w, s)
    checked, tighter = 0, 0
    for m, blk in _solved_layers(model):
        fl, (nf, nb) = dff.sharded_layer_floor(model, m, _is_attention_core), _nets(blk)
        assert fl.phase_s(fl.fwd_dram, 1, nf) <= blk.fwd.time_s * TOL, m
        assert fl.phase_s(fl.bwd_dram, 1, nb) <= blk.bwd.time_s * TOL, m
        assert fl.phase_s(fl.core, 1) <= blk.attention_core.time_s * TOL, m
        if blk.onchip is not None:
            assert fl.phase_s(fl.fwd, 1, nf) <= blk.onchip.fwd_s * TOL, m
            assert fl.phase_s(fl.bwd, 1, nb) <= blk.onchip.bwd_s * TOL, m
        old = dff._block_floor_of(model.graphs(1, m.cp, m.ep_outside_tp).layer, s, m.tp, True, False,
                                  _is_attention_core)
        # (the pass floor takes each phase at the larger of the two: the forward's binds here,
        # the backward's lattice being past SHARDED_MAX_IDEALS)
        tighter += fl.phase_s(fl.fwd_dram, 1) > 1.1 * old.phase_s(old.fwd_dram, m.micro_batch)
        checked += 1
    assert checked >= 8 and tighter, (checked, tighter)


def test_nets_only_bound_below_the_shard_bound_and_every_evaluation():
    """Every mapping with TP > 1 of the small MoE space at micro-batch 1 on a 3-tile chip: the
    shard bound is below its evaluation, the stash screen's first, cheaper bound (the layer's
    collectives on the 1/tp floor, no plan floor of the sharded graph) below the forward-only
    shard bound (the sharded floor of the forward phases alone), that below the shard bound, and
    the cheaper bounds' memos never hand the shard bound their weaker floors (asked first on the
    same model)."""
    w, s = _dataflow_moe("24 MiB", 3)
    bounds, exact, fresh = LLMModel(w, s), LLMModel(w, s), LLMModel(w, s)
    checked = tighter = 0
    for m in llm_candidates(bounds, Knobs(micro_batch=1)):
        if m.tp <= 1 or m.tp_comm_overlap:
            continue
        try:
            t = exact.evaluate(m).iteration_time_s
        except InfeasibleError:
            continue
        cheap = bounds._nets_bound_s(m)
        assert not bounds.nets_only_floors
        forward = bounds._forward_shard_bound_s(m)
        assert bounds.sharded_floor_stage == "full"
        shard = bounds.shard_bound_s(m)
        assert shard == fresh.shard_bound_s(m), m  # (no weaker floor leaked through a memo)
        assert 0.0 < cheap <= forward * TOL and forward <= shard * TOL and shard <= t * TOL, m
        tighter += shard > cheap * TOL
        checked += 1
    assert checked > 20 and tighter > 0, (checked, tighter)


@pytest.mark.parametrize("tiles", [3, 4])
def test_search_with_the_sharded_floor_equals_exhaustive(tiles):
    w, s = _dataflow_moe("24 MiB", tiles)
    fast = solve_llm(w, s, Knobs(micro_batch=1))
    full = solve_llm(w, s, Knobs(micro_batch=1), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_deepseek_v3_tp64_layer_on_dragonfly():
    """DeepSeek-V3's MoE layer at TP 64 (ep 1, micro-batch 6) on 512 dragonfly chips: the sharded
    floors are below the solved phases and at least 3x (forward) / 5x (backward) the 1/tp floor
    (0.047 -> 0.185 s forward against 0.191 s solved)."""
    model = LLMModel(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512))
    group = (("global", 64),)
    blk = model.block("layer", 6, 64, group, True, 1, 1, False)
    sh = model._shard_block(model.graphs(6, 1, 1).layer, 64, group, True, False)
    fl = dff.dataflow_block_floor(sh.graph, model.system, 1, _is_attention_core, dff.SHARDED_MAX_IDEALS)
    old = dff._block_floor_of(model.graphs(1, 1, 1).layer, model.system, 64, True, False, _is_attention_core)
    nf, nb = _nets(blk)
    f, b = fl.phase_s(fl.fwd_dram, 1, nf), fl.phase_s(fl.bwd_dram, 1, nb)
    assert f <= blk.fwd.time_s * TOL and b <= blk.bwd.time_s * TOL
    assert f >= 3 * old.phase_s(old.fwd_dram, 6, nf) and b >= 5 * old.phase_s(old.bwd_dram, 6, nb)


@pytest.mark.parametrize("sram,tiles", [("24 MiB", 3), ("64 MiB", 4)])
def test_reduced_sharded_floor_below_every_solved_phase(sram, tiles):
    """With an ideal cap small enough that every phase's lattice is too large, the sharded floor
    plans on the phase's heaviest kernels (fused_floor.reduced_plan_floor): still below the exact
    solve of every sharded layer's forward and backward of the small MoE space."""
    w, s = _dataflow_moe(sram, tiles)
    model = LLMModel(w, s)
    reduced = 0
    for m, blk in _solved_layers(model):
        sh = model.sharded_layer(m)
        fl = dff.dataflow_block_floor(sh.graph, model.system, 1, _is_attention_core, 40, sh.network_time_s)
        nf, nb = _nets(blk)
        reduced += fl.bwd_dram.plan is not None
        assert fl.phase_s(fl.fwd_dram, 1, nf) <= blk.fwd.time_s * TOL, m
        assert fl.phase_s(fl.bwd_dram, 1, nb) <= blk.bwd.time_s * TOL, m
    assert reduced
