"""Forced weight streaming: DRAM re-reads every partition plan of a dataflow phase pays when a
kernel's weights or weight-gradient accumulators exceed the SRAM (a floor, issue 12).

:mod:`dfmodel.intra_chip.cost` (module docstring, "Weight streaming") charges a partition ``S``
that runs at option ``(f, streamed)`` ``(1/f - 1) Q(S)`` bytes beyond its resident traffic, with
``Q(S)`` its weights plus twice the accumulators its kernels produce, and lets it run resident
only when ``f X(S) + F(S) <= SRAM`` and streamed only when ``f X(S) + phi F(S) <= SRAM``
(``X``: row-scaled SRAM at ``f = 1``; ``F``: weights and accumulators it touches; ``phi``:
:data:`~dfmodel.intra_chip.cost.STREAM_BUFFER_FRACTION`). For any set ``S`` holding kernel ``k``:

- ``F(S) >= F_k`` (the weights ``k`` reads, the accumulators it touches);
- ``X(S) >= X_k``: every row-scaled tensor ``k`` touches is internal to ``S`` (its bytes once) or
  crosses it (twice: a double buffer), and one that enters the phase from outside or leaves it
  crosses every ``S`` (twice);
- so when ``F_k > SRAM`` no resident option fits (``f > 0``): ``S`` streams, at a tile fraction
  ``f <= f_k``, the largest power of two with ``f_k X_k + phi F_k <= SRAM`` (tile fractions halve
  from 1: ``cost.tile_fractions``), and re-reads each item ``j`` of ``Q(S)`` (a weight ``k``
  reads, an accumulator ``k`` produces) ``1/f - 1 >= 1/f_k - 1`` times.

Each item is charged once, at the largest ``1/f_k - 1`` over the kernels of the phase that touch
it (0 for a kernel that may run resident): the partition holding that kernel re-reads it at least
so often, so the sum is at most the plan's streaming bytes. (DeepSeek-V3's MoE backward at TP 8,
EP 64 on SN30, micro-batch 12: ``wgrad.fc1``'s 940 MB of accumulators and the 470 MB ``fc1``
weight it reads exceed the 640 MB SRAM; it streams at ``f = 1/4`` and re-reads 4.23 GB, the
floor's charge exactly.)
Built on the *unsharded* phase at one micro-batch, as :mod:`dfmodel.inter_chip.dataflow_floor`
builds its floors: a sharded chip holds at least ``1/tp`` of every byte (``strategies.local_fraction``)
and the row-scaled bytes grow at least ``k``-fold with the micro-batch, so with ``F_k / tp``,
``k X_k / tp`` and ``Q_j / tp`` the fits are relaxed (``f_k`` no smaller) and the charge no larger.
With ``stash_free`` (the on-chip-stash variant) the forward-to-backward tensors count nothing.
tests/test_stream_floor.py checks it against brute force over every plan of small phases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Phase
from dfmodel.intra_chip.cost import STREAM_BUFFER_FRACTION


@dataclass(frozen=True)
class StreamFloor:
    """Per kernel that touches a streamed item: (``F_k``, ``X_k``) bytes at one micro-batch,
    unsharded; per item: (bytes re-read per extra row tile, indices of the kernels touching it)."""

    kernels: tuple[tuple[float, float], ...]
    items: tuple[tuple[float, tuple[int, ...]], ...]
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def extra_bytes(self, micro_batch: int, tp: int, sram_bytes: float) -> float:
        """Least streaming re-reads (bytes per chip) of any plan of the phase at ``micro_batch``
        on a chip of ``sram_bytes`` holding ``1/tp`` of it (module docstring). Memoised: the
        search's pass floors ask it ~300k times on DeepSeek-V3 / sn30."""
        key = (micro_batch, tp, sram_bytes)
        if key not in self._memo:
            factors = [_reread_factor(f / tp, micro_batch * x / tp, sram_bytes) for f, x in self.kernels]
            self._memo[key] = sum(q / tp * max(factors[i] for i in who) for q, who in self.items)
        return self._memo[key]


    def must_stream(self, tp: int, sram_bytes: float) -> bool:
        """Whether some kernel's weights and accumulators alone exceed the SRAM (its partition
        streams them, at whatever tile: the re-reads may still be 0 at ``f = 1``)."""
        return any(f / tp > sram_bytes for f, _ in self.kernels)


def _reread_factor(fixed_bytes: float, scaled_bytes: float, sram_bytes: float) -> float:
    """``1/f_k - 1`` for a kernel no resident option fits (0 when one may, or none fits at all:
    the phase then has no plan, and 0 is still a floor)."""
    free = sram_bytes - STREAM_BUFFER_FRACTION * fixed_bytes
    if fixed_bytes <= sram_bytes or free <= 0:
        return 0.0
    if scaled_bytes <= free:
        return 0.0  # f = 1 fits: no re-read
    f = 2.0 ** math.floor(math.log2(free / scaled_bytes))  # largest power of two that fits
    return 1.0 / f - 1.0


def stream_floor(graph: DataflowGraph, names: set[str], stash_free: bool) -> StreamFloor | None:
    """:class:`StreamFloor` of the kernels ``names`` of ``graph`` (None when none reads a weight
    or produces an accumulator)."""
    kinds = {k.name: k for k in graph.kernels}
    order = [k.name for k in graph.kernels if k.name in names]
    index = {n: i for i, n in enumerate(order)}
    fixed = [0.0] * len(order)
    scaled = [0.0] * len(order)
    items: list[tuple[float, tuple[int, ...]]] = []
    weights: dict[str, tuple[float, list[int]]] = {}
    for n in order:  # weights, one per name at its largest declared size (CostModel.weights)
        k = kinds[n]
        if k.weight_bytes > 0:
            b, who = weights.setdefault(k.weight or f"<{n}>", (0.0, []))
            weights[k.weight or f"<{n}>"] = (max(b, float(k.weight_bytes)), who + [index[n]])
    for b, who in weights.values():
        for i in who:
            fixed[i] += b
        items.append((b, tuple(who)))
    for key, (b, producer, consumers, leaves) in _tensor_groups(graph, names).items():
        p = kinds.get(producer)
        accumulator = producer in names and p.phase == Phase.weight_grad
        stash = p is not None and p.phase == Phase.forward and any(
            kinds[c].phase != Phase.forward for c in consumers if c in kinds)
        crosses = producer not in names or leaves  # enters, or leaves, every set holding its kernel
        if stash_free and stash and crosses:
            continue
        touching = [index[c] for c in consumers if c in names] + ([index[producer]] if producer in names else [])
        for i in set(touching):
            if accumulator:
                fixed[i] += b
            else:
                scaled[i] += (2.0 if crosses else 1.0) * b
        if accumulator:
            items.append((2.0 * b, (index[producer],)))
    if not items:
        return None
    return StreamFloor(tuple(zip(fixed, scaled)), tuple(items))


def _tensor_groups(graph: DataflowGraph, names: set[str]) -> dict:
    """Tensors of the phase grouped by (name, producer) as ``CostModel`` groups them: (largest
    bytes, producer, consumers, whether it leaves the phase: a graph output or a consumer
    outside)."""
    out: dict[tuple, tuple] = {}
    for t in graph.tensors:
        if t.producer not in names and t.consumer not in names:
            continue
        b, p, cs, leaves = out.get((t.name, t.producer), (0.0, t.producer, (), False))
        inside = t.consumer is not None and t.consumer in names
        out[(t.name, t.producer)] = (max(b, float(t.bytes)), p, cs + ((t.consumer,) if inside else ()),
                                     leaves or not inside)
    return out


__all__ = ["StreamFloor", "stream_floor"]
