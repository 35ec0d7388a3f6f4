"""Mixture of experts and expert parallelism (issue 10 section 4): closed forms, the degenerate
1-expert MoE, and the search against exhaustive enumeration with ep in {1, 2, 4}."""

from __future__ import annotations

import copy

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.moe import dispatch_bytes_per_rank, expert_params, expert_shape
from dfmodel.graph.kernel import Phase
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates

from test_inter_chip import SMALL_LLM, small_system

MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "num_shared_experts": 1}


def with_moe(moe: dict, base: dict = SMALL_LLM) -> dict:
    w = copy.deepcopy(base)
    w["name"] = "small_moe"
    w["model"]["moe"] = moe
    return w


def test_dispatch_all_to_all_volume_closed_form():
    """One rank sends T x top_k x h x bytes x (ep-1)/ep in each dispatch (and each combine)."""
    w = load_workload(with_moe(MOE))
    T, h = 2 * w.model.seq_len, w.model.hidden
    for ep in (1, 2, 4, 8):
        assert dispatch_bytes_per_rank(T, w.model.moe, h, 2, ep) == T * 2 * h * 2 * (ep - 1) / ep


def test_ep_comm_charges_two_all_to_alls_each_way():
    w, s = load_workload(with_moe(MOE)), load_system(small_system(4, 2))
    model = LLMModel(w, s)
    m = next(c for c in llm_candidates(model, Knobs(ep=4, micro_batch=1, recompute="none")))
    tokens = m.micro_batch * w.model.seq_len // m.tp
    nbytes = dispatch_bytes_per_rank(tokens, w.model.moe, w.model.hidden, 2, 4)
    one = model.costs.time_s("all_to_all", nbytes * 4 / 3, m.group("ep"))
    assert model._ep_comm(m) == pytest.approx((2 * one, 2 * one), rel=1e-12)
    ev = model.evaluate(m)
    assert ev.breakdown_s["ep_comm"] > 0
    assert sum(ev.breakdown_s.values()) == pytest.approx(ev.iteration_time_s, rel=1e-9)


def test_one_expert_top1_equals_dense_mlp():
    """Routing every token to the one expert is the identity: same graph cost and memory."""
    dense = load_workload(SMALL_LLM)
    moe = load_workload(with_moe({"num_experts": 1, "top_k": 1, "expert_ffn_hidden": dense.model.ffn}))
    gd, gm = build_graphs(dense, batch=2).layer, build_graphs(moe, batch=2).layer
    assert gm.params() == gd.params()
    assert gm.matmul_flop(Phase.forward) == gd.matmul_flop(Phase.forward)
    assert gm.total_flop() == gd.total_flop()
    s = load_system(small_system(4, 2))
    a, b = solve_llm(dense, s, Knobs()), solve_llm(moe, s, Knobs())
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s, rel=1e-12)
    assert b.memory_per_chip_bytes == pytest.approx(a.memory_per_chip_bytes, rel=1e-12)
    assert b.parallelism == a.parallelism


def test_experts_split_by_ep_and_flop_unchanged():
    w = load_workload(with_moe(MOE))
    full = build_graphs(w, batch=2).layer
    for ep in (2, 4, 8):
        g = build_graphs(w, batch=2, ep=ep).layer
        assert expert_params(g) == pytest.approx(expert_params(full) / ep, rel=1e-12)
        assert g.params() - expert_params(g) == full.params() - expert_params(full)
        assert g.total_flop() == full.total_flop()  # each rank computes its tokens' routed rows
    # expert parameters: E experts x (fc1 + fc2) with biases, swiglu fc1 = 2 f wide
    h, f, E = w.model.hidden, 64, 8
    f_in = 2 * f if w.model.ffn_type == "swiglu" else f
    assert expert_params(full) == E * ((h * f_in + f_in) + (f * h + h))


def test_grouped_gemm_pads_each_expert():
    cfg = load_workload(with_moe({"num_experts": 64, "top_k": 2, "expert_ffn_hidden": 64})).model.moe
    ex = expert_shape(100, cfg, 1)
    assert (ex.experts_local, ex.rows_per_expert) == (64, 4)  # ceil(200 / 64)
    assert expert_shape(100, cfg, 16).rows_per_expert == 50


@pytest.mark.parametrize("knobs", [Knobs(), Knobs(micro_batch=1, recompute="selective"), Knobs(ep=2)])
def test_search_equals_exhaustive_with_ep(knobs):
    w, s = load_workload(with_moe(MOE)), load_system(small_system(4, 2))
    fast = solve_llm(w, s, knobs)
    full = solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.candidates_evaluated <= full.solver.candidates_evaluated


def test_bounds_valid_for_ep_candidates():
    model = LLMModel(load_workload(with_moe(MOE)), load_system(small_system(4, 2)))
    cands = [m for m in llm_candidates(model, Knobs(micro_batch=1)) if m.ep > 1]
    assert {m.ep for m in cands} >= {2, 4}
    for m in cands[::3]:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-12)
        # the screen the search runs before any block solve must count experts / ep too
        assert model.memory_before_blocks(m).total_bytes <= ev.memory.total_bytes * (1 + 1e-12)


def test_more_ep_never_more_expert_memory():
    model = LLMModel(load_workload(with_moe(MOE)), load_system(small_system(4, 2)))
    by_ep = {}
    for m in llm_candidates(model, Knobs(tp=1, pp=1, micro_batch=1, recompute="none", sequence_parallel=False,
                                           zero_stage=0)):
        by_ep.setdefault(m.ep, model.evaluate(m).memory.weights_bytes)
    eps = sorted(by_ep)
    assert len(eps) >= 2
    assert all(by_ep[a] > by_ep[b] for a, b in zip(eps, eps[1:]))


def test_bad_moe_fields_are_one_line_errors():
    with pytest.raises(InputError, match="top_k"):
        load_workload(with_moe({"num_experts": 2, "top_k": 3, "expert_ffn_hidden": 8}))
    with pytest.raises(InputError, match="first_dense_layers"):
        load_workload(with_moe({"num_experts": 2, "top_k": 1, "expert_ffn_hidden": 8, "first_dense_layers": 99}))


# -- multi-head latent attention ------------------------------------------------------------------

def test_mla_attention_parameters_closed_form():
    """DeepSeek-V3 attention per layer: down h x (1536+512+64) + norms, up 1536 x 128 x 192 +
    512 x 128 x 256, out 128 x 128 -> h (+ bias, as every linear here)."""
    w = load_workload("deepseek_v3")
    g = build_graphs(w, batch=1, ep=256).layer
    h = 7168
    attn = sum(k.params for k in g.kernels if k.group == "attention")
    down = h * (1536 + 512 + 64) + 1536 + 512
    up = 1536 * 128 * 192 + 512 * 128 * 256
    out = 128 * 128 * h + h
    assert attn == down + up + out
    # attention with 192-dim queries/keys and 128-dim values (unfused: the workload leaves it to the system)
    s, bh = w.model.seq_len, 128
    assert g.kernel("fwd.attn_score").flop == 2 * bh * s * s * 192
    assert g.kernel("fwd.attn_v").flop == 2 * bh * s * 128 * s
    assert g.kernel("fwd.out_proj").dims["k"] == 128 * 128


def test_deepseek_v3_total_parameters():
    """58 MoE layers + 3 dense layers (dense SwiGLU FFN of 18432) + embeddings: 671B (report:
    671B total; before the dense layers were built apart this counted 704B)."""
    w = load_workload("deepseek_v3")
    gs = build_graphs(w, batch=1)
    total = gs.params()
    moe_layer = gs.layer.params()
    dense_mlp = 7168 * 2 * 18432 + 2 * 18432 + 18432 * 7168 + 7168
    routed_and_router = expert_params(gs.layer) + gs.layer.kernel("fwd.router").params
    shared = sum(k.params for k in gs.layer.kernels if k.name.startswith("fwd.shared"))
    assert gs.num_dense_layers == 3 and gs.num_moe_layers == 58
    assert gs.dense_layer.params() == moe_layer - routed_and_router - shared + dense_mlp
    assert total == pytest.approx(671e9, rel=0.01)
    assert moe_layer > 11e9


def test_mla_requires_all_kv_heads():
    w = copy.deepcopy(SMALL_LLM)
    w["model"].update(num_kv_heads=4, mla={"q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                                            "qk_nope_head_dim": 32, "v_head_dim": 32})
    with pytest.raises(InputError, match="num_kv_heads"):
        load_workload(w)


def test_small_mla_moe_search_equals_exhaustive():
    w = copy.deepcopy(with_moe(MOE))
    w["model"]["mla"] = {"q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
                         "v_head_dim": 32}
    w, s = load_workload(w), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1)
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
