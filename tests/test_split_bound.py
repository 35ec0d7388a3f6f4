"""The two-stage memory split bound of a dataflow search (issue 12).

With two plain 1F1B stages, :meth:`LLMModel.evaluate` runs a layer split whose stages fit the
chip's memory (the time-balanced one, or the least bottleneck of those that fit), so the
bottleneck stage holds at least as many layers as the fitting splits force on it:

- ``_fitting_splits`` finds the splits that fit as an interval by bisection on each stage alone.
  Oracle: every split's exact memory (``_stage_memory_of`` of the whole split);
- ``split_stage_floor_s`` takes the least bottleneck over that interval where memory moves the
  split past the crossing of the two stages' floors. Oracle: a scan of every split of the interval;
- the own-group pre-solve bound holding it never exceeds the evaluated step time, and on splits
  moved for memory the bottleneck floor exceeds the mean stage's;
- ``_no_split_fits`` (the middle split first, then the interval) agrees with the interval;
- the search with it still equals exhaustive enumeration
  (``test_split_memory_screen.test_search_with_the_screens_equals_exhaustive``, whose capacities
  include two where many splits move)."""

from __future__ import annotations

import pytest

from dfmodel.inter_chip import dataflow_floor
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel, _is_attention_core
from dfmodel.inter_chip.llm_space import llm_candidates
from test_split_memory_screen import _tight_dataflow_moe

CAPACITY = "600 MiB"  # (the small MoE model: a third of its two-stage mappings fit only some splits)


def _two_stage(model: LLMModel, step: int) -> list:
    return [m for m in llm_candidates(model, Knobs()) if m.pp == 2 and m.interleave == 1][::step]


def _splits_that_fit(model: LLMModel, m) -> list[int]:
    params = model._plan_free_block_params(m)
    n = model.num_layers
    out = []
    for s in range(1, n):
        moe, dense = model._split_kinds((s, n - s), m)
        if model._stage_memory_of(m, params, moe, dense)[1].fits:
            out.append(s)
    return out


def test_fitting_splits_are_every_split_that_fits():
    w, s = _tight_dataflow_moe(CAPACITY)
    model = LLMModel(w, s)
    kinds = {"none": 0, "narrow": 0, "all": 0}
    for m in _two_stage(model, 5):
        got = model._fitting_splits(m)
        want = _splits_that_fit(model, m)
        assert got == ((want[0], want[-1]) if want else ()), (m, got, want)
        assert want == list(range(want[0], want[-1] + 1)) if want else True  # (an interval)
        kinds["none" if not want else "all" if len(want) == model.num_layers - 1 else "narrow"] += 1
    assert all(k > 20 for k in kinds.values()), kinds


def test_split_stage_floor_is_the_least_bottleneck_over_the_fitting_splits():
    w, s = _tight_dataflow_moe(CAPACITY)
    model = LLMModel(w, s)
    n, checked = model.num_layers, 0
    for m in _two_stage(model, 23):
        fitting = model._fitting_splits(m)
        if not fitting:
            assert model.split_stage_floor_s(m, 0.0) == 0.0
            continue
        groups = model._tp_groups(m) if m.tp > 1 else None

        def stage_s(i, split):
            moe, dense = (kinds[i] for kinds in model._split_kinds((split, n - split), m))
            return dataflow_floor.pass_floor_s(model, m, _is_attention_core, groups, stage=(i, moe, dense)) + moe * 1e-3

        scan = min(max(stage_s(0, x), stage_s(1, x)) for x in range(fitting[0], fitting[1] + 1))
        got = model.split_stage_floor_s(m, 1e-3)
        end = stage_s(1, fitting[1]) >= stage_s(0, fitting[1]) or stage_s(0, fitting[0]) >= stage_s(1, fitting[0])
        # the crossing beyond the interval: its end's floor, the least; inside: 0 (the mean stage's)
        assert got == (pytest.approx(scan, rel=1e-9) if end else 0.0), (m, fitting, got, scan)
        checked += end
    assert checked > 10


def test_split_bound_holds_and_binds_on_moved_splits():
    w, s = _tight_dataflow_moe(CAPACITY)
    model = LLMModel(w, s)
    fitting, raised = 0, 0
    for m in _two_stage(model, 11):
        ev = model.evaluate(m)
        if not ev.fits:
            continue
        fitting += 1
        stages = [f + b for f, b in zip(ev.stage_fwd_s, ev.stage_bwd_s)]
        assert model.split_stage_floor_s(m, 0.0) <= max(stages) * (1 + 1e-9), m
        ep_s = model._moe_ep_floor_s(m)
        own = (m.group("tp"),)
        assert model.split_stage_floor_s(m, ep_s, own) <= max(stages) * (1 + 1e-9), m
        for bound in (model._own_groups_bound_s(m), model.presolve_bound_s(m) or 0.0):
            assert bound <= ev.iteration_time_s * (1 + 1e-9), (m, bound, ev.iteration_time_s)
        mean_s = model._mean_stage_floor_s(m, own) + model.num_moe_layers * ep_s / m.pp
        if ev.split_moved and model.split_stage_floor_s(m, ep_s, own) > mean_s * 1.01:
            raised += 1
    assert fitting > 30 and raised > 5, (fitting, raised)


def test_no_split_fits_agrees_with_the_interval():
    w, s = _tight_dataflow_moe(CAPACITY)
    model = LLMModel(w, s)
    none = 0
    for m in _two_stage(model, 3):
        assert model._no_split_fits(m) == (model._fitting_splits(m) == ()), m
        none += model._no_split_fits(m)
    assert none > 20


def test_no_split_that_fits_prunes_before_the_presolve_bound():
    w, s = _tight_dataflow_moe(CAPACITY)
    model = LLMModel(w, s)
    cap = float(s.chip.memory.capacity_bytes)
    # (mappings the one-stage floors of the screen let through, as they took any split)
    missed = [m for m in _two_stage(model, 3)
              if model._fitting_splits(m) == () and model.memory_before_blocks(m).total_bytes <= cap]
    assert len(missed) > 5
    for m in missed:
        assert model.presolve_bound_s(m) is None  # (evaluate's memory screen rejects it at once)
        # the leaf group's screen prunes it, reporting the least memory of its splits
        assert model.screen_bytes(m, cap) == pytest.approx(model.memory_before_solves(m).total_bytes, rel=1e-12)
        assert model.screen_bytes(m, cap) > cap
