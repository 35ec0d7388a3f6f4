"""Collective cost models: closed forms, monotonicity, composition, placements, errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.errors import InputError
from dfmodel.netmodels import (
    COLLECTIVES,
    CostTable,
    algorithms,
    collective_time,
    group_size,
    groups_for,
    resolve_group,
    split_dims,
)
from dfmodel.netmodels.formulas import halving_doubling_all_reduce_s, pipelined_chain_s
from dfmodel.system import load_system

GiB = 2.0**30


def make_system(*dims: dict):
    """A system with the given network dims (each a dict with name/topology/size/bw/latency...)."""
    return load_system(
        {
            "name": "t",
            "chip": {
                "name": "c",
                "peak_flops": 1e12,
                "sram_bytes": 1e6,
                "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10},
            },
            "network": list(dims),
        }
    )


def dim(name, topology, size, bw=1e9, lat=1e-6, eff=1.0, bidirectional=True):
    return {"name": name, "topology": topology, "size": size, "link_bandwidth_Bps": bw,
            "latency_s": lat, "efficiency": eff, "bidirectional": bidirectional}


def by_name(system, collective, S, group) -> dict[str, float]:
    return {c.algorithm: c.time_s for c in algorithms(system, collective, S, group)}


# ----------------------------------------------------------------------------- closed forms


def test_unidirectional_ring_closed_forms():
    p, S, B, a = 4, 8e9, 2e9, 3e-6
    s = make_system(dim("x", "ring", p, B, a, bidirectional=False))
    g = (("x", p),)
    t = lambda c: collective_time(s, c, S, g).time_s  # noqa: E731
    assert t("all_reduce") == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * S / B)
    assert t("reduce_scatter") == pytest.approx((p - 1) * a + (p - 1) / p * S / B)
    assert t("all_gather") == pytest.approx((p - 1) * a + (p - 1) / p * S / B)
    # all-to-all one way round: each link carries S/p * (1 + 2 + ... + p-1) = (p-1)/2 * S
    assert t("all_to_all") == pytest.approx((p - 1) * a + (p - 1) / 2 * S / B)
    assert t("p2p") == pytest.approx(a + S / B)
    # pipelined broadcast over p-1 hops, optimal segments: (sqrt((p-2) a) + sqrt(S/B))^2
    assert t("broadcast") == pytest.approx((math.sqrt((p - 2) * a) + math.sqrt(S / B)) ** 2)


def test_bidirectional_ring_halves_bandwidth_term_but_not_for_two_members():
    p, S, B, a = 8, 8e9, 1e9, 1e-6
    s = make_system(dim("x", "ring", p, B, a), dim("y", "ring", 2, B, a))
    ar = collective_time(s, "all_reduce", S, (("x", p),))
    assert ar.time_s == pytest.approx(2 * (p - 1) * a + (p - 1) / p * S / B)
    assert ar.algorithm == "bidirectional ring all-reduce over x"
    # shortest way round: each link direction carries S * floor(p^2/4) / (2p) = S p / 8
    a2a = collective_time(s, "all_to_all", S, (("x", p),))
    assert a2a.time_s == pytest.approx(p // 2 * a + S * p / 8 / B)
    two = collective_time(s, "all_reduce", S, (("y", 2),))
    assert two.time_s == pytest.approx(2 * a + S / B)  # one full-duplex link, no split
    assert two.algorithm == "ring all-reduce over y"


def test_fully_connected_direct_closed_forms():
    p, S, B, a = 4, 4e9, 1e9, 1e-6
    s = make_system(dim("fc", "fully_connected", p, B, a))
    g = (("fc", p),)
    ar = collective_time(s, "all_reduce", S, g)
    assert ar.time_s == pytest.approx(2 * a + 2 * S / p / B)
    assert ar.algorithm == "direct all-reduce over fc"
    assert collective_time(s, "reduce_scatter", S, g).time_s == pytest.approx(a + S / p / B)
    assert collective_time(s, "all_gather", S, g).time_s == pytest.approx(a + S / p / B)
    assert collective_time(s, "all_to_all", S, g).time_s == pytest.approx(a + S / p / B)
    bc = by_name(s, "broadcast", S, g)
    assert bc["direct broadcast over fc"] == pytest.approx(a + S / B)
    assert bc["direct scatter+all-gather broadcast over fc"] == pytest.approx(2 * a + 2 * S / p / B)
    # the embedded ring uses both directions (p > 2)
    ar_all = by_name(s, "all_reduce", S, g)
    assert ar_all["bidirectional ring all-reduce over fc"] == pytest.approx(2 * (p - 1) * a + (p - 1) / p * S / B)


def test_switch_closed_forms():
    p, S, B, a = 8, 8e9, 1e9, 2e-6
    s = make_system(dim("sw", "switch", p, B, a))
    g = (("sw", p),)
    lg = 3
    ar = by_name(s, "all_reduce", S, g)
    assert ar["ring all-reduce over sw"] == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * S / B)
    assert ar["halving-doubling all-reduce over sw"] == pytest.approx(2 * lg * a + 2 * (p - 1) / p * S / B)
    # double binary tree: a segmented chain of 2 log2 p stages moving 2 S / B
    c = 2 * S / B
    assert ar["double binary tree all-reduce over sw"] == pytest.approx((math.sqrt((2 * lg - 1) * a) + math.sqrt(c)) ** 2)
    rs = by_name(s, "reduce_scatter", S, g)
    assert rs["recursive halving reduce-scatter over sw"] == pytest.approx(lg * a + (p - 1) / p * S / B)
    ag = by_name(s, "all_gather", S, g)
    assert ag["recursive doubling all-gather over sw"] == pytest.approx(lg * a + (p - 1) / p * S / B)
    a2a = by_name(s, "all_to_all", S, g)
    assert a2a["pairwise all-to-all over sw"] == pytest.approx((p - 1) * a + (p - 1) / p * S / B)
    assert a2a["bruck all-to-all over sw"] == pytest.approx(lg * a + lg * S / (2 * B))
    bc = by_name(s, "broadcast", S, g)
    assert bc["binomial tree broadcast over sw"] == pytest.approx(lg * (a + S / B))
    assert bc["scatter+all-gather broadcast over sw"] == pytest.approx((lg + p - 1) * a + 2 * (p - 1) / p * S / B)
    assert collective_time(s, "p2p", S, g).time_s == pytest.approx(a + S / B)


def test_small_message_prefers_log_latency_algorithms_on_a_switch():
    s = make_system(dim("sw", "switch", 64, 1e10, 5e-6))
    small = collective_time(s, "all_reduce", 1024, (("sw", 64),))
    big = collective_time(s, "all_reduce", GiB, (("sw", 64),))
    assert "ring" not in small.algorithm
    assert small.time_s < 2 * 63 * 5e-6  # far below the ring's latency term
    assert big.time_s <= 2 * 63 * 5e-6 + 2 * 63 / 64 * GiB / 1e10 + 1e-12


def test_efficiency_scales_bandwidth():
    s1 = make_system(dim("sw", "switch", 8, 1e9, 0.0, eff=1.0))
    s2 = make_system(dim("sw", "switch", 8, 1e9, 0.0, eff=0.5))
    t1 = collective_time(s1, "all_gather", GiB, (("sw", 8),)).time_s
    t2 = collective_time(s2, "all_gather", GiB, (("sw", 8),)).time_s
    assert t2 == pytest.approx(2 * t1)


def test_halving_doubling_non_power_of_two_adds_two_exchanges():
    p, S, B, a = 6, 6e9, 1e9, 1e-6
    p2 = 4
    expected = 2 * 2 * a + 2 * (p2 - 1) / p2 * S / B + 2 * (a + S / B)
    assert halving_doubling_all_reduce_s(p, S, B, a) == pytest.approx(expected)


def test_pipelined_chain_limits():
    assert pipelined_chain_s(1, 2.0, 1.0) == 3.0
    assert pipelined_chain_s(4, 2.0, 0.0) == 2.0  # no latency: infinitely fine segments
    assert pipelined_chain_s(4, 0.0, 1.0) == 4.0  # no data: hops * latency
    # brute force over integer segment counts is never better than the continuous optimum
    for hops, c, a in [(3, 5.0, 0.1), (10, 1.0, 0.5), (2, 0.01, 1.0)]:
        best = min((hops - 1 + k) * (a + c / k) for k in range(1, 2000))
        assert pipelined_chain_s(hops, c, a) <= best + 1e-12


# ----------------------------------------------------------------------------- composition


def test_two_d_torus_hierarchical_matches_closed_formula():
    px, py, S = 4, 8, 1 * GiB
    Bx, By, ax, ay = 50e9, 25e9, 1e-6, 2e-6
    s = make_system(dim("x", "ring", px, Bx, ax), dim("y", "ring", py, By, ay))
    # Written independently: bidirectional rings halve the bandwidth term (p > 2).
    rs_x = (px - 1) * ax + (px - 1) / px * S / (2 * Bx)
    ar_y = 2 * (py - 1) * ay + 2 * (py - 1) / py * (S / px) / (2 * By)
    ag_x = rs_x
    expected = rs_x + ar_y + ag_x
    name = ("bidirectional ring reduce-scatter over x, then bidirectional ring all-reduce over y, "
            "then bidirectional ring all-gather over x")
    cands = by_name(s, "all_reduce", S, (("x", px), ("y", py)))
    assert cands[name] == pytest.approx(expected)
    best = collective_time(s, "all_reduce", S, (("x", px), ("y", py)))
    assert best.time_s <= expected
    # the pipelined variant: the busier dimension plus latency-only fill
    pipe = cands["pipelined over dims: " + name.replace(", then ", ", ")]
    fill = 2 * ((px - 1) * ax) + 2 * (py - 1) * ay
    assert pipe == pytest.approx(max(rs_x + ag_x, ar_y) + fill)


def test_hierarchical_steps_shrink_the_message():
    s = make_system(dim("nv", "switch", 8, 300e9, 2e-6), dim("ib", "switch", 16, 25e9, 5e-6))
    cands = algorithms(s, "all_reduce", GiB, (("nv", 8), ("ib", 16)))
    inner_first = next(c for c in cands if c.algorithm.startswith("recursive halving reduce-scatter over nv")
                       or c.algorithm.startswith("ring reduce-scatter over nv"))
    sizes = [st.message_bytes for st in inner_first.steps]
    assert sizes == [GiB, GiB / 8, GiB]
    assert [st.dims for st in inner_first.steps] == ["nv", "ib", "nv"]
    assert inner_first.time_s == pytest.approx(sum(st.time_s for st in inner_first.steps))


def test_reduce_scatter_and_all_gather_compose():
    s = make_system(dim("a", "switch", 4, 1e9, 0.0), dim("b", "switch", 2, 1e9, 0.0))
    S = 8e9
    rs = by_name(s, "reduce_scatter", S, (("a", 4), ("b", 2)))
    # inner first: 3/4 S over a, then 1/2 of S/4 over b
    assert min(v for k, v in rs.items() if not k.startswith("pipelined") and "flat" not in k) == pytest.approx(
        min(3 / 4 * S / 1e9 + 1 / 2 * S / 4 / 1e9, 1 / 2 * S / 1e9 + 3 / 4 * S / 2 / 1e9))
    ag = collective_time(s, "all_gather", S, (("a", 4), ("b", 2)))
    assert ag.time_s <= 3 / 4 * S / 1e9 + 1 / 2 * S / 4 / 1e9 + 1e-12


def test_all_to_all_multi_dim_is_per_dim_sequence_or_pipelined():
    s = make_system(dim("a", "fully_connected", 4, 1e9, 1e-6), dim("b", "switch", 8, 1e9, 1e-6))
    S = 1e9
    cands = by_name(s, "all_to_all", S, (("a", 4), ("b", 8)))
    t_a = 1e-6 + S / 4 / 1e9
    t_b = min(7e-6 + 7 / 8 * S / 1e9, 3e-6 + 3 * S / 2e9)
    seq = [v for k, v in cands.items() if not k.startswith("pipelined")]
    assert seq == [pytest.approx(t_a + t_b)]


def test_p2p_multi_dim_is_slowest_hop():
    s = make_system(dim("a", "switch", 4, 100e9, 1e-6), dim("b", "switch", 8, 10e9, 5e-6))
    c = collective_time(s, "p2p", 1e9, (("a", 4), ("b", 8)))
    assert c.time_s == pytest.approx(5e-6 + 1e9 / 10e9)
    assert "over b" in c.algorithm


def test_flat_ring_candidate_runs_at_slowest_dim():
    s = make_system(dim("a", "switch", 4, 100e9, 1e-6), dim("b", "switch", 8, 10e9, 5e-6))
    cands = by_name(s, "all_reduce", GiB, (("a", 4), ("b", 8)))
    flat = [v for k, v in cands.items() if k.startswith("flat ring")]
    assert flat == [pytest.approx(2 * 31 * 5e-6 + 2 * 31 / 32 * GiB / 10e9)]


def test_algorithm_string_names_dims():
    s = make_system(dim("nvlink", "switch", 8, 300e9, 2e-6), dim("ib", "switch", 4, 25e9, 5e-6))
    c = collective_time(s, "all_reduce", GiB, (("nvlink", 8), ("ib", 4)))
    assert "nvlink" in c.algorithm and "ib" in c.algorithm
    half = collective_time(s, "all_reduce", GiB, (("nvlink", 4),))
    assert "nvlink(4/8)" in half.algorithm


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_single_member_group_costs_nothing(collective):
    s = make_system(dim("x", "ring", 4), dim("y", "switch", 8))
    for g in [(), (("y", 1),), (("x", 1), ("y", 1))]:
        c = collective_time(s, collective, GiB, g)
        assert c.time_s == 0.0
        assert c.steps == ()


# ----------------------------------------------------------------------------- properties

TOPOLOGY = st.sampled_from(["ring", "fully_connected", "switch"])
COLLECTIVE = st.sampled_from(COLLECTIVES)
BW = st.floats(1e8, 1e12)
LAT = st.floats(0.0, 1e-4)
SIZE = st.floats(0.0, 1e10)


@st.composite
def one_or_two_dims(draw):
    n = draw(st.integers(1, 2))
    dims = []
    for i in range(n):
        topo = draw(TOPOLOGY)
        size = draw(st.integers(2, 12))
        dims.append(dim(f"d{i}", topo, size, draw(BW), draw(LAT), draw(st.floats(0.3, 1.0)), draw(st.booleans())))
    group = []
    for d in dims:
        if d["topology"] == "ring":
            m = d["size"]
        else:
            m = draw(st.sampled_from([k for k in range(1, d["size"] + 1) if d["size"] % k == 0]))
        group.append((d["name"], m))
    return dims, tuple(group)


def _scaled(dims, i, key, factor):
    out = [dict(d) for d in dims]
    out[i][key] = out[i][key] * factor
    return out


@settings(max_examples=150, deadline=None)
@given(one_or_two_dims(), COLLECTIVE, SIZE, st.floats(1.0, 100.0), st.data())
def test_monotone_in_bandwidth_latency_and_size(dg, collective, S, factor, data):
    dims, group = dg
    base = collective_time(make_system(*dims), collective, S, group).time_s
    i = data.draw(st.integers(0, len(dims) - 1))
    faster = collective_time(make_system(*_scaled(dims, i, "link_bandwidth_Bps", factor)), collective, S, group).time_s
    assert faster <= base * (1 + 1e-9) + 1e-15
    slower = collective_time(make_system(*_scaled(dims, i, "latency_s", factor)), collective, S, group).time_s
    assert slower >= base * (1 - 1e-9) - 1e-15
    bigger = collective_time(make_system(*dims), collective, S * factor + 1.0, group).time_s
    assert bigger >= base * (1 - 1e-9) - 1e-15


@settings(max_examples=100, deadline=None)
@given(one_or_two_dims(), COLLECTIVE, SIZE)
def test_fastest_is_no_slower_than_every_candidate(dg, collective, S):
    dims, group = dg
    s = make_system(*dims)
    best = collective_time(s, collective, S, group)
    cands = algorithms(s, collective, S, group)
    assert best in cands
    assert all(best.time_s <= c.time_s for c in cands)
    assert all(c.time_s >= 0 and math.isfinite(c.time_s) for c in cands)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "collective, group, match",
    [
        ("allreduce_typo", (("x", 4),), "unknown collective"),
        ("all_reduce", (("nope", 2),), "unknown network dimension 'nope'"),
        ("all_reduce", (("x", 2),), "ring dimension must be used whole"),
        ("all_reduce", (("y", 3),), "must divide"),
        ("all_reduce", (("y", 16),), "must divide"),
        ("all_reduce", (("y", 2), ("y", 4)), "appears twice"),
        ("all_reduce", (("y", 0),), "positive integer"),
        ("all_reduce", ("y",), "pairs"),
    ],
)
def test_bad_requests_raise_one_line_errors(collective, group, match):
    s = make_system(dim("x", "ring", 4), dim("y", "switch", 8))
    with pytest.raises(ValueError, match=match) as info:
        collective_time(s, collective, 1e6, group)
    assert isinstance(info.value, InputError)
    assert "\n" not in str(info.value)


def test_negative_message_is_rejected():
    s = make_system(dim("y", "switch", 8))
    with pytest.raises(InputError, match="message size"):
        collective_time(s, "all_reduce", -1, (("y", 8),))


def test_hyphenated_collective_names_are_accepted():
    s = make_system(dim("y", "switch", 8))
    assert collective_time(s, "all-reduce", 1e6, (("y", 8),)) == collective_time(s, "all_reduce", 1e6, (("y", 8),))


# ----------------------------------------------------------------------------- placements


def dgx_like(nodes=16):
    return make_system(dim("nv", "switch", 8, 300e9, 2e-6), dim("ib", "switch", nodes, 25e9, 5e-6))


def test_groups_for_switch_dims():
    s = dgx_like()
    assert groups_for(s, 1) == [()]
    assert groups_for(s, 4) == [(("nv", 4),), (("nv", 2), ("ib", 2)), (("ib", 4),)]
    g16 = groups_for(s, 16)
    assert (("nv", 8), ("ib", 2)) in g16 and (("ib", 16),) in g16 and (("nv", 2), ("ib", 8)) in g16
    assert groups_for(s, 256) == []
    for d in range(1, 129):
        for g in groups_for(s, d):
            assert group_size(g) == d
            resolve_group(s, g)  # every placement is a valid group


def test_groups_for_rings_use_whole_dims():
    s = make_system(dim("x", "ring", 4), dim("y", "ring", 4), dim("z", "ring", 8))
    assert groups_for(s, 4) == [(("x", 4),), (("y", 4),)]
    assert groups_for(s, 16) == [(("x", 4), ("y", 4))]
    assert groups_for(s, 32) == [(("y", 4), ("z", 8))]
    assert groups_for(s, 2) == []


def test_split_dims_fixed_order():
    s = dgx_like(16)
    layouts = split_dims(s, {"tp": 4, "dp": 8, "pp": 4}, order=("tp", "dp", "pp"))
    assert layouts == [{"tp": (("nv", 4),), "dp": (("nv", 2), ("ib", 4)), "pp": (("ib", 4),)}]


def test_split_dims_all_orders_cover_every_chip():
    s = dgx_like(16)
    layouts = split_dims(s, {"tp": 8, "pp": 4, "dp": 4})
    assert len(layouts) == len({tuple(sorted(l.items())) for l in layouts}) >= 3
    assert layouts[0] == {"tp": (("nv", 8),), "pp": (("ib", 4),), "dp": (("ib", 4),)}
    for layout in layouts:
        used: dict[str, int] = {}
        for name, g in layout.items():
            assert group_size(g) == {"tp": 8, "pp": 4, "dp": 4}[name]
            resolve_group(s, g)
            for dname, m in g:
                used[dname] = used.get(dname, 1) * m
        assert used == {"nv": 8, "ib": 16}


def test_split_dims_respects_rings_and_checks_product():
    s = make_system(dim("x", "ring", 4), dim("y", "ring", 4))
    assert split_dims(s, {"tp": 2, "dp": 8}) == []  # a ring cannot be halved
    assert split_dims(s, {"tp": 4, "dp": 4}) == [{"tp": (("x", 4),), "dp": (("y", 4),)},
                                                 {"tp": (("y", 4),), "dp": (("x", 4),)}]
    assert split_dims(s, {"tp": 1, "dp": 16}) == [{"tp": (), "dp": (("x", 4), ("y", 4))}]
    with pytest.raises(InputError, match="multiply to 8"):
        split_dims(s, {"tp": 2, "dp": 4})


# ----------------------------------------------------------------------------- cost table


def test_cost_table_caches_and_matches():
    s = dgx_like(16)
    t = CostTable(s)
    g = (("nv", 8), ("ib", 16))
    c1 = t.cost("all_reduce", GiB, g)
    assert c1 == collective_time(s, "all_reduce", GiB, g)
    assert t.cost("all_reduce", GiB + 0.2, [["nv", 8], ["ib", 16]]) is c1
    assert len(t) == 1
    assert t.time_s("all_reduce", GiB, g) == c1.time_s
    rows = t.table(g, sizes_bytes=[1024, GiB])
    assert len(rows) == 2 * len(COLLECTIVES)
    assert set(rows[0]) == {"collective", "size_bytes", "time_s", "algorithm"}
    with pytest.raises(InputError):
        t.cost("all_reduce", 1e6, (("zz", 2),))
