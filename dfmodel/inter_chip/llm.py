"""Evaluate one LLM training mapping end to end, and a valid lower bound for pruning.

For a :class:`~dfmodel.inter_chip.config.Mapping`: shard the decoder layer (and embedding and
head) over the TP group, run the intra-chip pass on the forward and on the backward kernels
(1F1B runs them at different times, so they never fuse), add recompute, balance layers over
pipeline stages, compose the 1F1B pipeline, add the exposed data-parallel gradient sync, the
optimizer step and the input pipeline, and check memory per chip. Context parallelism runs the
layer of one cp rank (:mod:`.context`: s/cp queries against all s keys) and adds the exposed
K/V exchange (``cp_comm``); gradients are reduced and ZeRO shards over the dp x cp ranks
(Megatron-Core); ZeRO-3 adds per-layer parameter gathers and gradient reduce-scatters. Inner results are cached by
the knobs they depend on, so the search pays for each distinct layer solve once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.moe import dispatch_bytes_per_rank, expert_params
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.workload import resolve_attention
from dfmodel.inter_chip import memory as mem
from dfmodel.inter_chip import pipeline as pipe
from dfmodel.inter_chip.checkpoint import checkpoint_state
from dfmodel.inter_chip.config import DIM_NAMES, Mapping
from dfmodel.inter_chip.context import cp_exchange, cp_rank_graph, is_attention_core, kv_bytes_per_rank, with_params_of
from dfmodel.inter_chip.io import IOTerms, io_terms
from dfmodel.inter_chip.sharding import ShardedGraph, TPGroup, shard
from dfmodel.intra_chip import partition
from dfmodel.netmodels import CostTable, merge_groups, nccl
from dfmodel.system.processor import achieved_rate_Fps, compute_time_s, memory_time_s
from dfmodel.system.schema import Precision, System

#: Adam step DRAM traffic per parameter: read fp32 master, m, v and the gradient, write master,
#: m, v and the 16-bit weight (4+4+4+2 read, 4+4+4+2 written).
OPTIMIZER_BYTES_PER_PARAM = 28.0
COMPONENTS = ("compute", "memory", "tp_comm")
#: exposed communication of each parallel dimension, one breakdown key each (``<dim>_comm``)
COMM_KEYS = tuple(f"{d}_comm" for d in DIM_NAMES)


@dataclass
class PhaseTime:
    """Intra-chip time of one group of kernels per micro-batch, split by bottleneck component."""

    time_s: float
    parts_s: dict[str, float]
    partitions: list[dict]
    proven_optimal: bool
    gap: float

    @classmethod
    def of(cls, graph: DataflowGraph | None, system: System, network_s: dict[str, float], solver, time_limit_s):
        if graph is None or len(graph) == 0:
            return cls(0.0, dict.fromkeys(COMPONENTS, 0.0), [], True, 0.0)
        res = partition(graph, system, network_time_s=network_s, solver=solver, time_limit_s=time_limit_s)
        parts = dict.fromkeys(COMPONENTS, 0.0)
        rows = []
        for p in res.partitions:
            for k, v in cls.split(p.compute_s, p.memory_s, p.network_s, p.time_s, system.chip.overlap).items():
                parts[k] += v
            rows.append(p.to_dict() if hasattr(p, "to_dict") else dict(p.__dict__))
        return cls(res.time_s, parts, rows, bool(res.proven_optimal), float(res.gap or 0.0))

    @staticmethod
    def split(compute_s: float, memory_s: float, network_s: float, time_s: float, overlap: bool) -> dict[str, float]:
        """One partition's time split into its parts; they add up to ``time_s``.

        Compute (with the partition's fixed overheads: kernel launch, tile start-up) comes first;
        memory counts only its time not hidden under compute (``max(c, m) - c`` when the chip
        overlaps them, all of it when it does not); the network (TP collectives) the rest. Binning
        a whole partition under its dominant term instead made "compute" grow when memory got
        faster (a partition flipping from memory- to compute-bound); with this split the compute
        part of a partition does not depend on memory bandwidth at all.

        >>> def show(parts): return {k: round(v, 9) for k, v in parts.items()}
        >>> show(PhaseTime.split(1.0, 1.5, 0.2, 1.6, overlap=True))      # memory-bound, 0.1 s overhead
        {'compute': 1.1, 'memory': 0.5, 'tp_comm': 0.0}
        >>> show(PhaseTime.split(1.0, 0.5, 0.2, 1.7, overlap=False))
        {'compute': 1.0, 'memory': 0.5, 'tp_comm': 0.2}
        """
        combined = max(compute_s, memory_s, network_s) if overlap else compute_s + memory_s + network_s
        busy = min(combined, time_s)
        compute = min(compute_s, busy)
        exposed_memory = (max(compute_s, memory_s) if overlap else compute_s + memory_s) - compute_s
        memory = max(0.0, min(busy - compute, exposed_memory))
        return {"compute": compute + (time_s - busy), "memory": memory, "tp_comm": max(0.0, busy - compute - memory)}

    def scaled(self, factor: float) -> dict[str, float]:
        return {k: v * factor for k, v in self.parts_s.items()}


@dataclass
class BlockTimes:
    """Forward / backward / selective-recompute times of one sharded block (layer, embedding, head)."""

    sharded: ShardedGraph
    fwd: PhaseTime
    bwd: PhaseTime
    attention_core: PhaseTime
    attention_core_bwd: PhaseTime | None = None  # solved only for cp > 1 (hides the K/V ring)

    def backward_s(self, recompute: str) -> float:
        extra = {"none": 0.0, "selective": self.attention_core.time_s, "full": self.fwd.time_s}[recompute]
        return self.bwd.time_s + extra

    def parts(self, recompute: str) -> dict[str, float]:
        extra = {"none": None, "selective": self.attention_core, "full": self.fwd}[recompute]
        out = {k: self.fwd.parts_s[k] + self.bwd.parts_s[k] + (extra.parts_s[k] if extra else 0.0) for k in COMPONENTS}
        return out

    @property
    def params_per_chip(self) -> float:
        return self.sharded.graph.params()


@dataclass
class Evaluation:
    """Everything computed for one mapping (the search keeps the best)."""

    mapping: Mapping
    iteration_time_s: float
    breakdown_s: dict[str, float]
    memory: "mem.MemoryBreakdown"
    fits: bool
    layer: BlockTimes
    layers_per_stage: list[int]
    stage_fwd_s: list[float]
    stage_bwd_s: list[float]
    proven_optimal: bool
    input_bound: bool = False
    notes: list[str] = field(default_factory=list)
    io: IOTerms | None = None  # input and checkpoint details (dfmodel.inter_chip.io)


@dataclass
class MemoryFloorMiss:
    """What :meth:`LLMModel.evaluate` returns (when screening) for a mapping whose memory
    lower bound already exceeds the chip: ``memory`` is that bound, never an overestimate."""

    mapping: Mapping
    memory: "mem.MemoryBreakdown"
    fits: bool = False
    iteration_time_s: float = float("inf")


def _is_attention_core(kernel) -> bool:
    """Kernels selective recompute re-runs (Korthikanti et al. 2022, section 4.3): the attention
    score, softmax (and dropout) and attention-times-value, which hold the s^2 activations."""
    return (
        kernel.phase == Phase.forward
        and "attention" in kernel.group
        and kernel.weight_bytes == 0
        and kernel.kind in (KernelKind.matmul, KernelKind.reduction)
        and kernel.efficiency != "attention"  # FlashAttention's backward recomputes on its own
    )


#: The linear layers whose GEMMs Megatron's tp_comm_overlap pairs with the TP collectives.
UB_LINEAR = ("qkv", "out_proj", "fc1", "fc2")


def _userbuffers_s(phase: PhaseTime, tp: int) -> float:
    """A layer phase's time with the TP collectives chunked under their GEMMs
    (:func:`dfmodel.netmodels.nccl.tp_overlapped_phase_s`; GEMMs slowed by the SMs the exchange
    holds, :func:`~dfmodel.netmodels.nccl.userbuffers_gemm_slowdown`)."""
    def linear(row) -> bool:
        return any(len(p := k.split(".")) > 1 and p[1] in UB_LINEAR for k in row["kernels"])

    gemm_s = sum(max(r["compute_s"], r["memory_s"]) for r in phase.partitions if linear(r))
    comm_s = sum(r["network_s"] for r in phase.partitions)
    if comm_s <= 0 or gemm_s <= 0:
        return phase.time_s
    return nccl.tp_overlapped_phase_s(phase.time_s, phase.parts_s["tp_comm"], gemm_s, comm_s, tp,
                                      gemm_slowdown=nccl.userbuffers_gemm_slowdown())


@lru_cache(maxsize=65536)
def _balance(num_layers: int, pp: int, interleave: int, layer_s: float, first_s: float, last_s: float) -> tuple[int, ...]:
    """Memoised :func:`pipeline.balance_layers`: candidates differing only in placement of
    PP/DP share their layer split."""
    return tuple(pipe.balance_layers(num_layers, pp, interleave, layer_s, first_s, last_s))


class LLMModel:
    """Cost model of LLM training on one system; ``evaluate(mapping)`` and ``lower_bound``."""

    def __init__(self, workload, system: System, *, solver: str = "auto", time_limit_s: float | None = None):
        self.workload = resolve_attention(workload, system.chip.execution)
        self.system = system
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.costs = CostTable(system)
        self.model = self.workload.model
        self.training = self.workload.training
        self.precision = Precision(self.training.precision)
        self._graphs: dict[int, object] = {}
        self._blocks: dict[tuple, BlockTimes | None] = {}
        self._memory_floors: dict[tuple, "mem.MemoryBreakdown"] = {}

    # -- graphs and inner solves (cached) ------------------------------------------------------
    def graphs(self, micro_batch: int, cp: int = 1, ep: int = 1):
        """Graphs of one micro-batch on one cp rank (cp = 1: the whole sequence) and one of
        ``ep`` expert-parallel ranks (MoE: it holds ``E / ep`` experts)."""
        key = (micro_batch if cp == 1 else (micro_batch, cp)) if ep == 1 else (micro_batch, cp, "ep", ep)
        if key not in self._graphs:
            if cp == 1:
                self._graphs[key] = build_graphs(self.workload, batch=micro_batch, ep=ep)
            else:
                local = self.model.seq_len // cp
                w = self.workload.model_copy(update={"model": self.model.model_copy(update={"seq_len": local})})
                gs, full = build_graphs(w, batch=micro_batch, ep=ep), self.graphs(1, 1, ep)
                self._graphs[key] = replace(
                    gs,
                    layer=with_params_of(cp_rank_graph(gs.layer, cp, local), full.layer),
                    embedding=with_params_of(gs.embedding, full.embedding),
                    head=with_params_of(gs.head, full.head),
                )
        return self._graphs[key]

    def block(self, which: str, micro_batch: int, tp: int, tp_group, sp: bool, cp: int = 1,
              ep: int = 1) -> BlockTimes | None:
        ep = ep if which == "layer" else 1  # only the layer holds experts
        key = (which, micro_batch, tp, tp_group, sp) + ((cp,) if cp > 1 else ()) + ((("ep", ep),) if ep > 1 else ())
        if key not in self._blocks:
            graph = getattr(self.graphs(micro_batch, cp, ep), which)
            self._blocks[key] = None if graph is None else self._solve_block(graph, tp, tp_group, sp, core_bwd=cp > 1)
        return self._blocks[key]

    def _solve_block(self, graph: DataflowGraph, tp: int, tp_group, sp: bool, core_bwd: bool = False) -> BlockTimes:
        sharded = shard(graph, self.system, TPGroup(tp, tp_group), self.costs, sequence_parallel=sp, solver=self.solver,
                        megatron_layouts=True)  # time and memory from the same (Megatron) layouts
        g = sharded.graph
        by_phase = {
            "fwd": [k.name for k in g.kernels if k.phase == Phase.forward],
            "bwd": [k.name for k in g.kernels if k.phase != Phase.forward],
            "core": [k.name for k in g.kernels if _is_attention_core(k)],
            "core_bwd": [k.name for k in g.kernels if k.phase != Phase.forward and is_attention_core(k)],
        }
        net = sharded.network_time_s

        def run(names):
            if not names:
                return PhaseTime.of(None, self.system, {}, self.solver, self.time_limit_s)
            sub = g.subgraph(names, name=f"{g.name}.{len(names)}")
            return PhaseTime.of(sub, self.system, {n: net[n] for n in names if n in net}, self.solver, self.time_limit_s)

        return BlockTimes(sharded, run(by_phase["fwd"]), run(by_phase["bwd"]), run(by_phase["core"]),
                          run(by_phase["core_bwd"]) if core_bwd else None)

    # -- bounds ---------------------------------------------------------------------------------
    @cached_property
    def num_layers(self) -> int:
        return self.model.num_layers

    @cached_property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        moe = getattr(self.model, "moe", None)
        return moe.num_experts if moe is not None else 0

    @lru_cache(maxsize=None)  # noqa: B019 -- one model per search; keys are small ints/strings
    def compute_floor_s(self, micro_batch: int, recompute: str) -> float:
        """Per-chip-group compute time of one micro-batch through the whole model on ONE chip:
        every kernel's FLOP at the chip's achieved peak (no padding), plus recompute."""
        gs = self.graphs(micro_batch)
        chip = self.system.chip

        def floor(graph, pred=lambda k: True):
            if graph is None:
                return 0.0
            total = 0.0
            for k in graph.kernels:
                if not pred(k) or k.kind == KernelKind.comm:
                    continue
                total += k.flop / achieved_rate_Fps(chip, k, self.precision)
            return total

        layer = floor(gs.layer)
        extra = {
            "none": 0.0,
            "selective": floor(gs.layer, _is_attention_core),
            "full": floor(gs.layer, lambda k: k.phase == Phase.forward),
        }[recompute]
        return (layer + extra) * self.num_layers + floor(gs.embedding) + floor(gs.head)

    def lower_bound_s(self, m: Mapping) -> float:
        """Valid lower bound on ``evaluate(m).iteration_time_s``.

        Each chip does at least 1/tp of the compute floor of its stage, and a stage at least
        the average (a cp rank does exactly 1/cp of the FLOP: see :mod:`.context`); the 1F1B makespan ``m T* + (sum T - T*)/v`` grows with the bottleneck
        ``T* >= avg``, so it is at least ``(m + (pp - 1)/v) avg``. The optimizer step is added
        with the fewest parameters a chip can hold."""
        avg_stage_s = self.compute_floor_s(m.micro_batch, m.recompute) / (m.tp * m.cp * m.pp)
        pipeline_s = (m.num_micro_batches + (m.pp - 1) / m.interleave) * avg_stage_s
        return pipeline_s + self.optimizer_s(m, self.params_per_chip_floor(m))

    def refined_bound_s(self, m: Mapping) -> float | None:
        """A tighter valid bound once the candidate's blocks are solved (None before): the same
        pipeline argument with the exact per-micro-batch stage times summed over all stages."""
        key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel) + ((m.cp,) if m.cp > 1 else ())
        ep_key = (("ep", m.ep),) if m.ep > 1 else ()
        blocks = [self._blocks.get((w, *key, *(ep_key if w == "layer" else ())), False)
                  for w in ("layer", "embedding", "head")]
        if blocks[0] is False or blocks[0] is None or any(b is False for b in blocks):
            return None
        layer, emb, head = blocks
        total = self.num_layers * sum(self._layer_compute_s(m, layer))
        total += sum(b.fwd.time_s + b.backward_s("none") for b in (emb, head) if b)
        avg_stage_s = total / m.pp
        pipeline_s = (m.num_micro_batches + (m.pp - 1) / m.interleave) * avg_stage_s
        return pipeline_s + self.optimizer_s(m, self.params_per_chip_floor(m))

    @staticmethod
    def _layer_compute_s(m: Mapping, layer: BlockTimes) -> tuple[float, float]:
        """One layer's (forward, backward) time per micro-batch without the exposed cp/ep/ZeRO-3
        communication, as :meth:`evaluate` composes it (with ``tp_comm_overlap`` the TP
        collectives chunked under their GEMMs, which can be faster than the phases as solved:
        a bound from the solved phases alone overshot such mappings by up to 6%)."""
        if m.tp_comm_overlap and m.tp > 1:  # Megatron tp_comm_overlap (TE userbuffers)
            ub = layer.__dict__.get("_userbuffers_s")  # per block and tp (a bound is asked often)
            if ub is None or ub[0] != m.tp:
                ub = layer.__dict__["_userbuffers_s"] = (m.tp, _userbuffers_s(layer.fwd, m.tp),
                                                          _userbuffers_s(layer.bwd, m.tp))
            _, fwd_ub, bwd_ub = ub
            redo = {"none": 0.0, "selective": layer.attention_core.time_s, "full": fwd_ub}[m.recompute]
            return fwd_ub, bwd_ub + redo
        return layer.fwd.time_s, layer.backward_s(m.recompute)

    def params_per_chip_floor(self, m: Mapping) -> float:
        """Fewest parameters any chip can hold: all of them split evenly over TP x PP (MoE:
        expert parameters also over ep; their optimizer state, sharded over dp x cp / ep ranks,
        is then ``expert / (dp x cp)`` per chip as the dense part's, so this stays a floor)."""
        total, layer, layer_experts = self._param_counts
        if total is None:
            return 0.0
        return (total - self.num_layers * layer_experts * (1 - 1 / m.ep)) / (m.tp * m.pp)

    @cached_property
    def _param_counts(self) -> tuple:
        """(all parameters or None, one layer's, one layer's MoE expert parameters): what the
        bounds read on every candidate, counted once (summing kernels costs ~50 us each time)."""
        g = self.graphs(1)
        total = g.params() if hasattr(g, "params") else None
        return total, g.layer.params(), expert_params(g.layer)

    def optimizer_s(self, m: Mapping, params_per_chip: float) -> float:
        shard_dp = m.dp_cp if m.distributed_optimizer else 1
        return memory_time_s(self.system.chip, OPTIMIZER_BYTES_PER_PARAM * params_per_chip / shard_dp)

    # -- memory ---------------------------------------------------------------------------------
    def memory_floor_bytes(self, m: Mapping) -> float:
        """Least memory per chip any choice of recompute / SP / optimizer sharding / layer split
        can reach for these degrees and micro-batching (valid: prunes before any inner solve)."""
        return mem.memory_lower_bound_bytes(
            num_layers=self.num_layers,
            params_per_layer=self._param_counts[1] - self._param_counts[2] * (1 - 1 / m.ep),
            seq_len=self.model.seq_len // m.cp,
            micro_batch=m.micro_batch,
            hidden=self.model.hidden,
            tp=m.tp,
            pp=m.pp,
            dp=m.dp_cp,
            num_micro_batches=m.num_micro_batches,
            bytes_per_element=self.precision.bytes,
            zero_stage=m.zero_stage if m.zero_stage >= 2 else None,
            bytes_per_param_optimizer=(mem.REMAINDER_BYTES + 8 if getattr(self.training, "param_remainders", False)
                                       else 12),  # never above the state llm_memory_per_chip counts
        )

    def _block_key(self, which: str, m: Mapping) -> tuple:
        return (which, m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel) + ((m.cp,) if m.cp > 1 else ())

    def memory_before_blocks(self, m: Mapping) -> "mem.MemoryBreakdown":
        """A valid lower bound on ``evaluate(m).memory`` (the worst stage), without solving a block.

        A chip holds at least ``1/tp`` of every parameter (TP splits a weight at most ``tp``
        ways; Megatron replicates only the norms), and whatever the layer split, some stage
        holds at least ``ceil(L / pp)`` layers. Memory only grows with parameters and layers
        (:func:`memory.llm_memory_per_chip`), so the worst stage needs at least the least, over
        stages ``i``, of the split with those ``ceil(L / pp)`` layers on stage ``i`` and none
        elsewhere. test_search.py checks it against ``evaluate`` on every candidate."""
        key = tuple(v for k, v in vars(m).items() if k != "placement")
        if key not in self._memory_floors:
            g = self.graphs(1)
            experts = expert_params(g.layer) / (m.ep * m.tp)  # a rank holds E / ep experts, split tp ways
            layer = (g.layer.params() - expert_params(g.layer)) / m.tp + experts
            emb = g.embedding.params() / m.tp if g.embedding is not None else 0.0
            head = g.head.params() / m.tp if g.head is not None else 0.0
            head += mem.tied_embedding_copy_params(vocab=self.model.vocab_size, hidden=self.model.hidden, tp=m.tp,
                                                   pp=m.pp, tie_embeddings=self.model.tie_embeddings)
            k = -(-self.num_layers // m.pp)
            best = None
            # a middle stage i holds no embedding or head and fewer micro-batches in flight the
            # later it is (memory.in_flight_micro_batches), so of the middle stages the last one
            # (pp - 2) gives the least: three splits instead of pp (each costs O(pp))
            for i in sorted({0, max(0, m.pp - 2), m.pp - 1}):
                stages = [0] * m.pp
                stages[i] = k
                params = [n * layer for n in stages]
                params[0] += emb
                params[-1] += head
                b = self.memory_check(m, params, stages, layer, layer_expert_params=experts)
                if best is None or b.total_bytes < best.total_bytes:
                    best = b
            self._memory_floors[key] = best
        return self._memory_floors[key]

    def memory_check(self, m: Mapping, params_per_stage: list[float], layers_per_stage: list[int],
                     layer_params: float, layer_sharded: DataflowGraph | None = None,
                     layer_expert_params: float | None = None) -> "mem.MemoryBreakdown":
        """Worst stage's memory per chip (weights, grads, optimizer, activations in flight,
        reserve): :func:`memory.llm_memory_per_chip`. ``params_per_stage`` holds the layer
        parameters plus the embedding (first stage) and head and tied copy (last stage);
        ``layer_params`` is one layer's parameters on a chip, of which ``layer_expert_params``
        (default: counted on ``layer_sharded``) are MoE expert parameters."""
        if layer_expert_params is None:
            layer_expert_params = expert_params(layer_sharded)
        first = params_per_stage[0] - layers_per_stage[0] * layer_params
        last = params_per_stage[-1] - layers_per_stage[-1] * layer_params if m.pp > 1 else 0.0
        chip_memory = self.system.chip.memory
        return mem.llm_memory_per_chip(
            model=self.model, training=self.training, attention=self.model.attention or "unfused",
            tp=m.tp, pp=m.pp, dp=m.dp_cp, micro_batch=m.micro_batch, num_micro_batches=m.num_micro_batches,
            interleave=m.interleave, recompute=m.recompute, sequence_parallel=m.sequence_parallel,
            distributed_optimizer=m.distributed_optimizer, layer_params_per_chip=layer_params,
            first_params=first, last_params=last, layers_per_stage=layers_per_stage,
            capacity_bytes=chip_memory.capacity_bytes, reserve_bytes=chip_memory.reserve_bytes,
            cp=m.cp, zero_stage=m.zero_stage, layer_expert_params_per_chip=layer_expert_params, ep=m.ep)

    # -- the full evaluation ----------------------------------------------------------------------
    #: :func:`dfmodel.inter_chip.search.search` may pass ``cutoff_s`` and ``screen_memory``
    evaluate_accepts_cutoff = True

    def evaluate(self, m: Mapping, cutoff_s: float | None = None,
                 screen_memory: bool = False) -> "Evaluation | MemoryFloorMiss | None":
        """The mapping's time, memory and breakdown. With ``cutoff_s``: None instead when a
        valid lower bound proves the time above it before the costly pipeline simulation (the
        search then needs no more than that). With ``screen_memory``: a
        :class:`MemoryFloorMiss` when :meth:`memory_before_blocks` proves, before any block
        solve, that it cannot fit."""
        if screen_memory and self._blocks.get(self._block_key("layer", m)) is None:
            floor = self.memory_before_blocks(m)
            if not floor.fits:
                return MemoryFloorMiss(m, floor)
        tp_group, pp_group = m.group("tp"), m.group("pp")
        dp_group = merge_groups(self.system, m.group("cp"), m.group("dp"))  # Megatron-Core dp x cp
        key = (m.micro_batch, m.tp, tp_group, m.sequence_parallel)
        layer = self.block("layer", *key, m.cp, m.ep)
        emb = self.block("embedding", *key, m.cp)
        head = self.block("head", *key, m.cp)
        # exposed communication per layer and micro-batch, by breakdown key: (forward, backward)
        extra = self._layer_comm(m, layer, dp_group)
        extra_f = sum(f for f, _ in extra.values())
        extra_b = sum(b for _, b in extra.values())
        t_f = layer.fwd.time_s + extra_f
        t_b = layer.backward_s(m.recompute) + extra_b
        if m.tp_comm_overlap and m.tp > 1:  # Megatron tp_comm_overlap (TE userbuffers)
            fwd_ub, bwd_ub = _userbuffers_s(layer.fwd, m.tp), _userbuffers_s(layer.bwd, m.tp)
            redo = {"none": 0.0, "selective": layer.attention_core.time_s, "full": fwd_ub}[m.recompute]
            t_f, t_b = fwd_ub + extra_f, bwd_ub + redo + extra_b
        emb_f, emb_b = (emb.fwd.time_s, emb.backward_s("none")) if emb else (0.0, 0.0)
        head_f, head_b = (head.fwd.time_s, head.backward_s("none")) if head else (0.0, 0.0)
        if m.zero_stage == 3:  # their parameters are gathered like a layer's
            emb_f, emb_b = self._fsdp_exposed(emb, emb_f, emb_b, m, dp_group)
            head_f, head_b = self._fsdp_exposed(head, head_f, head_b, m, dp_group)

        layers = _balance(self.num_layers, m.pp, m.interleave, t_f + t_b, emb_f + emb_b, head_f + head_b)
        stages = self._stage_layers(layers, m)
        stage_fwd = [n * t_f for n in stages]
        stage_bwd = [n * t_b for n in stages]
        stage_fwd[0] += emb_f
        stage_bwd[0] += emb_b
        stage_fwd[-1] += head_f
        stage_bwd[-1] += head_b

        p2p_s = 0.0
        if m.pp > 1:
            act_bytes = m.micro_batch * (self.model.seq_len // m.cp) * self.model.hidden * self.training.activation_bytes / m.tp
            p2p_s = self.costs.time_s("p2p", act_bytes, pp_group)
        pt = pipe.pipeline_time(stage_fwd, stage_bwd, m.num_micro_batches, m.interleave, p2p_s)
        if not pt.exact and m.interleave > 1:
            if cutoff_s is not None and (pipe.simulated_lower_bound_s(stage_fwd, stage_bwd, m.num_micro_batches,
                                                                       m.interleave, p2p_s)
                                         + self.optimizer_s(m, self.params_per_chip_floor(m))) > cutoff_s:
                return None  # the step is at least pipeline + optimizer; DP sync and I/O add >= 0
            # the closed form is only a lower bound when p2p exceeds a chunk op: simulate
            pt = pipe.pipeline_time_simulated(stage_fwd, stage_bwd, m.num_micro_batches, m.interleave, p2p_s)

        params_stage = [n * layer.params_per_chip for n in stages]
        params_stage[0] += emb.params_per_chip if emb else 0.0
        params_stage[-1] += head.params_per_chip if head else 0.0
        params_stage[-1] += mem.tied_embedding_copy_params(
            vocab=self.model.vocab_size, hidden=self.model.hidden, tp=m.tp, pp=m.pp,
            tie_embeddings=self.model.tie_embeddings)
        worst_params = max(params_stage)

        dp_exposed = self._dp_sync_s(m, worst_params, stage_fwd[0], stage_bwd[0], dp_group)
        # MoE: expert state is sharded over dp x cp / ep ranks, not dp x cp (Megatron-Core's
        # expert data parallel group): ep times the per-chip optimizer bytes of its local experts
        worst_experts = stages[max(range(m.pp), key=lambda i: params_stage[i])] * expert_params(layer.sharded.graph)
        opt_s = self.optimizer_s(m, worst_params + (m.ep - 1) * worst_experts)
        step_s = pt.total_s + dp_exposed + opt_s
        io = io_terms(self.system, self.training, self.training.global_batch, step_s, self.checkpoint_state(m),
                      source=self.workload.source)
        input_s = io.input_s
        total = step_s + input_s + io.checkpoint_s

        b = max(range(m.pp), key=lambda i: stage_fwd[i] + stage_bwd[i])
        busy = m.num_micro_batches * (stage_fwd[b] + stage_bwd[b])
        # the bottleneck stage's busy time: exposed per-layer communication, the rest by component
        comm = {k: m.num_micro_batches * stages[b] * (f + bw) for k, (f, bw) in extra.items()}
        if m.zero_stage == 3:
            for blk, f0, b0, here in ((emb, emb_f, emb_b, b == 0), (head, head_f, head_b, b == m.pp - 1)):
                if blk and here:
                    exposed = (f0 - blk.fwd.time_s) + (b0 - blk.backward_s("none"))
                    comm["dp_comm"] = comm.get("dp_comm", 0.0) + m.num_micro_batches * exposed
        shares = self._stage_shares(stages[b], m, layer, emb if b == 0 else None, head if b == m.pp - 1 else None)
        rest = busy - sum(comm.values())
        breakdown = {k: rest * shares[k] for k in COMPONENTS}
        pp_comm = min(max(pt.total_s - busy, 0.0), pt.p2p_exposed_s)
        breakdown.update(
            pp_comm=pp_comm,
            bubble=max(pt.total_s - busy - pp_comm, 0.0),
            dp_comm=dp_exposed + comm.pop("dp_comm", 0.0),
            optimizer=opt_s,
            input=input_s,
            checkpoint=io.checkpoint_s,
        )
        for k in COMM_KEYS:  # every dimension's key, 0 when it has none
            breakdown[k] = breakdown.get(k, 0.0) + comm.pop(k, 0.0)
        memory = self.memory_check(m, params_stage, stages, layer.params_per_chip, layer.sharded.graph)
        proven = layer.fwd.proven_optimal and layer.bwd.proven_optimal
        return Evaluation(
            m,
            total,
            breakdown,
            memory,
            memory.fits,
            layer,
            stages,
            stage_fwd,
            stage_bwd,
            proven,
            input_bound=input_s > 0,
            io=io,
        )

    def checkpoint_state(self, m: Mapping):
        """What a checkpoint of this mapping saves and who writes it (None: no checkpointing)."""
        ckpt = getattr(self.training, "checkpoint", None)
        if ckpt is None:
            return None
        return checkpoint_state(self.graphs(1).params(), num_chips=self.system.num_chips, tp=m.tp, pp=m.pp,
                                dp=m.dp_cp, checkpoint=ckpt)

    # -- communication terms of the record's dimensions -----------------------------------------
    def _layer_comm(self, m: Mapping, layer: BlockTimes, dp_group) -> dict[str, tuple[float, float]]:
        """Exposed communication of one layer and micro-batch, (forward, backward) per key."""
        out: dict[str, tuple[float, float]] = {}
        if m.cp > 1:
            kv = kv_bytes_per_rank(seq_len=self.model.seq_len, micro_batch=m.micro_batch, cp=m.cp, tp=m.tp,
                                   num_kv_heads=self.model.num_kv_heads, head_dim=self._kv_head_dim,
                                   bytes_per_element=self.training.activation_bytes)
            core_b = layer.attention_core_bwd.time_s if layer.attention_core_bwd else 0.0
            x = cp_exchange(m.cp_comm, m.cp, kv, layer.attention_core.time_s, core_b, self.costs, m.group("cp"))
            # recompute re-runs the forward attention, and with it the K/V exchange
            again = x.fwd_s if m.recompute in ("selective", "full") else 0.0
            out["cp_comm"] = (x.fwd_s, x.bwd_s + again)
        if m.ep > 1:
            out["ep_comm"] = self._ep_comm(m)
        if m.zero_stage == 3:
            f, b = self._fsdp_exposed(layer, layer.fwd.time_s, layer.backward_s(m.recompute), m, dp_group)
            out["dp_comm"] = (f - layer.fwd.time_s, b - layer.backward_s(m.recompute))
        return out

    @cached_property
    def _kv_head_dim(self) -> float:
        """Mean of the key and value head dims (K + V bytes = 2 x this per head): h / a, or
        MLA's ``(qk_nope + qk_rope + v_head) / 2`` (it exchanges every head's full K and V)."""
        mla = getattr(self.model, "mla", None)
        return (mla.qk_head_dim + mla.v_head_dim) / 2 if mla else self.model.hidden // self.model.num_heads

    def _ep_comm(self, m: Mapping) -> tuple[float, float]:
        """Exposed MoE token all-to-alls of one layer and micro-batch over the ep group.

        Megatron-Core's ``MoEAlltoAllTokenDispatcher``: forward = dispatch + combine, backward =
        their two transposes, each an all-to-all in which a rank sends
        :func:`~dfmodel.graph.builders.moe.dispatch_bytes_per_rank` (its ``T / tp`` sequence-
        parallel tokens x top_k x capacity x imbalance rows of ``h`` activations, the ``(ep-1)/ep``
        bound for other ranks). They sit on the critical path between router and experts and
        are exposed whole (no overlap with the layer's compute; Megatron-Core overlaps them only
        across micro-batches with its separate 1F1B A2A-overlap schedule, not modelled). Full
        recomputation runs the forward pair again.
        """
        tokens = m.micro_batch * (self.model.seq_len // m.cp) // m.tp
        nbytes = dispatch_bytes_per_rank(tokens, self.model.moe, self.model.hidden, self.training.activation_bytes, m.ep)
        # the cost table's all_to_all takes the whole local buffer (S/p to each member): send
        # bytes x ep / (ep - 1)
        one_s = self.costs.time_s("all_to_all", nbytes * m.ep / (m.ep - 1), m.group("ep"))
        again = 2 * one_s if m.recompute == "full" else 0.0
        return 2 * one_s, 2 * one_s + again

    def _fsdp_exposed(self, blk: BlockTimes | None, fwd_s: float, bwd_s: float, m: Mapping, group) -> tuple[float, float]:
        """ZeRO-3 / FSDP times of one block per micro-batch: (forward, backward) with the
        parameter gathers and gradient reduce-scatter.

        Forward: all-gather the block's ``P e`` parameter bytes over the dp x cp ranks;
        backward: all-gather them again and reduce-scatter the ``P e`` gradient bytes (PyTorch
        FSDP ``FULL_SHARD``; Rajbhandari et al. 2020 sec. 5.3: 3x the traffic of a plain
        all-reduce's half). With prefetch (``overlap_param_gather``) the gather of the next
        block runs under this block's compute: only the excess is exposed, ``max(0, comm -
        compute)``; without it the collectives are exposed whole.
        """
        if blk is None or m.dp_cp == 1:
            return fwd_s, bwd_s
        # 16-bit parameters gathered, gradients reduce-scattered in the framework's reduce precision
        ag = self.costs.time_s("all_gather", blk.params_per_chip * self.training.activation_bytes, group)
        rs = self.costs.time_s("reduce_scatter", blk.params_per_chip * self.training.grad_bytes, group)
        if m.overlap_param_gather:
            return max(fwd_s, ag), max(bwd_s, ag + rs)
        return fwd_s + ag, bwd_s + ag + rs

    def _dp_sync_s(self, m: Mapping, params: float, fwd0_s: float, bwd0_s: float, group) -> float:
        """Exposed gradient synchronisation over the dp x cp ranks at the end of the iteration.

        Stage 0 runs the last backward, so its gradients sync last (its backward is the window).
        ZeRO 0: all-reduce; 1: reduce-scatter of gradients + all-gather of the updated parameters
        (Megatron's distributed optimizer); 2: as 1, but the gradients are reduce-scattered
        after every micro-batch's backward (DeepSpeed ZeRO-2 with gradient accumulation), the
        first ``m - 1`` under the next micro-batch's backward; 3: the per-block collectives of
        :meth:`_fsdp_exposed`, nothing at the end. A collective whose overlap flag is off is
        exposed whole; the others share the window as :func:`pipeline.dp_sync_exposed_s` says.
        """
        if m.dp_cp == 1 or m.zero_stage == 3:
            return 0.0
        grad_bytes = params * self.training.grad_bytes  # fp32 for bf16/fp8 (Megatron)
        if m.zero_stage == 0:
            reduce_s, gather_s = self.costs.time_s("all_reduce", grad_bytes, group), 0.0
        else:  # gradients reduce-scattered, 16-bit parameters all-gathered
            reduce_s = self.costs.time_s("reduce_scatter", grad_bytes, group)
            gather_s = self.costs.time_s("all_gather", params * self.training.activation_bytes, group)
        hidden = (reduce_s if m.overlap_grad_reduce else 0.0) + (gather_s if m.overlap_param_gather else 0.0)
        exposed = (reduce_s if not m.overlap_grad_reduce else 0.0) + (gather_s if not m.overlap_param_gather else 0.0)
        if hidden:
            exposed += pipe.dp_sync_exposed_s(
                sync_s=hidden, grad_elements=params, chunk_backward_s=bwd0_s / m.interleave,
                interleave=m.interleave, pp=m.pp, overlap_fraction=self.system.dp_overlap,
                bucket_elements=pipe.megatron_bucket_elements(m.dp_cp))
        if m.zero_stage == 2 and m.num_micro_batches > 1:
            window = bwd0_s * self.system.dp_overlap if m.overlap_grad_reduce else 0.0
            exposed += (m.num_micro_batches - 1) * max(0.0, reduce_s - window)
        return exposed

    def _stage_layers(self, layers: tuple[int, ...], m: Mapping) -> list[int]:
        """Layers per physical stage (interleaved chunks summed)."""
        if len(layers) == m.pp:
            return list(layers)
        return [sum(layers[i::m.pp]) for i in range(m.pp)]

    def _stage_shares(self, n_layers: int, m: Mapping, layer: BlockTimes, emb, head) -> dict[str, float]:
        parts = {k: n_layers * v for k, v in layer.parts(m.recompute).items()}
        for blk in (emb, head):
            if blk:
                for k, v in blk.parts("none").items():
                    parts[k] += v
        total = sum(parts.values()) or 1.0
        return {k: v / total for k, v in parts.items()}


__all__ = ["LLMModel", "Evaluation", "compute_time_s"]
