"""Per-stage caps on the layers that keep their stash on chip (LLMModel._onchip_layers_cap in the
refined bound, dataflow_floor.staged_layers_on_chip in the pass floor): never below what the
evaluation keeps (oracle: its own layer split, stage by stage), so both bounds stay below every
candidate's evaluation on a dataflow chip whose SRAM holds only some stashes; and tighter there
than "every layer on chip". And a block key that fits no plan is not solved twice."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip import dataflow_floor as dff
from dfmodel.inter_chip import memory as mem
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.search import llm_candidates
from tests.test_inter_chip import SMALL_LLM
from tests.test_onchip_stash import dataflow_system


@pytest.mark.parametrize("sram", ["48 MiB", "160 MiB"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_caps_hold_the_evaluations_layers_and_bounds_stay_below(sram, recompute):
    model = LLMModel(load_workload(SMALL_LLM), load_system(dataflow_system(sram, chips=4)))
    cands = list(llm_candidates(model, Knobs(recompute=recompute, tp=1)))
    assert cands
    sram_b, tighter, checked = float(model.system.chip.sram_bytes), 0, 0
    for m in cands:
        ev = model.evaluate(m)
        rb = model.refined_bound_s(m)
        layer = model.block("layer", m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert rb <= ev.iteration_time_s * (1 + 1e-12)
        if layer.onchip is None:
            continue
        checked += 1
        kept = sum(layer.onchip.layers_on_chip(sram_b, n, mem.in_flight_micro_batches(m.pp, i, m.num_micro_batches,
                                                                                       m.interleave),
                                               full_recompute=recompute == "full",
                                               checkpoint_bytes=model._checkpoint_bytes(m))
                   for i, n in enumerate(ev.layers_per_stage))
        cap = model._onchip_layers_cap(m, layer.onchip)
        assert kept <= cap <= model.num_layers
        floors = model.__dict__["_dataflow_block_floors"]
        fl = floors[("layer", m.tp, m.cp, 1, False)]
        in_flight = tuple(mem.in_flight_micro_batches(m.pp, i, m.num_micro_batches) for i in range(m.pp))
        staged = dff.staged_layers_on_chip(fl, m.micro_batch, sram_b, model.num_layers, in_flight, recompute,
                                           model._checkpoint_bytes(m))
        assert kept <= staged <= fl.max_layers_on_chip(m.micro_batch, sram_b, model.num_layers, m.pp, recompute,
                                                       model._checkpoint_bytes(m))
        tighter += cap < model.num_layers
    assert checked and tighter


def test_a_block_that_fits_no_plan_fails_again_without_a_solve(monkeypatch):
    """LLMModel.block keeps the InfeasibleError of a block key: the second call raises the same
    message without solving again; another key still solves."""
    from dfmodel.errors import InfeasibleError

    model = LLMModel(load_workload(SMALL_LLM), load_system(dataflow_system("1 MiB", chips=4)))
    calls = []
    real = model._solve_block
    monkeypatch.setattr(model, "_solve_block", lambda *a, **k: calls.append(a) or real(*a, **k))
    msgs = []
    for _ in range(2):
        with pytest.raises(InfeasibleError) as exc:
            model.block("layer", 1, 1, (), False)
        msgs.append(str(exc.value))
    assert len(calls) == 1 and msgs[0] == msgs[1]
    with pytest.raises(InfeasibleError):
        model.block("layer", 2, 1, (), False)
    assert len(calls) == 2
