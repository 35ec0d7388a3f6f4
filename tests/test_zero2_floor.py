"""The ZeRO-2 exposed reduce-scatter floor (issue 12: DeepSeek-V3 on GPUs, where ZeRO-2 mappings
expose per-micro-batch gradient reduce-scatters far above the optimum) against exhaustive
evaluation on a small MoE space.

Oracles: every ZeRO-2 mapping's evaluated time is at least its pre-solve bound
(``LLMModel.lower_bound_s`` plus the floor, as the search's leaves add it) and its refined
bound; the floor is positive for some of them (else it prunes nothing); the search still
finds the exhaustive optimum."""

from __future__ import annotations

import dataclasses

import pytest

from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm_space import LLMSpace, llm_candidates
from dfmodel.inter_chip.search import search
from test_moe_proof_speed import _model, _walk


def _zero2(model, mb):
    return [m for m in llm_candidates(model, Knobs(micro_batch=mb)) if m.zero_stage == 2]


@pytest.mark.parametrize("dense", [0, 1])
def test_zero2_floor_never_exceeds_an_evaluation(dense):
    model = _model(first_dense_layers=dense)
    plain = _model(first_dense_layers=dense)  # the same bounds without the ZeRO-2 floor
    plain.zero2_exposed_floor_s = lambda *a, **k: 0.0
    bit = raised = 0
    for m in _zero2(model, 1) + _zero2(model, 2):
        t = model.evaluate(m).iteration_time_s
        plain.evaluate(m)
        opt = model.optimizer_s(m, model.params_per_chip_floor(m))
        pipe = model.lower_bound_s(m) - opt
        placed = model.zero2_exposed_floor_s(m, pipe)
        free = model.zero2_exposed_floor_s(dataclasses.replace(m, placement=()), pipe)
        assert free <= placed * (1 + 1e-12), m  # the placement-free floor takes the cheapest placement
        assert pipe + opt + placed <= t * (1 + 1e-12), m
        refined = model.refined_bound_s(m)  # with the worst stage's expert floor (blocks solved)
        assert refined <= t * (1 + 1e-12), (m, refined, t)
        bit += placed > 0
        raised += refined > plain.refined_bound_s(m) * (1 + 1e-9)
    assert bit > 5 and raised > 5, (bit, raised)


def test_zero2_floor_is_zero_where_it_does_not_apply():
    model = _model()
    for m in llm_candidates(model, Knobs(micro_batch=1)):
        if m.zero_stage != 2 or m.num_micro_batches == 1 or m.dp_cp == 1:
            assert model.zero2_exposed_floor_s(m, 0.0) == 0.0, m


def test_leaf_bounds_hold_every_zero2_mapping_and_search_is_exhaustive():
    model = _model()
    knobs = Knobs(micro_batch=1)
    nodes = []
    for root in LLMSpace(model, knobs).roots():
        _walk(root, 0.0, nodes)
    checked = 0
    for node, parent_bound in nodes:
        assert node.bound_s >= parent_bound * (1 - 1e-12), node.knobs
        if node.leaf and dict(node.knobs).get("zero_stage") == 2:
            for m in node.expand():
                assert model.evaluate(m).iteration_time_s >= node.bound_s * (1 - 1e-12), m
                checked += 1
    assert checked > 50, checked
    best, _ = search(model, LLMSpace(model, knobs))
    oracle, _ = search(model, llm_candidates(model, knobs), exhaustive=True)
    assert best.iteration_time_s == pytest.approx(oracle.iteration_time_s, rel=1e-12)
