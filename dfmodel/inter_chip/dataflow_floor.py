"""Floors on a block's per-micro-batch time on one *dataflow* chip, without solving it.

A dataflow chip (SN30, WSE-2: ``execution: dataflow``) fuses kernels into partitions, so the
per-kernel DRAM floor of :mod:`.block_floor` (every kernel reads and writes DRAM) does not hold
there. What every partition plan of a phase still pays (:mod:`dfmodel.intra_chip.cost`, whose
terms this module bounds, never re-derives):

- **compute**: a partition's compute is the sum of its kernels' ``compute_time_s``, so a plan's
  is the sum over all kernels: at least every kernel's FLOP at the achieved rate
  (``achieved_rate_Fps``, padding >= 1 dropped);
- **compulsory DRAM traffic**: every weight a partition uses is read from DRAM by it (resident or
  streamed: ``CostModel._terms``, ``add(mem, w.bytes, used)``), so at least once per phase;
  a tensor entering the phase from outside (a graph input of the phase's subgraph) is read, and
  one leaving it (a graph output: the block's output, its input gradient, the weight gradients)
  written, at least once; plus every kernel's ``extra_memory_bytes``. The forward-to-backward
  stash is *not* counted: the on-chip variant keeps it in SRAM (:mod:`.onchip_stash`);
- **overheads**: a non-empty phase has at least one partition: ``kernel_overhead_s`` plus one
  row tile's ``tile_overhead_s / f`` with ``f <= 1``.

- **the stash** (tensors a forward kernel makes for a backward one): a layer keeps it in SRAM
  only while it fits -- a stage keeps at most ``floor(SRAM / (S in_flight))`` layers' stashes
  on chip (``OnChipStash.layers_on_chip``, ``in_flight >= 1``; with full recompute all or none);
  every other layer's forward writes it and its backward reads it back (they are outputs and
  inputs of the two solved subgraphs). At a long sequence the attention scores make ``S`` tens
  of GB per micro-batch: on WSE-2 (40 GB SRAM, 150 GB/s MemoryX) this term is most of the time.

A plan's time is ``sum_p max(c_p, m_p, n_p) + overheads >= max(sum c_p, sum m_p) + ko + tau``
(overlapping chips; the sum of the parts otherwise), and ``sum m_p`` is at least the compulsory
traffic. The phases are solved separately (``LLMModel._solve_block``: forward, backward, the
attention core for selective recompute), so a block's floor is the sum of its phases' floors.

Sharding over a TP group of ``tp`` chips (``sharding.shard``) gives each chip a copy of every
kernel with its FLOP, tensors and weights scaled by the layout's local fraction, which is at
least ``1 / tp`` (``strategies.local_fraction``): the floor divides the unsharded block's terms
by ``tp`` (a replicated layer norm is under-counted, never over-counted). Communication kernels
inserted by sharding stay inside their phase (their tensors are internal or already counted).

Everything is built once per block on the graph of one micro-batch and scaled: activations and
FLOP grow at least linearly with the micro-batch at a fixed sequence length, weights and
weight gradients do not (the same split as :class:`.block_floor.BlockFloor`).
tests/test_dataflow_floor.py checks floor <= solved phase (off-chip and on-chip stash) on every
shipped LLM block at several TP degrees and micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.inter_chip.comm_floor import forced_phase_comm_s
from dfmodel.inter_chip.config import RECOMPUTE
from dfmodel.inter_chip.fused_floor import MAX_FLOOR_IDEALS, PlanFloor, plan_floor, reduced_plan_floor
from dfmodel.inter_chip.layout_floor import least_share_graph
from dfmodel.inter_chip.memory import in_flight_micro_batches
from dfmodel.inter_chip.sharding import is_weight_gradient
from dfmodel.intra_chip.cost import DEFAULT_TILE_OVERHEAD_S
from dfmodel.intra_chip.stream_floor import StreamFloor, stream_floor
from dfmodel.system.processor import achieved_rate_Fps, memory_time_s
from dfmodel.system.schema import System


@dataclass(frozen=True)
class PhaseFloor:
    """One phase at micro-batch 1 on one chip of the TP group: compute seconds ``compute_s``
    (grows with the micro-batch), compulsory bytes that grow (``act_bytes``) and that do not
    (``fixed_bytes``: weights, weight gradients)."""

    compute_s: float
    act_bytes: float
    fixed_bytes: float
    kernels: int
    # the cheapest plan of the unsharded phase under a relaxed cost (:mod:`.fused_floor`: chips
    # with fewer tiles than the phase has kernels), divided by the TP degree ``tp``
    plan: PlanFloor | None = None
    tp: int = 1
    sram_bytes: float | None = None  # the chip's (the plan floor's options must fit it: fused_floor)
    # re-reads of weights / accumulators too large for the SRAM (intra_chip.stream_floor), or None
    stream: StreamFloor | None = None
    _busy_memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # (replace() starts a new one)

    def time_s(self, k: int, s_per_byte: float, overhead_s: float, overlap: bool, network_s: float = 0.0,
               hidden: bool = False) -> float:
        """The floor at micro-batch ``k`` with at least ``network_s`` of TP collectives in the
        phase (:func:`.comm_floor.forced_phase_comm_s`): a partition takes ``max(c, m, n)`` (the
        sum without overlap), so the phase ``max(C, M, N)``. ``hidden`` (tp_comm_overlap's
        userbuffers, ``llm._userbuffers_s``): the phase is at least its collectives and at least
        the rest, ``max(floor, N)``."""
        if not self.kernels:
            return 0.0
        busy, overhead_s = self.busy_s(k, s_per_byte, overhead_s, overlap)
        return with_network_s(busy, overhead_s, overlap, network_s, hidden)

    def busy_s(self, k: int, s_per_byte: float, overhead_s: float, overlap: bool,
               plans: bool = True) -> tuple[float, float]:
        """The phase's floor at micro-batch ``k`` before its TP collectives: (compute and memory
        busy seconds, overheads). Memoised: the search asks it again for every TP group and
        Pareto pair of collectives (:func:`_block_pass_pairs`), which only change the network.
        ``plans=False``: without the plan floor's shortest path (:attr:`plan`), the closed form
        alone: a weaker floor (the plan's only raises it), several times cheaper."""
        key = (k, s_per_byte, overhead_s, overlap, plans)
        hit = self._busy_memo.get(key)
        if hit is None:
            c = k * self.compute_s
            m = (k * self.act_bytes + self.fixed_bytes) * s_per_byte
            if self.stream is not None and self.sram_bytes is not None:  # (added to every plan's DRAM bytes)
                m += self.stream.extra_bytes(k, self.tp, self.sram_bytes) * s_per_byte
            busy = max(c, m) if overlap else c + m
            if self.plan is not None:  # sum_p max(c_p, m_p) over the best relaxed plan, its partitions
                if plans:
                    busy = max(busy, self.plan.best_s(k, s_per_byte, overlap, self.tp, self.sram_bytes) / self.tp)
                overhead_s *= max(1, self.plan.min_partitions)
            hit = self._busy_memo[key] = (busy, overhead_s)
        return hit


def with_network_s(busy_s: float, overhead_s: float, overlap: bool, network_s: float, hidden: bool) -> float:
    """A phase's floor from its busy seconds and overheads (:meth:`PhaseFloor.busy_s`) with at
    least ``network_s`` of TP collectives (:meth:`PhaseFloor.time_s`)."""
    if hidden:
        return max(busy_s + overhead_s, network_s)
    return (max(busy_s, network_s) if overlap else busy_s + network_s) + overhead_s


@dataclass(frozen=True)
class DataflowBlockFloor:
    """Floors of a block's forward, backward and selective-recompute (attention core) phases."""

    fwd: PhaseFloor
    bwd: PhaseFloor
    core: PhaseFloor
    s_per_byte: float
    overhead_s: float
    overlap: bool
    # the same phases when the stash goes through DRAM (the forward writes it, the backward
    # reads it: outputs / inputs of the two solved subgraphs), and the stash bytes per chip
    fwd_dram: PhaseFloor | None = None
    bwd_dram: PhaseFloor | None = None
    stash_bytes: float = 0.0

    def phase_s(self, phase: PhaseFloor, k: int, network_s: float = 0.0, hidden: bool = False) -> float:
        return phase.time_s(k, self.s_per_byte, self.overhead_s, self.overlap, network_s, hidden)

    def kernels_s(self, k: int, recompute: str, net: tuple[float, float] = (0.0, 0.0), hidden: bool = False) -> float:
        """Forward + backward (+ recompute: the core again, or the whole forward) at micro-batch ``k``
        (as ``BlockTimes.backward_s`` adds them); ``net``: the (forward, backward) TP collective
        floors, ``hidden`` under userbuffers (:meth:`PhaseFloor.time_s`)."""
        f = self.phase_s(self.fwd, k, net[0], hidden)
        extra = {"none": 0.0, "selective": self.phase_s(self.core, k), "full": f}[recompute]
        return f + self.phase_s(self.bwd, k, net[1], hidden) + extra

    def dram_kernels_s(self, k: int, recompute: str, net: tuple[float, float] = (0.0, 0.0),
                       hidden: bool = False) -> float:
        """:meth:`kernels_s` of a layer whose stash goes through DRAM (full recompute's second
        forward writes it again: ``layer_times`` applies the DRAM forward to both)."""
        if self.fwd_dram is None:
            return self.kernels_s(k, recompute, net, hidden)
        f = self.phase_s(self.fwd_dram, k, net[0], hidden)
        extra = {"none": 0.0, "selective": self.phase_s(self.core, k), "full": f}[recompute]
        return f + self.phase_s(self.bwd_dram, k, net[1], hidden) + extra

    def pairs_s(self, k: int, recompute: str, nets, hidden: bool = False) -> tuple:
        """Per (forward, backward) network pair of ``nets``: (:meth:`kernels_s`,
        :meth:`dram_kernels_s`), each phase's busy time taken once for all pairs (the same sums)."""
        kept, dram = self.pair_arrays(k, recompute, nets, hidden)
        return tuple(zip(kept.tolist(), dram.tolist()))

    def pair_arrays(self, k: int, recompute: str, nets, hidden: bool = False,
                    also: "tuple[DataflowBlockFloor, int] | None" = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`pairs_s` as two arrays over the pairs (stash kept on chip, through DRAM): the
        same floating-point operations in the same order, one numpy pass per phase instead of
        a Python loop over the pairs (the search asks ~50k times, ~60 pairs each, at dragonfly 512).
        ``also``: another floor of the same block and its micro-batch factor (:func:`sharded_layer_floor`:
        the layer as sharded on the mapping's own TP group, at factor 1); each phase then takes
        the larger of its two floors (each is one)."""
        return self.pair_arrays_by_recompute(k, (recompute,), nets, hidden, also)[recompute]

    def pair_arrays_by_recompute(self, k: int, recomputes, nets, hidden: bool = False,
                                 also: "tuple[DataflowBlockFloor, int] | None" = None,
                                 plans: bool = True) -> dict[str, tuple]:
        """:meth:`pair_arrays` for each recompute of ``recomputes``, each phase's array built
        once for all of them (the same operations per recompute: the search's group floors ask
        every recompute of a block at once). ``plans``: as :meth:`PhaseFloor.busy_s`."""
        net = np.asarray(nets, dtype=float).reshape(-1, 2)
        nf, nb = net[:, 0], net[:, 1]
        floors = [(self, k)] + ([also] if also is not None else [])

        def at(which: str, n, hid: bool):
            return np.maximum.reduce([fl._phase_arr(getattr(fl, which) or getattr(fl, which.split("_")[0]), kk, n, hid,
                                                    plans) for fl, kk in floors])

        core = at("core", np.zeros(nf.shape), False) if "selective" in recomputes else None
        out: dict[str, list] = {rc: [] for rc in recomputes}
        for fwd, bwd in (("fwd", "bwd"), ("fwd_dram", "bwd_dram")):
            f, b = at(fwd, nf, hidden), at(bwd, nb, hidden)
            for rc in recomputes:
                extra = {"none": 0.0, "selective": core, "full": f}[rc]
                out[rc].append(f + b + extra)
        return {rc: (kept, dram) for rc, (kept, dram) in out.items()}

    def _phase_arr(self, phase: PhaseFloor, k: int, n: np.ndarray, hid: bool, plans: bool = True) -> np.ndarray:
        """:func:`with_network_s` of ``phase`` at micro-batch ``k`` over the network seconds ``n``
        (0 s for an empty phase; ``plans``: as :meth:`PhaseFloor.busy_s`)."""
        if not phase.kernels:
            return np.zeros(n.shape)
        busy, overhead_s = phase.busy_s(k, self.s_per_byte, self.overhead_s, self.overlap, plans)
        if hid:
            return np.maximum(busy + overhead_s, n)
        return (np.maximum(busy, n) if self.overlap else busy + n) + overhead_s

    def max_layers_on_chip(self, k: int, sram_bytes: float, layers: int, stages: int, recompute: str,
                           checkpoint_bytes: float = 0.0) -> int:
        """At most this many of ``layers`` (over ``stages`` pipeline stages) keep their stash in
        SRAM (``OnChipStash.layers_on_chip``: ``floor(free / (S in_flight))`` per stage with
        ``free <= sram`` and ``in_flight >= 1``; full recompute: all or none per stage, all only
        when ``S + n ckpt`` fits, ``n`` the stage's layers and ``ckpt`` their input each, so at
        most ``stages * floor((SRAM - S) / ckpt)``). ``S`` grows at least ``k``-fold with the
        micro-batch."""
        stash = k * self.stash_bytes
        if stash <= 0:
            return layers
        if recompute == "full":  # a stage of n layers keeps them on chip only if S + n ckpt fits
            if stash > sram_bytes:
                return 0
            if checkpoint_bytes <= 0:
                return layers
            return min(layers, stages * int((sram_bytes - stash) // checkpoint_bytes))
        return min(layers, stages * int(sram_bytes // stash))


def staged_layers_on_chip(fl: DataflowBlockFloor, k: int, sram_bytes: float, layers: int, in_flight: tuple,
                          recompute: str, checkpoint_bytes: float = 0.0) -> int:
    """:meth:`DataflowBlockFloor.max_layers_on_chip` with each stage's own in-flight micro-batches
    ``in_flight`` (a floor of ``memory.in_flight_micro_batches``: plain 1F1B's, which interleaving
    never lowers) instead of 1: stage ``i`` keeps at most ``floor(SRAM / (S f_i))`` stashes (full
    recompute: ``floor((SRAM - S) / (f_i ckpt))`` layers), so the first stages of a deep pipeline,
    holding ``pp - i`` micro-batches, keep far fewer than the last."""
    stash = k * fl.stash_bytes
    if stash <= 0:
        return layers
    if recompute == "full":
        if stash > sram_bytes:
            return 0
        if checkpoint_bytes <= 0:
            return layers
        free = sram_bytes - stash  # (1e-12: as llm._full_recompute_cap)
        return min(layers, sum(min(layers, math.floor(free / (f * checkpoint_bytes) * (1 + 1e-12))) for f in in_flight))
    return min(layers, sum(min(layers, math.floor(sram_bytes / (stash * f))) for f in in_flight))


def _phase_floor(graph: DataflowGraph, system: System, names: set[str], tp: int, stash_free: bool,
                 max_ideals: int = MAX_FLOOR_IDEALS, network_s: dict[str, float] | None = None) -> PhaseFloor:
    """:class:`PhaseFloor` of the kernels ``names`` of ``graph`` (one micro-batch, unsharded).
    ``stash_free``: tensors from a forward to a backward kernel are not compulsory (they may stay
    on chip); tensors crossing the phase's boundary otherwise are."""
    chip = system.chip
    precision = graph.meta.get("precision", "bf16")
    kinds = {k.name: k for k in graph.kernels}
    compute_s = act = fixed = 0.0
    weights: dict[str, float] = {}
    count = 0
    for k in graph.kernels:
        if k.name not in names:
            continue
        count += 1
        if k.kind != KernelKind.comm and k.flop:
            compute_s += k.flop / achieved_rate_Fps(chip, k, precision)
        act += k.extra_memory_bytes
        if k.weight_bytes > 0:  # one read per weight name (CostModel.weights), its largest size
            key = k.weight or f"<{k.name}>"
            weights[key] = max(weights.get(key, 0.0), float(k.weight_bytes))
    fixed += sum(weights.values())

    def stash(t) -> bool:
        p, c = kinds.get(t.producer), kinds.get(t.consumer)
        return p is not None and c is not None and p.phase == Phase.forward and c.phase != Phase.forward

    crossing: dict[tuple, tuple[float, bool]] = {}  # (name, producer) -> (bytes, fixed): read/written once
    for t in graph.tensors:
        p_in, c_in = t.producer in names, t.consumer in names
        if p_in == c_in or (stash_free and stash(t)):
            continue
        if not p_in and not c_in:
            continue
        pk = kinds.get(t.producer)
        is_fixed = pk is not None and (pk.phase == Phase.weight_grad or is_weight_gradient(pk, t))
        key = (t.name, t.producer, p_in)
        old = crossing.get(key)
        if old is None or t.bytes > old[0]:
            crossing[key] = (float(t.bytes), is_fixed)
    for b, is_fixed in crossing.values():
        if is_fixed:
            fixed += b
        else:
            act += b
    plan = plan_floor(graph, system, names, stash_free, max_ideals=max_ideals, network_s=network_s)
    if plan is None and network_s is not None and len(names) > system.chip.compute_tiles:
        # (the sharded layer's backward: its lattice is too large, its heaviest kernels' is not)
        plan = reduced_plan_floor(graph, system, names, stash_free, max_ideals, network_s)
    return PhaseFloor(compute_s / tp, act / tp, fixed / tp, count, plan, tp,
                      float(chip.sram_bytes), stream_floor(graph, names, stash_free))


def dataflow_block_floor(graph: DataflowGraph, system: System, tp: int, is_core,
                         max_ideals: int = MAX_FLOOR_IDEALS, network_s: dict[str, float] | None = None, *,
                         forward_only: bool = False,
                         forward: "DataflowBlockFloor | None" = None) -> DataflowBlockFloor:
    """:class:`DataflowBlockFloor` of ``graph`` (one micro-batch) on a TP group of ``tp`` chips.
    ``is_core(kernel)`` picks selective recompute's kernels; a phase whose lattice has more
    than ``max_ideals`` ideals keeps the closed-form floor (:func:`.fused_floor.plan_floor`).
    ``network_s``: the network seconds of ``graph``'s communication kernels (a sharded graph at
    ``tp = 1``, asked at factor 1): each plan floor's set then takes at least its network
    (:attr:`.fused_floor.PlanFloor.N`). ``forward_only``: the backward and recompute phases
    empty (0 s: a weaker floor, valid as any phase's is); ``forward``: such a floor of the same
    arguments, whose forward phases are taken instead of built again."""
    fwd = {k.name for k in graph.kernels if k.phase == Phase.forward}
    bwd = {k.name for k in graph.kernels if k.phase != Phase.forward}
    core = {k.name for k in graph.kernels if is_core(k)}
    chip = system.chip
    overhead = float(chip.efficiency.kernel_overhead_s) + DEFAULT_TILE_OVERHEAD_S  # >= tau / f, f <= 1
    kinds = {k.name: k for k in graph.kernels}
    stash: dict[tuple, float] = {}  # onchip_stash.stash_tensors of the unsharded graph
    for t in graph.tensors:
        if t.producer in fwd and t.consumer in bwd and kinds[t.producer].phase == Phase.forward:
            stash[(t.name, t.producer)] = max(stash.get((t.name, t.producer), 0.0), float(t.bytes))
    def phase(names: set[str], stash_free: bool) -> PhaseFloor:
        if forward_only and names is not fwd:
            return EMPTY_PHASE
        if forward is not None and names is fwd:
            return forward.fwd if stash_free else forward.fwd_dram
        return _phase_floor(graph, system, names, tp, stash_free, max_ideals, network_s)

    return DataflowBlockFloor(phase(fwd, True), phase(bwd, True), phase(core, False), memory_time_s(chip, 1.0), overhead,
                              bool(chip.overlap), phase(fwd, False), phase(bwd, False), sum(stash.values()) / tp)


#: a phase without kernels: 0 s (:meth:`PhaseFloor.time_s`), what a floor leaves out
EMPTY_PHASE = PhaseFloor(0.0, 0.0, 0.0, 0)


__all__ = ["DataflowBlockFloor", "PhaseFloor", "dataflow_block_floor"]


def pass_floor_s(model, m, is_core, tp_groups=None, stash_cap: int | None = None, layer_nets: tuple | None = None,
                 plans: bool = True, stage: tuple[int, int, int] | None = None) -> float:
    """Valid lower bound on one micro-batch's forward + backward (+ recompute) through every
    block on one dataflow chip (``LLMModel.pass_floor_s`` on ``execution: dataflow``; ``is_core``
    picks selective recompute's kernels): each
    block's :class:`DataflowBlockFloor` times its count. With ``tp_groups`` (TP > 1): each phase
    also holds its forced TP reductions (:func:`.comm_floor.forced_phase_comm_s`), on the
    cheapest of the groups. ``stash_cap``: at most this many of the (MoE) layers keep their
    stash in SRAM (``LLMModel.stash_cap``: from the layer's solved on-chip plans), the others
    pay the DRAM floor. ``layer_nets``: the (forward, backward) network seconds of the (MoE)
    layer as sharded on ``m``'s own TP group (``LLMModel.layer_nets_s``: every collective of the
    layouts it runs, not only the forced reductions), with ``tp_groups`` that one group.
    ``plans=False``: every phase at its closed form, without its plan floor
    (:meth:`PhaseFloor.busy_s`): weaker, cheaper. ``stage``: ``(i, moe, dense)``, the same floor
    of plain 1F1B's stage ``i`` alone when it holds ``moe`` (MoE, or every layer of a dense
    model) and ``dense`` (an MoE model's dense) layers: the embedding on the first stage, the
    head on the last, at most as many layers keeping their stash in SRAM as the SRAM holds at
    that stage's in-flight micro-batches (an MoE model: at one, which every stage holds at
    least). Memoised per block key on ``model``."""
    if tp_groups and m.tp > 1:
        return min(_pass_floor_on_s(model, m, is_core, tuple(g), stash_cap, layer_nets, plans, stage)
                   for g in tp_groups)
    return _pass_floor_on_s(model, m, is_core, None, stash_cap, plans=plans, stage=stage)


def _pass_floor_on_s(model, m, is_core, group, stash_cap: int | None = None, layer_nets: tuple | None = None,
                     plans: bool = True, stage: tuple[int, int, int] | None = None) -> float:
    """:func:`pass_floor_s` on one TP group (None: without the TP collectives). Under
    ``model.sharded_floor_stage`` ``none`` (:meth:`LLMModel.nets_only`) the (MoE) layer with
    ``layer_nets`` skips its sharded floor (:func:`sharded_layer_floor`): a weaker bound, without
    the plan floors of the sharded graph; ``forward``: with that floor's forward phases only."""
    ub = m.tp_comm_overlap and m.tp > 1
    dense = model.num_experts <= 1  # (MoE layers keep the 1 / tp shares: their expert layouts differ)
    sp = m.sequence_parallel and m.tp > 1
    only, stage = stage, model.sharded_floor_stage
    key = (m.micro_batch, m.recompute, m.tp, m.cp, m.ep_outside_tp, m.pp) + (
        () if group is None else (group, m.sequence_parallel, m.whole_experts, ub)) + (
        (sp, m.num_micro_batches) if dense else ()) + (() if stash_cap is None else ("cap", stash_cap)) + (
        () if layer_nets is None else ("nets", layer_nets, stage)) + (() if plans else ("closed",)) + (
        () if only is None else ("stage", only))
    memo = model.__dict__.setdefault("_dataflow_pass_memo", {})
    if key in memo:
        return memo[key]
    sram = float(model.system.chip.sram_bytes)
    total = 0.0
    for which, count, rc, ep in _pass_blocks(model, m, only):
        if not count:
            continue
        bkey, fl = _cached_block_floor(model, m, which, ep, is_core)
        if fl is None:
            continue
        nets = layer_nets if which == "layer" else None
        # (MoE layers only: a dense layer's floor has Megatron's least shares already, layout_floor,
        # and the sharded one cost Llama-3 70B on 512 dragonfly chips 10 % more CPU for nothing)
        also = (None if nets is None or dense or stage == "none" else
                (sharded_layer_floor(model, m, is_core, forward_only=stage == "forward"), 1))
        pairs = _block_pass_pairs(model, fl, bkey, which, m, rc, ep, group, ub, nets, also, stage if also else None,
                                  plans)
        if which in ("layer", "dense_layer"):  # layers whose stash does not fit SRAM write and read it
            stages = range(m.pp) if only is None else (only[0],)
            if dense:  # each stage's own in-flight micro-batches (plain 1F1B's: interleaving adds)
                in_flight = tuple(in_flight_micro_batches(m.pp, i, m.num_micro_batches) for i in stages)
                on = staged_layers_on_chip(fl, m.micro_batch, sram, count, in_flight, rc, model._checkpoint_bytes(m))
            else:
                on = fl.max_layers_on_chip(m.micro_batch, sram, count, len(stages), rc, model._checkpoint_bytes(m))
            if stash_cap is not None and which == "layer":  # (floors decrease with on: kept <= dram)
                on = min(on, stash_cap)
            total += _least_split_s(on, count, *pairs)
        else:  # (evaluate times the embedding and head with their stash through DRAM, always)
            total += count * float(pairs[1].min())
    memo[key] = total
    return total


def _pass_blocks(model, m, stage: tuple[int, int, int] | None = None) -> list[tuple]:
    """(block, count, recompute, ep) of one micro-batch's pass through a chip's blocks, or through
    those of ``stage`` (:func:`pass_floor_s`)."""
    moe, dense = (model.num_moe_layers, model.num_dense_layers) if stage is None else stage[1:]
    first, last = (True, True) if stage is None else (stage[0] == 0, stage[0] == m.pp - 1)
    blocks = [("layer", moe, m.recompute, m.ep_outside_tp), ("embedding", int(first), "none", 1),
              ("head", int(last), "none", 1)]
    if model.num_dense_layers:
        blocks.append(("dense_layer", dense, m.recompute, 1))
    return blocks


def _cached_block_floor(model, m, which: str, ep: int, is_core) -> tuple[tuple, "DataflowBlockFloor | None"]:
    """(key, :func:`_block_floor_of`) of block ``which`` at ``m``'s TP and CP degrees, memoised on
    ``model`` (None when the model has no such block)."""
    dense = model.num_experts <= 1
    sp = m.sequence_parallel and m.tp > 1
    bkey = (which, m.tp, m.cp, ep) + ((sp,) if dense else ())
    floors = model.__dict__.setdefault("_dataflow_block_floors", {})
    if bkey not in floors:
        graph = getattr(model.graphs(1, m.cp, ep), which)
        floors[bkey] = None if graph is None else _block_floor_of(graph, model.system, m.tp, sp, dense, is_core)
    return bkey, floors[bkey]


def _least_split_s(on: int, count: int, kept: np.ndarray, dram: np.ndarray) -> float:
    """Least over the network pairs of ``on`` layers at their kept-stash floor and the other
    ``count - on`` at their DRAM floor (:func:`_times`: none of an infinite floor adds 0)."""
    if on == 0:
        return float((count * dram).min())
    if on == count:
        return float((on * kept).min())
    return float((on * kept + (count - on) * dram).min())


def _times(n: int, floor_s: float) -> float:
    """``n`` layers at ``floor_s`` each: 0 for none, even when the floor is infinite (no plan of
    the phase fits the SRAM: fused_floor), where ``0 * inf`` would be NaN, a bound the search
    could neither prune nor order."""
    return n * floor_s if n else 0.0


def _block_pass_pairs(model, fl: DataflowBlockFloor, bkey: tuple, which: str, m, rc: str, ep: int, group, ub: bool,
                      nets_s: tuple | None = None, also: tuple | None = None, also_stage: str | None = None,
                      plans: bool = True) -> tuple:
    """Per Pareto pair of the block's forced TP collectives on ``group`` (None: none), the block's
    (stash kept on chip, stash through DRAM) floors at ``m``'s micro-batch and recompute ``rc``.
    Memoised on what they read (the block floor's key, the TP floor's knobs, the micro-batch, the
    group): the search asks again for every pipeline depth and data-parallel degree.
    ``nets_s``: the block's own (forward, backward) network seconds as sharded on ``group``
    (every phase plan pays all of them: a partition's network is the sum of its kernels'),
    instead of the forced reductions' Pareto pairs; ``also``: the block's floor as sharded on
    ``group`` (:func:`sharded_layer_floor`, with ``nets_s``), each phase at the larger floor, of
    the stage ``also_stage`` (:attr:`LLMModel.sharded_floor_stage`: which floor of the group it is).
    ``plans``: as :func:`pass_floor_s`."""
    whole = m.whole_experts and which == "layer"
    key = bkey + (m.sequence_parallel, whole, m.micro_batch, group, ub, nets_s, also_stage, plans)
    memo = model.__dict__.setdefault("_dataflow_pair_memo", {})
    by_rc = memo.get(key)
    if by_rc is not None and rc in by_rc:
        return by_rc[rc]
    nets, hidden = [(0.0, 0.0)], False
    if group is not None:  # the block's forced TP reductions per phase (Megatron layouts)
        nets = [nets_s] if nets_s is not None else _forced_nets(model, which, m, ep, whole, group)
        hidden = nets is not None and ub and which in ("layer", "dense_layer")  # userbuffers pair them with the GEMMs
        nets = nets or [(0.0, 0.0)]
    # (a layer's every recompute at once: the group floors ask them all; the embedding and head "none" only)
    rcs = RECOMPUTE if which in ("layer", "dense_layer") else (rc,)
    memo[key] = by_rc = {**(by_rc or {}), **fl.pair_arrays_by_recompute(m.micro_batch, rcs, nets, hidden, also, plans)}
    return by_rc[rc]


def _forced_nets(model, which: str, m, ep: int, whole: bool, group) -> list | None:
    """:func:`.comm_floor.forced_phase_comm_s` of the block on ``group`` at ``m``'s micro-batch
    (None when the block has no TP floor), memoised on what it reads: every recompute and
    tp_comm_overlap choice asks the same."""
    key = (which, m.tp, m.cp, m.sequence_parallel, ep, whole, m.micro_batch, group)
    memo = model.__dict__.setdefault("_dataflow_nets_memo", {})
    if key not in memo:
        tp_floor = model._block_floor(which, m.tp, m.cp, m.sequence_parallel, ep, whole)
        memo[key] = None if tp_floor is None else forced_phase_comm_s(
            tp_floor, m.micro_batch, model.costs, group, model.__dict__.setdefault("_collective_memo", {}))
    return memo[key]


def _block_floor_of(graph: DataflowGraph, system: System, tp: int, sp: bool, dense: bool, is_core) -> DataflowBlockFloor:
    """:func:`dataflow_block_floor` of a block on a TP group of ``tp``: a dense block's on its
    graph scaled to the least per-chip shares of Megatron's layouts (:mod:`.layout_floor`,
    never below ``1 / tp``), an MoE block's at ``1 / tp``."""
    if dense and tp > 1:
        return dataflow_block_floor(least_share_graph(graph, system, tp, sp), system, 1, is_core)
    return dataflow_block_floor(graph, system, tp, is_core)


#: ideals a phase of the sharded layer may have for its plan floor (:func:`sharded_layer_floor`):
#: DeepSeek-V3's sharded forward has ~80 (a few ms), its backward ~20k (1.7 M ideal pairs, 0.1 s
#: to find too many): the backward keeps the unsharded 1/tp plan floor and its own closed form
SHARDED_MAX_IDEALS = 2_000


def sharded_layer_floor(model, m, is_core, forward_only: bool = False) -> DataflowBlockFloor:
    """:class:`DataflowBlockFloor` of ``m``'s (MoE) layer *as sharded* on its own TP group (the
    per-chip graph ``LLMModel._solve_block`` solves: ``LLMModel._shard_block``, memoised), at
    ``m``'s micro-batch (so at factor 1) and ``tp = 1``: the floors of :mod:`.fused_floor` and
    this module hold on any graph, this one included, and it holds what the 1/tp floor of the
    unsharded layer relaxes away -- the column-split GEMMs' replicated inputs, the sharded
    weights' true per-chip bytes, and the communication kernels, each taking one of the
    chip's few compute tiles (dragonfly: 4), so partitions hold fewer GEMMs and spill more
    tensors. DeepSeek-V3's forward at TP 64 (ep 1, mb 6) on dragonfly: floor 0.047 s (1/tp)
    -> 0.185 s, solved 0.191 s. ``forward_only``: its forward phases alone (the backward's
    reduced plan floor is two thirds of the cost), which the full floor then reuses.
    Memoised per layer block key on ``model``."""
    key = (model._block_key("layer", m), forward_only)
    memo = model.__dict__.setdefault("_sharded_layer_floors", {})
    if key not in memo:
        sh = model.sharded_layer(m)
        fwd = None if forward_only else sharded_layer_floor(model, m, is_core, forward_only=True)
        memo[key] = dataflow_block_floor(sh.graph, model.system, 1, is_core, SHARDED_MAX_IDEALS, sh.network_time_s,
                                         forward_only=forward_only, forward=fwd)
    return memo[key]


__all__ += ["pass_floor_s", "sharded_layer_floor", "streams_forced"]


def streams_forced(model, m) -> bool:
    """Whether a phase of ``m``'s MoE layer must stream some weights or accumulators on this
    dataflow chip (:meth:`~dfmodel.intra_chip.stream_floor.StreamFloor.must_stream` at ``m``'s
    TP degree): where the closed form misses the partitions' structure
    (``LLMModel._floor_blocks_bound_s`` is worth its cost). Reads the floors :func:`pass_floor_s`
    builds for ``m``'s degrees."""
    key = ("layer", m.tp, m.cp, m.ep_outside_tp)
    if key not in model.__dict__.get("_dataflow_block_floors", {}):
        model.pass_floor_s(m, comm=False)  # (builds them, memoised)
    fl = model.__dict__.get("_dataflow_block_floors", {}).get(key)
    if fl is None:
        return False
    sram = float(model.system.chip.sram_bytes)
    return any(ph is not None and ph.stream is not None and ph.stream.must_stream(fl.fwd.tp, sram)
               for ph in (fl.fwd_dram, fl.bwd_dram))
