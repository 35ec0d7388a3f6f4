"""Candidate algorithms for each collective on one 1-D topology (ring, fully_connected, switch).

:func:`candidates` lists ``(algorithm_name, time_s)`` for one collective on ``p`` members of one
dimension; the formulas themselves live in :mod:`dfmodel.netmodels.formulas`.

Bandwidth (``link_bandwidth_Bps * efficiency``, one direction, see :mod:`dfmodel.system.schema`):

- ring: each member has a link to each of its two neighbours. When the dimension is
  ``bidirectional`` and ``p > 2``, ring algorithms split the message in two halves that travel
  opposite ways round at once, which halves the bandwidth term (the latency term is unchanged):
  ring all-reduce ``2(p-1) a + (p-1)/p * S/B``. A two-member ring is one full-duplex link, which
  the one-way algorithm already uses in both directions, so there is no split for ``p = 2``.
  With ``bidirectional: false`` the ring is one-way and the classic forms apply.
- fully_connected: a dedicated link between each pair, so a member can talk to all ``p-1``
  others at once ("direct" algorithms). A ring embedded in the clique can also split both ways.
- switch: one injection link per member into a non-blocking switch. Any pairing is possible
  (trees, recursive halving/doubling, pairwise exchange), but a member sends at most ``B`` in
  total, so a ring gains nothing from running both ways.

Other groups sharing the same links at the same time (e.g. tensor- and data-parallel groups on
factors of one switch) are not modelled here: the caller decides what overlaps.
"""

from __future__ import annotations

import math

from dfmodel.netmodels import formulas as f

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")
TOPOLOGIES = ("ring", "fully_connected", "switch")

PRETTY = {
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "p2p": "p2p",
}


def ring_directions(topology: str, members: int, bidirectional: bool) -> int:
    """How many ways round a ring algorithm can send at once on this dimension (1 or 2)."""
    if topology == "switch" or not bidirectional or members <= 2:
        return 1
    return 2


def candidates(
    topology: str,
    collective: str,
    members: int,
    message_bytes: float,
    bandwidth_Bps: float,
    latency_s: float,
    bidirectional: bool = True,
) -> list[tuple[str, float]]:
    """``(algorithm, time_s)`` for every algorithm this topology supports for ``collective``.

    >>> candidates("ring", "all_reduce", 4, 4e9, 1e9, 0.0)   # 2*3/4 * 4 GB / (2 * 1 GB/s)
    [('bidirectional ring', 3.0)]
    >>> candidates("switch", "p2p", 8, 1e9, 1e9, 1e-6)
    [('p2p', 1.000001)]
    """
    p, S, B, a = members, float(message_bytes), float(bandwidth_Bps), float(latency_s)
    if p <= 1:
        return [("none", 0.0)]
    if collective == "p2p":
        # Adjacent members (pipeline stages laid out along the dimension): one hop.
        return [("p2p", f.point_to_point_s(S, B, a))]
    d = ring_directions(topology, p, bidirectional)
    ring_name = "bidirectional ring" if d == 2 else "ring"
    Bd = B * d
    out: list[tuple[str, float]] = []
    if topology == "ring":
        if collective == "all_reduce":
            out.append((ring_name, f.ring_all_reduce_s(p, S, Bd, a)))
        elif collective in ("reduce_scatter", "all_gather"):
            out.append((ring_name, f.ring_reduce_scatter_s(p, S, Bd, a)))
        elif collective == "all_to_all":
            out.append((ring_name, f.ring_all_to_all_s(p, S, B, a, d == 2)))
        elif collective == "broadcast":
            out.append(("pipelined ring", f.pipelined_chain_s(p - 1, S / B, a)))
            if d == 2:
                # The whole message both ways round: half the hops, each way carries all of S.
                out.append(("pipelined bidirectional ring", f.pipelined_chain_s(math.ceil((p - 1) / 2), S / B, a)))
                # Half the message each way, each half all the way round.
                out.append(("pipelined split ring", f.pipelined_chain_s(p - 1, S / Bd, a)))
    elif topology == "fully_connected":
        if collective == "all_reduce":
            out.append(("direct", 2 * f.direct_exchange_s(S / p, B, a)))
            out.append((ring_name, f.ring_all_reduce_s(p, S, Bd, a)))
            out.append(("halving-doubling", f.halving_doubling_all_reduce_s(p, S, B, a)))
        elif collective in ("reduce_scatter", "all_gather"):
            out.append(("direct", f.direct_exchange_s(S / p, B, a)))
            out.append((ring_name, f.ring_reduce_scatter_s(p, S, Bd, a)))
        elif collective == "all_to_all":
            out.append(("direct", f.direct_exchange_s(S / p, B, a)))
        elif collective == "broadcast":
            out.append(("direct", f.direct_exchange_s(S, B, a)))
            # Scatter S/p to each member directly, then a direct all-gather of the pieces.
            out.append(("direct scatter+all-gather", 2 * f.direct_exchange_s(S / p, B, a)))
    elif topology == "switch":
        if collective == "all_reduce":
            out.append(("ring", f.ring_all_reduce_s(p, S, B, a)))
            out.append(("double binary tree", f.double_binary_tree_all_reduce_s(p, S, B, a)))
            out.append(("halving-doubling", f.halving_doubling_all_reduce_s(p, S, B, a)))
        elif collective in ("reduce_scatter", "all_gather"):
            out.append(("ring", f.ring_reduce_scatter_s(p, S, B, a)))
            name = "recursive halving" if collective == "reduce_scatter" else "recursive doubling"
            out.append((name, f.recursive_reduce_scatter_s(p, S, B, a)))
        elif collective == "all_to_all":
            out.append(("pairwise", f.pairwise_all_to_all_s(p, S, B, a)))
            out.append(("bruck", f.bruck_all_to_all_s(p, S, B, a)))
        elif collective == "broadcast":
            out.append(("binomial tree", f.binomial_broadcast_s(p, S, B, a)))
            out.append(("scatter+all-gather", f.scatter_allgather_broadcast_s(p, S, B, a)))
            out.append(("pipelined chain", f.pipelined_chain_s(p - 1, S / B, a)))
    else:
        raise ValueError(f"unknown topology {topology!r}; expected one of {', '.join(TOPOLOGIES)}")
    if not out:
        raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")
    return out


#: Switch algorithms of :func:`candidates` that NCCL does not implement (see :func:`dim_candidates`).
NCCL_MISSING = ("recursive halving", "recursive doubling", "halving-doubling")


#: :func:`dim_candidates` memo: the search asks the same (dimension, collective, members, bytes)
#: many times over (DeepSeek-V3 / 512 H100: 68 k calls, 9 k distinct; the zero-byte fills of
#: pipelined compositions alone are half), so each is computed once. Keyed on the dimension's
#: field values (a dimension edited in place is another key); cleared when it grows large.
_CANDIDATES: dict[tuple, tuple[tuple[str, float], ...]] = {}
_CANDIDATES_MAX = 1 << 17


def dim_candidates(dim, collective: str, members: int, message_bytes: float) -> tuple[tuple[str, float], ...]:
    """:func:`dim_candidates_uncached`, memoised (see :data:`_CANDIDATES`)."""
    key = (tuple(dim.__dict__.values()), collective, members, message_bytes)
    hit = _CANDIDATES.get(key)
    if hit is None:
        if len(_CANDIDATES) >= _CANDIDATES_MAX:
            _CANDIDATES.clear()
        hit = _CANDIDATES[key] = tuple(dim_candidates_uncached(dim, collective, members, message_bytes))
    return hit


def dim_candidates_uncached(dim, collective: str, members: int, message_bytes: float) -> list[tuple[str, float]]:
    """:func:`candidates` on one network dimension, plus what its spec enables: NCCL's protocols
    as choices (``nccl_protocols``: every algorithm also with LL and LL128, see
    :mod:`dfmodel.netmodels.nccl`; with ``nccl_transport``, NCCL's own latencies), NVLink SHARP
    all-reduce on a switch (``nvls_efficiency``) and InfiniBand SHARP all-reduce (``sharp``).
    """
    from dfmodel.netmodels import nccl

    B, a = dim.effective_bandwidth_Bps, dim.latency_s

    def base(bw: float, lat: float) -> list[tuple[str, float]]:
        out = candidates(dim.topology, collective, members, message_bytes, bw, lat, dim.bidirectional)
        if dim.nccl_protocols and dim.topology == "switch":
            # NCCL (2.18-2.21, NeMo 24.x / Megatron-Core containers) has no recursive halving /
            # doubling or halving-doubling: all-reduce runs ring or tree, reduce-scatter and
            # all-gather ring only (NCCL src/include/device.h NCCL_ALGO_RING / TREE, tuning.cc
            # ncclTopoTuneModel: RS/AG are enabled for RING (and NVLS / CollNet / PAT, not modelled
            # here) only), so at n ranks they pay n - 1 latency steps, not log2 n
            out = [(name, t) for name, t in out if name not in NCCL_MISSING]
        return out

    if dim.nccl_protocols and members > 1 and collective != "p2p":
        out = [(f"{name} {pr.name}", t) for i, pr in enumerate(nccl.PROTOCOLS)
               for name, t in _protocol_candidates(dim, collective, i, lambda lat, bw=B * pr.bandwidth_fraction:
                                                   base(bw, lat), a * pr.latency_fraction)]
    else:
        out = base(B, a)
    if dim.nvls_efficiency and dim.topology == "switch" and collective == "all_reduce" and members > 1:
        out.append(("NVLS", nccl.nvls_all_reduce_s(message_bytes, dim.link_bandwidth_Bps, dim.nvls_efficiency)))
    if dim.sharp and dim.topology == "switch" and collective == "all_reduce" and members > 1:
        out.append(("SHARP", nccl.sharp_all_reduce_s(message_bytes, B)))
    return out


#: Collectives NCCL runs as rings or trees (all-to-all is grouped send / receive).
_NCCL_FAMILIES = {"all_reduce": ("ring", "tree"), "reduce_scatter": ("ring",), "all_gather": ("ring",),
                  "broadcast": ("ring", "tree")}


def _protocol_candidates(dim, collective: str, protocol: int, at, plain_latency_s: float) -> list[tuple[str, float]]:
    """The candidates of one NCCL protocol, ``at(latency)`` giving them at a per-step latency.
    Without ``nccl_transport`` every algorithm takes ``plain_latency_s`` (``latency_s`` scaled
    per protocol). With it, a ring or tree algorithm (:func:`nccl.algorithm_family`) takes
    NCCL's per-step latency of its family on that transport plus the family's base latency once
    (tuning.cc); an algorithm of neither family (all-to-all, scatter + all-gather) keeps
    ``plain_latency_s``."""
    from dfmodel.netmodels import nccl

    families = _NCCL_FAMILIES.get(collective, ()) if dim.nccl_transport else ()
    if not families:
        return at(plain_latency_s)
    by_family = {fam: at(nccl.step_latency_s(dim.nccl_transport, fam, protocol)) for fam in families}
    out = []
    for fam, options in by_family.items():
        out += [(name, t + nccl.base_latency_s(fam, protocol)) for name, t in options
                if nccl.algorithm_family(name) == fam]
    if collective == "broadcast":  # scatter + all-gather: neither a ring nor a tree
        out += [(name, t) for name, t in at(plain_latency_s) if nccl.algorithm_family(name) is None]
    return out
