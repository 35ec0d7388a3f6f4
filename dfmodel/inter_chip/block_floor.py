"""Floors on a block's per-micro-batch time on one chip, without solving it (search bounds).

The search (:mod:`dfmodel.inter_chip.search`) prunes a candidate whose lower bound is no better
than the best time found. ``LLMModel.compute_floor_s`` bounds a block by its FLOP at the chip's
achieved peak; that misses what a kernel-by-kernel chip (a GPU) always pays on top:

- **per-kernel memory traffic** (:func:`kernel_floors`): every kernel alone reads its inputs and
  writes its output in DRAM (``intra_chip.cost.CostModel``: a singleton partition's crossing
  tensors, weights and extra bytes), so its time is at least ``max(FLOP / rate, bytes / bw)``
  (overlapping chips; the sum otherwise) plus the launch overhead. Layernorm, softmax and the
  elementwise kernels are HBM-bound: this is the "memory" part of the breakdown;
- **TP collectives no layout avoids** (:func:`forced_comm_s`): a strategy whose output is a
  partial sum (``P``: a row-parallel forward GEMM, a column-parallel data-gradient GEMM, the
  vocabulary-parallel embedding) must be reduced before anything reads it -- no strategy takes
  ``P`` as input and a partial sum never leaves a block as is (``strategies.conversion``: an
  all-reduce to ``R`` or a reduce-scatter to ``T``/``F``). Every weight group (the forward,
  data- and weight-gradient GEMMs of one weight share one strategy) therefore pays, whichever
  strategy the sharding MILP picks, at least the cheapest of its options' forced reductions.
  Megatron-LM's layer pays exactly these: 2 reductions forward, 2 backward.

Each sharded kernel is a scaled copy of the unsharded one (``sharding._scaled_kernel``): its
FLOP shrink by the group size only if its strategy splits work, its tensors by their layout's
local fraction. The floor takes, per kernel, the least over the strategies its group may use
(``ShardingProblem.options``, Megatron layouts), and drops matmul tile padding (>= 1). Dataflow
chips fuse kernels (no per-kernel traffic) and overlap collectives inside a partition: they keep
the compute-only floor. test_block_floor.py checks floor <= solved block on every key of small
cases, and the search tests check bound <= evaluated on every candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup, is_weight_gradient
from dfmodel.inter_chip.strategies import local_fraction
from dfmodel.system.processor import achieved_rate_Fps, memory_time_s
from dfmodel.system.schema import System


@dataclass(frozen=True)
class BlockFloor:
    """Per-micro-batch floors of one block on one chip of a TP group of ``tp``, as functions of
    the micro-batch size ``k`` (built on the graph of one micro-batch).

    Every activation tensor and every kernel's FLOP grow (at least) linearly with the
    micro-batch at a fixed sequence length, while weights and the weight gradients a
    weight-gradient kernel writes do not (test_block_floor.py checks this on every shipped
    workload): a kernel under strategy ``o`` takes at least ``max(k C, s (k A + W))``
    (``C`` its FLOP time, ``A`` its activation bytes, ``W`` its fixed bytes per chip, ``s`` s/byte).
    ``forced`` holds per weight group, per strategy option, the partial-sum outputs it must
    reduce as (bytes, forward?, grows with k?); ``paired`` per weight group whether one of its
    kernels is a GEMM tp_comm_overlap pairs with its collectives (``linear``)."""

    C: np.ndarray  # (kernels, options) seconds, inf where a kernel has fewer options
    A: np.ndarray  # activation bytes
    W: np.ndarray  # fixed bytes
    fwd: np.ndarray  # forward kernels
    core: np.ndarray  # attention-core kernels (selective recompute)
    forced: tuple
    overhead_s: float
    s_per_byte: float
    overlap: bool
    linear: np.ndarray | None = None  # the GEMMs tp_comm_overlap pairs with TP collectives
    paired: tuple = ()  # per ``forced`` group: its reductions are a paired GEMM's (tp_comm_overlap)
    # (kernels_s and kernels_overlapped_s's sums per (micro-batch, recompute): the search asks
    # them ~10^5 times of a few hundred keys; not an init field, so dataclasses.replace starts empty)
    _sums: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def kernel_floors_s(self, k: int) -> np.ndarray:
        """Each kernel's floor at micro-batch ``k``: least over its options, plus its launch."""
        if not len(self.C):
            return np.zeros(0)
        mem = (k * self.A + self.W) * self.s_per_byte
        t = np.maximum(k * self.C, mem) if self.overlap else k * self.C + mem
        return t.min(axis=1) + self.overhead_s

    def kernels_s(self, k: int, recompute: str) -> float:
        """Forward + backward (+ recompute) floor of the block's compute kernels."""
        key = ("plain", k, recompute)
        hit = self._sums.get(key)
        if hit is None:
            t = self.kernel_floors_s(k)
            extra = {"none": 0.0, "selective": float(t[self.core].sum()), "full": float(t[self.fwd].sum())}[recompute]
            hit = self._sums[key] = float(t.sum()) + extra
        return hit

    def kernels_overlapped_s(self, k: int, recompute: str, comm_s: float) -> float:
        """The layer's floor under Megatron's tp_comm_overlap (``llm._userbuffers_s``): per
        phase, the rest of the phase plus its GEMMs paired with its collectives, which take at
        least the longer of the two (``nccl.tp_comm_overlap_s``: ``g + (n - 1) max(g, c) >=
        max(n g, (n - 1) c)``); summed over the phases, ``max(Gf, Cf) + max(Gb, Cb) >= max(Gf +
        Gb, Cf + Cb)``. ``comm_s`` is a floor on the whole block's TP collective seconds
        (network only, full recompute's repeated forward included: :func:`forced_comm_s`)."""
        rest, gemm = self._overlap_parts_s(k, recompute)
        return rest + max(gemm, comm_s)

    def _overlap_parts_s(self, k: int, recompute: str) -> tuple[float, float]:
        """(every other kernel and each GEMM's launch, the paired GEMMs) of
        :meth:`kernels_overlapped_s`, memoised per (micro-batch, recompute)."""
        key = ("overlapped", k, recompute)
        hit = self._sums.get(key)
        if hit is None:
            t = self.kernel_floors_s(k)
            lin = self.linear if self.linear is not None else np.zeros(len(t), dtype=bool)
            gemm_t = np.where(lin, t - self.overhead_s, 0.0)
            rest_t = t - gemm_t  # every other kernel, and each GEMM's launch
            again = {"none": None, "selective": None, "full": self.fwd}[recompute]
            rest = float(rest_t.sum()) + (float(t[self.core].sum()) if recompute == "selective" else 0.0)
            gemm = float(gemm_t.sum())
            if again is not None:
                rest += float(rest_t[again].sum())
                gemm += float(gemm_t[again].sum())
            hit = self._sums[key] = (rest, gemm)
        return hit


def _tensors(graph: DataflowGraph):
    """Per kernel: ({(name, producer): (bytes, tensor)} of its inputs, {output name: (bytes,
    tensor)}) grouped as the intra-chip cost model groups them (one tensor per (name,
    producer), at its largest declared size)."""
    ins: dict[str, dict] = {}
    outs: dict[str, dict] = {}
    for t in graph.tensors:
        if t.consumer is not None:
            d = ins.setdefault(t.consumer, {})
            old = d.get((t.name, t.producer))
            if old is None or t.bytes > old[0]:
                d[(t.name, t.producer)] = (float(t.bytes), t)
        if t.producer is not None:
            d = outs.setdefault(t.producer, {})
            old = d.get(t.name)
            if old is None or t.bytes > old[0]:
                d[t.name] = (float(t.bytes), t)
    return ins, outs


def block_floor(graph: DataflowGraph, system: System, tp: int, sequence_parallel: bool, *,
                whole_experts: bool = False, is_core=None, is_linear=None) -> BlockFloor:
    """:class:`BlockFloor` of ``graph`` (one micro-batch) on a TP group of ``tp`` chips (Megatron
    layouts, as ``LLMModel`` shards it). ``is_core(kernel)`` picks the selective-recompute kernels."""
    chip = system.chip
    problem = ShardingProblem(graph, system, TPGroup(tp, ()), None, tokens_split=sequence_parallel,
                              megatron_layouts=True, whole_experts=whole_experts)
    options = problem.options
    precision = graph.meta.get("precision", "bf16")
    ins, outs = _tensors(graph)
    kernels = [k for k in graph.kernels if k.kind != KernelKind.comm]
    width = max((len(options[problem.group_of[k.name]]) for k in kernels), default=1)
    C = np.full((len(kernels), width), np.inf)
    A = np.zeros((len(kernels), width))
    W = np.zeros((len(kernels), width))
    by_name = {k.name: k for k in kernels}

    def fixed(t) -> bool:  # weight gradients are weight-sized: they do not grow with the micro-batch
        k = by_name.get(t.producer)
        return k is not None and (k.phase == Phase.weight_grad or is_weight_gradient(k, t))

    for i, k in enumerate(kernels):
        rate = achieved_rate_Fps(chip, k, precision) if k.flop else 1.0
        for j, name in enumerate(options[problem.group_of[k.name]]):
            s = problem.strategy(k, name)
            work = tp if s.splits_work else 1
            act = const = 0.0
            # the consumer reads each input in its strategy's layout; the output leaves in s.output
            for b, t in ins.get(k.name, {}).values():
                part = b * local_fraction(problem.in_layout(k, name, t), tp)
                if fixed(t):
                    const += part
                else:
                    act += part
            for b, t in outs.get(k.name, {}).values():
                part = b * local_fraction(s.output, tp)
                if fixed(t):
                    const += part
                else:
                    act += part
            C[i, j] = k.flop / rate / work
            A[i, j] = act + k.extra_memory_bytes / work
            W[i, j] = const + k.weight_bytes / (tp if s.splits_weight else 1)
    fwd = np.array([k.phase == Phase.forward for k in kernels], dtype=bool)
    core = np.array([k.phase == Phase.forward and is_core is not None and is_core(k) for k in kernels], dtype=bool)
    forced, paired = [], []
    linear = np.array([is_linear is not None and is_linear(k) for k in kernels], dtype=bool)
    is_paired = {k.name for k, lin in zip(kernels, linear) if lin}
    if tp > 1:
        for g, ks in problem.groups.items():
            per_option = []
            for name in options[g]:
                items = []
                for k in ks:
                    s = problem.strategy(k, name)
                    if s.output != "P":
                        continue
                    for b, t in outs.get(k.name, {}).values():
                        if t.consumer is None and is_weight_gradient(k, t) and s.splits_weight:
                            continue  # a weight-gradient shard stays local (ShardingProblem.output_layouts)
                        items.append((b, k.phase == Phase.forward, not fixed(t)))
                per_option.append(tuple(items))
            if per_option and all(per_option):  # every option leaves a partial sum to reduce
                forced.append(tuple(per_option))
                paired.append(any(k.name in is_paired for k in ks))
    return BlockFloor(C, A, W, fwd, core, tuple(forced), float(chip.efficiency.kernel_overhead_s),
                      memory_time_s(chip, 1.0), bool(chip.overlap), linear, tuple(paired))


def forced_comm_s(floor: BlockFloor, k: int, costs, group, recompute: str, memo: dict | None = None,
                  launches: bool = True, paired: bool | None = None) -> float:
    """Least TP-collective time of the block at micro-batch ``k`` on ``group`` (a placement
    tuple) whatever the sharding: per weight group, its cheapest option's partial-sum
    reductions (an all-reduce or reduce-scatter of the logical bytes, whichever is cheaper,
    each its own communication kernel with its launch overhead); full recompute repeats the
    forward ones. ``memo`` caches collective times across calls; ``launches=False``: the
    network seconds alone. ``paired`` True / False: only the weight groups whose reductions
    tp_comm_overlap pairs / does not pair with their GEMMs (:attr:`BlockFloor.paired`)."""
    if not floor.forced:
        return 0.0
    memo = {} if memo is None else memo

    def reduce_s(b: float) -> float:
        key = (b, group)
        if key not in memo:
            memo[key] = min(costs.time_s("all_reduce", b, group), costs.time_s("reduce_scatter", b, group))
        return memo[key] + (floor.overhead_s if launches else 0.0)

    again = 2.0 if recompute == "full" else 1.0
    total = 0.0
    for i, per_option in enumerate(floor.forced):
        if paired is not None and floor.paired[i] != paired:
            continue
        total += min(sum(reduce_s(b * k if grows else b) * (again if fwd else 1.0) for b, fwd, grows in items)
                     for items in per_option)
    return total


__all__ = ["BlockFloor", "block_floor", "forced_comm_s"]
