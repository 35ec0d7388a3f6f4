"""MoE search (issue 10 done-when, DeepSeek-V3): recipe incumbents seeded before the search
(they only move the cutoff, never the answer), and the "nothing fits" message when every group
is screened out during the search."""

from __future__ import annotations

import dataclasses

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InfeasibleError
from dfmodel.inter_chip import experts as X
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import LLMSpace, mappings_under

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
    assert eps == sorted(eps, reverse=True)  # largest ep first
    for ep in set(eps):  # per ep, one per pipeline depth, shallowest first
        pps = [ev.mapping.pp for ev in seeds if ev.mapping.ep == ep]
        assert pps == sorted(set(pps))
    for ev in seeds:
        assert ev.fits and ev.mapping in in_space and ev.mapping.ep > 1
        assert ev.iteration_time_s == model.evaluate(ev.mapping).iteration_time_s


def test_seeds_never_evaluate_a_leaf_no_plan_fits():
    """A seed leaf whose bound is infinite (no partition plan of a phase fits the SRAM on any
    TP group) cannot run: seeds skip it and try the next. DeepSeek-V3 on 512 dragonfly chips,
    whose TP 1 and 2 softmaxes exceed the SRAM alone: every mapping the seeds hand to
    ``evaluate`` (here a stand-in that never fits, so every try is made) has a finite bound,
    while roots that would have been tried first hold infinite leaves."""
    import math
    from types import SimpleNamespace

    from dfmodel.inter_chip.llm_space import leaf_nodes

    model, space = _space(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=512), Knobs())
    capacity = model.system.chip.memory.capacity_bytes
    tried = []
    list(space.seeds(capacity, lambda m: tried.append(m) or SimpleNamespace(fits=False)))
    assert len(tried) > 5 and all(model.lower_bound_s(m) < math.inf for m in tried)
    narrow = [r for r in space.roots_built if dict(r.knobs)["tp"] <= 2 and dict(r.knobs)["ep"] > 1
              and r.floor_bytes <= capacity]
    group = min(narrow[0].expand(), key=lambda g: dict(g.knobs)["micro_batch"])
    assert any(math.isinf(leaf.bound_s) for leaf in leaf_nodes(group))


def test_seeds_fall_back_to_zero3_before_a_heavier_recompute():
    """Where no ZeRO 0 / 1 leaf of the lightest recompute passes the memory screen, the seed is
    the ZeRO-3 leaf of that recompute (DeepSeek-V3 on 8192 dragonfly chips: TP 8, PP 1, no
    recompute under ZeRO-3 is the optimum, 122 s; the ZeRO-1 seed needed selective recompute,
    145 s); where a ZeRO-1 leaf fits it stays the seed."""
    from types import SimpleNamespace

    model, space = _space(load_workload("deepseek_v3"), load_system("dragonfly", num_chips=8192), Knobs())
    capacity = model.system.chip.memory.capacity_bytes
    tried = []
    list(space.seeds(capacity, lambda m: tried.append(m) or SimpleNamespace(fits=True)))
    assert (tried[0].pp, tried[0].recompute, tried[0].zero_stage) == (1, "none", 3)
    for m in tried:  # (ZeRO-3 only where its ZeRO-1 twin does not pass the screen)
        assert m.zero_stage == 1 or model.screen_bytes(dataclasses.replace(m, zero_stage=1), capacity) > capacity, m
    assert any(m.zero_stage == 1 for m in tried)


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


# -- DeepSeek-V3's communication savings: node-limited routing, FP8 dispatch ---------------------
def _ep_mapping(model, ep, **knobs):
    from dfmodel.inter_chip.llm_space import llm_candidates

    return next(c for c in llm_candidates(model, Knobs(tp=1, pp=1, ep=ep, micro_batch=1, recompute="none",
                                                         overlap_moe_expert_parallel_comm=False, **knobs))
                if dict(c.group("ep")).get("ib", 1) > 1)  # an ep group that spans the nodes


def _nccl_a2a_by_hand(c, nbytes: float) -> float:
    """Megatron-Core's NCCL all-to-all of ``nbytes`` per rank over small_system(4, 2)'s nvlink x ib
    ep group, written out: one all-to-all per dimension, in series or pipelined (busiest + the
    latency-only fills), the IB step's bandwidth term at experts.nccl_a2a_scale_out_efficiency."""
    nv = c.time_s("all_to_all", nbytes, (("nvlink", 4),))
    ib0 = c.time_s("all_to_all", 0.0, (("ib", 2),))
    ib = ib0 + (c.time_s("all_to_all", nbytes, (("ib", 2),)) - ib0) / X.nccl_a2a_scale_out_efficiency()
    fill = c.time_s("all_to_all", 0.0, (("nvlink", 4),)) + ib0
    return min(nv + ib, max(nv, ib) + fill)


def test_node_limited_routing_closed_form():
    """ep over 2 nodes x 4 GPUs, top-2 of 8 experts, at most 1 node per token: the IB step's
    buffer is T x 1 x h x e (one copy per node), the NVLink step's T x 2 x h x e (every copy);
    the two steps run one after another or pipelined, whichever is faster. Without the limit
    (Megatron-Core's NCCL all-to-all) every copy crosses IB, whose bandwidth term runs at
    experts.nccl_a2a_scale_out_efficiency."""
    s = load_system(small_system(4, 2))
    free = LLMModel(load_workload(moe_workload()), s)
    lim = LLMModel(load_workload(moe_workload(max_nodes_per_token=1)), s)
    m = _ep_mapping(free, 8)
    h, T, c = free.model.hidden, free.model.seq_len, free.costs
    full = T * 2 * h * 2
    assert m.group("ep") == (("nvlink", 4), ("ib", 2))
    free_one = _nccl_a2a_by_hand(c, full)
    assert free._ep_comm(m) == pytest.approx((2 * free_one, 2 * free_one), rel=1e-12)
    nv = c.time_s("all_to_all", full, (("nvlink", 4),))
    fill = c.time_s("all_to_all", 0.0, (("nvlink", 4),)) + c.time_s("all_to_all", 0.0, (("ib", 2),))
    ib = c.time_s("all_to_all", full / 2, (("ib", 2),))
    one = min(nv + ib, max(nv, ib) + fill)
    assert lim._ep_comm(m) == pytest.approx((2 * one, 2 * one), rel=1e-12)
    assert sum(lim._ep_comm(m)) < sum(free._ep_comm(m))
    # a limit of top_k nodes or more changes nothing
    same = LLMModel(load_workload(moe_workload(max_nodes_per_token=2)), s)
    assert sum(same._ep_comm(m)) <= sum(free._ep_comm(m)) * (1 + 1e-12)


def test_fp8_dispatch_halves_only_the_dispatches():
    s = load_system(small_system(4, 2))
    bf, f8 = (LLMModel(load_workload(moe_workload(dispatch_fp8=v)), s) for v in (False, True))
    m = _ep_mapping(bf, 8)
    h, T, c = bf.model.hidden, bf.model.seq_len, bf.costs
    assert m.group("ep") == (("nvlink", 4), ("ib", 2))
    combine = _nccl_a2a_by_hand(c, T * 2 * h * 2)
    dispatch = _nccl_a2a_by_hand(c, T * 2 * h * X.FP8_DISPATCH_BYTES)
    assert f8._ep_comm(m) == pytest.approx((dispatch + combine,) * 2, rel=1e-12)
    assert dispatch < combine


def test_more_scale_out_bandwidth_never_slower_a2a():
    w = load_workload(moe_workload(max_nodes_per_token=1, dispatch_fp8=True))
    times = []
    for ib in ("12.5 GB/s", "25 GB/s", "50 GB/s", "100 GB/s"):
        model = LLMModel(w, load_system(small_system(4, 2, ib_bw=ib)))
        times.append(sum(model._ep_comm(_ep_mapping(model, 8))))
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_search_equals_exhaustive_with_node_limited_fp8_dispatch():
    w, s = load_workload(moe_workload(first_dense_layers=1, max_nodes_per_token=1, dispatch_fp8=True)), \
        load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1)
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.parallelism.ep > 1 or full.parallelism.ep == fast.parallelism.ep


def test_moe_fields_rejected_with_a_clear_message():
    from dfmodel.errors import DFModelError

    with pytest.raises(DFModelError, match="max_nodes_per_token"):
        load_workload(moe_workload(max_nodes_per_token=0))


def test_moe_activation_delta_counts_linear_inputs_at_the_fp8_size():
    """FP8 training keeps linear-GEMM inputs at 1 byte (TE), dense or expert alike: the MoE
    delta's FC2 inputs (dense removed, experts and shared experts added) and the permuted FC1
    input change by (e - 1) bytes per element; the rest stays at e."""
    from types import SimpleNamespace as N

    from dfmodel.inter_chip.memory import moe_mla_activation_delta_bytes as delta

    moe = N(routed_token_factor=2.0, expert_ffn_hidden=64, num_experts=8, num_shared_experts=1, top_k=2)
    model = N(hidden=128, ffn=512, ffn_type="swiglu", moe=moe, mla=None)
    s, b, t, e = 256, 2, 2, 2
    kw = dict(seq_len=s, micro_batch=b, tp=t, sequence_parallel=True, bytes_per_element=e, recompute="none")
    rows = s * b * 2.0
    expected = (e - 1) * (-s * b * 512 / t + rows * 64 / t + rows * 128 / t + s * b * 64 / t)
    assert delta(model, **kw) - delta(model, linear_input_bytes=1, **kw) == pytest.approx(expected, rel=1e-12)
    assert delta(model, **kw) == delta(model, linear_input_bytes=e, **kw)  # bf16: as before
    assert delta(model, linear_input_bytes=1, **{**kw, "recompute": "full"}) == 0.0


def test_overlapped_a2a_exposes_the_unpaired_warm_up_micro_batches():
    """pp = 2: of M forwards (backwards) on the first stage, one is unpaired and exposed whole."""
    from dfmodel.inter_chip.llm_space import llm_candidates

    w, s = load_workload(moe_workload()), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    base = dict(tp=1, pp=2, ep=4, micro_batch=1, recompute="none")
    m_on = next(iter(llm_candidates(model, Knobs(**base, overlap_moe_expert_parallel_comm=True))))
    M = m_on.num_micro_batches
    assert M >= 2
    key = (m_on.micro_batch, m_on.tp, m_on.group("tp"), m_on.sequence_parallel)
    layer = model.block("layer", *key, 1, 4)
    a_f, a_b = model._ep_comm(m_on, None)  # not overlapped
    c = layer.fwd.time_s + layer.backward_s("none")
    share = X.overlapped_a2a_exposed_s(a_f + a_b, c, X.a2a_sm_fraction()) / (a_f + a_b)
    mean = share + (1 - share) / M
    assert model._ep_comm(m_on, layer) == pytest.approx((a_f * mean, a_b * mean), rel=1e-12)
    assert sum(model._ep_comm(m_on, layer)) <= a_f + a_b


def test_dgx_h800_scale_out_a2a_matches_deepep_bottleneck_bandwidth():
    """DeepEP's README (H800, CX7 400 Gb/s; 4096 tokens, hidden 7168, top-8, FP8 dispatch /
    BF16 combine) reports 43-47 GB/s RDMA bottleneck bandwidth per GPU for internode dispatch
    and combine at EP 16-64 (one IB copy per target node). The IB step of our node-limited
    all-to-all moves (n-1)/n of its buffer over each GPU's NIC: that rate must land in 43-47."""
    from dfmodel.graph.workload import MoEConfig
    from dfmodel.netmodels import CostTable

    s = load_system("dgx_h800", num_chips=64)
    costs = CostTable(s)
    moe = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048, max_nodes_per_token=4)
    rows, h = 4096 * 8, 7168
    for nodes in (2, 4, 8):
        group = (("ib", nodes),)
        t = X.token_a2a_s(costs, group, "nvlink", rows=rows, hidden=h, bytes_per_element=2, moe=moe)
        copies = min(4, nodes)
        sent = 4096 * copies * h * 2 * (nodes - 1) / nodes
        assert 43e9 <= sent / t <= 47e9


def test_every_leaf_bound_is_below_its_mappings_with_overlap_and_pipelines():
    """The space's MoE all-to-all bound term (SM share, and the unpaired warm-up micro-batches
    whole) stays below every evaluation, pipelines of 1-4 stages included."""
    w, s = load_workload(moe_workload(first_dense_layers=1)), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1, overlap_moe_expert_parallel_comm=True, recompute="none")
    model, space = _space(w, s, knobs)
    checked = set()

    def walk(node):
        for child in node.expand():
            if hasattr(child, "bound_s"):
                yield from ([(child, m) for m in child.expand()] if child.leaf else walk(child))

    for root in space.roots_built:
        for leaf, m in walk(root):
            ev = model.evaluate(m)
            assert leaf.bound_s <= ev.iteration_time_s * (1 + 1e-12), (m, leaf.bound_s, ev.iteration_time_s)
            checked.add((m.pp, m.ep))
    assert {(2, 4), (1, 8)} <= checked or any(pp > 1 and ep > 1 for pp, ep in checked)


@pytest.mark.parametrize("knobs", [Knobs(micro_batch=1, recompute="none"),
                                   Knobs(micro_batch=1, recompute="full", overlap_moe_expert_parallel_comm=True)])
def test_presolve_and_refined_bounds_are_below_every_moe_evaluation(knobs):
    """Exhaustive oracle for the MoE mapping bounds: the pre-solve bound (forced TP reductions
    on the mapping's own TP group, all-to-alls on its own ep group), the refined bound (its
    solved blocks plus its exact all-to-alls) and the pre-solve memory screen of every mapping
    of a small space stay below its evaluation, and the pre-solve bound is above the group
    bound somewhere (it prunes more)."""
    w, s = load_workload(moe_workload(first_dense_layers=1)), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    tighter = checked = 0
    for m in LLMSpace(model, knobs):
        pre = model.presolve_bound_s(m)
        ev = model.evaluate(m)
        if m.ep > 1 or m.zero_stage == 3:  # (ep 1: ZeRO-3's expert gathers are its own, LLMModel._moe_fsdp_floor_s)
            assert pre is not None and pre <= ev.iteration_time_s * (1 + 1e-12), (m, pre, ev.iteration_time_s)
            tighter += pre > model.lower_bound_s(m) * (1 + 1e-9)
            checked += 1
        else:
            assert pre is None
        assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12), m
        # the pre-solve memory screen (with the MoE-layers-alone split) stays below the evaluation
        assert model.memory_before_blocks(m).total_bytes <= ev.memory.total_bytes * (1 + 1e-12), m
    assert checked and tighter


def test_leanest_takes_an_offloaded_twin_when_nothing_fits_on_the_chip():
    """A MoE model too large for the chips without offload (DeepSeek-V3 on 64 H100s): the early
    incumbent of a time-limited search is an offloaded mapping, not none at all."""
    from test_offload import with_host

    w = load_workload(moe_workload(first_dense_layers=1))
    model = LLMModel(w, load_system(with_host(small_system(4, 2))))
    space = LLMSpace(model, Knobs(micro_batch=1))
    space.roots()
    need = min(r.floor_bytes for r in space.roots_built)
    # the chips hold a little less than the leanest group needs on the chip
    model.system = model.system.model_copy(update={"chip": model.system.chip.model_copy(update={
        "memory": model.system.chip.memory.model_copy(update={"capacity_bytes": need * 0.999})})})
    cap = model.system.chip.memory.capacity_bytes
    assert not [r for r in space.roots_built if r.floor_bytes <= cap]
    lean = space.leanest(cap)
    assert lean is not None and lean.offload_optimizer != "none"
    assert lean in set(x for r in space.roots_built if r.relief is not None and (t := r.relief()) is not None
                       for x in mappings_under(t))



# -- Megatron-Core's NCCL all-to-all over the scale-out network (DeepEP issue #59) ---------------
def test_nccl_a2a_share_is_the_published_ratio_written_out():
    """DeepEP issue #59: NCCL's combine 13 ms, DeepEP's 5 ms for the same layer on 8 H100 nodes;
    NCCL sent top_k = 8 copies per token where DeepEP sent one per target node (M = 4): NCCL's
    rate = (8 / 4) x 5 / 13 of DeepEP's."""
    assert X.nccl_a2a_scale_out_efficiency() == pytest.approx(2 * 5 / 13, rel=1e-12)
    assert 0.0 < X.nccl_a2a_scale_out_efficiency() < 1.0


@pytest.mark.parametrize("preset,chips,group", [("dgx_h100", 64, (("nvlink", 8), ("ib", 8))),
                                                ("v100_fdr", 16, (("pcie", 4), ("ib", 4)))])  # host-staged: in series
def test_nccl_a2a_at_full_share_is_the_cost_tables_all_to_all(monkeypatch, preset, chips, group):
    """The NCCL path runs the all-to-all as the cost table does (per dimension, in series or
    pipelined as the dimensions allow): at a share of 1 it is the cost table's all_to_all."""
    from dfmodel.graph.workload import MoEConfig
    from dfmodel.netmodels import CostTable

    s = load_system(preset, num_chips=chips)
    costs = CostTable(s)
    moe = MoEConfig(num_experts=64, top_k=8, expert_ffn_hidden=2048)
    kw = dict(rows=8 * 4096, hidden=7168, bytes_per_element=2, moe=moe)
    slowed = X.token_a2a_s(costs, group, s.network[0].name, **kw)
    monkeypatch.setattr(X, "nccl_a2a_scale_out_efficiency", lambda: 1.0)
    full = X.token_a2a_s(costs, group, s.network[0].name, **kw)
    assert full == pytest.approx(costs.time_s("all_to_all", 8 * 4096 * 7168 * 2, group), rel=1e-12)
    assert slowed > full


def test_nccl_share_slows_only_switched_scale_out_and_not_node_limited_dispatch(monkeypatch):
    """NVLink-only groups, a TPU's torus rings and a per-node (DeepEP) dispatch keep their
    times; on dgx_h100 the IB step of an NCCL all-to-all moves (n-1)/n of its buffer at the
    NCCL share of the 45 GB/s the preset's IB runs at."""
    from dfmodel.graph.workload import MoEConfig
    from dfmodel.netmodels import CostTable

    free = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048)
    lim = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048, max_nodes_per_token=4)
    kw = dict(rows=8 * 4096, hidden=7168, bytes_per_element=2)
    S = 8 * 4096 * 7168 * 2
    h100 = load_system("dgx_h100", num_chips=64)
    tpu = load_system("tpu_v4", num_chips=4096)
    ch, ct = CostTable(h100), CostTable(tpu)
    nv, ring = (("nvlink", 8),), (("x", 16), ("y", 16))
    assert X.token_a2a_s(ch, nv, "nvlink", moe=free, **kw) == ch.time_s("all_to_all", S, nv)
    assert X.token_a2a_s(ct, ring, "x", moe=free, **kw) == ct.time_s("all_to_all", S, ring)
    ib = (("ib", 8),)
    t0 = ch.time_s("all_to_all", 0.0, ib)
    t = X.token_a2a_s(ch, ib, "nvlink", moe=free, **kw)
    # (within 1 %: the latency term of a 235 MB step, under NCCL's Simple protocol, is not the zero-byte one)
    assert S * 7 / 8 / (t - t0) == pytest.approx(45e9 * X.nccl_a2a_scale_out_efficiency(), rel=1e-2)
    both = (("nvlink", 8), ("ib", 8))
    before = X.token_a2a_s(ch, both, "nvlink", moe=lim, **kw)
    monkeypatch.setattr(X, "nccl_a2a_scale_out_efficiency", lambda: 0.1)
    assert X.token_a2a_s(ch, both, "nvlink", moe=lim, **kw) == before


def test_nccl_share_only_on_kernel_by_kernel_chips():
    """A dataflow chip's switched scale-out is not NCCL's: no dimension is slowed there."""
    s = load_system(small_system(4, 2))
    assert X.nccl_scale_out_dims(s, (("nvlink", 4), ("ib", 2)), "nvlink") == {"ib"}
    s.chip.execution = "dataflow"
    assert X.nccl_scale_out_dims(s, (("nvlink", 4), ("ib", 2)), "nvlink") == frozenset()
