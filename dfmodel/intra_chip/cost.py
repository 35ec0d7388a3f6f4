"""The cost of one partition (a set of kernels run together on one chip): the single source.

The exact DP, the brute-force oracle, the MILP's coefficients and the reports all read this
module, so they agree to rounding. For a partition ``S`` (DESIGN.md section 4):

- compute: kernel-by-kernel chips run each kernel alone; dataflow chips share their compute
  tiles among the kernels of ``S`` in proportion to work, so the pipeline finishes in
  ``sum_k compute_time_s(k)`` (the continuous optimum of the tile-sharing min-max; needs
  ``|S| <= compute_tiles``). The integer allocation is reported as a diagnostic only;
- memory bytes: tensors entering ``S`` (a producer outside ``S`` or a graph input, read once per
  tensor), tensors leaving ``S`` (a consumer outside ``S`` or a graph output, written once
  per tensor), weights (once per ``Kernel.weight`` name: fused fwd/bwd/wgrad kernels read W once) and
  ``extra_memory_bytes``, plus the re-reads of streamed weights (below); time = ``memory_time_s``;
- network: the given per-kernel network seconds, summed;
- time = ``max(compute, memory, network)`` if the chip overlaps, else their sum, plus overheads:
  ``kernel_overhead_s`` per kernel (kernel-by-kernel) or per partition (dataflow), and for
  dataflow ``tile_overhead_s`` per row tile streamed (see :data:`DEFAULT_TILE_OVERHEAD_S`);
- SRAM (dataflow only) at row-tile fraction ``f``: ``f * bytes`` per internal tensor (FIFO),
  ``2 f * bytes`` per boundary tensor (double buffer), whole resident weights, and whole
  weight-gradient accumulators (outputs of ``weight_grad`` kernels sum over all rows, so they do
  not shrink with the tile);
- weight streaming (dataflow only; see :ref:`below <streaming>`): each partition chooses an
  *option* ``(f, mode)``, mode ``resident`` (as above) or ``streamed``, and takes the fastest
  option that fits SRAM (ties: larger ``f``, then resident);
- DRAM lifetimes: intermediate tensors live in DRAM from the partition of their producer to
  that of their last consumer (unless both are in one partition); live bytes plus all weights
  must fit ``memory.capacity_bytes`` during every partition. Graph inputs and outputs belong
  to the caller (the inter-chip pass counts stashed activations).

Kernel-by-kernel partitions are always single kernels, so the cost of a set there is the sum of
its kernels' stand-alone costs (the closed form).

.. _streaming:

**Weight streaming** (SambaNova streams weight tiles from DDR; Cerebras' weight-streaming mode
keeps activations on the wafer and streams weights layer by layer). Write ``F`` for the
partition's fixed SRAM (its weights and the weight-gradient accumulators it touches, each
counted once), ``X`` for its row-scaled SRAM at ``f = 1`` and ``Q`` for the bytes that streaming
re-reads per extra row tile: its weights plus twice the accumulators its kernels *produce*.

- ``resident``: SRAM ``f X + F``; weights read from DRAM once per micro-batch, accumulators
  summed on chip and written once (the rules above);
- ``streamed``: a weight is cut into :data:`STREAM_CHUNKS` chunks along its reduction dimension
  and SRAM double-buffers them (the chunk in use and the one loading), so SRAM is
  ``f X + phi F`` with ``phi = 2 / STREAM_CHUNKS`` (:data:`STREAM_BUFFER_FRACTION`, 1/16: a
  655 MB weight shard keeps 41 MB on chip). Every row tile is multiplied by every chunk, so
  each of the ``1/f`` row tiles re-reads the weights: weight traffic ``W / f``. An accumulator
  is kept in DRAM and streamed through the same double buffer: each row tile after the first
  reads the partial sum and writes it back, ``2 (1/f - 1) G`` bytes beyond the resident case
  (which writes ``G`` once when it leaves). Together: memory bytes ``+ (1/f - 1) Q``. A
  weight-shaped tensor a partition only *reads* (an accumulator made elsewhere) is not indexed
  by rows, so it is read once, chunk by chunk. At ``f = 1`` streaming costs no traffic and saves
  SRAM (it is activation-stationary execution); with small tiles resident weights save traffic.
  The DRAM-lifetime check does not count a streamed accumulator's DRAM copy within its own
  partition: gradients are charged to DRAM by the inter-chip memory check.

Streaming is on by default for dataflow chips (``weight_streaming=False`` restores the
resident-only model). It never changes kernel-by-kernel chips, which read weights from DRAM in
every kernel anyway.

>>> from dfmodel.graph.kernel import Kernel, KernelKind, Tensor
>>> from dfmodel.graph.graph import DataflowGraph
>>> from dfmodel.system.schema import Chip
>>> chip = Chip(name="c", peak_flops=1e12, sram_bytes=2**20, compute_tiles=4,
...             memory={"kind": "DDR", "capacity_bytes": 2**30, "bandwidth_Bps": 1e9},
...             execution="dataflow")
>>> a = Kernel("a", KernelKind.matmul, {"m": 64, "n": 64, "k": 64}, flop=1e6, output_bytes=8192)
>>> b = Kernel("b", KernelKind.matmul, {"m": 64, "n": 64, "k": 64}, flop=1e6, output_bytes=8192)
>>> g = DataflowGraph([a, b], [Tensor("x", None, "a", 8192), Tensor("y", "a", "b", 8192),
...                            Tensor("z", "b", None, 8192)])
>>> cm = CostModel(g, chip)
>>> fused = cm.report_sets([{"a", "b"}])[0]
>>> round(fused["memory_bytes"]), round(fused["compute_s"] * 1e6, 3)   # y stays on chip
(16384, 2.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Phase
from dfmodel.intra_chip.packed import MAX_KERNELS, ChunkSum, Items, all_bits, any_bits, exact_integer_sum, pack_rows
from dfmodel.system.processor import compute_time_s, fused_compute_time_s, memory_time_s, tile_allocation
from dfmodel.system.schema import Chip, System

#: Cost of streaming one more row tile through a dataflow partition: the per-tile handshake and
#: pipeline fill/drain of a tile through the on-chip network, about a thousand cycles at ~1 GHz.
#: Smaller tiles save SRAM (FIFOs and double buffers shrink with the tile) but pay this once per
#: tile, so a partition takes the largest tile that fits. Override with ``tile_overhead_s``.
DEFAULT_TILE_OVERHEAD_S = 1e-6
#: Smallest row tile considered (rows of a systolic/PCU pass); tiles halve down to it.
MIN_TILE_ROWS = 128
#: Tile fractions when the graph does not say how many rows it streams.
DEFAULT_TILE_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: A streamed weight (or weight-gradient accumulator) is cut into this many chunks along its
#: reduction dimension; SRAM double-buffers one chunk, see the module docstring.
STREAM_CHUNKS = 32
#: SRAM a streamed weight or accumulator keeps on chip, as a fraction of its bytes (two chunks).
STREAM_BUFFER_FRACTION = 2.0 / STREAM_CHUNKS
#: sets per :meth:`CostModel.terms_of` call from which the chunk tables pay for a single call
#: (building them costs ~4 ms on a 43-kernel MoE backward, the tensor-by-tensor sums ~0.3 us a
#: set; the floor-pruned DP, which reuses them over millions of sets, builds them anyway)
PACKED_MIN_ROWS = 8192
#: Graph ``meta`` keys that give the rows a layer streams (first found wins; multiplied by
#: ``micro_batch``/``batch`` when present and the key counts per-sample rows).
_ROW_KEYS = ("tile_rows", "tokens", "seq_len", "seq", "sequence_length")


def tile_fractions(graph: DataflowGraph) -> tuple[float, ...]:
    """Row-tile fractions ``1, 1/2, 1/4, ...`` down to :data:`MIN_TILE_ROWS` rows.

    >>> from dfmodel.graph.graph import DataflowGraph
    >>> tile_fractions(DataflowGraph([], [], meta={"seq_len": 1024}))
    (1.0, 0.5, 0.25, 0.125)
    """
    meta = graph.meta or {}
    rows = None
    for key in _ROW_KEYS:
        if isinstance(meta.get(key), (int, float)) and meta[key] > 0:
            rows = float(meta[key])
            if key not in ("tile_rows", "tokens"):
                rows *= float(meta.get("micro_batch", meta.get("batch", 1)) or 1)
            break
    if rows is None:
        return DEFAULT_TILE_FRACTIONS
    out, f = [], 1.0
    while True:
        out.append(f)
        if rows * f / 2 < MIN_TILE_ROWS or len(out) >= 12:
            return tuple(out)
        f /= 2


def combine_times(compute, memory, network, overlap: bool):
    """Time of work whose compute, memory and network parts overlap (max) or not (sum)."""
    if overlap:
        return np.maximum(np.maximum(compute, memory), network)
    return compute + memory + network


def tensor_boundary(S: np.ndarray, t: "TensorUse", none: np.ndarray) -> tuple[np.ndarray, ...]:
    """(enters, leaves, internal, touched) of tensor ``t`` for each kernel set (a row of the
    boolean matrix ``S``): it enters a partition that holds a consumer but not its producer,
    leaves one that holds its producer while a consumer (or the graph's output) is outside,
    stays internal where producer and a consumer are both inside, and is touched where either
    is. ``none``: all-False, one per set. Entering and leaving exclude each other (the producer
    is outside, or inside)."""
    prod_in = S[:, t.producer] if t.producer >= 0 else none
    any_c, all_c = none, ~none
    for c in t.consumers:
        any_c = any_c | S[:, c]
        all_c = all_c & S[:, c]
    return any_c & ~prod_in, prod_in & (t.is_output | ~all_c), prod_in & any_c, prod_in | any_c


@dataclass(frozen=True)
class TensorUse:
    """One tensor name as a partition sees it (all edges of the name together)."""

    name: str
    bytes: float
    producer: int  # kernel index, -1 for a graph input
    consumers: tuple[int, ...]  # kernel indices reading it
    is_output: bool  # also a graph output (written to DRAM whatever the partition)
    row_scaled: bool  # SRAM share shrinks with the row tile (False: weight-gradient accumulators)


@dataclass(frozen=True)
class WeightUse:
    """One weight (``Kernel.weight`` name, or the kernel's own name) and its readers."""

    key: str
    bytes: float
    kernels: tuple[int, ...]


class CostModel:
    """Per-kernel and per-tensor data of one graph on one chip, and the partition cost.

    ``network_s`` maps kernel names to network seconds from the inter-chip pass (missing = 0).
    ``weight_streaming`` lets dataflow partitions stream their weights (module docstring);
    ``stream_buffer_fraction`` overrides :data:`STREAM_BUFFER_FRACTION`. Kernels are indexed in ``graph.topological_names()`` order; partition sets are boolean
    matrices ``S[m, n]`` (one row per candidate partition) so thousands are costed at once.
    """

    def __init__(
        self,
        graph: DataflowGraph,
        chip: Chip | System,
        network_s: Mapping[str, float] | None = None,
        *,
        tile_fractions_: Iterable[float] | None = None,
        tile_overhead_s: float | None = None,
        weight_streaming: bool = True,
        stream_buffer_fraction: float | None = None,
    ):
        if isinstance(chip, System):
            chip = chip.chip
        self.graph, self.chip = graph, chip
        self.names: list[str] = graph.topological_names()
        self.index = {k: i for i, k in enumerate(self.names)}
        n = self.n = len(self.names)
        network_s = dict(network_s or {})
        unknown = set(network_s) - set(self.index)
        if unknown:
            raise ValueError(f"network times for unknown kernels: {sorted(unknown)[:5]}")
        self.precision = graph.meta.get("precision", "bf16")
        self.dataflow = chip.execution == "dataflow"
        self.overlap = chip.overlap
        self.tiles = chip.compute_tiles
        self.sram_bytes = float(chip.sram_bytes)
        self.dram_bytes = float(chip.memory.capacity_bytes)
        self.kernel_overhead_s = float(chip.efficiency.kernel_overhead_s)
        self.tile_overhead_s = DEFAULT_TILE_OVERHEAD_S if tile_overhead_s is None else float(tile_overhead_s)
        self.fractions = tuple(sorted({float(f) for f in (tile_fractions_ or tile_fractions(graph))}, reverse=True))
        if not self.fractions or not all(0 < f <= 1 for f in self.fractions):
            raise ValueError(f"tile fractions must lie in (0, 1], got {self.fractions}")
        self.streaming = bool(weight_streaming) and self.dataflow
        self.phi = STREAM_BUFFER_FRACTION if stream_buffer_fraction is None else float(stream_buffer_fraction)
        if not 0 < self.phi <= 1:
            raise ValueError(f"stream_buffer_fraction must lie in (0, 1], got {self.phi}")
        #: the options a dataflow partition chooses from: (tile fraction, streamed), preferred first
        self.options: tuple[tuple[float, bool], ...] = tuple(
            (f, s) for f in self.fractions for s in ((False, True) if self.streaming else (False,))
        )
        self._option_tile = np.array([self.fractions.index(f) for f, _ in self.options], dtype=int)
        self._option_streamed = np.array([s for _, s in self.options], dtype=bool)
        #: seconds per byte of DRAM traffic (memory_time_s is linear in bytes)
        self.s_per_byte = memory_time_s(chip, 1.0)

        kernels = [graph.kernel(k) for k in self.names]
        self.kernels = kernels
        self.compute_s = np.array([compute_time_s(chip, k, self.precision) for k in kernels], dtype=float)
        self.network_s = np.array([float(network_s.get(k, 0.0)) for k in self.names], dtype=float)
        self.extra_bytes = np.array([k.extra_memory_bytes for k in kernels], dtype=float)

        # tensors grouped by (name, producer): the edges of one tensor read by several kernels.
        # The producer is part of the identity because a graph may reuse a name on both sides
        # of a communication kernel.
        groups: dict[tuple[str, str | None], dict] = {}
        for t in graph.tensors:
            g = groups.setdefault((t.name, t.producer), {"bytes": 0.0, "consumers": [], "out": False})
            g["bytes"] = max(g["bytes"], float(t.bytes))
            if t.consumer is None:
                g["out"] = True
            elif self.index[t.consumer] not in g["consumers"]:
                g["consumers"].append(self.index[t.consumer])
        self.tensors: list[TensorUse] = []
        for (name, producer), g in groups.items():
            p = -1 if producer is None else self.index[producer]
            scaled = p < 0 or kernels[p].phase != Phase.weight_grad
            self.tensors.append(TensorUse(name, g["bytes"], p, tuple(sorted(g["consumers"])), g["out"], scaled))

        wk: dict[str, list[int]] = {}
        wb: dict[str, float] = {}
        for i, k in enumerate(kernels):
            if k.weight_bytes > 0:
                key = k.weight or f"<{k.name}>"
                wk.setdefault(key, []).append(i)
                # a weight's size is a property of the weight: the largest any reader declares
                wb[key] = max(wb.get(key, 0.0), float(k.weight_bytes))
        self.weights = [WeightUse(key, wb[key], tuple(ks)) for key, ks in wk.items()]
        self.all_weight_bytes = float(sum(w.bytes for w in self.weights))
        #: bytes of weight-gradient accumulators each kernel produces (streamed: re-read and
        #: re-written per extra row tile)
        self.accumulator_bytes = np.zeros(n)
        for t in self.tensors:
            if not t.row_scaled:
                self.accumulator_bytes[t.producer] += t.bytes

        preds = [0] * n
        for t in self.tensors:
            for c in t.consumers:
                if t.producer >= 0:
                    preds[c] |= 1 << t.producer
        self.pred_mask = preds  # python-int bitmasks over kernel indices
        succ = [set() for _ in range(n)]
        for t in self.tensors:
            if t.producer >= 0:
                succ[t.producer].update(t.consumers)
        self.successors = [sorted(s) for s in succ]
        self.sinks = [i for i in range(n) if not succ[i]]

        # DRAM lifetimes can only bind if everything parked at once would not fit
        inter = sum(t.bytes for t in self.tensors if t.producer >= 0 and t.consumers)
        self.dram_check = inter + self.all_weight_bytes > self.dram_bytes
        self._singleton_s = None
        self._terms_memo: dict[tuple, dict[str, np.ndarray]] = {}

    def __getstate__(self) -> dict:
        """Pickles without the chunk tables (:mod:`.packed`): they hold closures, and are rebuilt
        on demand."""
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, ChunkSum)}

    # -- per-kernel closed form -----------------------------------------------------------------
    def singleton_time_s(self) -> np.ndarray:
        """Stand-alone time of every kernel (its own partition, kernel-by-kernel semantics)."""
        if self._singleton_s is None:
            ev = self._terms(np.eye(self.n, dtype=bool))
            over = self.kernel_overhead_s
            self._singleton_s = combine_times(ev["compute_s"], ev["memory_s"], ev["network_s"], self.overlap) + over
        return self._singleton_s

    # -- vectorised partition terms ---------------------------------------------------------------
    def _terms(self, S: np.ndarray) -> dict[str, np.ndarray]:
        """Raw per-set quantities (no feasibility): compute/memory/network, SRAM parts.

        Small matrices (plans, the singletons) are memoised: costing one plan asks for the same
        sets up to three times (its time, the per-kernel closed form, its report). The arrays
        returned are shared, never modified in place; the dict is a fresh copy."""
        S = np.asfortranarray(S, dtype=bool)  # column access below is then contiguous
        if S.shape[0] > 4 * self.n + 8:
            return self.terms_of(S)
        key = (S.shape, np.packbits(S, axis=None).tobytes())
        hit = self._terms_memo.get(key)
        if hit is None:
            hit = self._terms_memo[key] = self.terms_of(S)
        return dict(hit)

    def terms_of(self, S: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`_terms` of the set rows ``S`` computed afresh (no memo): what the floors of
        :mod:`dfmodel.inter_chip.fused_floor` read for a lattice's ~10^5 sets. Many rows go
        through the chunk tables of :meth:`terms_of_codes` (the same values, to the bit)."""
        if S.shape[0] >= PACKED_MIN_ROWS and self.packed_terms is not None:
            return self.terms_of_codes(pack_rows(S), S)
        return self.terms_by_tensor(S)

    def terms_of_codes(self, codes: np.ndarray, S: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`terms_of` of the sets ``codes`` (uint64 masks, :mod:`.packed`), ``S`` the same
        sets as boolean rows. Byte terms by :attr:`packed_terms`' chunk tables (exact: integer
        bytes, see :mod:`.packed`); compute and network seconds, floats whose sum depends on its
        order, by the same einsum over ``S`` as :meth:`terms_by_tensor`."""
        mem, stream, scaled, fixed, touched = self.packed_terms(codes)
        return {
            "count": np.bitwise_count(codes).astype(np.intp),  # (S.sum(axis=1))
            "compute_s": np.einsum("ij,j->i", S, self.compute_s),
            "network_s": np.einsum("ij,j->i", S, self.network_s),
            "memory_bytes": mem,
            "memory_s": mem * self.s_per_byte,
            "sram_scaled": scaled,
            "sram_fixed": fixed,
            "sram_touched": touched,
            "stream_bytes": stream,
        }

    @property
    def packed_terms(self) -> ChunkSum | None:
        """Chunk tables of the byte terms (columns memory, stream, sram_scaled, sram_fixed,
        sram_touched) over 64-bit set masks; None past 64 kernels or when some byte count is
        not an integer (then only the tensor-by-tensor sums are exact as they stand)."""
        if "_packed_terms" not in self.__dict__:
            ok = self.n <= MAX_KERNELS and self.exact_bytes
            self.__dict__["_packed_terms"] = ChunkSum(self.n, *self.byte_items()) if ok else None
        return self.__dict__["_packed_terms"]

    @property
    def _tensor_ends(self) -> list[list[int]]:
        """Per tensor, the kernels it joins: its producer (none for a graph input), its consumers."""
        if "_ends" not in self.__dict__:
            self.__dict__["_ends"] = [([t.producer] if t.producer >= 0 else []) + list(t.consumers) for t in self.tensors]
        return self.__dict__["_ends"]

    @property
    def exact_bytes(self) -> bool:
        """Whether every byte count is an integer and all of them (each counted up to 4 times: a
        crossing tensor's double buffer, the streamed accumulators) add up below 2**53: then
        every sum of byte terms is exact, whatever the order of its additions."""
        if "_exact_bytes" not in self.__dict__:
            values = ([t.bytes for t in self.tensors] + [w.bytes for w in self.weights]
                      + list(self.extra_bytes) + list(self.accumulator_bytes))
            self.__dict__["_exact_bytes"] = exact_integer_sum(values, multiplier=4.0)
        return self.__dict__["_exact_bytes"]

    def byte_items(self) -> Items:
        """(masks, evaluate) of the items the byte terms of :attr:`packed_terms` sum over."""
        return self._byte_item_masks(), self._byte_item_terms

    def seconds_items(self) -> Items:
        """(masks, evaluate) of the per-kernel compute and network seconds (2 columns): their
        chunk-table sums add in another order than :meth:`terms_of`'s, so they are not exact."""
        def evaluate(codes: np.ndarray, which: list[int]) -> np.ndarray:
            out = np.zeros((codes.size, 2))
            for k in which:
                out[any_bits(codes, 1 << k)] += (self.compute_s[k], self.network_s[k])
            return out
        return [1 << k for k in range(self.n)], evaluate

    def _byte_items(self) -> list:
        """The items the byte terms sum over: kernels (extra and accumulator bytes), weights, tensors."""
        return [("kernel", k) for k in range(self.n)] + [("weight", w) for w in self.weights] + \
            [("tensor", t) for t in self.tensors]

    def _byte_item_masks(self) -> list[int]:
        masks = []
        for kind, item in self._byte_items():
            if kind == "kernel":
                masks.append(1 << item)
            elif kind == "weight":
                masks.append(sum(1 << k for k in item.kernels))
            else:
                masks.append(sum(1 << k for k in set(item.consumers) | ({item.producer} - {-1})))
        return masks

    def _byte_item_terms(self, codes: np.ndarray, which: list[int]) -> np.ndarray:
        """Byte terms ``(len(codes), 5)`` of the items ``which`` of :meth:`_byte_items`: the rules
        of :meth:`terms_by_tensor`, on set masks."""
        items = self._byte_items()
        out = np.zeros((codes.size, 5))
        none = np.zeros(codes.size, dtype=bool)
        for i in which:
            kind, item = items[i]
            if kind == "kernel":
                inside = any_bits(codes, 1 << item)
                out[:, 0] += self.extra_bytes[item] * inside
                out[:, 1] += 2.0 * self.accumulator_bytes[item] * inside
            elif kind == "weight":
                used = any_bits(codes, sum(1 << k for k in item.kernels))
                out[:, [0, 1, 3]] += (item.bytes * used)[:, None]
            else:
                t, c_mask = item, sum(1 << c for c in item.consumers)
                prod_in = any_bits(codes, 1 << t.producer) if t.producer >= 0 else none
                any_c = any_bits(codes, c_mask) if c_mask else none
                all_c = all_bits(codes, c_mask)
                crossing = (any_c & ~prod_in) | (prod_in & (t.is_output | ~all_c))
                out[:, 0] += t.bytes * crossing
                if t.row_scaled:
                    out[:, 2] += t.bytes * (prod_in & any_c) + 2.0 * t.bytes * crossing
                    out[:, 4] += t.bytes * (prod_in | any_c)
                else:
                    out[:, 3] += t.bytes * (prod_in | any_c)
        return out

    def terms_by_tensor(self, S: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`terms_of` tensor by tensor: the reference the chunk tables must equal."""
        m = S.shape[0]
        def per_kernel(values):  # S @ values; einsum avoids BLAS threads, ~10x faster on these shapes, and
            return np.einsum("ij,j->i", S, values)  # reads the booleans as they are (no float copy of S)

        none = np.zeros(m, dtype=bool)
        # out[target] += value * where, gathered as integer counts per (target, value) and
        # multiplied once: a layer's tensors share a few byte sizes (22 for DeepSeek-V3's MoE
        # backward's 64 tensors), and a uint16 count costs a quarter of a float multiply-add
        counts: dict[tuple[str, float], np.ndarray] = {}

        def add(target: str, value: float, where: np.ndarray) -> None:
            c = counts.get((target, value))
            if c is None:
                counts[(target, value)] = where.astype(np.uint16)
            else:
                c += where

        # items no set touches add zeros; with exact bytes, leaving them out (and so perhaps
        # changing the order of the sums below) changes no bit (the heavy groups' sets touch a
        # few kernels of the graph)
        support = S.any(axis=0) if self.exact_bytes else np.ones(self.n, dtype=bool)
        for t, ends in zip(self.tensors, self._tensor_ends):
            if not support[ends].any():
                continue
            enters, leaves, internal, touched_by = tensor_boundary(S, t, none)
            crossing = enters | leaves  # exclusive: enter needs the producer outside, leave inside
            add("memory_bytes", t.bytes, crossing)
            if t.row_scaled:  # (SRAM at tile fraction 1 that shrinks with the tile; touched: <= it, monotone)
                add("sram_scaled", t.bytes, internal)
                add("sram_scaled", 2.0 * t.bytes, crossing)
                add("sram_touched", t.bytes, touched_by)
            else:  # (SRAM that does not shrink: weights, weight-gradient accumulators)
                add("sram_fixed", t.bytes, touched_by)
        for w in self.weights:
            if not support[list(w.kernels)].any():
                continue
            used = none
            for k in w.kernels:
                used = used | S[:, k]
            add("memory_bytes", w.bytes, used)
            add("sram_fixed", w.bytes, used)
            add("stream_bytes", w.bytes, used)
        out = {"memory_bytes": per_kernel(self.extra_bytes),
               "stream_bytes": 2.0 * per_kernel(self.accumulator_bytes),  # Q: re-read per extra streamed row tile
               "sram_scaled": np.zeros(m), "sram_fixed": np.zeros(m), "sram_touched": np.zeros(m)}
        for (target, value), c in counts.items():
            out[target] += value * c
        mem = out["memory_bytes"]
        return {
            "count": S.sum(axis=1),
            "compute_s": per_kernel(self.compute_s),
            "network_s": per_kernel(self.network_s),
            "memory_bytes": mem,
            "memory_s": mem * self.s_per_byte,
            "sram_scaled": out["sram_scaled"],
            "sram_fixed": out["sram_fixed"],
            "sram_touched": out["sram_touched"],
            "stream_bytes": out["stream_bytes"],
        }

    def live_bytes(self, I: np.ndarray, J: np.ndarray) -> np.ndarray:
        """DRAM bytes of intermediate tensors live while partition ``J - I`` runs after ideal ``I``.

        A tensor u->v is live iff u has run (``u in J``), some consumer v has not finished
        (``v not in I``), and not both u and v are in the partition (then it stays on chip).
        """
        I, J = np.asarray(I, dtype=bool), np.asarray(J, dtype=bool)
        S = J & ~I
        out = np.zeros(I.shape[0])
        for t in self.tensors:
            if t.producer < 0 or not t.consumers:
                continue
            u = t.producer
            live = np.zeros(I.shape[0], dtype=bool)
            for v in t.consumers:
                live |= J[:, u] & ~I[:, v] & ~(S[:, u] & S[:, v])
            out += t.bytes * live
        return out

    def dram_fits(self, live_bytes: np.ndarray) -> np.ndarray:
        """Whether tensors live in DRAM during a partition fit beside all the weights."""
        return live_bytes + self.all_weight_bytes <= self.dram_bytes

    def resident_weight_bytes(self, S: np.ndarray) -> np.ndarray:
        """Weights (deduplicated) of each set: a lower bound on its SRAM, monotone in the set."""
        S = np.asfortranarray(S, dtype=bool)
        out = np.zeros(S.shape[0])
        for w in self.weights:
            out[S[:, list(w.kernels)].any(axis=1)] += w.bytes
        return out

    def min_sram_bytes(self, S: np.ndarray) -> np.ndarray:
        """A lower bound on the SRAM each set needs at any option: ``f_min T + c F`` with ``T``
        the row-scaled bytes it touches (each internal or crossing tensor takes at least
        ``f * bytes``), ``F`` its weights and accumulators and ``c`` = ``phi`` when streaming is
        allowed, else 1. Monotone (a superset needs more) and subadditive over a chain of
        ideals: ``lb(J) - lb(I) <= lb(J - I)`` for ``I`` inside ``J`` (both ``T`` and ``F`` sum
        over the items a set touches)."""
        ev = self._terms(S)
        c = self.phi if self.streaming else 1.0
        return self.fractions[-1] * ev["sram_touched"] + c * ev["sram_fixed"]

    def must_split(self, S: np.ndarray) -> np.ndarray:
        """Sets that no partition can contain (so any superset is no partition either)."""
        S = np.asarray(S, dtype=bool)
        if not self.dataflow:
            return S.sum(axis=1) > 1
        return (S.sum(axis=1) > self.tiles) | (self.min_sram_bytes(S) > self.sram_bytes)

    # -- merging adjacent partitions --------------------------------------------------------------
    @property
    def merging_never_hurts(self) -> bool:
        """Whether two consecutive partitions whose union fits may always be merged at no loss.

        "Fits" means fits with resident weights at the smallest tile (what
        :meth:`additive_sram_bytes` bounds). The union's compute and network are the sums, its
        DRAM traffic with resident weights at most the sum (tensors between the two stay on chip,
        shared weights are read once, and the parts' own streamed re-reads only add to their
        cost), and one kernel overhead ``ko`` is saved; its tile may be smaller, costing at most
        ``tau / f_min - 2 tau`` more tile overhead. So merging never hurts when ``ko >= tau / f_min - 2 tau`` and DRAM
        lifetimes cannot bind (a merged partition can hold both parts' live tensors at once).
        Then some optimal plan has no two adjacent partitions whose union fits.
        """
        if not self.dataflow or self.dram_check:
            return False
        tau = self.tile_overhead_s
        return self.kernel_overhead_s >= tau / self.fractions[-1] - 2 * tau

    def additive_sram_bytes(self) -> np.ndarray:
        """Per-kernel SRAM charges whose sum over a set bounds the set's SRAM at the smallest tile
        with resident weights from above: each kernel is charged every tensor and weight it
        touches, in full."""
        fmin = self.fractions[-1]
        u = np.zeros(self.n)
        for t in self.tensors:
            if t.row_scaled:
                share = (2 if len(t.consumers) == 1 and not t.is_output else 3) * fmin * t.bytes
            else:
                share = t.bytes
            for k in ([t.producer] if t.producer >= 0 else []) + list(t.consumers):
                u[k] += share
        for w in self.weights:
            for k in w.kernels:
                u[k] += w.bytes
        return u

    def max_useful_partitions(self) -> int | None:
        """Partitions an optimal plan needs at most, when :attr:`merging_never_hurts`.

        Every two consecutive partitions of a plan that cannot be merged either need more SRAM
        than the chip has at the smallest tile (so their additive charges exceed it) or more
        tiles: ``U(p) + U(p+1) > SRAM`` or ``|p| + |p+1| > tiles``. Summing over the ``m - 1``
        consecutive pairs: ``m - 1 < 2 (U(all) / SRAM + n / tiles)``.
        """
        if not self.merging_never_hurts:
            return None
        ratio = 2.0 * (float(self.additive_sram_bytes().sum()) / self.sram_bytes + self.n / self.tiles)
        return max(1, min(self.n, int(math.floor(ratio)) + 1))

    def merge_adjacent(self, plan: list[list[str]]) -> list[list[str]]:
        """Merge consecutive partitions while the union fits and the objective does not grow."""
        plan = [list(p) for p in plan]
        changed = True
        while changed and len(plan) > 1:
            changed = False
            for i in range(len(plan) - 1):
                merged = plan[:i] + [plan[i] + plan[i + 1]] + plan[i + 2 :]
                if self.plan_time_s(merged) <= self.plan_time_s(plan) * (1 + 1e-12):  # ties merge
                    plan, changed = merged, True
                    break
        order = {k: i for i, k in enumerate(self.names)}
        return [sorted(p, key=order.__getitem__) for p in plan]

    def evaluate(self, S: np.ndarray, I: np.ndarray | None = None, terms: dict | None = None) -> dict[str, np.ndarray]:
        """Cost of each candidate partition (rows of ``S``), run after ideal ``I`` (rows).

        Returns the terms of :meth:`_terms` plus ``feasible``, the chosen option -- the fastest
        of :attr:`options` that fits SRAM: ``tile`` (index into ``fractions``, -1 if none) and
        ``streamed`` -- ``sram_bytes`` at it, ``time_s`` (NaN where infeasible) and, when ``I``
        is given and DRAM could bind, ``live_bytes``; ``memory_bytes``/``memory_s`` include the
        streamed re-reads (``stream_extra_bytes``). Kernel-by-kernel chips cost a set as the sum
        of its kernels alone. ``terms``: ``self._terms(S)`` when the caller has it already.
        """
        S = np.asarray(S, dtype=bool)
        m = S.shape[0]
        ev = self._terms(S) if terms is None else dict(terms)
        feasible = ev["count"] >= 1
        streamed = np.zeros(m, dtype=bool)
        extra = np.zeros(m)
        if self.dataflow:
            feasible &= ev["count"] <= self.tiles
            times, fits, needs = self.option_table(ev)
            masked = np.where(fits, times, np.inf)
            o = np.argmin(masked, axis=1)  # first minimum: larger tile, then resident
            rows = np.arange(m)
            ok = fits[rows, o]
            feasible &= ok
            tile = np.where(ok, self._option_tile[o], -1)
            streamed = ok & self._option_streamed[o]
            sram = np.where(ok, needs[rows, o], np.nan)
            time = times[rows, o]
            frac = np.asarray(self.fractions)[np.maximum(tile, 0)]
            extra = np.where(streamed, (1.0 / frac - 1.0) * ev["stream_bytes"], 0.0)
            ev["memory_bytes"] = ev["memory_bytes"] + extra
            ev["memory_s"] = ev["memory_bytes"] * self.s_per_byte
        else:
            tile = np.zeros(m, dtype=int)
            sram = np.zeros(m)
            time = S.astype(float) @ self.singleton_time_s()
        if I is not None and self.dram_check:
            I = np.asarray(I, dtype=bool)
            live = self.live_bytes(I, I | S)
            ev["live_bytes"] = live
            feasible &= self.dram_fits(live)
        ev.update(feasible=feasible, tile=tile, streamed=streamed, stream_extra_bytes=extra, sram_bytes=sram,
                  time_s=np.where(feasible, time, np.nan))
        return ev

    def option_table(self, ev: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(time_s, fits, sram_bytes)``, each ``(sets, len(options))``: every option of every
        set of ``ev`` (from :meth:`_terms`; dataflow). Time includes the partition overheads.

        Option ``(f, resident)``: SRAM ``f X + F``, time ``combine(c, m, n) + ko + tau / f``;
        ``(f, streamed)``: SRAM ``f X + phi F``, memory ``m + (1/f - 1) Q``.
        """
        m = ev["count"].shape[0]
        O = len(self.options)
        times, fits, needs = np.empty((m, O)), np.empty((m, O), dtype=bool), np.empty((m, O))
        base = combine_times(ev["compute_s"], ev["memory_s"], ev["network_s"], self.overlap)
        for i, (f, s) in enumerate(self.options):
            need = f * ev["sram_scaled"] + (self.phi if s else 1.0) * ev["sram_fixed"]
            if s:
                mem_s = (ev["memory_bytes"] + (1.0 / f - 1.0) * ev["stream_bytes"]) * self.s_per_byte
                t = combine_times(ev["compute_s"], mem_s, ev["network_s"], self.overlap)
            else:
                t = base
            times[:, i] = t + self.kernel_overhead_s + self.tile_overhead_s / f
            fits[:, i] = need <= self.sram_bytes
            needs[:, i] = need
        return times, fits, needs

    # -- sets, plans and reports ----------------------------------------------------------------
    def mask(self, kernels: Iterable[str] | Iterable[int]) -> np.ndarray:
        row = np.zeros(self.n, dtype=bool)
        for k in kernels:
            row[self.index[k] if isinstance(k, str) else k] = True
        return row

    def plan_matrices(self, plan: list[Iterable]) -> tuple[np.ndarray, np.ndarray]:
        """``(S, I)``: partition rows and the ideal run before each, for a partition sequence."""
        S = np.array([self.mask(p) for p in plan], dtype=bool).reshape(len(plan), self.n)
        I = np.zeros_like(S)
        if len(plan) > 1:
            I[1:] = np.cumsum(S, axis=0)[:-1] > 0
        return S, I

    def check_plan(self, plan: list[Iterable]) -> str | None:
        """None if ``plan`` is a valid partition sequence (cover, precedence), else why not."""
        S, I = self.plan_matrices(plan)
        counts = S.sum(axis=0)
        if np.any(counts != 1):
            bad = self.names[int(np.flatnonzero(counts != 1)[0])]
            return f"kernel {bad!r} appears {int(counts[self.index[bad]])} times"
        J = I | S
        for r in range(S.shape[0]):
            for k in np.flatnonzero(S[r]):
                if self.pred_mask[k] & ~_to_int(J[r]):
                    return f"kernel {self.names[k]!r} runs before one of its producers"
        return None

    def plan_time_s(self, plan: list[Iterable]) -> float:
        """Objective of a partition sequence: the sum of its partition times (inf if infeasible)."""
        S, I = self.plan_matrices(plan)
        ev = self.evaluate(S, I)
        return float(np.sum(ev["time_s"])) if ev["feasible"].all() else math.inf

    def report_sets(self, plan: list[Iterable]) -> list[dict]:
        """Per-partition breakdown of a sequence (SI units), including the integer tile split."""
        S, I = self.plan_matrices(plan)
        ev = self.evaluate(S, I)
        live = ev.get("live_bytes", self.live_bytes(I, I | S))
        out = []
        for r in range(S.shape[0]):
            idx = [int(i) for i in np.flatnonzero(S[r])]
            times = [float(self.compute_s[i]) for i in idx]
            row = {
                "kernels": [self.names[i] for i in idx],
                "compute_s": float(ev["compute_s"][r]),
                "memory_s": float(ev["memory_s"][r]),
                "network_s": float(ev["network_s"][r]),
                "memory_bytes": float(ev["memory_bytes"][r]),
                "time_s": float(ev["time_s"][r]),
                "feasible": bool(ev["feasible"][r]),
                "dram_live_bytes": float(live[r]),
            }
            if self.dataflow:
                alloc = tile_allocation(times, self.tiles)
                integer = fused_compute_time_s(times, self.tiles)
                row.update(
                    sram_bytes=float(ev["sram_bytes"][r]),
                    tile_fraction=self.fractions[int(ev["tile"][r])] if ev["tile"][r] >= 0 else None,
                    weights_streamed=bool(ev["streamed"][r]),
                    stream_extra_bytes=float(ev["stream_extra_bytes"][r]),
                    tiles_per_kernel=dict(zip(row["kernels"], alloc)) if alloc else {},
                    integer_tile_compute_s=integer,
                )
            else:
                row.update(sram_bytes=0.0, tile_fraction=None, tiles_per_kernel={}, integer_tile_compute_s=None,
                           weights_streamed=False, stream_extra_bytes=0.0)
            out.append(row)
        return out

    # -- infeasibility --------------------------------------------------------------------------
    def infeasibility_reason(self, max_partitions: int | None = None) -> str:
        """A one-line reason why no partition sequence fits (for errors and MILP results)."""
        mib = 2**20
        if self.all_weight_bytes > self.dram_bytes:
            return (f"weights {self.all_weight_bytes / mib:.1f} MiB exceed DRAM capacity "
                    f"{self.dram_bytes / mib:.1f} MiB")
        if self.dataflow:
            ev = self._terms(np.eye(self.n, dtype=bool))
            fmin = self.fractions[-1]
            c = self.phi if self.streaming else 1.0
            need = fmin * ev["sram_scaled"] + c * ev["sram_fixed"]
            worst = int(np.argmax(need - self.sram_bytes)) if self.n else 0
            if self.n and need[worst] > self.sram_bytes:
                k = self.names[worst]
                what = (f"streamed weight buffers {c * ev['sram_fixed'][worst] / mib:.1f} MiB" if self.streaming
                        else f"resident weights {ev['sram_fixed'][worst] / mib:.1f} MiB")
                return (f"kernel {k!r} needs {need[worst] / mib:.1f} MiB of SRAM even alone at the smallest "
                        f"tile {fmin:g} ({what}), over the chip's {self.sram_bytes / mib:.1f} MiB")
        if max_partitions is not None:
            return (f"no sequence of at most {max_partitions} partitions fits SRAM "
                    f"({self.sram_bytes / 2**20:.1f} MiB) and compute tiles ({self.tiles})")
        return "no partition sequence fits the chip's SRAM and DRAM capacity"


def _to_int(row: np.ndarray) -> int:
    """Bitmask of a boolean row."""
    return sum(1 << int(i) for i in np.flatnonzero(row))
