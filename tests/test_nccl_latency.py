"""NCCL's own latency model on dimensions that name their transport (``nccl_transport``), and
InfiniBand SHARP all-reduce (``sharp``). Oracles: NCCL's tuning.cc formulas written out by hand
(base latency once, then per-step hardware latency per protocol and transport)."""

from __future__ import annotations

import pytest

from dfmodel.errors import InputError
from dfmodel.netmodels import nccl
from dfmodel.netmodels.collectives import algorithms, collective_time
from dfmodel.netmodels.topologies import dim_candidates
from dfmodel.system.loader import load_system

from test_inter_chip import small_system

US = 1e-6


def _system(nodes=8, per_node=8, transport=True, sharp=False):
    s = small_system(per_node, nodes)
    for dim, t in zip(s["network"], ("nvlink", "net")):
        dim["nccl_protocols"] = True
        if transport:
            dim["nccl_transport"] = t
    s["network"][1]["sharp"] = sharp
    return load_system(s)


def test_a_tiny_all_reduce_on_the_network_costs_nccls_tree_latency():
    """A zero-byte all-reduce over 64 ranks, one per node: NCCL's tree with LL, base 6.8 us +
    2 log2(64) steps of 5.0 us (tuning.cc), the cheapest of every algorithm and protocol."""
    ib = _system(nodes=64).network[1]
    best = min(t for _, t in dim_candidates(ib, "all_reduce", 64, 0.0))
    assert best == pytest.approx((6.8 + 2 * 6 * 5.0) * US, rel=1e-9)


def test_a_tiny_reduce_scatter_on_nvlink_costs_nccls_ring_latency():
    """Ring LL inside a node: base 6.6 us + 7 steps of 0.6 us."""
    nv = _system().network[0]
    best = min(t for _, t in dim_candidates(nv, "reduce_scatter", 8, 0.0))
    assert best == pytest.approx((6.6 + 7 * 0.6) * US, rel=1e-9)


def test_a_large_reduce_scatter_is_bandwidth_bound_either_way():
    """At 1 GB the latency model moves the time by well under 1 %: the bytes still rule."""
    with_model, plain = _system().network[1], _system(transport=False).network[1]
    a = min(t for _, t in dim_candidates(with_model, "reduce_scatter", 8, 1e9))
    b = min(t for _, t in dim_candidates(plain, "reduce_scatter", 8, 1e9))
    assert a == pytest.approx(b, rel=1e-2) and a != b


def test_all_to_all_keeps_the_dimensions_own_latency():
    """NCCL's all-to-all is grouped send / receive, not a ring or tree: no NCCL ring latency."""
    with_model, plain = _system().network[1], _system(transport=False).network[1]
    assert dim_candidates(with_model, "all_to_all", 8, 1e3) == dim_candidates(plain, "all_to_all", 8, 1e3)


def test_flat_ring_pays_network_latency_only_on_the_steps_that_leave_the_node():
    """One ring through 8 GPUs x 6 nodes (reduce-scatter, zero bytes): of its 47 steps 5 cross
    the network (2.7 us each, LL) and 42 stay in a node, each at least the host's 1 us net
    overhead; the base latency once."""
    system = _system(nodes=6)
    flat = next(c for c in algorithms(system, "reduce_scatter", 0.0, (("nvlink", 8), ("ib", 6)))
                if "flat ring" in c.algorithm)
    assert flat.time_s == pytest.approx((6.6 + 42 * 1.0 + 5 * 2.7) * US, rel=1e-9)


def test_nccl_transport_needs_nccl_protocols():
    s = small_system(4, 2)
    s["network"][1]["nccl_transport"] = "net"
    with pytest.raises(InputError, match="nccl_transport"):
        load_system(s)


def test_sharp_all_reduce_sends_the_buffer_once():
    """With SHARP the network all-reduce of S bytes is CollNet's 31 us + S / B, which beats a
    ring's 2 (p-1)/p S / B for a large buffer; without it there is no such candidate."""
    on, off = _system(sharp=True).network[1], _system().network[1]
    S = 1e8
    names = dict(dim_candidates(on, "all_reduce", 8, S))
    assert names["SHARP"] == pytest.approx(31 * US + S / on.effective_bandwidth_Bps, rel=1e-12)
    assert "SHARP" not in dict(dim_candidates(off, "all_reduce", 8, S))
    assert min(names.values()) == names["SHARP"]
    # over the whole group too: never slower with the switches reducing
    group = (("nvlink", 8), ("ib", 8))
    assert collective_time(_system(sharp=True), "all_reduce", S, group).time_s < \
        collective_time(_system(), "all_reduce", S, group).time_s


def test_a_case_run_with_sharp_gets_it_on_the_network_dimensions_only():
    from dfmodel.validate import with_sharp

    spec = with_sharp("dgx_a100")
    flags = {d["name"]: d.get("sharp", False) for d in spec["network"]}
    assert flags == {"nvlink": False, "ib": True}
    assert load_system(spec).network[1].sharp


def test_shipped_gpu_presets_name_their_nccl_transports():
    for preset in ("dgx_a100", "dgx_h100", "dgx_h200", "dgx_b200", "dgx_h800", "gb200_nvl72"):
        system = load_system(preset)
        assert [d.nccl_transport for d in system.network] == ["nvlink", "net"], preset
        assert not any(d.sharp for d in system.network)  # a job asks for SHARP; the preset does not
    assert nccl.step_latency_s("net", "ring", 2) == pytest.approx(14 * US)


def test_dim_candidates_are_computed_once_and_see_a_dimension_edited_in_place(monkeypatch):
    """The memo gives what the computation gives; a second identical collective computes no
    dimension's candidates again; a dimension edited in place is a new key."""
    from dfmodel.netmodels import topologies

    system = _system(nodes=6)
    nv = system.network[0]
    for collective, S in (("all_reduce", 1e6), ("reduce_scatter", 0.0), ("all_to_all", 1e3), ("broadcast", 1e5)):
        assert topologies.dim_candidates(nv, collective, 8, S) == tuple(
            topologies.dim_candidates_uncached(nv, collective, 8, S))
    calls = []
    real = topologies.dim_candidates_uncached
    monkeypatch.setattr(topologies, "dim_candidates_uncached", lambda *a: calls.append(a) or real(*a))
    group = (("nvlink", 8), ("ib", 6))
    first = algorithms(system, "all_reduce", 3.3e6, group)
    n = len(calls)
    assert n > 0 and algorithms(system, "all_reduce", 3.3e6, group) == first and len(calls) == n
    before = dict(topologies.dim_candidates(nv, "all_to_all", 8, 1e3))
    nv.latency_s = 1e-3
    after = dict(topologies.dim_candidates(nv, "all_to_all", 8, 1e3))
    assert min(after.values()) > min(before.values())
