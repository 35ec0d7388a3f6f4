"""DLRM as NVIDIA's MLPerf runs it (HugeCTR): the frequency-hybrid embedding, the CUDA-graph launch,
and the gradient sync that cannot hide behind the embedding exchange on the same links."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from dfmodel.errors import InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip import dlrm as mod
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.dlrm import DLRMMapping, DLRMModel, frequent_split, harmonic
from dfmodel.system import load_system
from tests.test_families import DLRM, SYSTEMS, chip, solve, system

# -- the access law ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 100_000])
@pytest.mark.parametrize("s", [0.0, 0.5, 1.0, 1.3])
def test_harmonic_matches_the_exact_sum(n, s):
    exact = float(np.sum(np.arange(1, n + 1, dtype=float) ** -s))
    assert harmonic(n, s) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("rows,lookups,s,t", [(1000, 5000, 1.0, 3.0), (50, 400, 0.7, 2.0), (200, 10, 1.2, 1.0),
                                              (30, 3000, 0.9, 1.0), (1000, 5000, 0.0, 4.0), (1000, 5000, 0.0, 8.0)])
def test_frequent_split_is_brute_force(rows, lookups, s, t):
    """Rows whose expected count per iteration reaches t, and their share of the look-ups."""
    k = np.arange(1, rows + 1, dtype=float)
    p = k ** -s / np.sum(k ** -s)
    hot = lookups * p >= t * (1 - 1e-12)
    K, share = frequent_split(rows, lookups, s, t)
    assert K == int(hot.sum())
    assert share == pytest.approx(float(p[hot].sum()), rel=1e-9, abs=1e-12)


def test_zipf_exponent_field_and_errors():
    w = copy.deepcopy(DLRM)
    w["embedding"]["zipf_exponent"] = 1.1
    assert load_workload(w).embedding.zipf() == [1.1] * 5
    w["embedding"]["zipf_exponent"] = [1.0, 1.0]
    with pytest.raises(InputError, match=r"zipf_exponent.*num_tables \(5\)"):
        load_workload(w)
    w["embedding"]["zipf_exponent"] = -1
    with pytest.raises(InputError, match="zipf_exponent"):
        load_workload(w)


# -- the frequency-hybrid plan --------------------------------------------------------------------


def _mapping(model, plan, tp=8):
    return DLRMMapping(tp, model.N // tp, model.b, 1, plan, (("tp", (("nv", 4), ("ib", 2))), ("dp", ())))


def test_all_frequent_is_the_replicated_plan():
    """A threshold that makes every table frequent is torchrec's replicated plan, cost for cost."""
    s = system(SYSTEMS["switch4x2"])
    model = DLRMModel(load_workload(DLRM), s)
    plans = model.plans(8)
    fh = mod.Plan("fh-all", ("fh",) * 5, 1, tuple((r, 1.0) for r in DLRM["embedding"]["rows_per_table"]))
    model._plans[8] = plans = {**plans, fh.name: fh}
    rep = "hybrid:0,5"  # every table replicated
    assert plans[rep].schemes == ("dp",) * 5
    a, b = model.evaluate(_mapping(model, fh.name)), model.evaluate(_mapping(model, rep))
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)
    assert a.memory.total_bytes == pytest.approx(b.memory.total_bytes, rel=1e-12)


def test_infrequent_rows_travel_one_vector_per_lookup():
    """With nothing frequent, every chip sends and receives its own samples' look-ups (balanced):
    the all-to-all message is micro_batch x sum(lookups) x dim x bytes, with no reduce-scatter."""
    w = copy.deepcopy(DLRM)
    s = system(SYSTEMS["switch4x2"])
    model = DLRMModel(load_workload(w), s)
    none = mod.Plan("fh-none", ("fh",) * 5, 1, tuple((0, 0.0) for _ in range(5)))
    model._plans[8] = {**model.plans(8), none.name: none}
    _, _, _, vol = model.per_chip(_mapping(model, none.name))
    mb, dim = model.b, 16
    assert vol["a2a_msg"] == pytest.approx(mb * sum(DLRM["embedding"]["lookups_per_table"]) * dim * 4)
    assert vol["rw_msg"] == 0
    # every chip gathers 1/8 of the group's look-ups
    assert vol["gathered_elements"] == pytest.approx(8 * mb * sum(DLRM["embedding"]["lookups_per_table"]) * dim / 8)


def test_search_takes_the_hybrid_when_it_wins_and_never_loses():
    """Adding the frequency-hybrid plans can only make the optimum faster (it is a larger space),
    and a skewed access law (more look-ups on fewer rows) makes it at least as fast again."""
    s = system(SYSTEMS["switch2x8"])
    w = load_workload(DLRM)
    base = DLRMModel(w, s)
    old = [m for m in mod.candidates(base, Knobs()) if not m.plan.startswith("frequency")]
    best_old = min(base.evaluate(m).iteration_time_s for m in old)
    r = solve(DLRM, s)
    assert r.iteration_time_s <= best_old * (1 + 1e-12)
    skew = copy.deepcopy(DLRM)
    skew["embedding"]["zipf_exponent"] = 1.2
    assert solve(skew, s).iteration_time_s <= r.iteration_time_s * (1 + 1e-9)


def test_search_equals_exhaustive_with_skew():
    skew = copy.deepcopy(DLRM)
    skew["embedding"]["zipf_exponent"] = [1.1, 0.8, 1.3, 0.0, 0.5]
    for name in ("switch4x2", "switch2x8"):
        s = system(SYSTEMS[name])
        r, ex = solve(skew, s), solve(skew, s, exhaustive=True)
        assert r.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_more_bandwidth_never_slower_with_hybrid(scale):
    skew = copy.deepcopy(DLRM)
    skew["embedding"]["zipf_exponent"] = 1.0
    slow = solve(skew, system(SYSTEMS["switch2x8"]))
    other = solve(skew, system(SYSTEMS["switch2x8"], scale_bw=scale))
    if scale > 1:
        assert other.iteration_time_s <= slow.iteration_time_s * (1 + 1e-12)
    else:
        assert other.iteration_time_s >= slow.iteration_time_s * (1 - 1e-12)


# -- the gradient sync and the exchange share the links ------------------------------------------


def test_sync_hides_only_behind_the_backward_compute():
    """exposed = max(sync - dp_overlap x (backward - backward exchange), 0): the all-reduce of the
    replicated rows cannot ride on links the gradient all-to-all keeps busy."""
    s = system(SYSTEMS["switch2x8"])
    model = DLRMModel(load_workload(DLRM), s)
    m = DLRMMapping(16, 1, model.b, 1, "hybrid:0,2", (("tp", (("nv", 2), ("ib", 8))), ("dp", ())))
    ev = model.evaluate(m)
    names = model.base_graph(m.micro_batch)[1]
    window = ev.chip.backward_s - ev.detail["network_s"][names["a2a_bwd"]]
    assert window >= 0
    expected = max(ev.detail["sync_s"] - s.dp_overlap * window, 0.0)
    assert ev.breakdown_s["dp_comm"] == pytest.approx(expected, rel=1e-9, abs=1e-15)


# -- CUDA graphs --------------------------------------------------------------------------------------


def _graph_system(eager_s, graph_s):
    c = chip()
    c["efficiency"] = {**c["efficiency"], "kernel_overhead_s": eager_s, "graph_kernel_overhead_s": graph_s}
    return load_system({"name": "g", "chip": c, "network": [{"name": "nv", "topology": "switch", "size": 4,
                                                               "link_bandwidth_Bps": 200e9, "latency_s": 1e-6}]})


def test_cuda_graphs_replace_the_launch_overhead():
    """In a graph each kernel costs the in-graph gap: a smaller gap is faster, the eager one is the
    same, and without the workload's flag nothing changes."""
    w = copy.deepcopy(DLRM)
    eager = solve(w, _graph_system(5e-6, 0.5e-6)).iteration_time_s
    w["training"]["cuda_graphs"] = True
    fast = solve(w, _graph_system(5e-6, 0.5e-6))
    same = solve(w, _graph_system(5e-6, 5e-6)).iteration_time_s
    assert fast.iteration_time_s < eager
    assert same == pytest.approx(eager, rel=1e-12)


def test_graph_overhead_cannot_exceed_the_eager_one():
    with pytest.raises(InputError, match=r"graph_kernel_overhead_s.*at most kernel_overhead_s"):
        _graph_system(1e-6, 2e-6)


def test_mlperf_dlrm_cases_within_15_percent():
    """The three MLPerf v2.0 DLRM cases (HugeCTR on DGX A100) predict within 15 %, and at 64 and 112
    GPUs the search picks HugeCTR's own layout: the tables over all GPUs, frequency-hybrid."""
    from dfmodel.validate import evaluate_family_case, load_family_cases

    cases = [c for c in load_family_cases("other_families") if c.family == "dlrm_training"]
    assert len(cases) == 3
    for c in cases:
        row = evaluate_family_case(c)
        assert abs(row.error) <= 0.15, (c.id, row.error)
        if row.num_chips > 8:
            assert row.mapping.startswith(f"TP{row.num_chips} ")
