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
    fprop: none), so the phase's GEMMs slow by the time-weighted mean, not one average."""
    from dfmodel.inter_chip.llm import _userbuffers_s

    rows = [_row("comm1.all_gather.x", network_s=0.3), _row("fwd.fc1", 2.0),
            _row("fwd.fc2", 1.0), _row("comm2.reduce_scatter.y", network_s=0.3)]
    phase = _phase(rows, 0.6)
    for tp, fc2_sms in ((4, 16), (8, 8)):
        slow = (2.0 * 1.0 + 1.0 * 132 / (132 - fc2_sms)) / 3.0  # fc1 keeps every SM
        expect = nccl.tp_overlapped_phase_s(phase.time_s, 0.6, 3.0, 0.6, tp, gemm_slowdown=slow)
        assert _userbuffers_s(phase, tp, 132) == pytest.approx(expect, rel=1e-12)
    # the TP-4 config holds more SMs beside fc2 than the TP-8 one: never faster
    assert _userbuffers_s(phase, 4, 132) > _userbuffers_s(phase, 8, 132)
    # a GEMM no exchange pairs with (fc2 wgrad) is not slowed
    alone = _phase([_row("wgrad.fc2", 3.0), _row("comm3.all_gather.z", network_s=0.6)], 0.6)
    assert _userbuffers_s(alone, 8, 132) == pytest.approx(nccl.tp_overlapped_phase_s(3.6, 0.6, 3.0, 0.6, 8))


def test_userbuffers_parts_add_up_and_hide_the_comm():
    from dfmodel.inter_chip.llm import _userbuffers_parts, _userbuffers_s

    rows = [_row("comm1.all_gather.x", network_s=0.3), _row("fwd.fc1", 2.0),
            _row("fwd.fc2", 1.0), _row("comm2.reduce_scatter.y", network_s=0.3)]
    phase = _phase(rows, 0.6)
    parts = _userbuffers_parts(phase, 8, 132)
    assert sum(parts.values()) == pytest.approx(_userbuffers_s(phase, 8, 132), rel=1e-12)
    assert parts["tp_comm"] == pytest.approx(0.0, abs=1e-12)  # 0.6 s of comm under 3 s of GEMMs
    slow = _phase([_row("fwd.fc1", 0.2), _row("comm1.all_gather.x", network_s=2.0)], 2.0)
    assert _userbuffers_parts(slow, 8, 132)["tp_comm"] > 0  # comm longer than its GEMM stays exposed


def test_moe_layer_userbuffers_serve_attention_only():
    """Megatron-Core's TELinear turns userbuffers off for expert linears and leaves their TP
    exchange to the token dispatcher (explicit_expert_comm): in an MoE layer only QKV / the
    projection pair with their collectives; the experts' fc1 / fc2 and their collectives do not."""
    from dfmodel.inter_chip.llm import _userbuffers_s

    attn = [_row("comm1.all_gather.ln1_out", network_s=0.3), _row("fwd.qkv", 1.0),
            _row("fwd.out_proj", 0.5), _row("comm2.reduce_scatter.attn_out", network_s=0.3)]
    experts = [_row("fwd.fc1", 4.0), _row("fwd.fc2", 2.0), _row("comm3.reduce_scatter.expert_out", network_s=0.6)]
    dense = _phase(attn + experts, 1.2)
    moe = _phase(attn + [_row("fwd.router", 0.1)] + experts, 1.2)
    # dense: all 1.2 s of collectives under the 7.5 s of the four linears' GEMMs
    f = {n: 132 / (132 - nccl.userbuffers_sms(n, "fprop", 4)) for n in ("qkv", "out_proj", "fc1", "fc2")}
    slow_d = (1.0 * f["qkv"] + 0.5 * f["out_proj"] + 4.0 * f["fc1"] + 2.0 * f["fc2"]) / 7.5
    assert _userbuffers_s(dense, 4, 132) == pytest.approx(
        nccl.tp_overlapped_phase_s(dense.time_s, 1.2, 7.5, 1.2, 4, gemm_slowdown=slow_d), rel=1e-12)
    # MoE: 0.6 s (the experts' half of the collectives) stays exposed; 0.6 s pairs with 1.5 s of GEMMs
    slow_m = (1.0 * f["qkv"] + 0.5 * f["out_proj"]) / 1.5
    expect = 0.6 + nccl.tp_overlapped_phase_s(moe.time_s - 0.6, 0.6, 1.5, 0.6, 4, gemm_slowdown=slow_m)
    assert _userbuffers_s(moe, 4, 132) == pytest.approx(expect, rel=1e-12)
    assert _userbuffers_s(moe, 4, 132) > _userbuffers_s(dense, 4, 132) + 0.1  # beyond the router's 0.1 s
    from dfmodel.inter_chip.llm import _userbuffers_parts
    assert _userbuffers_parts(moe, 4, 132)["tp_comm"] >= 0.6 - 1e-12  # the experts' exchange stays exposed
    assert _userbuffers_parts(dense, 4, 132)["tp_comm"] == pytest.approx(0.0, abs=1e-12)
    assert _userbuffers_s(moe, 4, 132) <= moe.time_s  # never worse than no overlap
