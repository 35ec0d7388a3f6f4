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
