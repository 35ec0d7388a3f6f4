"""Alpha-beta cost formulas of collective algorithms on one group of ``p`` members.

Every function returns seconds. Arguments: ``p`` members, ``message_bytes`` (the collective's
size, see :mod:`dfmodel.netmodels` for what it means per collective), ``bandwidth_Bps`` (the rate
one member can send at along the path the algorithm uses, already times efficiency and, for a
bidirectional ring, times the number of directions used) and ``latency_s`` (alpha: the fixed cost
of one communication step). Reduction arithmetic (gamma) is ignored: on accelerators it runs at
memory speed and overlaps with the transfer.

Sources:

- [TRG05] R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 19(1), 2005 -- section 4 gives the alpha-beta cost of each
  algorithm (ring/recursive-doubling all-gather, recursive-halving reduce-scatter, pairwise and
  Bruck all-to-all, binomial and scatter+all-gather broadcast, Rabenseifner all-reduce).
- [CHPvdG07] E. Chan, M. Heimlich, A. Purkayastha, R. van de Geijn, "Collective communication:
  theory, practice, and experience", CCPE 19(13), 2007 -- table 1 (lower bounds) and the
  ring/"bucket" (``(p-1)a + (p-1)/p n b``) and minimum-spanning-tree algorithms.
- [PY09] P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 69(2), 2009 -- the ring all-reduce ``2(p-1)a + 2(p-1)/p n b``.
- [SST09] P. Sanders, J. Speck, J. L. Traeff, "Two-tree algorithms for full bandwidth broadcast,
  reduction and scan", Parallel Computing 35(12), 2009 -- the double binary tree NCCL uses.
- [BHKUW97] J. Bruck et al., "Efficient algorithms for all-to-all communications in multiport
  message-passing systems", IEEE TPDS 8(11), 1997.
- Segmented (pipelined) chains: the standard model ``(hops - 1 + k)(a + c/k)`` minimised over the
  number of segments ``k``, e.g. J. Pjesivac-Grbovic et al., "Performance analysis of MPI
  collective operations", Cluster Computing 10(2), 2007, section 3.

>>> ring_reduce_scatter_s(4, 4e9, 1e9, 1e-6)   # 3 steps, 3/4 of 4 GB at 1 GB/s
3.000003
"""

from __future__ import annotations

import math


def log2_steps(p: int) -> int:
    """``ceil(log2 p)``: rounds of a recursive-doubling / binomial-tree algorithm (0 for p = 1)."""
    return (p - 1).bit_length()


def ring_reduce_scatter_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Ring (bucket) reduce-scatter or all-gather: ``(p-1) a + (p-1)/p * S/B``.

    [CHPvdG07] section 5.1, [TRG05] section 4.1 (ring all-gather). The same formula serves
    all-gather, where ``S`` is the gathered output; for reduce-scatter ``S`` is the full input.
    """
    return (p - 1) * latency_s + (p - 1) / p * message_bytes / bandwidth_Bps


def ring_all_reduce_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Ring all-reduce = ring reduce-scatter + ring all-gather: ``2(p-1) a + 2(p-1)/p * S/B``.

    [PY09] eq. (1); [TRG05] section 4.4 (Rabenseifner's reduce-scatter + all-gather).
    """
    return 2 * ring_reduce_scatter_s(p, message_bytes, bandwidth_Bps, latency_s)


def recursive_reduce_scatter_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Recursive halving (reduce-scatter) / recursive doubling or Bruck (all-gather).

    ``ceil(log2 p) a + (p-1)/p * S/B`` -- [TRG05] section 4.1 (recursive doubling, Bruck for any
    p) and 4.2 (recursive halving, exact for power-of-two p; for other p we use the same cost,
    a slight underestimate that the ring candidate bounds from above). Needs any-to-any links
    (switch or fully connected), not a ring.
    """
    return log2_steps(p) * latency_s + (p - 1) / p * message_bytes / bandwidth_Bps


def halving_doubling_all_reduce_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Rabenseifner all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather.

    Power-of-two ``p``: ``2 log2(p) a + 2(p-1)/p * S/B`` ([TRG05] section 4.4). Otherwise the
    ``r = p - p'`` extra members (``p'`` the largest power of two below p) first hand their
    buffer to a partner and get the result back at the end: two more steps of ``a + S/B``.
    """
    p2 = 1 << (p.bit_length() - 1)
    core = 2 * recursive_reduce_scatter_s(p2, message_bytes, bandwidth_Bps, latency_s)
    if p2 == p:
        return core
    return core + 2 * point_to_point_s(message_bytes, bandwidth_Bps, latency_s)


def pipelined_chain_s(hops: int, transfer_s: float, latency_s: float) -> float:
    """A message pipelined over ``hops`` sequential stages in ``k`` segments, best ``k >= 1``.

    ``T(k) = (hops - 1 + k) * (a + transfer_s / k)`` where ``transfer_s`` is the time one stage
    needs for the whole message. Minimised over real ``k >= 1``: ``k* = sqrt((hops-1) c / a)``
    and ``T* = (sqrt((hops-1) a) + sqrt(c))^2`` (Pjesivac-Grbovic et al. 2007, segmented chain).
    With no latency the segments shrink to nothing and ``T = c``. A minimum of functions each
    monotone in ``a`` and ``c`` is monotone, so more bandwidth never makes this slower.

    >>> pipelined_chain_s(1, 2.0, 1.0)      # one hop: a + c
    3.0
    >>> pipelined_chain_s(5, 1.0, 0.25)     # (sqrt(4 * 0.25) + sqrt(1))^2
    4.0
    """
    if hops <= 0:
        return 0.0
    fill = (hops - 1) * latency_s
    if fill == 0.0:
        return latency_s + transfer_s if hops == 1 else transfer_s
    k_opt = math.sqrt((hops - 1) * transfer_s / latency_s)
    if k_opt <= 1.0:
        return hops * (latency_s + transfer_s)
    return (math.sqrt(fill) + math.sqrt(transfer_s)) ** 2


def double_binary_tree_all_reduce_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Pipelined double-binary-tree all-reduce ([SST09]; NCCL's "tree" algorithm).

    Two complementary binary trees each carry half the buffer; every member is inner in one tree
    and a leaf in the other, so over the reduction (up) and broadcast (down) each member sends
    and receives ``2 S`` in total. Modelled as a segmented chain of ``2 ceil(log2 p)`` stages
    whose steady state moves ``2 S / B``: asymptotically ``2 ceil(log2 p) a + 2 S/B`` plus the
    pipeline fill. Wins over the ring for small messages and large ``p``.
    """
    if p <= 1:
        return 0.0
    return pipelined_chain_s(2 * log2_steps(p), 2 * message_bytes / bandwidth_Bps, latency_s)


def direct_exchange_s(bytes_per_link: float, bandwidth_Bps: float, latency_s: float) -> float:
    """One step in which every member talks to every other over its own link, all in parallel.

    Fully connected topologies: each of the ``p-1`` links of a member carries ``bytes_per_link``
    at the same time, so the step costs ``a + bytes_per_link / B``. Reduce-scatter and all-gather
    send ``S/p`` per link; all-reduce is two such steps; all-to-all sends ``S/p`` per link.
    """
    return latency_s + bytes_per_link / bandwidth_Bps


def pairwise_all_to_all_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Pairwise-exchange all-to-all over one injection link: ``(p-1) a + (p-1)/p * S/B``.

    [TRG05] section 4.5 (pairwise exchange, long messages). ``S`` is a member's whole local
    buffer, of which ``(p-1)/p`` leaves the member.
    """
    return ring_reduce_scatter_s(p, message_bytes, bandwidth_Bps, latency_s)


def bruck_all_to_all_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Bruck all-to-all: ``ceil(log2 p) a + ceil(log2 p) * S/(2B)`` ([BHKUW97]; [TRG05] 4.5).

    Fewer steps, more bytes: each of the log rounds forwards about half the buffer. Short
    messages only.
    """
    steps = log2_steps(p)
    return steps * latency_s + steps * message_bytes / (2 * bandwidth_Bps)


def ring_all_to_all_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float, bidirectional: bool) -> float:
    """All-to-all on a ring of neighbour links, store-and-forward over the shortest way round.

    Each member sends ``S/p`` to each other member. One way round (``p-1`` steps) a piece for
    the member ``j`` hops ahead crosses ``j`` links, so each link carries
    ``S/p * sum_{j<p} j = (p-1)/2 * S``. Both ways (``floor(p/2)`` steps), pieces take the shorter
    way and each link direction carries ``S * floor(p^2/4) / (2p)`` (``S p / 8`` for even p).
    Time = steps * a + bytes per link direction / B. The link-load argument is the usual
    bisection bound for rings (e.g. [CHPvdG07] section 7).
    """
    if bidirectional and p > 2:
        steps = p // 2
        per_link = message_bytes * (p * p // 4) / (2 * p)
    else:
        steps = p - 1
        per_link = message_bytes * (p - 1) / 2
    return steps * latency_s + per_link / bandwidth_Bps


def binomial_broadcast_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Binomial-tree broadcast: ``ceil(log2 p) (a + S/B)`` ([TRG05] section 4.3, short messages)."""
    return log2_steps(p) * point_to_point_s(message_bytes, bandwidth_Bps, latency_s)


def scatter_allgather_broadcast_s(p: int, message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """Van de Geijn broadcast: binomial scatter + ring all-gather.

    ``(ceil(log2 p) + p - 1) a + 2 (p-1)/p * S/B`` ([TRG05] section 4.3, long messages).
    """
    scatter = recursive_reduce_scatter_s(p, message_bytes, bandwidth_Bps, latency_s)
    return scatter + ring_reduce_scatter_s(p, message_bytes, bandwidth_Bps, latency_s)


def point_to_point_s(message_bytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """One message over one link: ``a + S/B`` (the alpha-beta model itself, [CHPvdG07] 2)."""
    return latency_s + message_bytes / bandwidth_Bps
