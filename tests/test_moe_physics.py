"""MoE physics (issue 10 item 4, second pass): dense layers before the MoE layers, expert
gradients over the expert data-parallel group, the all-to-all overlap option; closed forms,
brute-force layer splits, search == exhaustive, bounds below evaluations."""

from __future__ import annotations

import math

import copy
import itertools

import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.moe import dispatch_bytes_per_rank, expert_params
from dfmodel.inter_chip import experts as X
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.netmodels import merge_groups

from test_inter_chip import SMALL_LLM, small_system

MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "num_shared_experts": 1}


def assert_bounds_below_evaluation(model, mappings) -> None:
    """Every search bound of each mapping (time: compute-only and refined; memory: the floor and
    the before-blocks screen) is at most what its evaluation gives."""
    for m in mappings:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-12)
        assert model.memory_before_blocks(m).total_bytes <= ev.memory.total_bytes * (1 + 1e-12)


def moe_workload(**moe) -> dict:
    w = copy.deepcopy(SMALL_LLM)
    w["name"] = "small_moe"
    w["model"]["moe"] = {**MOE, **moe}
    return w


# -- DeepSeek-V3: 671B total, 37B activated ----------------------------------------------------
def test_deepseek_v3_total_and_activated_parameters():
    """Report (arXiv:2412.19437, abstract and sec. 4.2): 671B total, 37B activated per token.
    Activated = everything but the 256 - 8 routed experts a token does not use."""
    gs = build_graphs("deepseek_v3", batch=1)
    total = gs.params()
    routed = expert_params(gs.layer) * gs.num_moe_layers
    activated = total - routed * (1 - 8 / 256)
    assert total == pytest.approx(671e9, rel=0.005)
    # 37B in the report; the embedding and head (0.93B each) are within the rounding
    assert 36.5e9 <= activated <= 38.5e9
    # the dense layers are real dense layers: SwiGLU FFN of 18432, no router, no experts
    assert gs.dense_layer.kernel("fwd.fc1").dims["n"] == 2 * 18432
    assert expert_params(gs.dense_layer) == 0
    assert "fwd.router" not in {k.name for k in gs.dense_layer.kernels}


def test_no_dense_layers_keeps_one_layer_kind():
    gs = build_graphs(load_workload(moe_workload()), batch=1)
    assert gs.dense_layer is None and gs.num_moe_layers == gs.num_layers


def test_dense_layers_flop_add_up():
    w = load_workload(moe_workload(first_dense_layers=3))
    gs = build_graphs(w, batch=2)
    assert gs.total_flop() == pytest.approx(5 * gs.layer.total_flop() + 3 * gs.dense_layer.total_flop()
                                            + gs.embedding.total_flop() + gs.head.total_flop(), rel=1e-12)


# -- the stage split sees dense and MoE layer times ------------------------------------------
def _brute_force_bottleneck(times: list[float], pp: int, first: float, last: float) -> float:
    best = float("inf")
    n = len(times)
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stage = [sum(times[bounds[i]:bounds[i + 1]]) for i in range(pp)]
        stage[0] += first
        stage[-1] += last
        best = min(best, max(stage))
    return best


@pytest.mark.parametrize("pp", [2, 4])
def test_stage_split_balances_dense_and_moe_layer_times(pp):
    """The evaluated stages hold the dense layers first and are an optimal min-max split of the
    per-layer times (brute force over every contiguous split)."""
    w = load_workload(moe_workload(first_dense_layers=3))
    model = LLMModel(w, load_system(small_system(4, 2)))
    m = next(c for c in llm_candidates(model, Knobs(pp=pp, tp=1, ep=2, micro_batch=1, recompute="none",
                                                    interleave=1)))
    ev = model.evaluate(m)
    key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
    dense, layer = model.block("dense_layer", *key), model.block("layer", *key, 1, m.ep)
    t_moe = sum(model._layer_phases_s(m, layer, model._layer_comm(m, layer, ())))
    t_dense = dense.fwd.time_s + dense.backward_s(m.recompute)
    assert t_dense != pytest.approx(t_moe, rel=1e-3)  # the two kinds really differ
    emb, head = model.block("embedding", *key), model.block("head", *key)
    first, last = emb.fwd.time_s + emb.backward_s("none"), head.fwd.time_s + head.backward_s("none")
    times = [t_dense] * 3 + [t_moe] * 5
    got = max(f + b for f, b in zip(ev.stage_fwd_s, ev.stage_bwd_s))
    assert got == pytest.approx(_brute_force_bottleneck(times, pp, first, last), rel=1e-9)
    # stage 0 holds the dense layers first: its time is the sum of the layers it holds
    n0 = ev.layers_per_stage[0]
    assert ev.stage_fwd_s[0] + ev.stage_bwd_s[0] == pytest.approx(first + sum(times[:n0]), rel=1e-9)


def test_dense_layers_per_stage_interleaved():
    # chunks in pipeline order run on stages 0, 1, 0, 1: dense layers fill chunks 0 and 1 first
    assert X.dense_layers_per_stage([2, 2, 2, 2], 2, 3) == [2, 1]
    assert X.dense_layers_per_stage([1, 3, 3, 1], 2, 5) == [2, 3]
    assert X.dense_layers_per_stage([4, 4], 2, 0) == [0, 0]


# -- expert gradients over the expert data-parallel group --------------------------------------
def test_expert_data_parallel_group_is_dp_cp_without_ep():
    s = load_system(small_system(4, 2))
    model = LLMModel(load_workload(moe_workload()), s)
    for m in llm_candidates(model, Knobs(tp=1, pp=1, micro_batch=1, recompute="none")):
        dpcp = merge_groups(s, m.group("cp"), m.group("dp"))
        edp = model._expert_dp_group(m)
        size = lambda g: eval("*".join(str(n) for _, n in g) or "1")  # noqa: E731
        assert size(edp) * m.ep == size(dpcp) == m.dp * m.cp


def test_expert_gradients_sync_over_expert_dp_ranks_closed_form():
    from dfmodel.inter_chip.pipeline import megatron_bucket_elements

    """ZeRO 0, overlap off: exposed sync = all-reduce(non-expert grads, dp x cp) +
    all-reduce(expert grads, dp x cp / ep); with ep = dp x cp the experts need no sync."""
    s = load_system(small_system(4, 2))
    model = LLMModel(load_workload(moe_workload()), s)
    for ep in (2, 8):
        m = next(c for c in llm_candidates(model, Knobs(tp=1, pp=1, ep=ep, micro_batch=1, recompute="none",
                                                        zero_stage=0, overlap_grad_reduce=False)))
        group = merge_groups(s, m.group("cp"), m.group("dp"))
        params, experts = 1e8, 4e7
        gb = model.training.grad_bytes
        bucket = megatron_bucket_elements(m.dp_cp)  # one all-reduce per Megatron bucket

        def bucketed(n, g):
            k = max(1, math.ceil(n / bucket))
            return k * model.costs.time_s("all_reduce", n * gb / k, g)

        want = bucketed(params - experts, group)
        edp = model._expert_dp_group(m)
        if ep < m.dp:
            want += bucketed(experts, edp)
        else:
            assert edp == ()
        got = model._dp_sync_s(m, params, 0.0, 0.0, group, expert_params_per_chip=experts)
        assert got == pytest.approx(want, rel=1e-12)
        # (not always cheaper than the old all-over-dp x cp reduction: ep = 2 carved out of the
        # NVLink ranks leaves a 4-rank expert group with half its members across IB, so each rank
        # sends twice the expert bytes over IB of a hierarchical 8-rank all-reduce)


def test_expert_optimizer_state_sharded_over_expert_dp():
    s = load_system(small_system(4, 2))
    model = LLMModel(load_workload(moe_workload()), s)
    m = next(c for c in llm_candidates(model, Knobs(tp=1, pp=1, ep=4, micro_batch=1, recompute="none",
                                                    zero_stage=1)))
    from dfmodel.inter_chip.llm import OPTIMIZER_BYTES_PER_PARAM
    from dfmodel.system.processor import memory_time_s
    want = memory_time_s(s.chip, OPTIMIZER_BYTES_PER_PARAM * (6e7 / m.dp + 4e7 / (m.dp // 4)))
    assert model.optimizer_s(m, 1e8, 4e7) == pytest.approx(want, rel=1e-12)


# -- the all-to-all overlap option ------------------------------------------------------------
def test_overlapped_a2a_closed_form():
    f = X.a2a_sm_fraction()
    assert f == pytest.approx(20 / 132)
    for a, c in [(1.0, 10.0), (10.0, 1.0), (5.0, 5.0), (0.0, 3.0)]:
        exposed = X.overlapped_a2a_exposed_s(a, c, f)
        # the pair takes max(a, c + f a); exposed is what exceeds the computation alone
        assert exposed == pytest.approx(max(a, c + f * a) - c if a else 0.0, abs=1e-15)
        assert 0.0 <= exposed <= a  # never worse than not overlapping
    with pytest.raises(ValueError):
        X.overlapped_a2a_exposed_s(1.0, 1.0, 1.0)


def test_ep_comm_with_overlap_matches_closed_form():
    w, s = load_workload(moe_workload()), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    base = dict(tp=1, pp=1, ep=4, micro_batch=1, recompute="none")
    m_off = next(c for c in llm_candidates(model, Knobs(**base, overlap_moe_expert_parallel_comm=False)))
    m_on = next(c for c in llm_candidates(model, Knobs(**base, overlap_moe_expert_parallel_comm=True))
                if c.placement == m_off.placement and c.options() == {**m_off.options(),
                                                                       "overlap_moe_expert_parallel_comm": True})
    assert m_on.num_micro_batches >= 2
    key = (m_on.micro_batch, m_on.tp, m_on.group("tp"), m_on.sequence_parallel)
    layer = model.block("layer", *key, 1, 4)
    tokens = m_on.micro_batch * w.model.seq_len
    nbytes = dispatch_bytes_per_rank(tokens, w.model.moe, w.model.hidden, 2, 4)
    one = model.costs.time_s("all_to_all", nbytes * 4 / 3, m_on.group("ep"))
    assert model._ep_comm(m_off, layer) == pytest.approx((2 * one, 2 * one), rel=1e-12)
    c = layer.fwd.time_s + layer.backward_s("none")
    exposed = X.overlapped_a2a_exposed_s(4 * one, c, 20 / 132)
    assert sum(model._ep_comm(m_on, layer)) == pytest.approx(exposed, rel=1e-12)
    on, off = model.evaluate(m_on), model.evaluate(m_off)
    assert on.breakdown_s["ep_comm"] < off.breakdown_s["ep_comm"]
    assert sum(on.breakdown_s.values()) == pytest.approx(on.iteration_time_s, rel=1e-9)


def test_overlap_option_only_with_experts():
    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    assert not any(c.overlap_moe_expert_parallel_comm for c in llm_candidates(model, Knobs(micro_batch=1)))
    assert not X.a2a_overlap_applies(ep=4, num_micro_batches=1)


# -- the search stays exact, bounds stay valid ---------------------------------------------------
def test_search_equals_exhaustive_with_dense_layers_and_overlap():
    w, s = load_workload(moe_workload(first_dense_layers=2)), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1)
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_bounds_below_evaluation_with_dense_layers():
    w, s = load_workload(moe_workload(first_dense_layers=3)), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    cands = list(llm_candidates(model, Knobs(micro_batch=1)))
    assert any(c.overlap_moe_expert_parallel_comm for c in cands) and any(c.ep > 1 for c in cands)
    assert_bounds_below_evaluation(model, cands[::5])


def test_dense_layers_cost_what_a_dense_model_does():
    """An MoE model whose every layer but one is dense: the dense layers' block is the dense
    model's layer block (same graph), so their time and parameters match it exactly."""
    dense_w = load_workload(SMALL_LLM)
    w = load_workload(moe_workload(first_dense_layers=7))
    s = load_system(small_system(4, 2))
    a, b = LLMModel(dense_w, s), LLMModel(w, s)
    key = (1, 2, (("nvlink", 2),), True)
    da, db = a.block("layer", *key), b.block("dense_layer", *key)
    assert db.fwd.time_s == pytest.approx(da.fwd.time_s, rel=1e-12)
    assert db.bwd.time_s == pytest.approx(da.bwd.time_s, rel=1e-12)
    assert db.params_per_chip == da.params_per_chip


def test_refined_bound_valid_with_tp_comm_overlap():
    """The lazy refined bound used the raw layer phases, above what evaluate() charges with
    tp_comm_overlap (userbuffers hide TP collectives): 30 of 297 sampled candidates of the
    small dense model had a bound above their time. It now uses the same phases."""
    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    cands = [c for c in llm_candidates(model, Knobs(micro_batch=1, tp=4)) if c.tp_comm_overlap]
    assert cands
    for m in cands[::3]:
        ev = model.evaluate(m)
        assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)


# -- calibration cases -------------------------------------------------------------------------
def test_moe_calibration_cases_load_and_map():
    from dfmodel.validate import knobs_of, load_cases, not_evaluable, read_case_items, workload_of

    cases = load_cases("moe_training")
    ds = next(c for c in cases if c.id == "deepseek-v3-h800-2048")
    w = load_workload(workload_of(ds))
    assert w.model.moe.first_dense_layers == 3 and w.model.mla is not None
    assert build_graphs(w, batch=1).params() == pytest.approx(671e9, rel=0.005)
    k = knobs_of(ds)
    assert k["ep"] == 64 and k["overlap_moe_expert_parallel_comm"] is True and k["dp"] == 128
    # 15360 x 4096 tokens at 180K GPU hours per trillion tokens on 2048 GPUs
    assert ds.measured.iteration_time_s == pytest.approx(15360 * 4096 * 180e3 * 3600 / (1e12 * 2048), rel=1e-3)
    _, items = read_case_items("moe_training")
    reasons = {i["id"]: not_evaluable(i) for i in items}
    assert reasons["dgxc-deepseek-v3-bf16-h100-1024"] is None  # expert TP 1: modelled
    assert knobs_of(next(c for c in cases if c.id == "dgxc-deepseek-v3-bf16-h100-1024"))["etp"] == 1
    assert reasons["deepseek-v3-h800-2048"] is None


# -- expert tensor parallelism -------------------------------------------------------------------
def _etp_pair(model, **knobs):
    base = dict(tp=2, pp=1, ep=2, micro_batch=1, recompute="none", sequence_parallel=True,
                overlap_moe_expert_parallel_comm=False, tp_comm_overlap=False, zero_stage=1)
    base.update(knobs)
    return [next(c for c in llm_candidates(model, Knobs(**base, etp=v))) for v in (0, 1)]


def test_expert_tp_1_keeps_experts_whole_and_spans_tp_with_ep():
    """etp 0 (= tp 2): each rank holds E / ep experts, each TP-split in two; etp 1: the ep group
    is the 2 TP ranks x ep / 2 dp ranks, each rank holds E / ep whole experts (Megatron-Core)."""
    w, s = load_workload(moe_workload()), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    full = expert_params(build_graphs(w, batch=1).layer)
    for ep in (2, 4):
        m0, m1 = _etp_pair(model, ep=ep)
        e0, e1 = model.evaluate(m0), model.evaluate(m1)
        assert expert_params(e0.layer.sharded.graph) == pytest.approx(full / (ep * 2), rel=1e-9)
        assert expert_params(e1.layer.sharded.graph) == pytest.approx(full / ep, rel=1e-9)
        fc1 = e1.layer.sharded.graph.kernel("fwd.fc1")
        f_in = 2 * 64 if w.model.ffn_type == "swiglu" else 64
        assert fc1.dims["b"] == 8 // ep and fc1.dims["n"] == f_in  # whole experts, not TP-split
        assert e1.layer.sharded.plan.strategy["fwd.fc1"] == "expert"
        # the same FLOP per rank either way (the TP group's routed rows split over its members)
        assert fc1.flop == pytest.approx(e0.layer.sharded.graph.kernel("fwd.fc1").flop, rel=1e-9)
        # groups: ep spans the TP ranks; expert data parallel = tp x dp x cp / ep
        size = lambda g: eval("*".join(str(n) for _, n in g) or "1")  # noqa: E731
        epg = dict(m1.group("ep"))
        assert all(epg.get(d, 1) % n == 0 for d, n in m1.group("tp"))  # the TP ranks are in it
        assert size(m1.group("ep")) == ep
        assert size(model._expert_dp_group(m1)) == m1.tp * m1.dp * m1.cp // ep == m1.expert_dp
        assert size(model._expert_dp_group(m0)) == m0.dp * m0.cp // ep == m0.expert_dp


def test_expert_tp_1_allows_ep_beyond_dp():
    """ep = tp x dp (8 on 8 chips with tp 2, dp 4) exists only with expert TP 1."""
    model = LLMModel(load_workload(moe_workload()), load_system(small_system(4, 2)))
    cands = list(llm_candidates(model, Knobs(tp=2, pp=1, ep=8, micro_batch=1, recompute="none")))
    assert cands and all(c.etp == 1 and c.sequence_parallel for c in cands)
    assert not list(llm_candidates(model, Knobs(tp=2, pp=1, ep=8, micro_batch=1, recompute="none", etp=0)))


def test_search_equals_exhaustive_with_expert_tp():
    w, s = load_workload(moe_workload(first_dense_layers=1)), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1, tp=2, recompute="none")
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    model = LLMModel(w, s)
    for m in [c for c in llm_candidates(model, knobs) if c.etp == 1][::4]:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.memory_before_blocks(m).total_bytes <= ev.memory.total_bytes * (1 + 1e-12)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-12)
