"""Host-staged (non-pipelined) network dimensions, and the published DLRM / HPL / FFT cases."""

from __future__ import annotations

import pytest

from dfmodel.errors import InputError
from dfmodel.netmodels import algorithms, collective_time
from dfmodel.system import load_system


def _two_dims(pipelined_inner: bool = True, pipelined_outer: bool = True):
    return load_system({
        "name": "staged",
        "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
                 "memory": {"kind": "HBM", "capacity_bytes": 1e9, "bandwidth_Bps": 1e11}},
        "network": [
            {"name": "pcie", "topology": "switch", "size": 4, "link_bandwidth_Bps": 10e9, "latency_s": 1e-5,
             "pipelined": pipelined_inner},
            {"name": "ib", "topology": "switch", "size": 2, "link_bandwidth_Bps": 2e9, "latency_s": 5e-6,
             "pipelined": pipelined_outer},
        ],
    })


@pytest.mark.parametrize("collective", ["all_to_all", "all_reduce", "all_gather", "reduce_scatter"])
def test_staged_dimension_runs_phases_in_series(collective):
    """With a host-staged dimension no algorithm overlaps phases across dimensions, so the time is
    never below the pipelined network's, and for an all-to-all it is the sum of the two phases."""
    S = 1e9
    group = (("pcie", 4), ("ib", 2))
    free = collective_time(_two_dims(), collective, S, group)
    for staged in (_two_dims(pipelined_inner=False), _two_dims(pipelined_outer=False)):
        algos = algorithms(staged, collective, S, group)
        assert not any(a.algorithm.startswith("pipelined") for a in algos)
        t = collective_time(staged, collective, S, group)
        assert t.time_s >= free.time_s * (1 - 1e-12)
        if collective == "all_to_all":
            one = lambda name, n: collective_time(staged, "all_to_all", S, ((name, n),)).time_s  # noqa: E731
            assert t.time_s == pytest.approx(one("pcie", 4) + one("ib", 2), rel=1e-12)


def test_one_dimension_is_unaffected():
    S = 3e8
    a = collective_time(_two_dims(), "all_to_all", S, (("pcie", 4),)).time_s
    b = collective_time(_two_dims(pipelined_inner=False), "all_to_all", S, (("pcie", 4),)).time_s
    assert a == b


def test_pipelined_must_be_a_boolean():
    spec = {"name": "x", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
                                  "memory": {"kind": "HBM", "capacity_bytes": 1e9, "bandwidth_Bps": 1e11}},
            "network": [{"name": "n", "topology": "switch", "size": 2, "link_bandwidth_Bps": 1e9,
                         "pipelined": "sometimes"}]}
    with pytest.raises(InputError, match="pipelined"):
        load_system(spec)


@pytest.mark.parametrize("family", ["dlrm_training", "hpl", "fft"])
def test_published_cases_within_15_percent(family):
    """Issue 11's goal for the other families: every published case within 15 %."""
    from dfmodel.validate import evaluate_family_case, load_family_cases

    cases = [c for c in load_family_cases("other_families") if c.family == family]
    assert cases
    for c in cases:
        row = evaluate_family_case(c)
        assert row.error is not None and abs(row.error) <= 0.15, (c.id, row.error)
