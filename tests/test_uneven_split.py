"""A pipeline whose time-balanced layer split does not fit the chip runs the least-bottleneck split
that does (``LLMModel.evaluate``; Megatron-Core's ``--decoder-first-pipeline-num-layers`` /
``--pipeline-model-parallel-layout``), where the search used to reject the mapping. Oracle: every
layer split of the mapping forced in turn, and the search against exhaustive enumeration."""

from __future__ import annotations

import itertools

import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip import llm
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from test_inter_chip import SMALL_LLM, small_system

CAPACITY = "1 GiB"  # the small model's pp-4 mappings at micro-batch 4: stage 0 holds 4 in flight


def _model():
    return LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2, capacity=CAPACITY)))


def _forced(monkeypatch, split):
    """Evaluate with ``split`` as the balanced split and no memory-aware split."""
    monkeypatch.setattr(llm, "_balance", lambda *a: tuple(split))
    real = llm.pipe.balance_layers
    monkeypatch.setattr(llm.pipe, "balance_layers",
                        lambda *a, **k: None if k.get("fits") is not None else real(*a, **k))


def _bottleneck(ev) -> float:
    return max(f + b for f, b in zip(ev.stage_fwd_s, ev.stage_bwd_s))


def test_the_uneven_split_is_the_least_bottleneck_of_every_split_that_fits(monkeypatch):
    model = _model()
    n = model.num_layers
    rescued = 0
    for m in llm_candidates(model, Knobs(micro_batch=4, recompute="none")):
        if m.pp != 4 or m.interleave > 1:
            continue
        ev = model.evaluate(m)
        balanced = llm._balance(n, m.pp, 1, *_times(model, m))
        with monkeypatch.context() as mp:
            _forced(mp, balanced)
            if model.evaluate(m).fits:
                continue  # the time-balanced split fits: nothing to move
            fitting = []
            for split in itertools.product(range(1, n + 1), repeat=m.pp):
                if sum(split) == n:
                    _forced(mp, split)
                    forced = model.evaluate(m)
                    if forced.fits:
                        fitting.append(_bottleneck(forced))
        rescued += 1
        assert ev.fits and tuple(ev.layers_per_stage) != tuple(balanced), m
        assert any(f"not the time-balanced {list(balanced)}" in note for note in ev.notes)
        assert ev.memory.total_bytes <= ev.memory.capacity_bytes
        assert _bottleneck(ev) == pytest.approx(min(fitting), rel=1e-12), m
    assert rescued >= 2


def _times(model: LLMModel, m) -> tuple[float, float, float]:
    """(layer, first-stage extra, last-stage extra) seconds ``evaluate`` balances with: read back
    from the split it takes when memory is no concern."""
    seen = {}
    real = llm._balance

    def spy(num_layers, pp, interleave, layer_s, first_s, last_s):
        seen["args"] = (layer_s, first_s, last_s)
        return real(num_layers, pp, interleave, layer_s, first_s, last_s)

    llm._balance = spy
    try:
        model.evaluate(m)
    finally:
        llm._balance = real
    return seen["args"]


def test_search_with_uneven_splits_equals_exhaustive():
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2, capacity=CAPACITY))
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_a_moved_split_shows_in_the_result_and_in_validate_label():
    """The result's pipeline says the split was moved, and validate's mapping label lists the
    layers per stage then (and only then)."""
    from dfmodel.validate import describe

    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2, capacity=CAPACITY))
    moved = solve_llm(w, s, Knobs(tp=1, pp=4, dp=2, micro_batch=4, interleave=1, recompute="none", zero_stage=0))
    assert moved.pipeline["split_moved"] is True
    layers = moved.pipeline["layers_per_stage"]
    assert sum(layers) == SMALL_LLM["model"]["num_layers"]
    assert describe(moved.parallelism, moved.pipeline).endswith(" layers " + "/".join(map(str, layers)))
    roomy = solve_llm(w, load_system(small_system(4, 2)), Knobs(tp=1, pp=4, dp=2, micro_batch=4, interleave=1, recompute="none", zero_stage=0))
    assert roomy.pipeline["split_moved"] is False
    assert "layers" not in describe(roomy.parallelism, roomy.pipeline)
