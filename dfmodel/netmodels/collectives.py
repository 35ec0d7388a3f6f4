"""Collectives over groups that span one or several network dimensions.

One dimension: the candidates of :mod:`dfmodel.netmodels.topologies`. Several dimensions
(``(("nvlink", 8), ("ib", 4))``), one candidate per composition below; :func:`collective_time`
returns the fastest.

- all_reduce, hierarchical ([TRG05]-style composition; the NCCL/Horovod 2-level scheme):
  reduce-scatter over all but the last dimension of an order, all-reduce over the last, then
  all-gather back in reverse. Each inner reduce-scatter divides the message by its member count,
  so the outer (usually slower) dimensions move less. Every order of the dimensions is a
  candidate (innermost-first is the usual winner); each phase uses its fastest 1-D algorithm.
- reduce_scatter / all_gather: the same per-dimension chain (reduce-scatter with the message
  shrinking as it goes, all-gather with it growing), every order a candidate.
- all_to_all: one all-to-all per dimension in sequence, each on the member's whole buffer
  (dimension-ordered exchange: after the exchange along one dimension every member holds the
  data bound for its own coordinate there).
- broadcast: one broadcast per dimension in sequence (the root's row, then every member of it).
- p2p: one message between consecutive members; a pipeline steps at its slowest boundary, so the
  slowest dimension of the group sets the time.
- flat ring: one ring through all members of the group (a snake through the dimensions), each
  step gated by the slowest dimension's bandwidth (times the directions every dimension allows)
  and latency -- a candidate for all_reduce, reduce_scatter, all_gather and broadcast.
- pipelined: every multi-phase composition above is also a candidate with the message cut into
  chunks that flow through the phases, so phases on *different* dimensions overlap (different
  links) while phases on the same dimension still add up (NCCL's multi-channel rings and trees
  behave like this across NVLink and InfiniBand). Time = the busiest dimension's summed phase
  times + the pipeline fill, estimated as every phase's zero-byte (latency-only) time. Only the
  latency is taken for the fill (many small chunks), and the bottleneck's latency is counted
  twice, which keeps the estimate on the safe side and monotone in every parameter. Not offered
  when a dimension of the group says ``pipelined: false`` (host-staged transfers run in series).

Not modelled: contention with other groups on shared links; multi-port torus algorithms that
run different chunks along different dimensions *in different orders* at the same time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dfmodel.netmodels import formulas as f
from dfmodel.netmodels.group import GroupDim, NetworkGroupError, resolve_group
from dfmodel.netmodels.topologies import COLLECTIVES, PRETTY, dim_candidates, ring_directions
from dfmodel.system.schema import System

# Beyond this many dimensions only innermost-first and outermost-first orders are tried.
_MAX_PERMUTED_DIMS = 4


@dataclass(frozen=True)
class StepCost:
    """One phase of a collective on one dimension (or, for a flat ring, on several joined by +)."""

    collective: str
    dims: str
    members: int
    message_bytes: float
    algorithm: str
    time_s: float

    def describe(self) -> str:
        return f"{self.algorithm} {PRETTY[self.collective]} over {self.dims}"


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective with the algorithm that achieves it.

    ``steps`` are the phases, each timed as if run alone. They run one after another and add up
    to ``time_s``, except when ``algorithm`` starts with ``"pipelined"`` (phases on different
    dimensions overlap, see the module doc); a p2p over several dimensions has one step, its
    slowest hop.
    """

    time_s: float
    algorithm: str
    steps: tuple[StepCost, ...] = ()


def normalize_collective(collective: str) -> str:
    """``"all-reduce"``/``"All_Reduce"`` -> ``"all_reduce"``; unknown names raise NetworkGroupError."""
    key = str(collective).strip().lower().replace("-", "_")
    if key not in COLLECTIVES:
        raise NetworkGroupError(
            f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}",
            field="collective",
        )
    return key


def _check_bytes(message_bytes: float) -> float:
    try:
        s = float(message_bytes)
    except (TypeError, ValueError):
        raise NetworkGroupError(f"message size must be a number of bytes, got {message_bytes!r}",
                                field="message_bytes") from None
    if not s >= 0 or s == float("inf"):
        raise NetworkGroupError(f"message size must be finite and >= 0 bytes, got {message_bytes!r}",
                                field="message_bytes")
    return s


def _step(collective: str, gd: GroupDim, message_bytes: float) -> StepCost:
    """Fastest 1-D algorithm for one phase on one dimension of the group."""
    dim = gd.dim
    options = dim_candidates(dim, collective, gd.members, message_bytes)
    name, t = min(options, key=lambda o: o[1])
    return StepCost(collective, gd.label, gd.members, message_bytes, name, t)


def _cost(steps: Sequence[StepCost]) -> CollectiveCost:
    """Phases one after another."""
    text = ", then ".join(s.describe() for s in steps)
    return CollectiveCost(sum(s.time_s for s in steps), text, tuple(steps))


def _pipelined(steps: Sequence[StepCost], dims: tuple[GroupDim, ...]) -> CollectiveCost:
    """Phases overlapped across dimensions: busiest dimension + latency-only fill (module doc)."""
    busy: dict[str, float] = {}
    for st in steps:
        busy[st.dims] = busy.get(st.dims, 0.0) + st.time_s
    by_label = {gd.label: gd for gd in dims}
    fill = sum(_step(st.collective, by_label[st.dims], 0.0).time_s for st in steps)
    text = "pipelined over dims: " + ", ".join(s.describe() for s in steps)
    return CollectiveCost(max(busy.values()) + fill, text, tuple(steps))


def _both(steps: Sequence[StepCost], dims: tuple[GroupDim, ...]) -> list[CollectiveCost]:
    """Phases in series, and pipelined across dimensions unless a dimension forbids it
    (``NetworkDim.pipelined`` false: host-staged transfers)."""
    if not all(gd.dim.pipelined for gd in dims):
        return [_cost(steps)]
    return [_cost(steps), _pipelined(steps, dims)]


def _orders(dims: tuple[GroupDim, ...]) -> list[tuple[GroupDim, ...]]:
    if len(dims) <= _MAX_PERMUTED_DIMS:
        return list(itertools.permutations(dims))
    return [dims, tuple(reversed(dims))]


def _hierarchical_all_reduce(order: tuple[GroupDim, ...], S: float) -> list[StepCost]:
    """Reduce-scatter inward over ``order[:-1]``, all-reduce over ``order[-1]``, all-gather out."""
    down: list[StepCost] = []
    size = S
    for gd in order[:-1]:
        down.append(_step("reduce_scatter", gd, size))
        size /= gd.members
    top = _step("all_reduce", order[-1], size)
    up: list[StepCost] = []
    for gd in reversed(order[:-1]):
        size *= gd.members
        up.append(_step("all_gather", gd, size))  # all-gather's size is its (full) output
    return [*down, top, *up]


def _chain(collective: str, order: tuple[GroupDim, ...], S: float) -> list[StepCost]:
    """Reduce-scatter (message shrinks) or all-gather (message grows to S) dimension by dimension."""
    steps: list[StepCost] = []
    if collective == "reduce_scatter":
        size = S
        for gd in order:
            steps.append(_step(collective, gd, size))
            size /= gd.members
    else:  # all_gather: the last step produces the full output S
        sizes = []
        size = S
        for gd in reversed(order):
            sizes.append(size)
            size /= gd.members
        for gd, sz in zip(order, reversed(sizes)):
            steps.append(_step(collective, gd, sz))
    return steps


def _flat_ring(collective: str, dims: tuple[GroupDim, ...], S: float) -> CollectiveCost:
    """One ring (or pipelined chain) through every member, at the slowest dimension's pace."""
    p = 1
    for gd in dims:
        p *= gd.members
    bw = min(gd.dim.effective_bandwidth_Bps * ring_directions(gd.dim.topology, gd.members, gd.dim.bidirectional)
             for gd in dims)
    lat = max(gd.dim.latency_s for gd in dims)
    label = "+".join(gd.label for gd in dims)
    slowest = min(dims, key=lambda gd: gd.dim.effective_bandwidth_Bps).dim.name
    if collective != "broadcast" and all(gd.dim.nccl_transport for gd in dims):
        t = _nccl_flat_ring_s(collective, dims, S, bw)
    elif collective == "all_reduce":
        t = f.ring_all_reduce_s(p, S, bw, lat)
    elif collective in ("reduce_scatter", "all_gather"):
        t = f.ring_reduce_scatter_s(p, S, bw, lat)
    else:  # broadcast: pipelined one way round
        min_one_way = min(gd.dim.effective_bandwidth_Bps for gd in dims)
        t = f.pipelined_chain_s(p - 1, S / min_one_way, lat)
    name = "flat pipelined ring" if collective == "broadcast" else "flat ring"
    step = StepCost(collective, label, p, S, name, t)
    return CollectiveCost(t, f"{step.describe()} (paced by {slowest})", (step,))


def _nccl_flat_ring_s(collective: str, dims: tuple[GroupDim, ...], S: float, bw: float) -> float:
    """One NCCL ring through every member (dimensions innermost first), as NCCL's tuning model
    times it (tuning.cc, ring): its base latency once, and per step the latency of the
    transport the step crosses -- of the ``p - 1`` steps of a pass, ``m_k - 1`` cross the
    outermost dimension, ``p / (m_1 ... m_{j-1}) - p / (m_1 ... m_j)`` dimension ``j`` (NCCL's
    ``nInterSteps = nNodes - 1``); an all-reduce makes two passes. The fastest protocol.

    >>> from dfmodel.system.schema import NetworkDim
    >>> nv = NetworkDim(name="nv", topology="switch", size=8, link_bandwidth_Bps=1e11, nccl_protocols=True,
    ...                 nccl_transport="nvlink")
    >>> ib = NetworkDim(name="ib", topology="switch", size=6, link_bandwidth_Bps=1e10, nccl_protocols=True,
    ...                 nccl_transport="net")
    >>> t = _nccl_flat_ring_s("reduce_scatter", (GroupDim(nv, 8), GroupDim(ib, 6)), 0.0, 1e10)
    >>> round(t * 1e6, 6)  # LL: 6.6 base + 42 intra steps at max(0.6, 1.0) + 5 network steps at 2.7
    62.1
    """
    from dfmodel.netmodels import nccl

    p = 1
    for gd in dims:
        p *= gd.members
    crossings, inner = [], 1
    for j, gd in enumerate(dims):
        outer_hops = p // (inner * gd.members)  # hops that roll this digit over: they cross an outer dimension
        crossings.append(gd.members - 1 if j == len(dims) - 1 else p // inner - outer_hops)
        inner *= gd.members
    passes = 2 if collective == "all_reduce" else 1
    multi_node = any(gd.dim.nccl_transport == "net" for gd in dims)
    best = float("inf")
    for i, pr in enumerate(nccl.PROTOCOLS):
        steps_s = sum(n * nccl.step_latency_s(gd.dim.nccl_transport, "ring", i, multi_node=multi_node)
                      for n, gd in zip(crossings, dims))
        best = min(best, nccl.base_latency_s("ring", i) + passes * (
            steps_s + f.ring_reduce_scatter_s(p, S, bw * pr.bandwidth_fraction, 0.0)))
    return best


def algorithms(system: System, collective: str, message_bytes: float, group) -> list[CollectiveCost]:
    """Every candidate algorithm for ``collective`` of ``message_bytes`` over ``group``.

    Message size ``S`` per collective: all_reduce = the buffer each member holds; all_gather =
    the full gathered output; reduce_scatter = the full input each member holds; all_to_all =
    each member's whole local buffer; broadcast = the buffer; p2p = the message.

    A group with one member in total has the single candidate ``none`` costing 0 s.
    """
    collective = normalize_collective(collective)
    S = _check_bytes(message_bytes)
    dims = resolve_group(system, group)
    if not dims:
        return [CollectiveCost(0.0, "none (single member)", ())]
    if len(dims) == 1:
        gd = dims[0]
        options = dim_candidates(gd.dim, collective, gd.members, S)
        out = []
        for name, t in options:
            step = StepCost(collective, gd.label, gd.members, S, name, t)
            out.append(CollectiveCost(t, step.describe(), (step,)))
        return out
    if collective == "p2p":
        steps = [_step("p2p", gd, S) for gd in dims]
        worst = max(steps, key=lambda s: s.time_s)
        labels = "+".join(gd.label for gd in dims)
        return [CollectiveCost(worst.time_s, f"{worst.describe()} (slowest hop of {labels})", (worst,))]
    if collective == "all_to_all":
        return _both([_step(collective, gd, S) for gd in dims], dims)
    if collective == "broadcast":
        return [*_both([_step(collective, gd, S) for gd in dims], dims), _flat_ring(collective, dims, S)]
    out = []
    for order in _orders(dims):
        if collective == "all_reduce":
            out.extend(_both(_hierarchical_all_reduce(order, S), dims))
        else:
            out.extend(_both(_chain(collective, order, S), dims))
    out.append(_flat_ring(collective, dims, S))
    return out


def collective_time(system: System, collective: str, message_bytes: float, group) -> CollectiveCost:
    """Fastest algorithm for ``collective`` of ``message_bytes`` over ``group``.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "x", "topology": "ring", "size": 4, "link_bandwidth_Bps": 1e9}]})
    >>> c = collective_time(s, "all_reduce", 4e9, [("x", 4)])   # 2*3/4 * 4 GB / (2 * 1 GB/s)
    >>> c.time_s, c.algorithm
    (3.0, 'bidirectional ring all-reduce over x')
    """
    return min(algorithms(system, collective, message_bytes, group), key=lambda c: c.time_s)
