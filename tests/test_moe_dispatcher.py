"""MoE dispatcher terms of issue 11 (session 7): the sort of received rows by local expert that
Megatron-Core's alltoall dispatcher runs around the grouped GEMM (``sort_chunks_by_idxs``), and
router GEMMs in fp32 (``moe_router_dtype``). Bytes written out by hand, the prediction moves the
right way, nothing moves without the condition, bounds stay below evaluations."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.builders.llm import build_llm_layer
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.system.processor import compute_time_s, mainloop_time_s

from test_inter_chip import small_system
from test_moe_fidelity import _first
from test_moe_physics import assert_bounds_below_evaluation, moe_workload

SORTED = ("fwd.permute", "fwd.unpermute", "bwd.unpermute", "bwd.permute")


def _extra(graph) -> dict[str, float]:
    return {k.name: k.extra_memory_bytes for k in graph.kernels if k.name in SORTED}


def test_sort_traffic_is_one_read_and_write_of_every_routed_row():
    """8 experts, top-2, ep 4 (2 local experts): each of the four passes reads and writes the
    rank's T x top_k rows of h bf16 elements; ep 8 (one expert per rank) and ep 1 sort nothing."""
    w = load_workload(moe_workload())
    batch = 2
    T, h = batch * w.model.seq_len, w.model.hidden
    rows = T * 2  # top_k = 2, capacity and imbalance 1
    by_hand = 2 * rows * h * 2  # read + write, 2 bytes per bf16 element
    assert _extra(build_llm_layer(w, batch, ep=4)) == {n: by_hand for n in SORTED}
    assert set(_extra(build_llm_layer(w, batch, ep=8)).values()) == {0.0}
    assert set(_extra(build_llm_layer(w, batch, ep=1)).values()) == {0.0}
    # a per-node dispatcher (DeepEP) expands received tokens into expert rows once: no second sort
    deepep = load_workload(moe_workload(max_nodes_per_token=2))
    assert set(_extra(build_llm_layer(deepep, batch, ep=4)).values()) == {0.0}


def test_fp8_dispatch_sorts_fp8_rows():
    """With ``dispatch_fp8`` the rows the dispatch delivers (and the gradients the combine's
    backward sends) are 1 byte + one fp32 scale per 128 elements; the two other passes stay 2."""
    w = load_workload(moe_workload(dispatch_fp8=True))  # an alltoall dispatcher that quantises first
    T, h = w.model.seq_len, w.model.hidden
    e = _extra(build_llm_layer(w, 1, ep=2))
    rows = 2 * T
    assert e["fwd.permute"] == pytest.approx(2 * rows * h * (1 + 4 / 128))
    assert e["bwd.unpermute"] == pytest.approx(2 * rows * h * (1 + 4 / 128))
    assert e["fwd.unpermute"] == e["bwd.permute"] == 2 * rows * h * 2


def test_sort_makes_a_multi_expert_rank_slower_and_bounds_hold(monkeypatch):
    """ep 2 on 8 experts (4 local experts): the layer pays the sort passes, so the same mapping
    is slower than with the sort taken out (by hand: the builder's term set to zero); every
    search bound stays below its evaluation."""
    from dfmodel.graph.builders import llm as builder

    s = load_system(small_system(4, 2))
    _big = moe_workload()
    _big["model"].update(hidden=2048, seq_len=2048)  # memory-bound sort passes well above the 4 us launch
    model = LLMModel(load_workload(_big), s)
    m = _first(model, tp=1, pp=1, ep=2, micro_batch=1, recompute="none", overlap_moe_expert_parallel_comm=False)
    with_sort = model.evaluate(m)
    assert_bounds_below_evaluation(model, [m])
    monkeypatch.setattr(builder, "sort_chunks_bytes", lambda *a, **k: (0.0, 0.0))
    without = LLMModel(load_workload(_big), s).evaluate(m)
    assert with_sort.iteration_time_s > without.iteration_time_s


def _router_kernels(graph):
    return {k.name: k for k in graph.kernels if k.name in ("fwd.router", "bwd.router", "wgrad.router")}


def test_fp32_router_runs_at_the_fp32_rate():
    """``router_dtype: fp32``: the three router GEMMs carry precision fp32 (the chip's fp32 peak,
    67 TFLOPS on H100 against 989 bf16), nothing else changes; the default keeps the layer's."""
    base = load_workload(moe_workload(num_experts=64, top_k=8))
    fp32 = load_workload(moe_workload(num_experts=64, top_k=8, router_dtype="fp32"))
    a, b = build_llm_layer(base, 1, ep=1), build_llm_layer(fp32, 1, ep=1)
    assert {k.precision for k in _router_kernels(b).values()} == {"fp32"}
    assert "fp32" not in {k.precision for k in _router_kernels(a).values()}
    others = lambda g: [(k.name, k.flop, k.precision) for k in g.kernels if "router" not in k.name]  # noqa: E731
    assert others(a) == others(b)
    chip = load_system("dgx_h100").chip
    ta = sum(mainloop_time_s(chip, k, k.precision or "bf16") for k in _router_kernels(a).values())
    tb = sum(mainloop_time_s(chip, k, k.precision or "bf16") for k in _router_kernels(b).values())
    # 989 x 0.65 bf16 against 67 x 0.75 fp32 (dgx_h100.yaml): 12.8x slower (the mainloops; the serial
    # epilogue is a wgmma GEMM's, so only the bf16 router's kernel time carries one)
    assert tb == pytest.approx(ta * (989 * 0.65) / (67 * 0.75), rel=1e-6)
    fp32_s = sum(compute_time_s(chip, k, k.precision) for k in _router_kernels(b).values())
    assert fp32_s == pytest.approx(tb, rel=1e-12)  # no serial epilogue on a non-wgmma GEMM
    assert sum(compute_time_s(chip, k, "bf16") for k in _router_kernels(a).values()) > ta


def _big(**moe) -> dict:
    """A layer long enough on an H100 that the host floor (0.57 ms per linear module) does not bind."""
    w = moe_workload(num_experts=64, top_k=8, **moe)
    w["model"].update(hidden=4096, num_heads=32, seq_len=4096)
    return w


def test_fp32_router_slows_the_prediction():
    """Same mapping, router GEMMs at fp32: more compute and a slower step (not host-bound), and
    the host floor does not drop the router (the fp32 call costs the 16-bit module's host time)."""
    s = load_system("dgx_h100", num_chips=16)
    a, b = LLMModel(load_workload(_big()), s), LLMModel(load_workload(_big(router_dtype="fp32")), s)
    m = _first(a, tp=1, pp=1, ep=8, micro_batch=1, recompute="none", overlap_moe_expert_parallel_comm=False)
    ea, eb = a.evaluate(m), b.evaluate(m)
    assert eb.breakdown_s["compute"] > ea.breakdown_s["compute"]
    assert eb.iteration_time_s > ea.iteration_time_s
    key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel, m.cp, m.ep_outside_tp)
    from dfmodel.inter_chip.llm import _host_floor_s

    floors = [_host_floor_s(x.block("layer", *key), s.chip, "bf16") for x in (a, b)]
    assert floors[0] == floors[1] > 0
    assert_bounds_below_evaluation(b, [m])
