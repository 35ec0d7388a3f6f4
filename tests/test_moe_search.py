"""MoE search (issue 10 done-when, DeepSeek-V3): recipe incumbents seeded before the search
(they only move the cutoff, never the answer), and the "nothing fits" message when every group
is screened out during the search."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InfeasibleError
from dfmodel.inter_chip import experts as X
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import LLMSpace

from test_inter_chip import SMALL_LLM, small_system
from test_moe_physics import moe_workload


def _space(w, s, knobs):
    model = LLMModel(w, s)
    space = LLMSpace(model, knobs)
    space.roots()
    return model, space


def test_seeds_are_fitting_evaluations_of_space_mappings_largest_ep_first():
    w, s = load_workload(moe_workload(first_dense_layers=1)), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1)
    model, space = _space(w, s, knobs)
    seeds = list(space.seeds(s.chip.memory.capacity_bytes, model.evaluate))
    assert seeds, "a small MoE case has recipe incumbents"
    in_space = set(LLMSpace(LLMModel(w, s), knobs))
    eps = [ev.mapping.ep for ev in seeds]
    assert eps == sorted(eps, reverse=True) and len(set(eps)) == len(eps)  # one per ep, largest first
    for ev in seeds:
        assert ev.fits and ev.mapping in in_space and ev.mapping.ep > 1
        assert ev.iteration_time_s == model.evaluate(ev.mapping).iteration_time_s


def test_dense_model_has_no_seeds():
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2))
    model, space = _space(w, s, Knobs(micro_batch=1))
    assert list(space.seeds(s.chip.memory.capacity_bytes, model.evaluate)) == []


@pytest.mark.parametrize("knobs", [Knobs(micro_batch=1), Knobs(micro_batch=1, tp=2, recompute="none"),
                                   Knobs(micro_batch=1, overlap_moe_expert_parallel_comm=True)])
def test_search_with_seeds_equals_exhaustive(knobs):
    w, s = load_workload(moe_workload(first_dense_layers=1)), load_system(small_system(4, 2))
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_recipe_order_prefers_tp_inside_fast_domain_then_largest_ep():
    degs = [{"tp": 16, "pp": 1, "cp": 1, "ep": 64}, {"tp": 2, "pp": 16, "cp": 1, "ep": 64},
            {"tp": 1, "pp": 16, "cp": 1, "ep": 32}, {"tp": 1, "pp": 4, "cp": 2, "ep": 64}]
    order = sorted(degs, key=lambda d: X.recipe_order(d, 8))
    assert order == [degs[1], degs[2], degs[3], degs[0]]


def test_nothing_fits_after_screens_is_a_clear_error():
    # every group passes its root floor but fails the leaf screen: a one-line memory message
    # (it used to raise AttributeError on a None)
    with pytest.raises(InfeasibleError, match="no mapping fits in memory"):
        solve_llm(load_workload("deepseek_v3"), load_system("dgx_h800", num_chips=2048),
                  Knobs(tp=2, pp=1, dp=1024, ep=64, zero_stage=1, micro_batch=1, etp=1,
                        overlap_moe_expert_parallel_comm=True, sequence_parallel=True))
