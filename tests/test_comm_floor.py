"""Communication floors of the search's bounds on slow links (issue 12,
dfmodel/inter_chip/comm_floor.py): each is below every candidate's evaluation (exhaustive on
small cases), attained by some placement, and the searches they prune still find the
exhaustive optimum."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip import pipeline as pipe
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.netmodels import merge_groups
from tests.test_inter_chip import SMALL_LLM, small_system

#: a PCIe-box-like system: slow links inside and between nodes, so p2p is a large share
SLOW = small_system(4, 2, nv_bw="8 GB/s", ib_bw="1 GB/s")
DEEP = {**SMALL_LLM, "training": {"global_batch": 32, "precision": "bf16"}}


def _candidates(knobs: Knobs, every: int = 1):
    model = LLMModel(load_workload(DEEP), load_system(SLOW))
    return model, list(llm_candidates(model, knobs))[::every]


@pytest.mark.parametrize("knobs", [Knobs(interleave=1), Knobs(pp=4), Knobs(pp=2, cp=2, micro_batch=2)])
def test_p2p_floor_is_the_least_over_placements_of_the_schedule_exposure(knobs):
    """Plain 1F1B: the floor is K x the cheapest PP group's transfer (K the closed form's
    critical-path count); every candidate's own exposure is at least that, some attains it;
    interleaved candidates get none."""
    model, cands = _candidates(knobs)
    by_knobs: dict = {}
    for m in cands:
        floor = model.p2p_floor_s(m)
        if m.pp == 1 or m.interleave > 1:
            assert floor == 0.0
            continue
        own = pipe.p2p_transfers_on_critical_path(m.pp, m.num_micro_batches) * model.p2p_s(
            m.micro_batch, m.cp, m.tp, m.group("pp"))
        assert floor <= own * (1 + 1e-12)
        # (tp_comm_overlap restricts the TP group to userbuffers-capable dims, hence the PP
        # placements too: the floor is the least over the degrees' placements, attained by the
        # candidates with or without it)
        key = tuple(v for k, v in vars(m).items() if k not in ("placement", "tp_comm_overlap"))
        by_knobs.setdefault(key, []).append(own / floor)
    assert by_knobs and all(min(r) == pytest.approx(1.0, rel=1e-12) for r in by_knobs.values())


@pytest.mark.parametrize("knobs,every", [(Knobs(), 5), (Knobs(pp=4, recompute="full"), 1),
                                         (Knobs(pp=2, cp=2), 1)])
def test_bound_with_p2p_is_below_every_evaluation(knobs, every):
    """``lower_bound_s`` (now with the p2p floor) <= the evaluated time on every candidate
    (exhaustive on the pipelined ones), and the floor is what lifts some bounds."""
    model, cands = _candidates(knobs, every)
    lifted = 0
    for m in cands:
        ev = model.evaluate(m)
        bound = model.lower_bound_s(m)
        assert bound <= ev.iteration_time_s * (1 + 1e-12)
        lifted += model.p2p_floor_s(m) > 0
    assert lifted > 0


@pytest.mark.parametrize("knobs", [Knobs(), Knobs(pp=4)])
def test_search_with_comm_floors_equals_exhaustive(knobs):
    w, s = load_workload(DEEP), load_system(SLOW)
    fast = solve_llm(w, s, knobs)
    full = solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == full.iteration_time_s
    assert fast.solver.status == "optimal"
    assert fast.parallelism == full.parallelism


@pytest.mark.parametrize("knobs", [Knobs(zero_stage=3, tp_comm_overlap=False),
                                   Knobs(zero_stage=3, recompute="full", pp=2),
                                   Knobs(zero_stage=3, cp=2, pp=1)])
def test_fsdp_floor_is_below_every_zero3_layer(knobs):
    """ZeRO-3: the floor (2 gathers + 1 reduce-scatter of the layer's parameters over tp, on the
    cheapest dp x cp group) is below every candidate's exposed-and-hidden layer pass, and the
    bound holding it below every evaluation; some placement's collectives attain it."""
    model, cands = _candidates(knobs)
    ratios: dict = {}
    for m in cands:
        floor = model.fsdp_layer_floor_s(m)
        if m.dp_cp == 1 or (m.tp_comm_overlap and m.tp > 1):
            assert floor == 0.0
            continue
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        g = merge_groups(model.system, m.group("cp"), m.group("dp"))  # Megatron-Core's dp x cp ranks
        f, b = model._layer_phases_s(m, ev.layer, model._layer_comm(m, ev.layer, g))
        assert model.num_layers * floor <= model.num_layers * (f + b) * (1 + 1e-12)
        p = ev.layer.params_per_chip
        t = model.training
        own = (2 * model.costs.time_s("all_gather", p * t.activation_bytes, g)
               + model.costs.time_s("reduce_scatter", p * t.grad_bytes, g))
        assert floor <= own * (1 + 1e-12)
        ratios.setdefault((m.tp, m.pp, m.dp, m.cp), []).append(own / floor)
    assert ratios and any(min(r) < 1.01 for r in ratios.values())


@pytest.mark.parametrize("knobs", [Knobs(zero_stage=3), Knobs(pp=4, interleave=1), Knobs(cp=2, pp=2)])
def test_refined_bound_with_exposed_comm_is_below_every_evaluation(knobs):
    """Once a mapping's blocks are solved, its refined bound adds the layer's exposed
    communication (cp exchange, ZeRO-3 gathers) and plain 1F1B's p2p on its own groups: still
    below the evaluation on every candidate (exhaustive), and above the placement-free bound."""
    model, cands = _candidates(knobs)
    seen = 0
    for m in cands:
        ev = model.evaluate(m)
        rb = model.refined_bound_s(m)
        assert rb is not None and rb <= ev.iteration_time_s * (1 + 1e-12)
        seen += rb > model.lower_bound_s(m) * (1 + 1e-9)
    assert seen > 0


def _slow_dataflow():
    s = small_system(4, 2, nv_bw="4 GB/s", ib_bw="1 GB/s")
    s["chip"]["execution"] = "dataflow"
    s["chip"]["overlap"] = True
    return s


@pytest.mark.parametrize("system,tp,group", [("dragonfly", 8, (("local", 8),)),
                                             ("dragonfly", 24, (("local", 8), ("global", 3))),
                                             ("sn30", 8, (("x", 8),))])
@pytest.mark.parametrize("workload", ["gpt3_13b", "llama3_70b"])
def test_dataflow_phase_floor_with_tp_collectives_is_below_every_solved_phase(workload, system, tp, group):
    """With the forced TP reductions as each phase's network floor (max(C, M, N) per phase;
    max(floor, N) under userbuffers), the dataflow floors stay below the solved forward and
    backward (off-chip and on-chip stash), and the userbuffers phase times, on shipped blocks."""
    from dfmodel.inter_chip import dataflow_floor as dff
    from dfmodel.inter_chip.comm_floor import forced_phase_comm_s
    from dfmodel.inter_chip.llm import _is_attention_core, _userbuffers_s

    from dfmodel.graph.kernel import Phase

    model = LLMModel(load_workload(workload), load_system(system))
    lifted = 0
    for mb in (1, 2):
        for sp in (False, True):
            blk = model.block("layer", mb, tp, group, sp)
            fl = dff.dataflow_block_floor(model.graphs(1).layer, model.system, tp, _is_attention_core)
            nets = forced_phase_comm_s(model._block_floor("layer", tp, 1, sp, 1, False), mb, model.costs, group)
            # the sharding's own collectives per phase are above one of the Pareto pairs
            net_s, kinds = blk.sharded.network_time_s, {k.name: k.phase for k in blk.sharded.graph.kernels}
            own_f = sum(t for n, t in net_s.items() if kinds.get(n) == Phase.forward)
            own_b = sum(t for n, t in net_s.items() if kinds.get(n) not in (None, Phase.forward))
            below = [(a, b) for a, b in nets if a <= own_f * (1 + 1e-9) and b <= own_b * (1 + 1e-9)]
            assert below
            ok = []
            for a, b in below:
                f, bw = fl.phase_s(fl.fwd, mb, a), fl.phase_s(fl.bwd, mb, b)
                hf, hb = fl.phase_s(fl.fwd, mb, a, True), fl.phase_s(fl.bwd, mb, b, True)
                ok.append(f <= blk.fwd.time_s * (1 + 1e-9) and bw <= blk.bwd.time_s * (1 + 1e-9)
                          and fl.phase_s(fl.fwd_dram, mb, a) <= blk.fwd.time_s * (1 + 1e-9)
                          and fl.phase_s(fl.bwd_dram, mb, b) <= blk.bwd.time_s * (1 + 1e-9)
                          and (blk.onchip is None or (f <= blk.onchip.fwd_s * (1 + 1e-9)
                                                      and bw <= blk.onchip.bwd_s * (1 + 1e-9)))
                          and hf <= _userbuffers_s(blk.fwd, tp) * (1 + 1e-9)
                          and hb <= _userbuffers_s(blk.bwd, tp) * (1 + 1e-9))
                lifted += f + bw > (fl.phase_s(fl.fwd, mb) + fl.phase_s(fl.bwd, mb)) * (1 + 1e-9)
            assert all(ok)
    if len(group) > 1:  # across the slow global links the collectives outweigh compute and DRAM
        assert lifted > 0


@pytest.mark.parametrize("knobs,every", [(Knobs(), 3), (Knobs(tp=4), 1), (Knobs(tp=8, recompute="full"), 1)])
def test_dataflow_bound_with_tp_collectives_is_below_every_evaluation(knobs, every):
    model = LLMModel(load_workload(DEEP), load_system(_slow_dataflow()))
    cands = list(llm_candidates(model, knobs))[::every]
    for m in cands:
        assert model.lower_bound_s(m) <= model.evaluate(m).iteration_time_s * (1 + 1e-12)


def test_dataflow_search_with_tp_floor_equals_exhaustive():
    w, s = load_workload(DEEP), load_system(_slow_dataflow())
    fast = solve_llm(w, s, Knobs(pp=1))
    full = solve_llm(w, s, Knobs(pp=1), exhaustive=True)
    assert fast.iteration_time_s == full.iteration_time_s and fast.parallelism == full.parallelism


def test_shared_layer_comm_equals_the_fresh_one_on_every_candidate():
    """The refined bound's memoised exposed communication is exactly evaluate()'s on every
    candidate (cp, ZeRO-3 and the overlap flags varied): the fields it skips are never read."""
    model, cands = _candidates(Knobs(cp=2))
    _, more = _candidates(Knobs(zero_stage=3, pp=2))
    for m in cands + more:
        ev = model.evaluate(m)
        g = merge_groups(model.system, m.group("cp"), m.group("dp"))
        assert model._layer_comm_shared(m, ev.layer) == model._layer_comm(m, ev.layer, g)
