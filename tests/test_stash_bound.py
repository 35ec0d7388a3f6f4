"""The stash bound of dataflow chips (issue 12, ``LLMModel.stash_cap`` / ``stash_bound_s``): a
mapping's layers keep their stash in SRAM only where its on-chip plans leave room, so the
dataflow floor with at most that many layers on chip bounds the mapping before its layer's DRAM
phases are solved.

Oracles: on every mapping of a small MoE space on a dataflow chip, the bound (from the forward
on-chip plan alone and from both) is below the exact evaluation, the forward-only cap is never
below the full one, the bound is above the pre-solve bound somewhere (else it proves nothing
new), and the search with it equals exhaustive enumeration."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from test_inter_chip import small_system
from test_moe_physics import moe_workload

TOL = 1 + 1e-12
STEP = 23  # (a sample of the ~900 mappings per micro-batch: every ep, pp, tp and placement appear)


def _dataflow_moe(sram: str):
    s = small_system(4, 2)
    s["chip"].update(execution="dataflow", overlap=True, sram_bytes=sram, compute_tiles=4)
    return load_workload(moe_workload(first_dense_layers=1)), load_system(s)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_stash_bound_below_every_evaluation(recompute):
    w, s = _dataflow_moe("24 MiB")
    bounds, exact = LLMModel(w, s), LLMModel(w, s)  # (bounds: no block ever solved on it)
    checked = tighter = 0
    for mb in (1, 2, 4):
        for m in list(llm_candidates(bounds, Knobs(micro_batch=mb, recompute=recompute)))[::STEP]:
            if m.ep <= 1:
                continue
            fwd_only, both = bounds.stash_bound_s(m, True), bounds.stash_bound_s(m)
            assert bounds.stash_cap(m, True) >= bounds.stash_cap(m)
            t = exact.evaluate(m).iteration_time_s
            assert fwd_only <= both * TOL and both <= t * TOL, (m, fwd_only, both, t)
            tighter += both > bounds.presolve_bound_s(m) * (1 + 1e-9)
            checked += 1
    assert checked > 20 and tighter > 0, (checked, tighter)


def test_search_with_the_stash_bound_equals_exhaustive():
    w, s = _dataflow_moe("24 MiB")
    fast = solve_llm(w, s, Knobs(recompute="full"))
    full = solve_llm(w, s, Knobs(recompute="full"), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_shard_bound_below_every_evaluation_and_above_the_forced_floor():
    """The dataflow floor with the layer's own collectives as sharded on m's TP group
    (``shard_bound_s``, no on-chip plan solved) is below every evaluation of a sample of the small
    MoE space, on a slow TP network where those collectives weigh, and above the bound with the
    forced reductions alone (``presolve_bound_s``) on some mappings: it proves something new."""
    w, s = _dataflow_moe("24 MiB")
    sd = s.model_dump()
    for d in sd["network"]:  # (slow links: every layout's conversions count)
        d["link_bandwidth_Bps"] = 2e9
    s = load_system(sd)
    bounds, exact = LLMModel(w, s), LLMModel(w, s)
    checked = tighter = 0
    for mb in (1, 2):
        for m in list(llm_candidates(bounds, Knobs(micro_batch=mb)))[::STEP // 2]:
            if m.ep <= 1 or m.tp <= 1:
                continue
            b = bounds.shard_bound_s(m)
            t = exact.evaluate(m).iteration_time_s
            assert b <= t * TOL and bounds.stash_bound_s(m) <= t * TOL, (m, b, t)
            tighter += b > bounds.presolve_bound_s(m) * (1 + 1e-6)
            checked += 1
    assert checked > 10 and tighter > 0, (checked, tighter)


def test_search_with_the_shard_bound_equals_exhaustive_on_slow_links():
    w, s = _dataflow_moe("24 MiB")
    sd = s.model_dump()
    for d in sd["network"]:
        d["link_bandwidth_Bps"] = 2e9
    s = load_system(sd)
    fast = solve_llm(w, s, Knobs(micro_batch=2))
    full = solve_llm(w, s, Knobs(micro_batch=2), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"
