"""Megatron's tp_comm_overlap as a record option (issue 11 round 2)."""

from __future__ import annotations

import pytest

from dfmodel import optimize
from dfmodel.netmodels import nccl

from test_inter_chip import SMALL_LLM, small_system


def test_overlapped_phase_closed_form_and_bounds():
    # rest 2 + one GEMM piece 3 + max(3, 2): the exposed 2 s of TP communication disappear
    assert nccl.tp_overlapped_phase_s(10.0, 2.0, 6.0, 2.0, 2) == 8.0
    for comm in (0.5, 2.0, 8.0, 20.0):
        t = nccl.tp_overlapped_phase_s(10.0, 2.0, 6.0, comm, 4)
        assert t >= max(6.0, comm) + 2.0 - 1e-12  # never better than perfect overlap
        assert t <= 2.0 + 6.0 + comm + 1e-12  # never worse than no overlap
    # more communication is never faster; a slower GEMM is never faster
    ts = [nccl.tp_overlapped_phase_s(10.0, 2.0, 6.0, c, 8) for c in (1, 2, 4, 8, 16)]
    assert ts == sorted(ts)
    assert nccl.tp_overlapped_phase_s(10, 2, 6, 2, 8, gemm_slowdown=1.1) > nccl.tp_overlapped_phase_s(10, 2, 6, 2, 8)


def test_userbuffers_slowdown_from_the_sms_it_holds():
    assert nccl.userbuffers_gemm_slowdown(132, 0) == 1.0
    assert nccl.userbuffers_gemm_slowdown(132, 33) == pytest.approx(132 / 99)


def test_option_is_recorded_and_neutral_without_tp():
    on = optimize(SMALL_LLM, small_system(4, 2), tp=2, tp_comm_overlap=True)
    off = optimize(SMALL_LLM, small_system(4, 2), tp=2, tp_comm_overlap=False)
    assert on.parallelism.tp_comm_overlap is True and off.parallelism.tp_comm_overlap is False
    free = optimize(SMALL_LLM, small_system(4, 2), tp=2)
    assert free.iteration_time_s <= min(on.iteration_time_s, off.iteration_time_s)  # the search chooses
    one = optimize(SMALL_LLM, small_system(4, 2), tp=1)
    assert one.parallelism.tp_comm_overlap is False  # nothing to overlap at tp 1


def _phase(rows, tp_comm_s):
    from dfmodel.inter_chip.llm import PhaseTime

    total = sum(r["time_s"] for r in rows)
    parts = {"compute": total - tp_comm_s, "memory": 0.0, "tp_comm": tp_comm_s}
    return PhaseTime(total, parts, rows, True, 0.0)


def _row(kernel, compute_s=0.0, network_s=0.0):
    return {"kernels": [kernel], "compute_s": compute_s, "memory_s": 0.0, "network_s": network_s,
            "time_s": compute_s + network_s}


def test_userbuffers_slow_each_gemm_by_its_own_exchange_sms():
    """Issue 11 round 3: NeMo's userbuffers configs give each overlapped GEMM its own SM count
    (pipelined RS after fc2 fprop: 16 SMs at TP 4, 8 at TP 8; ring-exchange AG before fc1
    fprop: none), so each GEMM slows by its own exchange's SMs."""
    from dfmodel.inter_chip.llm import _userbuffers_s

    rows = [_row("comm1.all_gather.ln2_out", network_s=0.3), _row("fwd.fc1", 2.0),
            _row("fwd.fc2", 1.0), _row("comm2.reduce_scatter.mlp_out", network_s=0.3)]
    phase = _phase(rows, 0.6)
    # both exchanges hide under their GEMMs: fc1 2.0 s unslowed, fc2 1.0 s on 132 - 16 (TP 4) or
    # 132 - 8 (TP 8) SMs
    assert _userbuffers_s(phase, 4, 132) == pytest.approx(2.0 + 132 / 116, rel=1e-12)  # 3.1379...
    assert _userbuffers_s(phase, 8, 132) == pytest.approx(2.0 + 132 / 124, rel=1e-12)  # 3.0645...
    # a GEMM no exchange pairs with (fc2 wgrad) is not slowed: the d_ln2_out exchange hides under
    # FC1's weight-gradient GEMM, 3 s: 3 / 8 + 7 x max(3 / 8, 0.6 / 7) = 3.0
    alone = _phase([_row("wgrad.fc2", 3.0), _row("wgrad.fc1", 3.0), _row("comm3.reduce_scatter.d_ln2_out", network_s=0.6)],
                   0.6)
    assert _userbuffers_s(alone, 8, 132, (("fc1_wgrad", 0),)) == pytest.approx(6.0, rel=1e-12)


#: a run whose userbuffers exchanges hold no SMs (every TE exchange name at 0): overlap alone
NO_SMS = tuple((name, 0) for name in nccl.UB_SM_EXCHANGES.values())


def test_each_exchange_hides_only_under_its_own_gemm():
    """TE userbuffers chunk each exchange with its own GEMM (llm.UB_PAIRS): the projection's
    reduce-scatter, longer than the projection's GEMM (FP8 halves the GEMM, not the 16-bit RS),
    stays partly exposed however long QKV's GEMM is. By hand at TP 4: QKV 1.0 s with its 0.3 s
    all-gather: 1/4 + 3 x max(1/4, 0.1) = 1.0; projection 0.2 s with its 0.6 s reduce-scatter:
    0.05 + 3 x max(0.05, 0.2) = 0.65; the phase 1.65 s (one pooled overlap of 1.2 s of GEMMs and
    0.9 s of exchanges would give 1.2 s), 0.45 s of it exposed communication."""
    from dfmodel.inter_chip.llm import _userbuffers_parts, _userbuffers_s

    rows = [_row("comm1.all_gather.ln1_out", network_s=0.3), _row("fwd.qkv", 1.0),
            _row("fwd.out_proj", 0.2), _row("comm2.reduce_scatter.attn_out", network_s=0.6)]
    phase = _phase(rows, 0.9)
    assert _userbuffers_s(phase, 4, 132, NO_SMS) == pytest.approx(1.65, rel=1e-12)
    assert _userbuffers_parts(phase, 4, 132, NO_SMS)["tp_comm"] == pytest.approx(0.45, rel=1e-12)
    # an exchange that no GEMM of the phase pairs with stays exposed as it was (a small all-reduce)
    lone = _phase(rows + [_row("comm3.all_reduce.dW.ln1", network_s=0.05)], 0.95)
    assert _userbuffers_s(lone, 4, 132, NO_SMS) == pytest.approx(1.70, rel=1e-12)
    # the backward pairs by its own names: d_r1's all-gather under the projection's data gradient
    bwd = _phase([_row("comm1.all_gather.d_r1", network_s=0.6), _row("bwd.out_proj", 0.2),
                  _row("wgrad.out_proj", 0.2)], 0.6)
    assert _userbuffers_s(bwd, 4, 132, NO_SMS) == pytest.approx(0.65 + 0.2, rel=1e-12)


def test_userbuffers_parts_add_up_and_hide_the_comm():
    from dfmodel.inter_chip.llm import _userbuffers_parts, _userbuffers_s

    rows = [_row("comm1.all_gather.ln2_out", network_s=0.3), _row("fwd.fc1", 2.0),
            _row("fwd.fc2", 1.0), _row("comm2.reduce_scatter.mlp_out", network_s=0.3)]
    phase = _phase(rows, 0.6)
    parts = _userbuffers_parts(phase, 8, 132)
    assert sum(parts.values()) == pytest.approx(_userbuffers_s(phase, 8, 132), rel=1e-12)
    assert parts["tp_comm"] == pytest.approx(0.0, abs=1e-12)  # each 0.3 s exchange under its 1-2 s GEMM
    slow = _phase([_row("fwd.fc1", 0.2), _row("comm1.all_gather.ln2_out", network_s=2.0)], 2.0)
    assert _userbuffers_parts(slow, 8, 132)["tp_comm"] > 0  # comm longer than its GEMM stays exposed


def test_moe_layer_userbuffers_serve_attention_only():
    """Megatron-Core's TELinear turns userbuffers off for expert linears and leaves their TP
    exchange to the token dispatcher (explicit_expert_comm): in an MoE layer only QKV / the
    projection pair with their collectives; the experts' fc1 / fc2 and their collectives do not."""
    from dfmodel.inter_chip.llm import _userbuffers_parts, _userbuffers_s

    attn = [_row("comm1.all_gather.ln1_out", network_s=0.3), _row("fwd.qkv", 1.0),
            _row("fwd.out_proj", 0.5), _row("comm2.reduce_scatter.attn_out", network_s=0.3)]
    experts = [_row("fwd.fc1", 4.0), _row("fwd.fc2", 2.0), _row("comm3.reduce_scatter.mlp_out", network_s=0.6)]
    dense = _phase(attn + experts, 1.2)
    moe = _phase(attn + [_row("fwd.router", 0.1)] + experts, 1.2)
    # dense: every exchange under its own GEMM (each shorter than its GEMM's chunks), which slows
    # by its own exchange's SMs (NeMo's TP-4 config): the phase is the four slowed GEMMs
    f = {n: 132 / (132 - nccl.userbuffers_sms(n, "fprop", 4)) for n in ("qkv", "out_proj", "fc1", "fc2")}
    slowed = 1.0 * f["qkv"] + 0.5 * f["out_proj"] + 4.0 * f["fc1"] + 2.0 * f["fc2"]
    assert _userbuffers_s(dense, 4, 132) == pytest.approx(slowed, rel=1e-12)
    # MoE: the experts' 0.6 s exchange stays exposed and their GEMMs keep their time; attention's
    # two exchanges hide under QKV and the projection
    expect = 0.6 + 0.1 + 4.0 + 2.0 + 1.0 * f["qkv"] + 0.5 * f["out_proj"]
    assert _userbuffers_s(moe, 4, 132) == pytest.approx(expect, rel=1e-12)
    assert _userbuffers_s(moe, 4, 132) > _userbuffers_s(dense, 4, 132) + 0.1  # beyond the router's 0.1 s
    assert _userbuffers_parts(moe, 4, 132)["tp_comm"] >= 0.6 - 1e-12  # the experts' exchange stays exposed
    assert _userbuffers_parts(dense, 4, 132)["tp_comm"] == pytest.approx(0.0, abs=1e-12)
    assert _userbuffers_s(moe, 4, 132) <= moe.time_s  # never worse than no overlap


def test_paired_userbuffers_never_below_the_pooled_overlap_the_floors_use():
    """The search's floors (block_floor.kernels_overlapped_s) rest on the pooled overlap of all a
    phase's GEMMs and exchanges; pairing each exchange with its own GEMM can only add time (a sum
    of maxima is at least the maximum of the sums), so the floors stay below: checked on random
    phases, with exchanges shorter and longer than their GEMMs."""
    import random

    from dfmodel.inter_chip.llm import _userbuffers_s

    rng = random.Random(11)
    pairs = [("ln1_out", "fwd.qkv"), ("attn_out", "fwd.out_proj"), ("ln2_out", "fwd.fc1"), ("mlp_out", "fwd.fc2")]
    for _ in range(200):
        rows, comm_s, gemm_s = [], 0.0, 0.0
        for i, (tensor, gemm) in enumerate(pairs):
            g, c = rng.uniform(0.01, 2.0), rng.uniform(0.0, 1.5)
            rows += [_row(f"comm{i}.x.{tensor}", network_s=c), _row(gemm, g)]
            comm_s, gemm_s = comm_s + c, gemm_s + g
        phase = _phase(rows, comm_s)
        tp = rng.choice((2, 4, 8))
        pooled = nccl.tp_overlapped_phase_s(phase.time_s, comm_s, gemm_s, comm_s, tp)
        assert _userbuffers_s(phase, tp, 132, NO_SMS) >= pooled - 1e-12
        assert _userbuffers_s(phase, tp, 132, NO_SMS) <= phase.time_s + 1e-12  # never worse than no overlap
