"""An MoE layer's pre-MLP norm output stays 16-bit in FP8 runs (issue 11, session 8): Megatron-Core
builds it as a standalone TENorm (gpt_layer_specs.py: ``pre_mlp_layernorm=TENorm if num_experts``),
not a LayerNormLinear that writes and all-gathers FP8, so the router, the permute and the
dispatcher's TP all-gather read bf16. Bytes written out by hand; the FP8 MoE layer gets slower
with the term, a dense FP8 layer does not move; bounds stay below evaluations."""

from __future__ import annotations

import copy

from dfmodel import load_system, load_workload
from dfmodel.graph.builders.llm import build_llm_layer

from test_inter_chip import SMALL_LLM, small_system
from test_moe_physics import assert_bounds_below_evaluation, moe_workload


def _fp8(w: dict) -> dict:
    w = copy.deepcopy(w)
    w["training"]["precision"] = "fp8"
    return w


def _bytes(graph, name: str) -> set[float]:
    return {t.bytes for t in graph.tensors if t.name == name}


def test_moe_pre_mlp_norm_output_is_bf16_dense_is_fp8():
    moe = load_workload(_fp8(moe_workload()))
    dense = load_workload(_fp8(SMALL_LLM))
    T, h = moe.model.seq_len, moe.model.hidden  # one sequence
    assert _bytes(build_llm_layer(moe, 1, ep=2), "ln2_out") == {T * h * 2}  # 2 bytes per bf16 element
    # the dense FP8 layer's LayerNormLinear all-gathers FP8 (TE fp8_allgather default): 1 byte
    assert _bytes(build_llm_layer(dense, 1), "ln2_out") == {dense.model.seq_len * dense.model.hidden * 1}
    # attention's QKV input is a LayerNormLinear in both: FP8
    assert _bytes(build_llm_layer(moe, 1, ep=2), "ln1_out") == {T * h * 1}


def test_bf16_norm_output_makes_the_fp8_moe_layer_slower_and_bounds_hold(monkeypatch):
    """TP 2 with SP (the norm output is all-gathered over TP): the same mapping is slower with the
    2-byte tensor than with the 1-byte one it replaced (the builder's edge patched back to FP8 bytes
    by hand); every search bound stays below its evaluation."""
    from dfmodel.graph.builders import base

    from test_moe_fidelity import _first
    from dfmodel.inter_chip.llm import LLMModel

    sd = small_system(4, 2)
    sd["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    s = load_system(sd)
    big = _fp8(moe_workload())
    big["model"].update(hidden=2048, seq_len=2048)  # the gather well above the launch overheads
    model = LLMModel(load_workload(big), s)
    m = _first(model, tp=2, pp=1, ep=2, micro_batch=1, recompute="none", sequence_parallel=True,
               overlap_moe_expert_parallel_comm=False)
    now = model.evaluate(m)
    assert_bounds_below_evaluation(model, [m])
    real = base.GraphBuilder.tensor

    def fp8_norm(self, name, producer, consumers, nbytes, *a, **k):
        return real(self, name, producer, consumers, nbytes / 2 if name == "ln2_out" else nbytes, *a, **k)
    monkeypatch.setattr(base.GraphBuilder, "tensor", fp8_norm)
    before = LLMModel(load_workload(big), s).evaluate(m)
    assert now.iteration_time_s > before.iteration_time_s


def test_moe_userbuffers_floor_leaves_the_experts_collectives_exposed(monkeypatch):
    """The per-kernel pass floor under tp_comm_overlap pairs only attention's forced TP reductions
    with attention's GEMMs in an MoE layer and adds the experts' outright, as
    ``_userbuffers_split`` charges them (Megatron-Core TELinear: no userbuffers for expert
    linears). Oracle: every search bound stays below the evaluation of every sampled
    userbuffers mapping with TP-split experts, and the floor is above the one that paired every
    linear's reductions with the GEMMs (what the floor did before) on some of them."""
    from dfmodel.inter_chip import llm
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.inter_chip.config import Knobs
    from dfmodel.inter_chip.llm_space import llm_candidates

    s = load_system(small_system(4, 2))
    w = load_workload(moe_workload())
    model = LLMModel(w, s)
    cands = [c for c in llm_candidates(model, Knobs(tp=4, ep=2, recompute="none"))
             if c.tp_comm_overlap and not c.whole_experts]
    assert cands
    picked = cands[::max(1, len(cands) // 12)]
    assert_bounds_below_evaluation(model, picked)
    for m in picked:  # sharp, per layer: the layer floor against the layer's userbuffers time
        model.evaluate(m)
        layer = model.block("layer", m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel, m.cp,
                            m.ep_outside_tp, whole_experts=m.whole_experts)
        fl = model._block_floor("layer", m.tp, m.cp, m.sequence_parallel, m.ep_outside_tp, m.whole_experts)
        g = m.group("tp")
        exposed = model._forced_comm_s(fl, m.micro_batch, g, m.recompute, launches=False, paired=False)
        paired = model._forced_comm_s(fl, m.micro_batch, g, m.recompute, launches=False, paired=True)
        assert exposed > 0 and paired > 0  # TP-split experts reduce partial sums, attention too
        floor = fl.kernels_overlapped_s(m.micro_batch, m.recompute, paired) + exposed
        assert floor <= sum(llm._layer_times_s(layer, m, s.chip.compute_tiles)) * (1 + 1e-9)
    now = [model.pass_floor_s(m) for m in picked]
    monkeypatch.setattr(llm, "_is_ub_moe_linear", llm._is_ub_linear)  # every linear paired: the old floor
    old_model = LLMModel(w, s)
    old = [old_model.pass_floor_s(m) for m in picked]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(now, old))
    assert any(a > b * (1 + 1e-3) for a, b in zip(now, old))
