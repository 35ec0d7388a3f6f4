"""MoE fidelity terms of issue 11 (session 4): DeepSeek-V3's multi-token prediction (MTP)
module on the last pipeline stage. Closed forms on tiny cases, bounds below evaluations, search ==
exhaustive, and MoE models without the new fields unchanged."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip import experts as X
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates

from test_inter_chip import small_system
from test_moe_physics import assert_bounds_below_evaluation, moe_workload


def _first(model, **knobs):
    return next(iter(llm_candidates(model, Knobs(**knobs))))


def _pair(mtp: int = 1, **moe):
    s = load_system(small_system(4, 2))
    return LLMModel(load_workload(moe_workload(**moe)), s), LLMModel(load_workload(moe_workload(mtp_layers=mtp, **moe)), s)


def test_mtp_adds_a_layer_a_head_and_the_projection_on_one_stage():
    """pp = 1: the single stage's forward grows by exactly one layer's forward (with its
    all-to-alls), one head's forward and the 2d x d projection: 2 x tokens x 2h x h / tp FLOP at
    the matmul rate; the backward by twice the projection and the layer's and head's backward."""
    base, mtp = _pair()
    m = _first(base, tp=1, pp=1, ep=4, micro_batch=1, recompute="none", overlap_moe_expert_parallel_comm=False)
    a, b = base.evaluate(m), mtp.evaluate(m)
    key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
    layer, head = mtp.block("layer", *key, m.cp, m.ep_outside_tp), mtp.block("head", *key, m.cp)
    t_f, t_b = mtp._layer_phases_s(m, layer, mtp._layer_comm(m, layer, ()))
    w, chip = mtp.model, mtp.system.chip
    proj_f = 2 * m.micro_batch * w.seq_len * 2 * w.hidden * w.hidden / m.tp / (chip.peak("bf16") * chip.efficiency.matmul_at("bf16"))
    assert b.stage_fwd_s[0] - a.stage_fwd_s[0] == pytest.approx(t_f + head.fwd.time_s + proj_f, rel=1e-9)
    assert b.stage_bwd_s[0] - a.stage_bwd_s[0] == pytest.approx(t_b + head.backward_s("none") + 2 * proj_f, rel=1e-9)
    assert b.iteration_time_s > a.iteration_time_s
    assert sum(b.breakdown_s.values()) == pytest.approx(b.iteration_time_s, rel=1e-9)


def test_mtp_parameters_on_the_last_stage():
    """pp = 2: the last stage holds the MTP block, its 2h x h / tp projection and, with untied
    embeddings, a copy of the vocabulary-parallel embedding (vocab x h / tp; tied: the head's
    copy is already there)."""
    base, mtp = _pair()
    assert mtp.model.tie_embeddings  # the small model is GPT-like
    untied = LLMModel(mtp.workload.model_copy(update={"model": mtp.model.model_copy(update={"tie_embeddings": False})}),
                      mtp.system)
    m = _first(base, tp=2, pp=2, ep=2, micro_batch=1, recompute="none")
    w = mtp.model
    key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
    layer = mtp.block("layer", *key, m.cp, m.ep_outside_tp)
    extra = layer.params_per_chip + 2 * w.hidden ** 2 / m.tp
    assert mtp._mtp_params_per_chip(m, layer.params_per_chip) == pytest.approx(extra)
    copy = w.vocab_size * w.hidden / m.tp
    assert untied._mtp_params_per_chip(m, layer.params_per_chip) == pytest.approx(extra + copy)
    assert base._mtp_params_per_chip(m, layer.params_per_chip) == 0.0
    a, b = base.evaluate(m), mtp.evaluate(m)
    assert b.memory.total_bytes > a.memory.total_bytes


def test_mtp_moves_layers_off_the_last_stage():
    """The layer split sees the MTP work as the last stage's fixed work: that stage never gets
    more layers than without it, and the slowest stage is never faster."""
    base, mtp = _pair()
    for pp in (2, 4):
        m = _first(base, tp=1, pp=pp, ep=2, micro_batch=1, recompute="none")
        a, b = base.evaluate(m), mtp.evaluate(m)
        assert b.layers_per_stage[-1] <= a.layers_per_stage[-1]
        assert sum(b.layers_per_stage) == sum(a.layers_per_stage)
        assert max(f + g for f, g in zip(b.stage_fwd_s, b.stage_bwd_s)) >= max(f + g for f, g in zip(a.stage_fwd_s, a.stage_bwd_s))


def test_bounds_below_evaluation_with_mtp():
    _, model = _pair(first_dense_layers=2)
    cands = list(llm_candidates(model, Knobs(micro_batch=1)))
    assert_bounds_below_evaluation(model, cands[::4])


def test_search_equals_exhaustive_with_mtp():
    w, s = load_workload(moe_workload(mtp_layers=1)), load_system(small_system(4, 2))
    knobs = Knobs(micro_batch=1)
    fast, full = solve_llm(w, s, knobs), solve_llm(w, s, knobs, exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)


def test_mtp_zero_is_bit_identical():
    base, zero = _pair(mtp=0)
    for m in list(llm_candidates(base, Knobs(micro_batch=1)))[::7]:
        a, b = base.evaluate(m), zero.evaluate(m)
        assert a.iteration_time_s == b.iteration_time_s and a.breakdown_s == b.breakdown_s


def test_mtp_stage_closed_form():
    from types import SimpleNamespace as N
    assert X.mtp_stage_s(N(mtp_layers=2), layer_s=(1.0, 2.0), head_s=(3.0, 4.0), projection_s=(0.5, 1.0)) == (9.0, 14.0)
    assert X.mtp_stage_s(None, layer_s=(1.0, 2.0), head_s=(3.0, 4.0), projection_s=(0.5, 1.0)) == (0.0, 0.0)


# -- MLA up-projection recompute (Megatron-Core recompute_modules [mla_up_proj]) ----------------
MLA = {"q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}


def _mla_pair():
    s = load_system(small_system(4, 2))
    off, on = moe_workload(first_dense_layers=1), moe_workload(first_dense_layers=1)
    off["model"]["mla"], on["model"]["mla"] = dict(MLA), {**MLA, "recompute_up_proj": True}
    return LLMModel(load_workload(off), s), LLMModel(load_workload(on), s)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_mla_up_recompute_time_and_memory_closed_form(recompute):
    """Each (MoE and dense) layer's backward grows by the up-projection GEMMs' forward,
    2 T (q_lora a (nope + rope) + kv_lora a (nope + v)) / tp FLOP at the matmul rate, and its
    saved activations shrink by Q, K, V: s b a e (2 (nope + rope) + v) / tp; full recompute:
    neither changes (it re-runs them anyway)."""
    off, on = _mla_pair()
    m = _first(off, tp=2, pp=1, ep=2, micro_batch=1, recompute=recompute)
    a, b = off.evaluate(m), on.evaluate(m)
    w, chip = on.model, on.system.chip
    T = m.micro_batch * w.seq_len
    up = 2 * T * (64 * 16 * 48 + 32 * 16 * 64) / m.tp / (chip.peak("bf16") * chip.efficiency.matmul_at("bf16"))
    layers = sum(a.layers_per_stage)  # one stage: every layer, MoE and dense
    expected = 0.0 if recompute == "full" else layers * up
    assert b.stage_bwd_s[0] - a.stage_bwd_s[0] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert b.stage_fwd_s[0] == a.stage_fwd_s[0]
    from dfmodel.inter_chip import memory as mem
    kw = dict(seq_len=w.seq_len, micro_batch=1, tp=2, sequence_parallel=True, bytes_per_element=2, recompute=recompute)
    saved = mem.moe_mla_activation_delta_bytes(off.model, **kw) - mem.moe_mla_activation_delta_bytes(w, **kw)
    assert saved == (0.0 if recompute == "full" else w.seq_len * 16 * 2 * (2 * 48 + 32) / 2)
    assert b.memory.total_bytes <= a.memory.total_bytes


def test_bounds_below_evaluation_with_mla_up_recompute_and_mtp():
    s = load_system(small_system(4, 2))
    w = moe_workload(first_dense_layers=1, mtp_layers=1)
    w["model"]["mla"] = {**MLA, "recompute_up_proj": True}
    model = LLMModel(load_workload(w), s)
    for m in list(llm_candidates(model, Knobs(micro_batch=1)))[::4]:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-12)
        assert model.memory_before_blocks(m).total_bytes <= ev.memory.total_bytes * (1 + 1e-12)
    fast, full = solve_llm(load_workload(w), s, Knobs(micro_batch=1)), solve_llm(load_workload(w), s, Knobs(micro_batch=1), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)


# -- Megatron-Core fine-grained recompute of the MoE layer: recompute_modules moe_act, layernorm ----
BOTH = {"recompute_activation": True, "recompute_norm": True}


def _recompute_pair(**flags):
    s = load_system(small_system(4, 2))
    return (LLMModel(load_workload(moe_workload(first_dense_layers=1)), s),
            LLMModel(load_workload(moe_workload(first_dense_layers=1, **flags)), s))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("flags", [{"recompute_activation": True}, {"recompute_norm": True}, BOTH])
def test_moe_fine_grained_recompute_time_and_memory_closed_form(recompute, flags):
    """Each MoE layer's backward grows by the recomputed element-wise passes at the chip's DRAM
    bandwidth -- the activation reads the FC1 output and writes its output, e (1 + 1) R f_e / tp
    (GELU experts: not gated), the pre-MLP norm reads and writes e s b h (/tp with SP) -- and its
    saved activations shrink by the FC2 input e R f_e / tp and the norm's output e s b h (/tp with
    SP); the dense layer does not change, nor does anything under full recompute (which re-runs
    the forward anyway and keeps only the layer inputs)."""
    from dfmodel.inter_chip import memory as mem
    from dfmodel.system.processor import memory_time_s

    off, on = _recompute_pair(**flags)
    m = _first(off, tp=2, pp=1, ep=2, micro_batch=1, recompute=recompute)
    a, b = off.evaluate(m), on.evaluate(m)
    w, chip, e = on.model, on.system.chip, 2
    T = m.micro_batch * w.seq_len
    R, fe, h, t = T * w.moe.top_k, w.moe.expert_ffn_hidden, w.hidden, m.tp
    sp = t if m.sequence_parallel else 1
    redo = (2 * e * R * fe / t if flags.get("recompute_activation") else 0.0) + (
        2 * e * T * h / sp if flags.get("recompute_norm") else 0.0)
    moe_layers = w.num_layers - w.moe.first_dense_layers
    expected = 0.0 if recompute == "full" else moe_layers * memory_time_s(chip, redo)
    assert b.stage_bwd_s[0] - a.stage_bwd_s[0] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert b.stage_fwd_s[0] == a.stage_fwd_s[0]
    kw = dict(seq_len=w.seq_len, micro_batch=1, tp=t, sequence_parallel=m.sequence_parallel, bytes_per_element=e,
              recompute=recompute)
    saved = mem.moe_mla_activation_delta_bytes(off.model, **kw) - mem.moe_mla_activation_delta_bytes(w, **kw)
    closed = (e * R * fe / t if flags.get("recompute_activation") else 0.0) + (
        e * T * h / sp if flags.get("recompute_norm") else 0.0)
    assert saved == pytest.approx(0.0 if recompute == "full" else closed, rel=1e-12)
    assert b.memory.total_bytes <= a.memory.total_bytes
    assert (b.memory.total_bytes < a.memory.total_bytes) == (recompute != "full")


def test_moe_recompute_bytes_fp8_and_mla():
    """FP8 training quantises the recomputed FC2 input again (read 2 bytes, write 1 per element);
    with MLA the input norm is a module of its own, recomputed (and quantised again) too."""
    from types import SimpleNamespace as N
    act = N(recompute_activation=True, recompute_norm=False, routed_token_factor=2, expert_ffn_hidden=64)
    norm = N(recompute_activation=False, recompute_norm=True, routed_token_factor=2, expert_ffn_hidden=64)
    kw = dict(tokens=512, tp=2, sequence_parallel=True, bytes_per_element=2)
    swiglu = N(moe=act, mla=None, hidden=1024, ffn_type="swiglu")
    assert X.moe_recompute_bytes(swiglu, linear_input_bytes=1, **kw) == (2 * 2 + 2 + 3) * 512 * 2 * 64 / 2
    assert X.moe_recompute_bytes(swiglu, linear_input_bytes=2, **kw) == (2 * 2 + 2) * 512 * 2 * 64 / 2
    plain, mla = N(moe=norm, mla=None, hidden=1024, ffn_type="gelu"), N(moe=norm, mla=object(), hidden=1024, ffn_type="gelu")
    rows = 512 * 1024 / 2
    assert X.moe_recompute_bytes(plain, linear_input_bytes=1, **kw) == 4 * rows
    assert X.moe_recompute_bytes(mla, linear_input_bytes=1, **kw) == 4 * rows + (4 + 3) * rows
    assert X.moe_recompute_bytes(N(moe=None), linear_input_bytes=1, **kw) == 0.0


def test_mla_input_norm_memory_with_recompute_norm():
    """With MLA, recompute_norm also drops the input norm's output: twice the saving of a
    non-MLA MoE layer."""
    from dfmodel.inter_chip import memory as mem
    w = moe_workload(first_dense_layers=1)
    w["model"]["mla"] = dict(MLA)
    on = load_workload({**w, "model": {**w["model"], "moe": {**w["model"]["moe"], "recompute_norm": True}}}).model
    off = load_workload(w).model
    kw = dict(seq_len=off.seq_len, micro_batch=1, tp=2, sequence_parallel=True, bytes_per_element=2, recompute="none")
    saved = mem.moe_mla_activation_delta_bytes(off, **kw) - mem.moe_mla_activation_delta_bytes(on, **kw)
    assert saved == 2 * 2 * off.seq_len * off.hidden / 2


def test_bounds_below_evaluation_and_search_with_moe_fine_grained_recompute():
    s = load_system(small_system(4, 2))
    w = moe_workload(first_dense_layers=1, **BOTH)
    model = LLMModel(load_workload(w), s)
    assert_bounds_below_evaluation(model, list(llm_candidates(model, Knobs(micro_batch=1)))[::4])
    fast = solve_llm(load_workload(w), s, Knobs(micro_batch=1))
    full = solve_llm(load_workload(w), s, Knobs(micro_batch=1), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
