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

import contextlib
import math
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache, partial

from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.moe import expert_params, routed_rows
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.pipeline_layout import PipelineLayout, parse_pipeline_layout
from dfmodel.graph.workload import resolve_for_chip
from dfmodel.inter_chip import memory as mem
from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip import pipeline as pipe
from dfmodel.inter_chip.checkpoint import checkpoint_state
from dfmodel.inter_chip.config import DIM_NAMES, Knobs, Mapping
from dfmodel.inter_chip import experts as moe_terms
from dfmodel.inter_chip import block_floor as bf
from dfmodel.inter_chip import comm_floor, dataflow_floor
from dfmodel.inter_chip.context import cp_exchange, cp_rank_graph, is_attention_core, kv_bytes_per_rank, with_params_of
from dfmodel.inter_chip.io import IOTerms, io_terms
from dfmodel.inter_chip.onchip_stash import OnChipStash, onchip_graphs, stash_tensors
from dfmodel.inter_chip.onchip_stash import layer_times as stash_layer_times
from dfmodel.inter_chip.sharding import ShardedGraph, TPGroup, plan_free_params, shard
from dfmodel.intra_chip import partition
from dfmodel.intra_chip.api import floor_time_s
from dfmodel.netmodels import CostTable, merge_groups, nccl
from dfmodel.graph.builders.llm import FP8_CAST_EXTRA_BYTES
from dfmodel.system.processor import (achieved_rate_Fps, compute_time_s, fp8_operand_prep_s,
                                      graph_launched, memory_time_s)
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
    onchip: OnChipStash | None = None  # dataflow chips: fwd/bwd with the stash kept in SRAM

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
    #: the time-balanced layer split did not fit the chip: this is the least bottleneck that does
    split_moved: bool = False


@dataclass
class MemoryFloorMiss:
    """What :meth:`LLMModel.evaluate` returns (when screening) for a mapping whose memory
    lower bound already exceeds the chip: ``memory`` is that bound, never an overestimate."""

    mapping: Mapping
    memory: "mem.MemoryBreakdown"
    fits: bool = False
    iteration_time_s: float = float("inf")


#: Mapping fields no memory term reads (overlap flags, the placement, the CP exchange's kind):
#: :meth:`LLMModel.memory_before_blocks` memoises its floor without them
_MEMORY_BLIND = frozenset(("placement", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
                           "overlap_moe_expert_parallel_comm", "cp_comm"))


class _PlacementDependent(LookupError):
    """A block's parameters per chip depend on its TP group's placement (:meth:`LLMModel._block_params`
    without one)."""


def _last_true(pred, lo: int, hi: int) -> int | None:
    """Largest ``x`` in ``[lo, hi]`` with ``pred(x)`` for a predicate true up to some point and
    false after it (None: false at ``lo``), by bisection."""
    if not pred(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid - 1)
    return lo


def _first_true(pred, lo: int, hi: int) -> int | None:
    """Smallest ``x`` in ``[lo, hi]`` with ``pred(x)`` for a predicate false up to some point and
    true after it (None: false at ``hi``), by bisection."""
    if not pred(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
    return lo


def _pass_knobs(m) -> tuple:
    """What the dataflow pass floors read of a mapping (``dataflow_floor.pass_floor_s``, its
    TP groups given apart)."""
    return (m.micro_batch, m.recompute, m.tp, m.cp, m.ep_outside_tp, m.whole_experts, m.pp, m.num_micro_batches,
            m.sequence_parallel, m.tp_comm_overlap)


def _memory_knobs(m) -> tuple:
    """The mapping's fields memory reads (all but :data:`_MEMORY_BLIND`): memo keys of the memory checks."""
    return tuple(v for k, v in vars(m).items() if k not in _MEMORY_BLIND)


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
#: bytes of one amax in TE's delayed-scaling buffers (fp32, ``amax_history`` rows)
FP8_AMAX_BYTES = 4
#: a run's userbuffers SMs per TE exchange (:meth:`Training.userbuffers_config`); None: NeMo's tables
UBConfig = tuple[tuple[str, int], ...] | None


def _is_ub_linear(kernel, linears: tuple[str, ...] = UB_LINEAR) -> bool:
    """A GEMM tp_comm_overlap pairs with a TP collective (as ``_userbuffers_split`` finds them)."""
    p = kernel.name.split(".")
    return len(p) > 1 and p[1] in linears


def _userbuffers_s(phase: PhaseTime, tp: int, sms: int = nccl.H100_SMS, ub_config: UBConfig = None) -> float:
    """A layer phase's time with the TP collectives chunked under their GEMMs: each exchange
    under its own GEMM (:data:`UB_PAIRS`, :func:`dfmodel.netmodels.nccl.tp_comm_overlap_s` per
    pair), so an exchange longer than its GEMM stays partly exposed (FP8 halves the projection's
    GEMM, not its 16-bit reduce-scatter). Each GEMM is slowed by the SMs its own exchange holds
    (:func:`~dfmodel.netmodels.nccl.userbuffers_sms`: the run's ``ub_config``,
    :meth:`Training.userbuffers_config`, else NeMo's per-GEMM configs; of the chip's ``sms``).
    Never below the pooled overlap of all the phase's GEMMs and exchanges
    (:func:`~dfmodel.netmodels.nccl.tp_overlapped_phase_s`, what the search's floors use):
    ``sum max >= max sum``."""
    return _userbuffers_split(phase, tp, sms, ub_config)[0]


def _userbuffers_parts(phase: PhaseTime, tp: int, sms: int = nccl.H100_SMS, ub_config: UBConfig = None) -> dict[str, float]:
    """The phase's breakdown parts with userbuffers: the TP communication still exposed after
    the overlap stays ``tp_comm``; the GEMMs' slowdown from the SMs the exchanges hold counts as
    compute; memory unchanged. They add up to :func:`_userbuffers_s`."""
    time_s, exposed_s = _userbuffers_split(phase, tp, sms, ub_config)
    parts = dict(phase.parts_s)
    before = phase.time_s - parts["tp_comm"]  # the phase without its exposed TP communication
    parts["tp_comm"] = exposed_s
    parts["compute"] += time_s - before - exposed_s
    return parts


#: In an MoE layer userbuffers serve attention's linears only. Megatron-Core's TELinear
#: (megatron/core/extensions/transformer_engine.py) turns them off for expert linears ("Disable ub
#: overlap for experts": ub_split_ag / ub_split_rs False when is_expert) and gives TE no TP group
#: for them (explicit_expert_comm): the experts' TP exchange is the token dispatcher's own
#: collective, exposed. The TP collectives userbuffers still hide there are those of QKV's input and
#: its gradient and of the projection's output and its gradient (tensor names of build_llm_layer).
UB_MOE_LINEAR = ("qkv", "out_proj")
UB_MOE_TENSORS = ("ln1_out", "d_ln1_out", "attn_out", "d_r1")
_is_ub_moe_linear = partial(_is_ub_linear, linears=UB_MOE_LINEAR)


def _is_moe_phase(phase: PhaseTime) -> bool:
    """Whether a layer phase is an MoE layer's (it has the router: ``fwd/bwd/wgrad.router``)."""
    return any(k.split(".")[1:2] == ["router"] for r in phase.partitions for k in r["kernels"])


def _comm_tensor(row) -> str:
    """The tensor a communication partition moves (``commN.<collective>.<tensor>``), else ''."""
    k = row["kernels"][0] if len(row["kernels"]) == 1 else ""
    return k.split(".", 2)[2] if k.startswith("comm") and k.count(".") >= 2 else ""


#: The GEMM each userbuffers exchange runs under (TE v1.9-1.12 ``transformer_engine/pytorch/module``):
#: forward, the sequence-parallel all-gather of a column-parallel layer's input is chunked under its
#: own GEMM (``ub_overlap_ag``: QKV's ``ln1_out``, FC1's ``ln2_out``) and a row-parallel layer's
#: reduce-scatter under its own GEMM (``ub_overlap_rs``: the projection's ``attn_out``, FC2's
#: ``mlp_out``); backward, a row-parallel layer's gradient all-gather under its data-gradient GEMM
#: (``d_y`` before FC2's, ``d_r1`` before the projection's), and a column-parallel layer's input
#: all-gather under its data-gradient GEMM (``ub_bulk_dgrad``) and its data-gradient reduce-scatter
#: under its weight-gradient GEMM (``ub_bulk_wgrad``: ``d_ln2_out``, ``d_ln1_out``). An exchange
#: hides only under its own GEMM: one longer than that GEMM stays exposed however long the others.
UB_PAIRS = {("forward", "ln1_out"): "fwd.qkv", ("forward", "attn_out"): "fwd.out_proj",
            ("forward", "ln2_out"): "fwd.fc1", ("forward", "mlp_out"): "fwd.fc2",
            ("backward", "d_y"): "bwd.fc2", ("backward", "d_r1"): "bwd.out_proj",
            ("backward", "ln2_out"): "bwd.fc1", ("backward", "d_ln2_out"): "wgrad.fc1",
            ("backward", "ln1_out"): "bwd.qkv", ("backward", "d_ln1_out"): "wgrad.qkv"}


def _ub_exchanges(phase: PhaseTime, moe: bool) -> tuple[dict[str, float], float]:
    """({GEMM kernel name: network seconds of the exchange(s) under it}, those exchanges' share of
    the phase's exposed ``tp_comm``) of a layer phase under userbuffers (:data:`UB_PAIRS`; in an
    MoE layer attention's exchanges only, :data:`UB_MOE_TENSORS`)."""
    kernels = {k for r in phase.partitions for k in r["kernels"]}
    direction = "backward" if any(k.startswith(("bwd.", "wgrad.")) for k in kernels) else "forward"
    comm_of: dict[str, float] = {}
    exposed_s = 0.0
    for r in phase.partitions:
        tensor = _comm_tensor(r)
        gemm = UB_PAIRS.get((direction, tensor))
        if gemm not in kernels or r["network_s"] <= 0 or (moe and tensor not in UB_MOE_TENSORS):
            continue
        comm_of[gemm] = comm_of.get(gemm, 0.0) + r["network_s"]
        exposed_s += PhaseTime.split(r["compute_s"], r["memory_s"], r["network_s"], r["time_s"], True)["tp_comm"]
    return comm_of, exposed_s


def _userbuffers_split(phase: PhaseTime, tp: int, sms: int, ub_config: UBConfig = None) -> tuple[float, float]:
    """(time, TP communication still exposed) of a phase under userbuffers (:func:`_userbuffers_s`).
    Each exchange runs chunked under its own GEMM (:data:`UB_PAIRS`,
    :func:`~dfmodel.netmodels.nccl.tp_comm_overlap_s` per pair); a GEMM without one runs slowed by
    its exchange's SMs only; an exchange without its GEMM (the experts' in an MoE layer,
    :data:`UB_MOE_LINEAR`; small weight-gradient all-reduces) keeps its exposed share."""
    moe = _is_moe_phase(phase)
    ub_linear = UB_MOE_LINEAR if moe else UB_LINEAR

    def linear(row) -> tuple[str, str] | None:
        for k in row["kernels"]:
            p = k.split(".")
            if len(p) > 1 and p[1] in ub_linear:
                return p[1], {"fwd": "fprop", "bwd": "dgrad", "wgrad": "wgrad"}.get(p[0], "fprop")
        return None

    config = None if ub_config is None else dict(ub_config)
    comm_of, paired_exposed_s = _ub_exchanges(phase, moe)
    gemm_s = slowed_s = ub_s = 0.0
    for r in phase.partitions:
        role = linear(r)
        if role is None:
            continue
        t = max(r["compute_s"], r["memory_s"])
        slow = nccl.contended_kernel_s(1.0, 0.0, comm_channels=min(nccl.userbuffers_sms(*role, tp, config), sms - 1),
                                       sms=sms, comm_hbm_Bps=0.0, hbm_Bps=1.0)
        c = sum(comm_of.get(k, 0.0) for k in r["kernels"])
        gemm_s += t
        slowed_s += t * slow
        ub_s += nccl.tp_comm_overlap_s(t, c, tp, gemm_slowdown=slow) if c > 0 else t * slow
    if gemm_s <= 0 or paired_exposed_s <= 0:
        return phase.time_s, phase.parts_s["tp_comm"]
    time_s = phase.time_s - gemm_s - paired_exposed_s + ub_s
    return time_s, max(0.0, phase.parts_s["tp_comm"] - paired_exposed_s + ub_s - slowed_s)


def _layer_times_s(layer: BlockTimes, m: Mapping, sms: int = nccl.H100_SMS, ub_config: UBConfig = None) -> tuple[float, float]:
    """(forward, backward incl. recompute) of one layer and micro-batch before the record's
    extra communication; with Megatron's ``tp_comm_overlap`` (TE userbuffers) the TP collectives
    run under their GEMMs (:func:`_userbuffers_s`, on a chip of ``sms`` SMs), so the time can be
    below the phase's; ``ub_config``: the run's userbuffers SMs (:meth:`Training.userbuffers_config`)."""
    if m.tp_comm_overlap and m.tp > 1:
        fwd_ub, bwd_ub = _kept_on(layer, "_userbuffers_s", (m.tp, sms, ub_config),  # bounds ask often
                                  lambda: (_userbuffers_s(layer.fwd, m.tp, sms, ub_config),
                                           _userbuffers_s(layer.bwd, m.tp, sms, ub_config)))
        redo = {"none": 0.0, "selective": layer.attention_core.time_s, "full": fwd_ub}[m.recompute]
        return fwd_ub, bwd_ub + redo
    return layer.fwd.time_s, layer.backward_s(m.recompute)


#: FP8 GEMMs whose input operand is a layer norm's output that Transformer Engine's
#: LayerNormLinear quantises itself (Megatron-Core's TELayerNormColumnParallelLinear before QKV
#: and FC1; how much that saves is the recipe's ``norm_bytes``, :mod:`dfmodel.graph.fp8`). FC2 is
#: not one: Megatron-Core's MLP runs the activation as its own 16-bit kernel
#: (megatron/core/transformer/mlp.py ``MLP.forward``: ``bias_swiglu_impl`` / ``bias_gelu_impl``
#: on ``linear_fc1``'s output, then ``linear_fc2``, a TERowParallelLinear that casts its input;
#: the same in the experts, moe/experts.py), and MoE experts' FC1 reads the 16-bit permuted tokens.
FP8_NORM_INPUT = ("fwd.qkv", "fwd.fc1")


#: Expert GEMMs whose FP8 input crosses the all-to-all when ``moe.dispatch_fp8`` (the tokens before
#: the up-projection, the gradients before the down-projection's data gradient; DeepSeek-V3 sec. 3.3.3)
FP8_DISPATCHED = ("fwd.fc1", "bwd.fc2")


def _fp8_prep_s(layer: BlockTimes, chip, recipe: str = "delayed",
                dispatch_fp8: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of Transformer Engine's FP8 operand cast and
    transpose kernels in one layer under FP8 ``recipe``
    (:func:`dfmodel.system.processor.fp8_operand_prep_s`), 0 for a layer without FP8 GEMMs or on
    a chip that does not run kernel by kernel.

    Every forward and data-gradient FP8 GEMM's A operand (the activation, or the incoming
    gradient: ``m x k`` as the rank's GEMM reads it) is prepared for the weight-gradient GEMM
    (transposed, or a second copy quantised) and quantised on the rank's shard, from a layer
    norm's output (:data:`FP8_NORM_INPUT`), from a 16-bit tensor, or (``dispatch_fp8``, the expert
    GEMMs of :data:`FP8_DISPATCHED`) by the sender before the all-to-all; the shard is the
    elements the builder charges its cast bytes for, ``extra_memory_bytes / FP8_CAST_EXTRA_BYTES``
    (the sender's tokens for a dispatched operand). These kernels ran inside the GEMM's
    roofline before (hidden under its arithmetic); TE runs them on their own, before the GEMM.
    """
    return _kept_on(layer, "_fp8_prep_s", (recipe, dispatch_fp8),
                    lambda: _phase_sums_s(layer, chip, lambda k: _fp8_kernel_prep_s(k, chip, recipe, dispatch_fp8)))


def _fp8_kernel_prep_s(k, chip, recipe: str, dispatch_fp8: bool) -> float:
    """One kernel's share of :func:`_fp8_prep_s`: 0 unless it is a forward or data-gradient FP8 GEMM."""
    if k.precision != "fp8" or not k.kind.is_matrix or k.phase == Phase.weight_grad:
        return 0.0
    d = k.dims
    gathered = d.get("b", 1) * d.get("m", 0) * d.get("k", 0)
    shard = k.extra_memory_bytes / FP8_CAST_EXTRA_BYTES
    name = k.name.split("/")[-1]
    return fp8_operand_prep_s(chip, gathered, shard, from_norm=name in FP8_NORM_INPUT and not k.expert,
                              recipe=recipe, dispatched=dispatch_fp8 and k.expert and name in FP8_DISPATCHED)


#: kernels of one Q or K RMSNorm (TE ``RMSNorm``, Megatron-Core ``qk_layernorm`` as TENorm): one
#: forward; a backward and its weight-gradient finalize (TE common/normalization/rmsnorm/
#: rmsnorm_bwd_kernels.cuh ``rmsnorm_bwd_tuned_kernel`` + ``rmsnorm_bwd_finalize_tuned_kernel``)
QK_NORM_KERNELS = (1, 2)


def _qk_norm_s(layer: BlockTimes, chip, activation_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of a layer's query and key RMSNorms
    (``model.qk_norm``; Megatron-Core attention.py ``self.q_layernorm(query)`` /
    ``self.k_layernorm(key)`` after the QKV split), as kernels of their own: forward reads the
    rank's Q and K and writes them normed (2 passes), backward reads their gradient and the saved
    input and writes the input gradient (3 passes), at the achieved DRAM bandwidth, plus each
    kernel's launch. The rank's Q and K are the QKV GEMM's output less V (``(a + kv) / (a + 2 kv)``
    of it). 0 on a chip that does not run kernel by kernel (a compiler fuses the norm)."""
    if chip.execution != "kernel_by_kernel":
        return 0.0, 0.0
    return _kept_on(layer, "_qk_norm_s", activation_bytes, lambda: _qk_norm_uncached_s(layer, chip, activation_bytes))


def _qk_norm_uncached_s(layer: BlockTimes, chip, activation_bytes: float) -> tuple[float, float]:
    qkv = next((k for k in layer.sharded.graph.kernels if k.name.split("/")[-1] == "fwd.qkv"), None)
    if qkv is None:
        return 0.0, 0.0
    meta = layer.sharded.graph.meta
    a, kv = meta.get("num_heads", 1), meta.get("num_kv_heads", 1)
    elements = qkv.dims.get("m", 0) * qkv.dims.get("n", 0) * (a + kv) / (a + 2 * kv)
    launch = chip.efficiency.kernel_overhead_s
    f_k, b_k = QK_NORM_KERNELS
    return (memory_time_s(chip, 2 * elements * activation_bytes) + 2 * f_k * launch,
            memory_time_s(chip, 3 * elements * activation_bytes) + 2 * b_k * launch)


def _kept_on(block, name: str, key, compute):
    """``compute()`` kept on ``block`` (a :class:`BlockTimes`, built for one chip and precision)
    under ``name`` while ``key`` (the knobs it also depends on) stays the same: the bounds of the
    search ask for the same block's terms many times."""
    hit = block.__dict__.get(name)
    if hit is None or hit[0] != key:
        hit = block.__dict__[name] = (key, compute())
    return hit[1]


def _phase_sums_s(block, chip, seconds_of) -> tuple[float, float]:
    """(forward, backward incl. weight-gradient) sums of ``seconds_of(kernel)`` over a block's
    kernels; 0 on a chip that does not run kernel by kernel (per-kernel launch, cast and epilogue
    terms do not exist on a dataflow chip, whose partitions stream)."""
    fwd = bwd = 0.0
    if chip.execution == "kernel_by_kernel":
        for k in block.sharded.graph.kernels:
            t = seconds_of(k)
            if k.phase == Phase.forward:
                fwd += t
            else:
                bwd += t
    return fwd, bwd


def _host_linear_s(chip, kernel_precision: str | None, precision: str) -> float:
    """Host time of one linear module of a ``precision`` workload whose GEMM runs at
    ``kernel_precision`` (None: the workload's). An fp32 override (the router GEMM under
    Megatron-Core's ``moe_router_dtype``: the same eager ``linear`` call on up-cast operands, no
    Transformer Engine FP8 bookkeeping) costs the workload's 16-bit module."""
    if kernel_precision == "fp32" and precision != "fp32":
        return chip.efficiency.host_linear_at("bf16" if precision == "fp8" else precision)
    return chip.efficiency.host_linear_at(kernel_precision or precision)


def _host_floor_s(layer: BlockTimes, chip, precision: str) -> float:
    """Least time of one layer's forward + backward on one micro-batch that the host allows: the
    CPU of an eager framework queues the layer's kernels no faster than its per-module work, so
    the GPU waits on it when the layer's kernels are short (0 on a chip without a
    ``host_linear_s`` table, or one that does not run kernel by kernel).

    The sum over the layer's linear modules (forward matmuls that carry weights: QKV, projection,
    FC1, FC2; an MoE layer's router and expert GEMMs) of the chip's ``efficiency.host_linear_s`` at
    the module's GEMM precision. Transformer Engine's ``te.Linear`` measured on H100 by its
    maintainers (NVIDIA/TransformerEngine issue #445, ptrendx 2023-10-16, a 1024 x 1024 x 1024
    linear whose GPU work is microseconds, so the time is the host's): 0.57 ms in 16 bit and 2.07 ms
    in FP8, used per module forward + backward (an upper reading: the issue's test times ten forward
    calls; see the caveat at ``host_linear_s`` in systems/dgx_h100.yaml) (the cast / amax / scale
    bookkeeping; issue #761: "scheduling
    a te.Linear layer in FP8 takes more than 2x more time compared to BF16", the GPU idle in the FP8
    forward; PR #1016: "FP8 training is frequently bottlenecked by CPU overheads"). The other
    kernels of a layer (norms, attention, element-wise) are not counted: a lower estimate.
    """
    if not chip.efficiency.host_linear_s:
        return 0.0
    return _kept_on(layer, "_host_floor_s", None, lambda: _phase_sums_s(
        layer, chip, lambda k: _host_linear_s(chip, k.precision, precision)
        if k.phase == Phase.forward and k.kind.is_matrix and k.weight_bytes > 0 else 0.0)[0])


@lru_cache(maxsize=65536)
def _full_recompute_cap(onchip: OnChipStash, sram_bytes: float, layers: int, in_flight: float, ckpt_bytes: float) -> int:
    """Most layers a stage can hold with their stash on chip under full recompute: the largest
    ``n <= layers`` with ``peak + S + n in_flight ckpt <= SRAM`` (:meth:`OnChipStash.layers_on_chip`
    keeps all ``n`` of a stage then, none otherwise)."""
    free = sram_bytes - onchip.peak_sram_bytes - onchip.stash_bytes
    if free < 0:
        return 0
    per = in_flight * ckpt_bytes
    # (1e-12: a quotient a rounding below an integer still admits it, as the evaluation's sum may)
    return layers if per <= 0 else min(layers, math.floor(free / per * (1 + 1e-12)))


@lru_cache(maxsize=65536)
def _balance(num_layers: int, pp: int, interleave: int, layer_s: float, first_s: float, last_s: float) -> tuple[int, ...]:
    """Memoised :func:`pipeline.balance_layers`: candidates differing only in placement of
    PP/DP share their layer split."""
    return tuple(pipe.balance_layers(num_layers, pp, interleave, layer_s, first_s, last_s))


#: Mapping fields no pre-solve bound term reads (:meth:`LLMModel.presolve_bound_s`; it reads
#: the TP and ep groups of the placement)
_NOT_IN_PRESOLVE = frozenset(("placement", "cp_comm", "overlap_grad_reduce", "overlap_param_gather"))


def _check_fp8_recipe(training, system: System) -> None:
    """One-line error for an FP8 recipe the chip cannot run: MXFP8 needs block-scaled FP8 tensor
    cores, compute capability 10.x (TE quantization.py ``_compute_mxfp8_support``), the same
    generation as FP8 GEMMs in any layout (TE utils.py ``is_non_tn_fp8_gemm_supported``: 10.x-11.x),
    which is what :attr:`~dfmodel.system.schema.Chip.fp8_gemm_any_layout` records."""
    if training.precision == "fp8" and training.fp8.recipe == "mxfp8" and not system.chip.fp8_gemm_any_layout:
        raise InputError(f"training.fp8.recipe: mxfp8 needs a Blackwell-class chip (chip.fp8_gemm_any_layout), "
                         f"not {system.chip.name}; use delayed, current or blockwise")


def _pipeline_layout_of(workload) -> PipelineLayout | None:
    """The workload's ``training.pipeline_layout``, parsed and checked against the model: every
    transformer and MTP layer named once (Megatron-Core ``validate_layer_layout``), else a
    one-line error naming the field."""
    text = getattr(workload.training, "pipeline_layout", None)
    if text is None:
        return None
    lay = parse_pipeline_layout(text)
    moe = getattr(workload.model, "moe", None)
    mtp = moe.mtp_layers if moe is not None else 0
    if lay.num_decoder_layers != workload.model.num_layers or lay.num_mtp_layers != mtp:
        raise InputError(f"holds {lay.num_decoder_layers} transformer layers (t) and {lay.num_mtp_layers} MTP layers (m);"
                         f" the model has {workload.model.num_layers} (model.num_layers) and {mtp} "
                         f"(model.moe.mtp_layers)", source=getattr(workload, "source", None),
                         field="training.pipeline_layout")
    return lay


class LLMModel:
    """Cost model of LLM training on one system; ``evaluate(mapping)`` and ``lower_bound``."""

    #: which floor of the sharded layer the dataflow pass floors take (:meth:`floor_stage`): none,
    #: its forward phases only, or all of it
    sharded_floor_stage = "full"
    #: the bound by which the last :meth:`evaluate` with a cutoff proved its mapping past it
    #: (when it returned None: :meth:`_proves_past`), else None
    proven_bound_s: float | None = None

    @property
    def nets_only_floors(self) -> bool:
        """Whether the dataflow pass floors leave out the sharded layer's floor (:meth:`nets_only`)."""
        return self.sharded_floor_stage == "none"

    def __init__(self, workload, system: System, *, solver: str = "auto", time_limit_s: float | None = None):
        self.workload = resolve_for_chip(workload, system.chip)
        if getattr(self.workload.training, "cuda_graphs", False):
            system = graph_launched(system)  # replayed kernels: the in-graph gap, not the launch
        self.system = system
        self.solver = solver
        self.time_limit_s = time_limit_s
        self.costs = CostTable(system)
        self.model = self.workload.model
        self.training = self.workload.training
        self.precision = Precision(self.training.precision)
        _check_fp8_recipe(self.training, system)
        #: Megatron-Core's custom pipeline layout (None: the split evaluate balances itself)
        self.pipeline_layout = _pipeline_layout_of(self.workload)
        self._graphs: dict[int, object] = {}
        self._blocks: dict[tuple, BlockTimes | None] = {}
        self._memory_floors: dict[tuple, "mem.MemoryBreakdown"] = {}
        self._phases: dict[tuple, PhaseTime] = {}  # intra-chip solves by content (_phase_time)
        self._shard_memo: dict = {}  # placement-independent sharding results (sharding.shard)

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
                    dense_layer=(with_params_of(cp_rank_graph(gs.dense_layer, cp, local), full.dense_layer)
                                 if gs.dense_layer is not None else None),
                )
        return self._graphs[key]

    def block(self, which: str, micro_batch: int, tp: int, tp_group, sp: bool, cp: int = 1,
              ep: int = 1, whole_experts: bool = False) -> BlockTimes | None:
        """One block solved on the TP group. The (MoE) layer is one of ``ep`` expert-parallel
        ranks' (of the TP group's, with ``whole_experts``: expert TP 1, the group splits its
        ``E / ep`` experts over its members instead of TP-splitting each)."""
        ep = ep if which == "layer" else 1  # only the (MoE) layer holds experts
        whole_experts = whole_experts and which == "layer" and tp > 1
        key = ((which, micro_batch, tp, tp_group, sp) + ((cp,) if cp > 1 else ()) + ((("ep", ep),) if ep > 1 else ())
               + (("etp1",) if whole_experts else ()))
        if key not in self._blocks:
            failed = self.__dict__.setdefault("_block_failures", {})
            if key in failed:  # no plan fits (e.g. one kernel's SRAM): the same answer for every mapping
                raise failed[key].with_traceback(None)
            graph = getattr(self.graphs(micro_batch, cp, ep), which)
            try:
                self._blocks[key] = None if graph is None else self._solve_block(graph, tp, tp_group, sp,
                                                                                 core_bwd=cp > 1,
                                                                                 whole_experts=whole_experts)
            except InfeasibleError as exc:  # (kept: llama3_405b_128k on 8192 dragonfly chips re-solved
                failed[key] = exc           # 103 failing blocks 4618 times, 15 of its 19 CPU s)
                raise
        return self._blocks[key]

    def _shard_block(self, graph: DataflowGraph, tp: int, tp_group, sp: bool, whole_experts: bool) -> ShardedGraph:
        """A block's graph sharded over the TP group (Megatron layouts: time and memory from the same),
        memoised per (graph, group, knobs): the pre-solve floors, the stash screen, the layer's own
        collectives and the block solve each asked for it (DeepSeek-V3 on 512 dragonfly chips:
        3554 shardings of 1653 distinct blocks). The result is read-only and shared."""
        key = (id(graph), tp, tp_group, sp, whole_experts)
        memo = self.__dict__.setdefault("_sharded_blocks", {})
        hit = memo.get(key)
        if hit is None or hit[0] is not graph:  # (the graph is held: its id is not reused meanwhile)
            sharded = shard(graph, self.system, TPGroup(tp, tp_group), self.costs, sequence_parallel=sp,
                            solver=self.solver, megatron_layouts=True, whole_experts=whole_experts,
                            memo=self._shard_memo)
            hit = memo[key] = (graph, sharded)
        return hit[1]

    def sharded_layer(self, m: Mapping) -> ShardedGraph:
        """``m``'s (MoE) layer sharded on its own TP group, as :meth:`block` shards it before the
        solve (memoised in :meth:`_shard_block`): what the stash cap, the layer's own collectives
        (:meth:`layer_nets_s`) and the dataflow sharded-layer floor read."""
        graph = self.graphs(m.micro_batch, m.cp, m.ep_outside_tp).layer
        return self._shard_block(graph, m.tp, m.group("tp"), m.sequence_parallel, m.whole_experts)

    def _solve_block(self, graph: DataflowGraph, tp: int, tp_group, sp: bool, core_bwd: bool = False,
                     whole_experts: bool = False) -> BlockTimes:
        sharded = self._shard_block(graph, tp, tp_group, sp, whole_experts)
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
            phase_net = {n: net[n] for n in names if n in net}
            # key on what the subgraph would hold, and build it only on a miss
            key = (g.subgraph_key(names), tuple(phase_net.items()))
            return self._phase_time(key, lambda: g.subgraph(names, name=f"{g.name}.{len(names)}"), phase_net)

        onchip = None
        if self.system.chip.execution == "dataflow" and by_phase["fwd"] and by_phase["bwd"]:
            onchip = self._solve_onchip(g, by_phase["fwd"], by_phase["bwd"], net)
        return BlockTimes(sharded, run(by_phase["fwd"]), run(by_phase["bwd"]), run(by_phase["core"]),
                          run(by_phase["core_bwd"]) if core_bwd else None, onchip)

    def _phase_time(self, key: tuple, build, network_s: dict[str, float]) -> "PhaseTime":
        """:meth:`PhaseTime.of` memoised by content: blocks that differ only in knobs the
        phase does not see (a placement that leaves its collectives' times unchanged, a layer
        whose attention core is the same at two TP groups) share one intra-chip solve.
        ``key`` identifies the graph ``build()`` returns; results are read-only."""
        hit = self._phases.get(key)
        if hit is None:
            hit = self._phases[key] = PhaseTime.of(build(), self.system, network_s, self.solver, self.time_limit_s)
        return hit

    def _onchip_saving(self, layer: BlockTimes, m: Mapping, layers: int, stage: int) -> tuple[float, float]:
        """Mean (forward, backward) seconds per layer that stage ``stage`` of ``layers`` layers
        saves by keeping its stash in SRAM (:func:`.onchip_stash.layer_times`)."""
        f_on, b_on, _ = stash_layer_times(
            layer.fwd.time_s, layer.bwd.time_s, layer.onchip, sram_bytes=float(self.system.chip.sram_bytes),
            layers=layers, in_flight=mem.in_flight_micro_batches(m.pp, stage, m.num_micro_batches, m.interleave),
            full_recompute=m.recompute == "full", checkpoint_bytes=self._checkpoint_bytes(m))
        return layer.fwd.time_s - f_on, layer.bwd.time_s - b_on

    def _checkpoint_bytes(self, m: Mapping) -> float:
        """A layer's input per micro-batch and chip (what full recompute keeps)."""
        return m.micro_batch * (self.model.seq_len // m.cp) * self.model.hidden * self.training.activation_bytes / m.tp

    def _solve_onchip(self, g: DataflowGraph, fwd: list[str], bwd: list[str], net,
                      forward_only: bool = False) -> OnChipStash | None:
        """The layer's forward and backward with its stash kept in SRAM (:mod:`.onchip_stash`);
        None when one layer's stash alone exceeds the SRAM (no layer could ever keep it).
        ``forward_only``: the forward plan alone (backward time NaN, peak SRAM the forward's:
        no more than the whole layer's, so :meth:`_onchip_layers_cap` on it caps no lower)."""
        if sum(stash_tensors(g, set(fwd), set(bwd)).values()) > float(self.system.chip.sram_bytes):
            return None
        g_f, g_b, stash = onchip_graphs(g, fwd, bwd)
        net_f, net_b = {n: net[n] for n in fwd if n in net}, {n: net[n] for n in bwd if n in net}
        pf = self._phase_time((g_f.content_key, tuple(net_f.items())), lambda: g_f, net_f)
        if forward_only:
            peak = max((float(r.get("sram_bytes") or 0.0) for r in pf.partitions), default=0.0)
            return OnChipStash(stash, pf.time_s, math.nan, peak)
        pb = self._phase_time((g_b.content_key, tuple(net_b.items())), lambda: g_b, net_b)
        peak = max((float(r.get("sram_bytes") or 0.0) for r in pf.partitions + pb.partitions), default=0.0)
        return OnChipStash(stash, pf.time_s, pb.time_s, peak)

    def stash_cap(self, m: Mapping, forward_only: bool = False) -> int:
        """At most this many of ``m``'s (MoE) layers keep their stash in SRAM (dataflow chips;
        :meth:`_onchip_layers_cap`), from the layer's on-chip plans alone: the layer's DRAM
        phases (the costlier half of its solve) are not solved. ``forward_only``: from the
        on-chip forward plan alone (a cap no lower). The plans are memoised by content, so the
        block solve that may follow reuses them."""
        key = self._block_key("layer", m)
        if key in self._blocks:
            onchip = self._blocks[key].onchip
        else:
            memo = self.__dict__.setdefault("_onchip_alone", {})  # (it keeps the OnChipStash alive: ids key memos)
            mkey = key + (forward_only,)
            if mkey not in memo:
                sharded = self.sharded_layer(m)
                g = sharded.graph
                fwd = [k.name for k in g.kernels if k.phase == Phase.forward]
                bwd = [k.name for k in g.kernels if k.phase != Phase.forward]
                memo[mkey] = self._solve_onchip(g, fwd, bwd, sharded.network_time_s, forward_only)
            onchip = memo[mkey]
        return 0 if onchip is None else self._onchip_layers_cap(m, onchip)

    def _stash_screen(self, m: Mapping, cutoff_s: float) -> bool:
        """True when, on a dataflow chip, ``m`` is proven slower than ``cutoff_s`` from its layer's
        on-chip plans alone (:meth:`stash_bound_s`; first the forward plan, then both), before
        its DRAM phases are solved: a large micro-batch's stash that leaves no room in SRAM
        sends every layer's stash through DRAM, which the dataflow floor then counts."""
        if self.system.chip.execution != "dataflow" or self._block_key("layer", m) in self._blocks:
            return False
        try:  # (first from the layer's sharded graph alone: no phase solved; its own floor last)
            return (self._proves_past(self._nets_bound_s(m), cutoff_s)
                    or self._proves_past(self._forward_shard_bound_s(m), cutoff_s)
                    or self._proves_past(self.shard_bound_s(m), cutoff_s)
                    or any(self._proves_past(self.stash_bound_s(m, fo), cutoff_s) for fo in (True, False)))
        except InfeasibleError:  # (the block solve reports it)
            return False

    def _proves_past(self, bound_s: float, cutoff_s: float) -> bool:
        """``bound_s > cutoff_s``; when so, :meth:`evaluate` returns None and keeps the bound as
        ``proven_bound_s``: the search re-queues a mapping screened against the best time at
        this bound, not at the best (``search._SCREENED``), so the runners-up's cutoff prunes
        it without a second evaluation (DeepSeek-V3 / 8192 dragonfly: 21k of them, 1.7 CPU s)."""
        if bound_s > cutoff_s:
            self.proven_bound_s = bound_s
            return True
        return False

    def stash_bound_s(self, m: Mapping, forward_only: bool = False) -> float:
        """:meth:`presolve_bound_s` (on ``m``'s own TP and ep groups) with at most
        :meth:`stash_cap` layers keeping their stash in SRAM, and the layer's own collectives
        (:meth:`layer_nets_s`): a valid lower bound on ``evaluate(m).iteration_time_s`` on a
        dataflow chip."""
        return self._with_zero2_floor_s(m, self._own_groups_bound_memo_s(m, self.stash_cap(m, forward_only),
                                                                         self.layer_nets_s(m)))

    def shard_bound_s(self, m: Mapping) -> float:
        """:meth:`stash_bound_s` without the stash cap (no on-chip plan solved): the dataflow
        floor with the (MoE) layer's own collectives as sharded on ``m``'s TP group."""
        return self._with_zero2_floor_s(m, self._own_groups_bound_memo_s(m, None, self.layer_nets_s(m)))

    def _nets_bound_s(self, m: Mapping) -> float:
        """:meth:`shard_bound_s` without the sharded layer's own floor (:meth:`nets_only`): the
        layer's collectives on the 1/tp floor. It needs the layer's sharding only, not the plan
        floors of the sharded graph (a quarter of DeepSeek-V3/8192 dragonfly's serial proof), and
        proves most of its stash screens (12.6k of 19.7k); 0 where the layer has no collectives
        of its own (:meth:`layer_nets_s`)."""
        return self._staged_shard_bound_s(m, "none")

    def _forward_shard_bound_s(self, m: Mapping) -> float:
        """:meth:`shard_bound_s` with the sharded layer's floor of its forward phases only (the
        backward's, its costlier two thirds, at the 1/tp floor): between :meth:`_nets_bound_s`
        and :meth:`shard_bound_s`, each a valid bound; 0 as the former."""
        return self._staged_shard_bound_s(m, "forward")

    def _staged_shard_bound_s(self, m: Mapping, stage: str) -> float:
        """:meth:`shard_bound_s` at the sharded floor stage ``stage`` (:meth:`floor_stage`)."""
        if self.layer_nets_s(m) is None:
            return 0.0
        try:
            with self.floor_stage(stage):
                return self.shard_bound_s(m)
        except InfeasibleError:  # (the block solve reports it)
            return 0.0

    def nets_only(self):
        """:meth:`floor_stage` ``none``: the sharded layer's floor left out."""
        return self.floor_stage("none")

    @contextlib.contextmanager
    def floor_stage(self, stage: str):
        """Inside the block the dataflow pass floors with the layer's own collectives take the
        sharded layer's floor (:func:`.dataflow_floor.sharded_layer_floor`) at ``stage``: ``none``
        (left out), ``forward`` (its forward phases only) or ``full``; their memos key on it."""
        before, self.sharded_floor_stage = self.sharded_floor_stage, stage
        try:
            yield
        finally:
            self.sharded_floor_stage = before

    def layer_nets_s(self, m: Mapping) -> tuple[float, float] | None:
        """(forward, backward) network seconds of the (MoE) layer sharded on ``m``'s TP group, as
        :meth:`_solve_block` hands them to its phases (``ShardedGraph.network_time_s``): every
        plan of a phase pays all of them, a partition's network being the sum of its kernels'
        (``intra_chip.cost``), and each partition takes at least its network (overlap) or adds
        it. None without TP or under tp_comm_overlap (its floor pairs them otherwise). The
        sharding is memoised (``_shard_memo``): the block solve that may follow reuses it."""
        if m.tp <= 1 or m.tp_comm_overlap:
            return None
        key = self._block_key("layer", m)
        memo = self.__dict__.setdefault("_layer_nets_memo", {})
        if key not in memo:
            sh = self.sharded_layer(m)
            fwd = {k.name for k in sh.graph.kernels if k.phase == Phase.forward}
            f = sum(v for n, v in sh.network_time_s.items() if n in fwd)
            memo[key] = (f, sum(v for n, v in sh.network_time_s.items() if n not in fwd))
        return memo[key]

    # -- bounds ---------------------------------------------------------------------------------
    @cached_property
    def num_layers(self) -> int:
        return self.model.num_layers

    @cached_property
    def num_dense_layers(self) -> int:
        """Dense layers before an MoE model's MoE layers (``moe.first_dense_layers``; DeepSeek-V3: 3)."""
        return self.graphs(1).num_dense_layers

    @cached_property
    def num_moe_layers(self) -> int:
        """Layers built as :meth:`graphs` ``.layer`` (all of them for a dense model)."""
        return self.num_layers - self.num_dense_layers

    @cached_property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        moe = getattr(self.model, "moe", None)
        return moe.num_experts if moe is not None else 0

    def compute_floor_s(self, micro_batch: int, recompute: str) -> float:
        """Per-chip-group compute time of one micro-batch through the whole model on ONE chip:
        every kernel's FLOP at the chip's achieved peak (no padding), plus recompute."""
        # A memo on the instance, not functools.lru_cache on the method: that cache is the
        # class's and keeps every model (and its memos) alive for the life of the process.
        memo = self.__dict__.setdefault("_compute_floor_memo", {})
        if (micro_batch, recompute) not in memo:
            memo[micro_batch, recompute] = self._compute_floor_s(micro_batch, recompute)
        return memo[micro_batch, recompute]

    def _compute_floor_s(self, micro_batch: int, recompute: str) -> float:
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

        def with_recompute(graph):
            extra = {
                "none": 0.0,
                "selective": floor(graph, _is_attention_core),
                "full": floor(graph, lambda k: k.phase == Phase.forward),
            }[recompute]
            return floor(graph) + extra

        dense = with_recompute(gs.dense_layer) * self.num_dense_layers if self.num_dense_layers else 0.0
        mtp = self.num_mtp_layers  # each MTP module: one more (MoE) layer and the head again
        return (with_recompute(gs.layer) * (self.num_moe_layers + mtp) + dense + floor(gs.embedding)
                + floor(gs.head) * (1 + mtp))

    def presolve_bound_s(self, m: Mapping, cutoff_s: float | None = None) -> float | None:
        """A valid lower bound on ``evaluate(m).iteration_time_s`` of a MoE mapping before its
        blocks are solved, tighter than its group's: the per-kernel / forced TP-collective floor
        on ``m``'s own TP group (:meth:`pass_floor_s`; the group bound takes the cheapest group
        of any placement) plus the token all-to-alls exposed on ``m``'s own ep group (the group
        bound: its cheapest placement's, ``LLMSpace._exposed_ep_s``), or the pipeline bound of
        :meth:`_presolve_pipeline_s` (ZeRO-3 collectives, plain 1F1B's last stage). The search asks it of a
        mapping once, before solving its blocks (a TP group across slow links then never pays
        a block solve). None for a dense model (its search is left as it was). ``cutoff_s``
        (the search's): where the own-group bound, then the shard bound (:meth:`shard_bound_s`),
        already reaches it, the blocks' intra-chip floors (:meth:`_floor_blocks_bound_s`, ~10 of
        DeepSeek-V3/512 dragonfly's 40 serial CPU s) are not computed: the mapping is pruned on
        that bound alone."""
        if self.num_experts <= 1:
            return None
        if self._no_split_fits(m):  # evaluate's memory screen rejects it before any solve
            return None
        # (the blocks' floors where weights must stream: 0.05 CPU s a block key, which on WSE-2's
        # 40 GB SRAM doubled DeepSeek-V3's search for nothing)
        dataflow = self.system.chip.execution == "dataflow" and dataflow_floor.streams_forced(self, m)
        if m.ep <= 1 and (dataflow or m.zero_stage != 3):
            # (ep 1 on GPUs: only ZeRO-3's expert gathers are its own, _moe_fsdp_floor_s)
            return self._floor_blocks_bound_s(m) if dataflow else None
        key = self._presolve_key(m)
        memo = self.__dict__.setdefault("_presolve_memo", {})
        if key not in memo:
            # (where it applies it holds the own-group bound's terms: that one is not needed then)
            memo[key] = self._presolve_pipeline_s(m) or self._own_groups_bound_s(m)
        out = self._with_zero2_floor_s(m, memo[key])
        if not dataflow:
            return out
        if cutoff_s is not None:  # the cheaper bounds first: past the cutoff, no block floor is needed
            if out >= cutoff_s:
                return out
            for staged in (self._nets_bound_s, self._forward_shard_bound_s):  # (evaluate's stash screen asks them anyway)
                out = max(out, staged(m))
                if out >= cutoff_s:
                    return out
            out = max(out, self._shard_bound_or_0(m))
            if out >= cutoff_s:
                return out
        return max(out, self._floor_blocks_bound_s(m))

    @staticmethod
    def _presolve_key(m: Mapping) -> tuple:
        """What the own-group bound (:meth:`_own_groups_bound_s`) of ``m`` reads: every field but
        ``_NOT_IN_PRESOLVE``, and the TP and ep groups of the placement."""
        key = (tuple(v for k, v in vars(m).items() if k not in _NOT_IN_PRESOLVE), m.group("tp"), m.group("ep"))
        if m.zero_stage == 3:  # (the ZeRO-3 floor reads the dp x cp and expert data-parallel groups, and prefetch)
            key += (m.group("dp"), m.group("cp"), m.overlap_param_gather)
        return key

    def _own_groups_bound_memo_s(self, m: Mapping, stash_cap: int | None, layer_nets: tuple | None) -> float:
        """:meth:`_own_groups_bound_s` memoised on :meth:`_presolve_key` (with the cap and the
        layer's collectives): the stash screen asks it of every mapping that reaches
        :meth:`evaluate` (DeepSeek-V3 on 8192 dragonfly chips: ~20k, most differing only in
        fields it does not read)."""
        key = (self._presolve_key(m), stash_cap, layer_nets, self.sharded_floor_stage)
        memo = self.__dict__.setdefault("_own_bound_memo", {})
        if key not in memo:
            memo[key] = self._own_groups_bound_s(m, stash_cap, layer_nets)
        return memo[key]

    def _shard_bound_or_0(self, m: Mapping) -> float:
        """:meth:`shard_bound_s` where the layer has its own collectives (:meth:`layer_nets_s`),
        else 0 (a bound that proves nothing): memoised in the pass floors, so the stash screen
        of :meth:`evaluate` that may follow re-reads it."""
        if self.layer_nets_s(m) is None:
            return 0.0
        try:
            return self.shard_bound_s(m)
        except InfeasibleError:  # (the block solve reports it)
            return 0.0

    def _floor_blocks_bound_s(self, m: Mapping) -> float:
        """Dataflow chips: :meth:`refined_bound_s` with every block's phases at their intra-chip
        floors (:meth:`_floor_block`) instead of their solved times. Valid: the bound grows with
        the blocks' phase times, and each floor is below its solve. On sn30 the TP
        groups across nodes pay their expert collectives in partitions that also stream weights:
        DeepSeek-V3 TP 8 over nodes, EP 8, micro-batch 6, bound 1721 -> 4804 s against 5268 s
        evaluated (the solve: 5-22 CPU s a mapping, the floors ~0.05 s)."""
        if m.tp_comm_overlap and m.tp > 1:
            return 0.0  # (userbuffers re-time the solved partitions: _userbuffers_s reads them)
        dense = self._floor_block("dense_layer", m) if self.num_dense_layers else None
        return self._bound_from_blocks(m, self._floor_block("layer", m), self._floor_block("embedding", m),
                                       self._floor_block("head", m), dense)

    def _floor_block(self, which: str, m: Mapping) -> BlockTimes | None:
        """Block ``which`` of ``m`` as :meth:`block` would solve it, each phase timed by
        :func:`~dfmodel.intra_chip.api.floor_time_s` (its solve's time where solved already); the
        (MoE) layer's on-chip stash variant at 0 s with no SRAM beyond the stash (so at most as
        many layers keep it as the solved one allows, each saving at most its whole floor). None
        when the model has no such block. Memoised per block key; the sharding is
        :meth:`_shard_block`'s, which the later solve reuses."""
        key = self._block_key(which, m)
        memo = self.__dict__.setdefault("_floor_block_memo", {})
        if key in memo:
            return memo[key]
        layer = which == "layer"
        graph = getattr(self.graphs(m.micro_batch, m.cp, m.ep_outside_tp if layer else 1), which)
        if graph is None:
            memo[key] = None
            return None
        whole = m.whole_experts and m.tp > 1 and layer
        sharded = self._shard_block(graph, m.tp, m.group("tp"), m.sequence_parallel, whole)
        g, net = sharded.graph, sharded.network_time_s
        fwd = [k.name for k in g.kernels if k.phase == Phase.forward]
        bwd = [k.name for k in g.kernels if k.phase != Phase.forward]
        core = [k.name for k in g.kernels if _is_attention_core(k)] if m.recompute == "selective" else []

        def floor(names) -> PhaseTime:
            phase_net = {n: net[n] for n in names if n in net}
            pkey = (g.subgraph_key(names), tuple(phase_net.items()))
            solved = self._phases.get(pkey)
            t = solved.time_s if solved is not None else (
                floor_time_s(g.subgraph(names), self.system, network_time_s=phase_net) if names else 0.0)
            return PhaseTime(t, dict.fromkeys(COMPONENTS, 0.0), [], False, 1.0)

        onchip = None
        if layer and fwd and bwd:
            stash = sum(stash_tensors(g, set(fwd), set(bwd)).values())
            if stash <= float(self.system.chip.sram_bytes):
                onchip = OnChipStash(stash, 0.0, 0.0, 0.0)
        memo[key] = BlockTimes(sharded, floor(fwd), floor(bwd), floor(core), None, onchip)
        return memo[key]

    def _presolve_pipeline_s(self, m: Mapping) -> float:
        """A GPU MoE mapping's pipeline bound before any block is solved, on its own TP, dp x cp
        and expert data-parallel groups: the stages' summed time ``sum T`` is at least the
        per-kernel floors of every block (:meth:`pass_floor_s` on ``m``'s TP group) with each MoE
        layer's ZeRO-3 collectives (:meth:`_moe_layer_presolve_s`) and all-to-alls, or pp times
        the larger of the work floor (:meth:`_work_stage_floor_s`) with a stage's all-to-alls and
        the host transfers (:meth:`offload_ep_overlap_s`); it holds :meth:`_own_groups_bound_s`'s
        terms. The step is at least
        ``(M + (pp - 1) / v) sum T / pp`` and, in plain 1F1B, ``pipeline_time = (M - 1) T* +
        sum T >= (M - 1) T_last + sum T`` with ``T_last`` the last stage's floor
        (:meth:`_last_stage_floor_presolve_s`, as :meth:`_bound_from_blocks` takes it once the
        blocks are solved). 0 on dataflow chips (their stash may stay in SRAM) or without a floor."""
        if self.system.chip.execution == "dataflow":
            return 0.0
        group = (tuple(m.group("tp")),)
        pass_s, layer_s = self.pass_floor_s(m, group), self._block_pass_floor_s(m, "layer", group[0])
        if pass_s is None or layer_s is None:
            return 0.0
        n_moe = self.num_moe_layers
        moe_s = self._moe_layer_presolve_s(m, layer_s, self._moe_fsdp_floor_s(m))
        ep_s = n_moe * self._moe_ep_floor_s(m)  # (host transfers hide behind the all-to-alls too)
        sum_s = max(m.pp * max(self._work_stage_floor_s(m, group) + ep_s / m.pp, self.offload_stage_floor_s(m)),
                    pass_s + n_moe * (moe_s - layer_s) + ep_s)
        pipeline_s = (m.num_micro_batches + (m.pp - 1) / m.interleave) * sum_s / m.pp
        if m.pp > 1 and m.interleave == 1:
            last_s = self._last_stage_floor_presolve_s(m)
            if last_s is not None:
                pipeline_s = max(pipeline_s, (m.num_micro_batches - 1) * last_s + sum_s)
        pipeline_s += self.p2p_floor_s(m)
        return (pipeline_s + self.optimizer_s(m, self.params_per_chip_floor(m))) * (1 - 1e-12)

    def _moe_layer_presolve_s(self, m: Mapping, kernels_s: float, z_s: float) -> float:
        """Least time of one MoE layer and micro-batch before its all-to-alls, from its per-kernel
        floor ``kernels_s`` and, under ZeRO-3, its parameter gathers and gradient reduce-scatter
        ``2 ag + rs`` (:meth:`_fsdp_exposed`): added whole without prefetch
        (``overlap_param_gather`` off); with it the phases are ``max(fwd, ag)`` and
        ``max(bwd, ag + rs)``, so at least ``2 ag + rs`` -- unless tp_comm_overlap times the layer
        below the solved phases the max is taken against (then the kernels only). ``z_s``: that
        ``2 ag + rs`` (:meth:`_moe_fsdp_floor_s`; 0: none counted)."""
        if not m.overlap_param_gather:
            return kernels_s + z_s
        return kernels_s if m.tp_comm_overlap and m.tp > 1 else max(kernels_s, z_s)

    def _moe_fsdp_floor_s(self, m: Mapping) -> float:
        """ZeRO-3's ``2 ag + rs`` of one MoE layer per micro-batch (:meth:`_fsdp_collectives_s`) on
        ``m``'s own dp x cp and expert data-parallel groups, at the fewest parameters a chip
        holds (:meth:`_split_parts`: every weight split at most tp ways, E / ep experts a rank,
        split tp ways unless whole); 0 without ZeRO-3, experts or data parallelism."""
        if m.zero_stage != 3 or m.dp_cp == 1 or self.num_experts <= 1:
            return 0.0
        key = (m.placement, m.tp, m.dp, m.cp, m.ep, m.etp)
        memo = self.__dict__.setdefault("_moe_fsdp_floor_memo", {})
        if key not in memo:
            layer, experts = self._split_parts(m)[:2]
            ag, rs = self._fsdp_collectives_s(m, layer, experts, merge_groups(self.system, m.group("cp"), m.group("dp")))
            memo[key] = 2 * ag + rs
        return memo[key]

    def _moe_ep_floor_s(self, m: Mapping) -> float:
        """:meth:`_ep_exposed_floor_s` of an MoE mapping with expert parallelism, else 0."""
        return self._ep_exposed_floor_s(m) if self.num_experts > 1 and m.ep > 1 else 0.0

    def _last_stage_floor_presolve_s(self, m: Mapping) -> float | None:
        """:meth:`_last_stage_floor_s` from per-kernel floors on ``m``'s own TP group, its own
        all-to-alls and ZeRO-3 collectives (:meth:`_last_stage_on_s`)."""
        return self._last_stage_on_s(m, tuple(m.group("tp")), self._moe_ep_floor_s(m), self._moe_fsdp_floor_s(m))

    def _last_stage_on_s(self, m: Mapping, group: tuple, ep_layer_s: float, fsdp_s: float = 0.0) -> float | None:
        """:meth:`_last_stage_floor_s` before any block is solved: per-kernel floors on the TP
        ``group`` (:meth:`_block_pass_floor_s`) of the head, the MTP modules (a MoE layer with
        its all-to-alls ``ep_layer_s`` and the head again, each) and at least one layer, each MoE
        layer with its ZeRO-3 collectives ``fsdp_s`` as :meth:`_moe_layer_presolve_s` counts
        them. None when a block has no floor."""
        head = self._block_pass_floor_s(m, "head", group)
        layer = self._block_pass_floor_s(m, "layer", group)
        if head is None or layer is None:
            return None
        moe_s = self._moe_layer_presolve_s(m, layer, fsdp_s) + ep_layer_s
        # (the dense layers fill the first chunks, experts.dense_layers_per_stage, and the last
        # stage holds at least the chain's last layer: a MoE one whenever the model has any)
        return moe_s + head + self.num_mtp_layers * (moe_s + head)

    def last_stage_bound_s(self, m: Mapping, ep_layer_s: float) -> float:
        """Plain 1F1B's last-stage bound of every placement of ``m``'s knobs (a leaf group's):
        ``(M - 1) T_last + sum T`` plus the least exposed p2p and the optimizer floor, with
        ``T_last`` the least :meth:`_last_stage_on_s` over the TP groups a placement gives and
        ``sum T`` at least pp times the larger of the work floor with a stage's all-to-alls
        (``ep_layer_s`` per MoE layer: at most any placement's) and the host transfers
        (:meth:`offload_ep_overlap_s`). 0 where it does not apply (pp 1, interleaving, dataflow
        chips, a model without experts: its search is left as it was)."""
        if (m.pp <= 1 or m.interleave != 1 or self.num_experts <= 1
                or self.system.chip.execution == "dataflow"):
            return 0.0
        last_s = self.last_stage_floor_min_s(m, ep_layer_s)
        if last_s is None:
            return 0.0
        sum_s = m.pp * max(self._work_stage_floor_s(m) + self.num_moe_layers * ep_layer_s / m.pp,
                           self.offload_stage_floor_s(m))
        pipeline_s = (m.num_micro_batches - 1) * last_s + sum_s + self.p2p_floor_s(m)
        return (pipeline_s + self.optimizer_s(m, self.params_per_chip_floor(m))) * (1 - 1e-12)

    def _split_bound_applies(self, m: Mapping) -> bool:
        """Whether :meth:`split_stage_floor_s` may raise ``m``'s own-group bound
        (:meth:`_own_groups_bound_s`): two plain 1F1B stages on a dataflow chip, nothing offloaded
        (the host transfers hide behind the all-to-alls, :meth:`offload_ep_overlap_s`, which the
        mean-stage bound accounts for)."""
        return self._two_plain_stages(m) and self.system.chip.execution == "dataflow" and not off.uses_offload(m)

    def _two_plain_stages(self, m: Mapping) -> bool:
        """Two plain 1F1B stages whose layer split ``evaluate`` picks (no layout the workload names)."""
        return m.pp == 2 and m.interleave == 1 and self.pipeline_layout is None

    def split_stage_floor_s(self, m: Mapping, ep_layer_s: float, tp_groups=None, stash_cap: int | None = None,
                            layer_nets: tuple | None = None) -> float:
        """Least bottleneck stage time per micro-batch of ``m`` over the layer splits whose
        stages fit the chip's memory, on two plain 1F1B stages of a dataflow chip (0 elsewhere,
        or where a block's parameters depend on the TP group's placement). :meth:`evaluate`
        runs a split that fits, the time-balanced one or the least bottleneck of those that fit
        (``balance_layers(fits=...)``), so ``T* >= min_s max(T_0(s), T_1(s))`` over the fitting
        ``s`` (stage 0 holds the first ``s`` layers), each ``T_i`` at least that stage's
        :func:`.dataflow_floor.pass_floor_s` plus its MoE layers' all-to-alls (``ep_layer_s``
        each). ``T_0`` grows with ``s`` and ``T_1`` shrinks, so the least is at their crossing, or
        at an end of the interval when the crossing lies beyond it: this floor is that end's, and
        0 (no more than the mean stage holds) when the crossing lies inside. Where the first
        stage holds two micro-batches in flight and the second one, DeepSeek-V3 on 512 dragonfly
        chips fits only [26, 35] at micro-batch 4: the mean-stage bound sees 30.5 layers a
        stage, its evaluation 35 (1.3x)."""
        if self.system.chip.execution != "dataflow":
            return 0.0
        fitting = self._fitting_splits(m)
        if not fitting:
            return 0.0
        groups = (self._tp_groups(m) if tp_groups is None else tp_groups) if m.tp > 1 else None
        # (what it reads: the pass floors' knobs and groups, the fitting splits; the search asks
        # again for every placement sharing the TP group and every ZeRO stage sharing the splits)
        key = (_pass_knobs(m), fitting, groups, stash_cap, layer_nets if groups else None,
               self.sharded_floor_stage, ep_layer_s)
        memo = self.__dict__.setdefault("_split_stage_floor_memo", {})
        if key not in memo:
            memo[key] = self._split_stage_floor_of(m, fitting, ep_layer_s, groups, stash_cap, layer_nets)
        return memo[key]

    def _split_stage_floor_of(self, m: Mapping, fitting: tuple[int, int], ep_layer_s: float, groups,
                              stash_cap: int | None, layer_nets: tuple | None) -> float:
        lo, hi = fitting

        def stage_s(stage: int, s: int) -> float:
            moe, dense = (kinds[stage] for kinds in self._split_kinds((s, self.num_layers - s), m))
            return (dataflow_floor.pass_floor_s(self, m, _is_attention_core, groups, stash_cap,
                                                layer_nets if groups else None, stage=(stage, moe, dense))
                    + moe * ep_layer_s)

        # T_0 grows with s and T_1 shrinks: where memory moves the split past their crossing, the
        # least bottleneck is at an end of the interval. With the crossing inside it, the least
        # is within a layer of the mean stage, which the bounds hold already: 0 (its bisection
        # cost DeepSeek-V3 / 8192 dragonfly ~0.5 CPU s and pruned nothing)
        t0_hi, t1_hi = stage_s(0, hi), stage_s(1, hi)
        if t0_hi <= t1_hi:
            return t1_hi * (1 - 1e-12)
        t0_lo, t1_lo = stage_s(0, lo), stage_s(1, lo)
        return t0_lo * (1 - 1e-12) if t0_lo >= t1_lo else 0.0

    def _fitting_splits(self, m: Mapping) -> tuple[int, ...] | None:
        """``(lo, hi)``: the splits of ``m``'s two plain 1F1B stages whose stages fit the chip's
        memory are ``lo <= s <= hi`` (stage 0 holding the first ``s`` layers); ``()`` when none
        does; None for another pipeline or where a block's parameters depend on the TP group's
        placement. A stage's memory grows with its layers, so each bound is found by bisection
        on one stage alone (:meth:`_stage_memory_of` with the other stage empty: the worst stage
        is at least this one). Memoised on the memory knobs."""
        if not self._two_plain_stages(m):
            return None
        key = _memory_knobs(m)
        memo = self.__dict__.setdefault("_fitting_splits_memo", {})
        if key not in memo:
            memo[key] = self._fitting_splits_of(m)
        return memo[key]

    def _fitting_splits_of(self, m: Mapping) -> tuple[int, ...] | None:
        params = self._plan_free_block_params(m)
        if params is None:
            return None
        n = self.num_layers
        hi = _last_true(lambda s: self._stage_fits_split(m, params, 0, s), 1, n - 1)  # stage 0 fits s layers, s <= hi
        lo = _first_true(lambda s: self._stage_fits_split(m, params, 1, s), 1, n - 1)  # stage 1 n - s, s >= lo
        return () if hi is None or lo is None or lo > hi else (lo, hi)

    def _stage_fits_split(self, m: Mapping, params: tuple, stage: int, s: int) -> bool:
        """Whether stage ``stage`` of ``m``'s two fits the chip's memory at split ``s``, the other
        stage empty (:meth:`_stage_memory_of` with ``params``: :meth:`_plan_free_block_params`)."""
        moe_st, dense_st = self._split_kinds((s, self.num_layers - s), m)
        moe_st[1 - stage] = dense_st[1 - stage] = 0
        return self._stage_memory_of(m, params, moe_st, dense_st)[1].fits

    def _no_split_fits(self, m: Mapping) -> bool:
        """True when no split of ``m``'s two plain 1F1B stages fits the chip's memory
        (:meth:`_fitting_splits` is empty); False where it cannot tell (:meth:`_fitting_splits`
        None). The middle split is tried first: where it fits (most mappings) no interval is
        searched, which was 0.6 of DeepSeek-V3 / 8192 dragonfly's 20 CPU s. Memoised on the
        memory knobs."""
        if not self._two_plain_stages(m):
            return False
        key = _memory_knobs(m)
        memo = self.__dict__.setdefault("_no_split_fits_memo", {})
        if key not in memo:
            params = self._plan_free_block_params(m)
            middle = -(-self.num_layers // 2)
            memo[key] = params is not None and not (self._stage_fits_split(m, params, 0, middle)
                                                    and self._stage_fits_split(m, params, 1, middle)
                                                    ) and self._fitting_splits(m) == ()
        return memo[key]

    def _plan_free_block_params(self, m: Mapping) -> tuple | None:
        """:meth:`_block_params` of the layer, embedding, head and dense layer (None for a block
        the model lacks) where none depends on the TP group's placement, else None."""
        try:
            return tuple(self._block_params(which, m, placed=False)
                         for which in ("layer", "embedding", "head", "dense_layer"))
        except _PlacementDependent:
            return None

    def last_stage_floor_min_s(self, m: Mapping, ep_layer_s: float) -> float | None:
        """Least :meth:`_last_stage_on_s` over the TP groups a placement of ``m``'s degrees gives
        (``ep_layer_s``: all-to-alls per MoE layer, at most any placement's); None without floors."""
        lasts = [self._last_stage_on_s(m, tuple(g), ep_layer_s) for g in self._tp_groups(m)]
        return None if not lasts or any(x is None for x in lasts) else min(lasts)

    def _block_pass_floor_s(self, m: Mapping, which: str, group: tuple) -> float | None:
        """One block's share of :meth:`pass_floor_s` per micro-batch on the TP ``group``:
        per-kernel floor plus forced TP collectives (under tp_comm_overlap: overlapped with the
        GEMMs, in an MoE layer attention's only, as :meth:`_pass_floor_of` counts them)."""
        key = (which, m.micro_batch, m.recompute, m.tp, m.cp, m.ep_outside_tp, m.whole_experts,
               m.sequence_parallel and m.tp > 1, m.tp_comm_overlap and m.tp > 1, group)
        memo = self.__dict__.setdefault("_block_pass_floor_memo", {})
        if key in memo:
            return memo[key]
        layer_like = which != "head"
        brc = m.recompute if layer_like else "none"
        ep, whole = (m.ep_outside_tp, m.whole_experts) if which == "layer" else (1, False)
        fl = self._block_floor(which, m.tp, m.cp, m.sequence_parallel, ep, whole)
        k, g = m.micro_batch, group
        if fl is None:
            out = None
        elif layer_like and m.tp_comm_overlap and m.tp > 1:
            split = which == "layer" and self.num_experts > 1
            out = fl.kernels_overlapped_s(k, brc, self._forced_comm_s(fl, k, g, brc, launches=False,
                                                                     paired=True if split else None))
            out += self._forced_comm_s(fl, k, g, brc, launches=False, paired=False) if split else 0.0
        else:
            out = fl.kernels_s(k, brc) + (self._forced_comm_s(fl, k, g, brc) if m.tp > 1 else 0.0)
        memo[key] = out
        return out

    def _own_groups_bound_s(self, m: Mapping, stash_cap: int | None = None, layer_nets: tuple | None = None) -> float:
        """:meth:`lower_bound_s` on ``m``'s own TP group (``stash_cap``, ``layer_nets``: as there)
        plus the token all-to-alls exposed on its own ep group (MoE): before ZeRO-2's exposed
        reduce-scatters."""
        own = (m.group("tp"),)
        out = self.lower_bound_s(m, tp_groups=own, stash_cap=stash_cap, layer_nets=layer_nets)
        ep_stage_s = 0.0
        if self.num_experts > 1 and m.ep > 1:
            ep_stage_s = self.num_moe_layers * self._ep_exposed_floor_s(m) / m.pp
            out += (m.num_micro_batches + (m.pp - 1) / m.interleave) * ep_stage_s
            out -= self.offload_ep_overlap_s(m, ep_stage_s, own, stash_cap, layer_nets)
        if self._split_bound_applies(m):  # (M - 1) T* + sum T, less what this bound holds of it already
            split_s = self.split_stage_floor_s(m, self._moe_ep_floor_s(m), own, stash_cap, layer_nets)
            if split_s > 0.0:
                mean_s = self._mean_stage_floor_s(m, own, stash_cap, layer_nets) + ep_stage_s
                out += (m.num_micro_batches - 1) * max(0.0, split_s - mean_s)
        return out * (1 - 1e-12)

    def _with_zero2_floor_s(self, m: Mapping, bound_s: float) -> float:
        """``bound_s`` plus, under ZeRO-2, the reduce-scatters on ``m``'s own dp x cp and expert
        data-parallel groups over the pipeline part of it (it less the optimizer floor
        :meth:`lower_bound_s` adds)."""
        if m.zero_stage != 2:
            return bound_s
        return bound_s + self.zero2_exposed_floor_s(m, bound_s - self.optimizer_s(m, self.params_per_chip_floor(m)))

    def _ep_exposed_floor_s(self, m: Mapping) -> float:
        """Least exposed all-to-all time of one MoE layer and micro-batch of ``m`` before its
        layer is solved: all of :meth:`_ep_comm` without the overlap option; with it, at least
        the SM share of the communication kernels, and the unpaired warm-up / cool-down micro-
        batches whole (:func:`~dfmodel.inter_chip.experts.with_unpaired`; the same floor as
        ``LLMSpace._ep_layers_s``, on ``m``'s own ep group)."""
        ep_s = sum(self._ep_comm(m))
        if m.overlap_moe_expert_parallel_comm and moe_terms.a2a_overlap_applies(ep=m.ep, num_micro_batches=m.num_micro_batches):
            ep_s *= moe_terms.with_unpaired(moe_terms.a2a_sm_fraction(), pp=m.pp, num_micro_batches=m.num_micro_batches)
        return ep_s

    def lower_bound_s(self, m: Mapping, tp_groups=None, stash_cap: int | None = None,
                      layer_nets: tuple | None = None) -> float:
        """Valid lower bound on ``evaluate(m).iteration_time_s``.

        Each chip does at least 1/tp of the compute floor of its stage, and a stage at least
        the average (a cp rank does exactly 1/cp of the FLOP: see :mod:`.context`); the 1F1B makespan ``m T* + (sum T - T*)/v`` grows with the bottleneck
        ``T* >= avg``, so it is at least ``(m + (pp - 1)/v) avg``. The optimizer step is added
        with the fewest parameters a chip can hold. ``tp_groups``: the TP groups the forced TP
        collectives may run on (default: every one a placement of the degrees gives).
        ``stash_cap`` (dataflow chips): at most this many layers keep their stash in SRAM
        (:meth:`stash_cap`); ``layer_nets`` (dataflow chips, ``tp_groups`` m's own group): the
        layer's own network seconds (:meth:`layer_nets_s`)."""
        avg_stage_s = self._mean_stage_floor_s(m, tp_groups, stash_cap, layer_nets)
        pipeline_s = (m.num_micro_batches + (m.pp - 1) / m.interleave) * avg_stage_s + self.p2p_floor_s(m)
        return pipeline_s + self.optimizer_s(m, self.params_per_chip_floor(m))

    def _mean_stage_floor_s(self, m: Mapping, tp_groups=None, stash_cap: int | None = None,
                            layer_nets: tuple | None = None) -> float:
        """Least mean stage time per micro-batch (:meth:`lower_bound_s`): compute, per-kernel
        traffic and forced TP collectives, host transfers, ZeRO-3's gathers, whichever is larger."""
        return max(self._work_stage_floor_s(m, tp_groups, stash_cap, layer_nets), self.offload_stage_floor_s(m))

    def _work_stage_floor_s(self, m: Mapping, tp_groups=None, stash_cap: int | None = None,
                            layer_nets: tuple | None = None) -> float:
        """:meth:`_mean_stage_floor_s` without the host transfers: what a layer's other exposed
        communication (all-to-alls) adds to, and what the transfers hide behind."""
        avg_stage_s = self.compute_floor_s(m.micro_batch, m.recompute) / (m.tp * m.cp * m.pp)
        kernels_s = self.pass_floor_s(m, tp_groups, stash_cap=stash_cap, layer_nets=layer_nets)  # per-kernel traffic and forced TP collectives (GPUs)
        if kernels_s is not None:
            avg_stage_s = max(avg_stage_s, kernels_s / m.pp)
        # ZeRO-3: every layer's pass takes at least its parameter gathers and gradient reduce-scatter
        return max(avg_stage_s, self.num_layers / m.pp * self.fsdp_layer_floor_s(m))

    def offload_ep_overlap_s(self, m: Mapping, ep_stage_s: float, tp_groups=None, stash_cap: int | None = None,
                             layer_nets: tuple | None = None) -> float:
        """What ``lower_bound_s(m) + (M + (pp - 1) / v) ep_stage_s`` overstates: a layer's host
        transfers hide behind its whole pass, all-to-alls included (:meth:`_with_offload`:
        ``max(t + extras, x)``), so a stage is at least ``max(W + E, X)`` (W: the work floor
        :meth:`_work_stage_floor_s`, E: ``ep_stage_s``, X: the transfers'
        :meth:`offload_stage_floor_s`), not ``max(W, X) + E``; the difference is
        ``min(E, max(0, X - W))`` per micro-batch slot, 0 unless the transfers bind."""
        off_s = self.offload_stage_floor_s(m)
        if off_s <= 0.0 or ep_stage_s <= 0.0:
            return 0.0
        excess_s = off_s - self._work_stage_floor_s(m, tp_groups, stash_cap, layer_nets)
        if excess_s <= 0.0:
            return 0.0
        return (m.num_micro_batches + (m.pp - 1) / m.interleave) * min(ep_stage_s, excess_s) * (1 + 1e-12)

    def zero2_exposed_floor_s(self, m: Mapping, pipeline_floor_s: float, worst_params_floor: float = 0.0,
                              worst_experts_floor: float = 0.0) -> float:
        """Least exposed ZeRO-2 per-micro-batch gradient reduce-scatter of ``m`` (what
        :meth:`_dp_sync_s` adds, ``(M - 1) max(0, R - o b0)``), given a lower bound
        ``pipeline_floor_s`` on the pipeline time T. Stage 0 runs its backward ``b0`` M times,
        so ``b0 <= T / M``; ``T + (M - 1) max(0, R - o T / M)`` grows with T when ``o <= 1``, so
        the step is at least ``A + (M - 1) max(0, R - o A / M)`` for any ``A <= T``. R is the
        worst stage's ``P - X`` non-expert gradients over the dp x cp group at rate ``r_g`` per
        element plus its ``X`` expert ones over the expert data-parallel group at ``r_e``
        (:meth:`_grad_rs_rates`), so ``R >= min(r_g, r_e) P + max(0, r_e - r_g) X`` with P at
        least :meth:`params_per_chip_floor` (and ``worst_params_floor``) and X at least
        ``worst_experts_floor``. With the gradient reduction overlapped, the compute loses ``f`` of
        the hidden part (:meth:`_dp_sync_s`): at least ``(1 - f) E + f (M - 1) R`` for the exposed
        floor E above. 0 unless ZeRO-2 with several micro-batches and no offload."""
        o = self.system.dp_overlap
        if (m.zero_stage != 2 or m.num_micro_batches <= 1 or m.dp_cp == 1 or o > 1
                or m.offload_optimizer != "none" or m.offload_weights or m.offload_activations):
            return 0.0
        if not worst_params_floor and not worst_experts_floor:
            worst_params_floor, worst_experts_floor = self._presolve_stage_floors(m)
        params = max(self.params_per_chip_floor(m), worst_params_floor)
        reduce_floor_s = min(min(r_g, r_e) * params + max(0.0, r_e - r_g) * worst_experts_floor
                             for r_g, r_e in self._grad_rs_rates(m))
        M = m.num_micro_batches
        exposed_s = (M - 1) * max(0.0, reduce_floor_s - o * pipeline_floor_s / M)
        # (_dp_sync_s: the hidden rest of the (M - 1) reductions costs the compute f of itself, so
        # at least (1 - f) E + f (M - 1) R)
        f = self._collective_sm_fraction if m.overlap_grad_reduce else 0.0
        return ((1 - f) * exposed_s + f * (M - 1) * reduce_floor_s) * (1 - 1e-9)

    def _grad_rs_rates(self, m: Mapping) -> tuple:
        """(dp x cp, expert data-parallel) reduce-scatter seconds per gradient element, per
        placement (``m``'s own, or every placement of its degrees when it has none). The cost
        table's collectives are latency + bytes / bandwidth terms (fastest of several
        algorithms), so ``time(b) / b`` never grows with ``b``: the rate of a Megatron bucket
        (``_dp_sync_s`` sends ``k`` buckets of at most ``megatron_bucket_elements``) bounds every
        bucket's. Memoised per degrees (placement-free) or groups."""
        memo = self.__dict__.setdefault("_grad_rs_rate_memo", {})
        key = (m.tp, m.cp, m.pp, m.dp, m.ep, m.etp, m.placement)
        if key not in memo:
            elem_bytes = self.training.grad_bytes
            bucket_bytes = pipe.megatron_bucket_elements(m.dp_cp) * elem_bytes

            def groups(p):
                mm = replace(m, placement=p)
                dp = tuple(merge_groups(self.system, mm.group("cp"), mm.group("dp")))
                return dp, (tuple(self._expert_dp_group(mm)) if self.num_experts > 1 else dp)

            found = [groups(m.placement)] if m.placement else self._placed_groups(m, groups)
            rate = lambda g: self.costs.time_s("reduce_scatter", bucket_bytes, g) / bucket_bytes * elem_bytes
            memo[key] = tuple({(rate(g), rate(h)) for g, h in found})
        return memo[key]

    def _worst_stage_floors(self, m: Mapping, layer: BlockTimes, emb, head, dense) -> tuple[float, float]:
        """:meth:`_stage_floors_of` with the solved blocks' exact per-chip parameters (the
        MoE layer's, its experts', and the ``O`` outside the MoE layers: dense layers,
        embedding, head, MTP, tied copy); (0, 0) while a block is unsolved."""
        e = expert_params(layer.sharded.graph)
        if emb is None or head is None or (self.num_dense_layers and dense is None) or not e:
            return 0.0, 0.0
        lp = layer.params_per_chip
        other = (self.num_dense_layers * (dense.params_per_chip if dense else 0.0) + emb.params_per_chip
                 + head.params_per_chip + self._mtp_params_per_chip(m, lp) - self.num_mtp_layers * lp
                 + mem.tied_embedding_copy_params(vocab=self.model.vocab_size, hidden=self.model.hidden, tp=m.tp,
                                                  pp=m.pp, tie_embeddings=self.model.tie_embeddings))
        params, experts = self._stage_floors_of(m, lp, e, other)
        mean = ((self.num_moe_layers + self.num_mtp_layers) * lp + other) / m.pp  # (O exact: the mean)
        return max(params, mean * (1 - 1e-9)), experts

    def _presolve_stage_floors(self, m: Mapping) -> tuple[float, float]:
        """:meth:`_stage_floors_of` before any block is solved: a chip holds at least ``1 / tp``
        of a layer's non-expert parameters and ``1 / (ep_outside_tp tp)`` of its experts (as
        :meth:`memory_before_blocks`' mean-stage floor), and at most all of any block's (``O``: every parameter
        outside the MoE layers, plus the MTP modules' projections and two embedding copies,
        unsharded; the MTP modules' MoE layers are counted as ``Lp`` each)."""
        total, layer, experts, _ = self._param_counts
        if total is None or not experts or self.num_experts <= 1:
            return 0.0, 0.0
        h = self.model.hidden
        other = total - self.num_moe_layers * layer + self.num_mtp_layers * 2 * h * h + 2 * self.model.vocab_size * h
        per_chip = experts / (m.ep_outside_tp * m.tp)  # a rank holds E / (ep_outside_tp x tp) experts either way
        return self._stage_floors_of(m, (layer - experts) / m.tp + per_chip, per_chip, other)

    def _stage_floors_of(self, m: Mapping, layer_params: float, layer_experts: float,
                         other_params: float) -> tuple[float, float]:
        """(parameters, MoE expert parameters) the most-parameter stage of ``m`` holds at least
        (:meth:`evaluate`'s ``worst_params`` and ``worst_experts``, its ``n_w`` MoE layers x
        the layer's experts), from floors on a MoE layer's parameters ``Lp`` and experts per
        chip and a ceiling ``O`` on those outside the MoE layers and the k MTP modules' layers
        (``Lp`` each, :meth:`_mtp_params_per_chip`). With L MoE layers the worst stage holds
        ``P_w >= ((L + k) Lp + O) / pp`` (the mean) and ``P_w >= ceil(L / pp) Lp`` (the stage
        with the most MoE layers), and at most ``O + k Lp`` besides its own MoE layers, so
        ``n_w >= max(L / pp - (O / Lp + k) (1 - 1 / pp), ceil(L / pp) - O / Lp - k)``."""
        n, k, pp, lp, o = self.num_moe_layers, self.num_mtp_layers, m.pp, layer_params, other_params
        if lp <= 0:
            return 0.0, 0.0
        layers = max(0, math.ceil(max(n / pp - (o / lp + k) * (1 - 1 / pp), math.ceil(n / pp) - o / lp - k) - 1e-9))
        return math.ceil(n / pp) * lp * (1 - 1e-9), layers * layer_experts * (1 - 1e-9)

    def offload_stage_floor_s(self, m: Mapping) -> float:
        """Least mean stage time per micro-batch from host transfers (0 without offload): a
        layer's pass is never shorter than its host transfers (:meth:`_offload_layer_s`), and
        a stage runs ``L / pp`` layers on average. Reads the degrees, micro-batch, recompute,
        SP, ZeRO stage and offload options only (memoised on them: the search's groups of
        offloaded twins ask it before their leaves are built)."""
        if not off.uses_offload(m):
            return 0.0
        key = (m.tp, m.cp, m.pp, m.dp, m.ep, m.micro_batch, m.sequence_parallel, m.recompute, m.zero_stage,
               m.offload_optimizer, m.offload_activations, m.offload_weights)
        memo = self.__dict__.setdefault("_offload_floor_memo", {})
        if key not in memo:
            layer_params = self.graphs(1).layer.params() - expert_params(self.graphs(1).layer) * (1 - 1 / m.ep)
            # (the routed rows counted sharded, the least over expert TP: the key leaves it out)
            memo[key] = self.num_layers / m.pp * sum(self._offload_layer_s(m, layer_params / m.tp, least=True))
        return memo[key]

    def p2p_floor_s(self, m: Mapping) -> float:
        """Least exposed pipeline p2p of ``m``'s knobs over every PP group a placement of its
        degrees gives (:func:`.comm_floor.pp_p2p_floor_s`; reads no placement)."""
        if m.pp <= 1 or m.interleave != 1:
            return 0.0
        return comm_floor.pp_p2p_floor_s(self, pp=m.pp, micro_batch=m.micro_batch, num_micro_batches=m.num_micro_batches,
                                         interleave=m.interleave, cp=m.cp, tp=m.tp, pp_groups=self._pp_groups(m),
                                         memo=self.__dict__.setdefault("_p2p_floor_memo", {}))

    def fsdp_layer_floor_s(self, m: Mapping) -> float:
        """Least ZeRO-3 gather + reduce-scatter time of one layer and micro-batch over every dp x cp
        group a placement of ``m``'s degrees gives (:func:`.comm_floor.fsdp_layer_floor_s`)."""
        if m.zero_stage != 3 or m.dp_cp == 1:
            return 0.0
        groups = self._placed_groups(m, lambda p: merge_groups(self.system, dict(p)["cp"], dict(p)["dp"]))
        return comm_floor.fsdp_layer_floor_s(self, tp=m.tp, zero_stage=m.zero_stage, dp_cp=m.dp_cp,
                                             tp_comm_overlap=m.tp_comm_overlap, dp_groups=groups,
                                             memo=self.__dict__.setdefault("_fsdp_floor_memo", {}))

    def _pp_groups(self, m: Mapping) -> tuple:
        """Every PP group a placement of ``m``'s degrees gives (as :meth:`_tp_groups`)."""
        return self._placed_groups(m, lambda p: dict(p)["pp"])

    def _placed_groups(self, m: Mapping, pick) -> tuple:
        """The distinct ``pick(placement)`` over every placement of ``m``'s degrees, memoised
        per degrees and ``pick``'s code (what a placement-free floor takes the cheapest of)."""
        degrees = (m.tp, m.cp, m.pp, m.dp, m.ep, m.etp)
        key = degrees + (pick.__code__,)
        memo = self.__dict__.setdefault("_placed_group_memo", {})
        if key not in memo:
            places = self.__dict__.setdefault("_placements_memo", {})
            if degrees not in places:  # enumerated once per degrees (thousands on 8192 chips)
                from dfmodel.inter_chip.llm_space import placements  # (llm_space reads no LLMModel)

                deg = {"tp": m.tp, "cp": m.cp, "pp": m.pp, "dp": m.dp, "ep": m.ep}
                places[degrees] = placements(self.system, deg, m.etp)
            memo[key] = tuple(sorted({tuple(pick(p)) for p in places[degrees]}))
        return memo[key]

    def pass_floor_s(self, m: Mapping, tp_groups=None, comm: bool = True, stash_cap: int | None = None,
                     layer_nets: tuple | None = None, plans: bool = True) -> float | None:
        """Valid lower bound on one micro-batch's forward + backward (+ recompute) through every
        block on one chip (layers, embedding, head), before any exposed communication of other
        dimensions: each block's :func:`~dfmodel.inter_chip.block_floor.block_floor` (per-kernel
        FLOP and DRAM traffic, launch overheads) plus its forced TP reductions on the cheapest
        of ``tp_groups`` (default: every TP group a placement of these degrees can take, so
        the bound reads no placement; ``comm=False``: without them, a cheaper, weaker floor).
        On dataflow chips (kernels fuse there): :func:`.dataflow_floor.pass_floor_s` (compute and
        the DRAM traffic no partition plan avoids: weights, block inputs and outputs; ``plans=False``:
        without the phases' plan floors, a cheaper, weaker floor)."""
        if self.system.chip.execution == "dataflow":
            groups = (self._tp_groups(m) if tp_groups is None else tp_groups) if comm and m.tp > 1 else None
            return dataflow_floor.pass_floor_s(self, m, _is_attention_core, groups, stash_cap,
                                               layer_nets if groups else None, plans)
        ub = m.tp_comm_overlap and m.tp > 1
        key = (m.micro_batch, m.recompute, m.tp, m.cp, m.pp, m.dp, m.ep, m.etp, m.sequence_parallel and m.tp > 1, ub, comm)
        memo = self.__dict__.setdefault("_pass_floor_memo", {})
        if tp_groups is not None:
            key += (tuple(tp_groups),)
        if key in memo:
            return memo[key]
        groups = self._tp_groups(m) if tp_groups is None else tp_groups
        # (it reads pp and dp only through the TP groups their placements give: degree tuples
        # that differ only in pp / dp and give the same groups share one computation)
        by_groups = self.__dict__.setdefault("_pass_floor_by_groups", {})
        key2 = (m.micro_batch, m.recompute, m.tp, m.cp, m.ep_outside_tp, m.whole_experts,
                m.sequence_parallel and m.tp > 1, ub, comm, tuple(groups))
        if key2 not in by_groups:
            by_groups[key2] = self._pass_floor_of(m, groups, ub, comm)
        memo[key] = by_groups[key2]
        return memo[key]

    def _pass_floor_of(self, m: Mapping, groups, ub: bool, comm: bool) -> float:
        """:meth:`pass_floor_s` computed on the TP groups ``groups``."""
        k, rc = m.micro_batch, m.recompute
        blocks = [("layer", self.num_moe_layers, rc, m.ep_outside_tp, m.whole_experts, ub),
                  ("embedding", 1, "none", 1, False, False), ("head", 1, "none", 1, False, False)]
        if self.num_dense_layers:
            blocks.append(("dense_layer", self.num_dense_layers, rc, 1, False, ub))
        kernels_s, forced = 0.0, []
        for which, count, brc, ep, whole, userbuffers in blocks:
            fl = self._block_floor(which, m.tp, m.cp, m.sequence_parallel, ep, whole)
            if fl is None or not count:
                continue
            if userbuffers:  # tp_comm_overlap: the collectives run under the layer's GEMMs
                # (in an MoE layer those of attention only; the experts' stay exposed: _userbuffers_split)
                split = which == "layer" and self.num_experts > 1
                if comm and groups:
                    kernels_s += count * min(fl.kernels_overlapped_s(k, brc, self._forced_comm_s(
                        fl, k, tuple(g), brc, launches=False, paired=True if split else None))
                        + (self._forced_comm_s(fl, k, tuple(g), brc, launches=False, paired=False) if split else 0.0)
                        for g in groups)
                else:
                    kernels_s += count * fl.kernels_overlapped_s(k, brc, 0.0)
                continue
            kernels_s += count * fl.kernels_s(k, brc)
            forced.append((count, fl, brc))
        out = kernels_s
        if comm and forced and m.tp > 1 and groups:
            out += min(sum(count * self._forced_comm_s(fl, k, tuple(g), brc) for count, fl, brc in forced)
                       for g in groups)
        return out

    def _forced_comm_s(self, fl: "bf.BlockFloor", k: int, group: tuple, recompute: str, launches: bool = True,
                       paired: bool | None = None) -> float:
        """:func:`~dfmodel.inter_chip.block_floor.forced_comm_s` memoised on what it reads: the
        block floor (one object per block key, kept by :meth:`_block_floor`), the micro-batch,
        the TP group, full recompute or not, and the launches. Degree tuples that differ only in
        pp or dp share their TP groups, so most calls are hits."""
        memo = self.__dict__.setdefault("_forced_comm_memo", {})
        key = (id(fl), k, group, recompute == "full", launches, paired)
        if key not in memo:
            cmemo = self.__dict__.setdefault("_collective_memo", {})
            memo[key] = bf.forced_comm_s(fl, k, self.costs, group, recompute, cmemo, launches=launches, paired=paired)
        return memo[key]

    def _block_floor(self, which: str, tp: int, cp: int, sp: bool, ep: int, whole: bool) -> "bf.BlockFloor | None":
        """Memoised :func:`~dfmodel.inter_chip.block_floor.block_floor` of one block, built on
        one micro-batch's graph (None when the model has no such block)."""
        key = (which, tp, cp, sp and tp > 1, ep, whole and tp > 1)
        memo = self.__dict__.setdefault("_block_floors", {})
        if key not in memo:
            graph = getattr(self.graphs(1, cp, ep), which)
            # an MoE layer's userbuffers serve attention's GEMMs only, as _userbuffers_split pairs them
            linear = _is_ub_moe_linear if which == "layer" and self.num_experts > 1 else _is_ub_linear
            memo[key] = None if graph is None else bf.block_floor(graph, self.system, tp, sp and tp > 1,
                                                                  whole_experts=whole and tp > 1,
                                                                  is_core=_is_attention_core, is_linear=linear)
        return memo[key]

    def _tp_groups(self, m: Mapping) -> tuple:
        """Every TP group a placement of ``m``'s degrees gives (what a placement-free bound
        takes the cheapest of)."""
        return self._placed_groups(m, lambda p: dict(p)["tp"])

    def refined_bound_s(self, m: Mapping) -> float | None:
        """A tighter valid bound once the candidate's blocks are solved (None before): the same
        pipeline argument with the exact per-micro-batch stage times summed over all stages."""
        key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel) + ((m.cp,) if m.cp > 1 else ())
        ep_key = self._layer_key_tail(m)
        names = ("layer", "embedding", "head") + (("dense_layer",) if self.num_dense_layers else ())
        blocks = [self._blocks.get((w, *key, *(ep_key if w == "layer" else ())), False) for w in names]
        if blocks[0] is False or blocks[0] is None:
            return None
        # (a block not solved yet counts 0: the layer alone bounds the mapping, as evaluate's cutoff does)
        blocks = [None if b is False else b for b in blocks]
        return self._bound_from_blocks(m, *blocks[:3], blocks[3] if self.num_dense_layers else None)

    def _bound_from_blocks(self, m: Mapping, layer: BlockTimes, emb: BlockTimes | None, head: BlockTimes | None,
                           dense: BlockTimes | None) -> float:
        """:meth:`refined_bound_s` from the solved blocks; a block given as None counts 0 (evaluate
        adds its times to the stages, never less than 0), so the layer alone already bounds the
        mapping before its embedding and head are solved (:meth:`evaluate` with a cutoff)."""
        # the layer phases as evaluate() times them before any exposed communication (with
        # tp_comm_overlap's userbuffers: the raw phases were above them, an invalid bound); a
        # layer's pass is never shorter than its host transfers (offload: they only hide behind it);
        # with the exposed communication evaluate() adds to each layer (cp exchange, MoE
        # all-to-alls, ZeRO-3's gathers: _layer_comm reads only the mapping and the solved layer)
        extra = self._layer_comm_shared(m, layer)
        moe_layer_s = sum(self._layer_phases_s(m, layer, extra))  # (the MTP modules' layer too)
        total = self.num_moe_layers * max(moe_layer_s, sum(self._offload_layer_s(m, layer.params_per_chip)))
        if layer.onchip is not None:  # at most _onchip_layers_cap layers keep their stash on chip
            save_f = max(0.0, layer.fwd.time_s - layer.onchip.fwd_s)
            total -= self._onchip_layers_cap(m, layer.onchip) * (1 + 1e-9) * (
                save_f * (2 if m.recompute == "full" else 1) + max(0.0, layer.bwd.time_s - layer.onchip.bwd_s))
        if self.num_dense_layers and dense is not None:
            extra_d = self._layer_comm_shared(m, dense, experts=False)
            total += self.num_dense_layers * max(sum(self._layer_phases_s(m, dense, extra_d)),
                                                 sum(self._offload_layer_s(m, dense.params_per_chip)))
        total += sum(b.fwd.time_s + b.backward_s("none") for b in (emb, head) if b)
        if self.num_mtp_layers:  # the MTP modules' layer and head (their projection left out: >= 0)
            total += self.num_mtp_layers * (moe_layer_s + (head.fwd.time_s + head.backward_s("none") if head else 0.0))
        avg_stage_s = total / m.pp
        pipeline_s = (m.num_micro_batches + (m.pp - 1) / m.interleave) * avg_stage_s
        if m.pp > 1 and m.interleave == 1 and head is not None and layer.onchip is None:
            # the last stage holds the head, the MTP modules and at least one layer, whatever the split
            last_s = self._last_stage_floor_s(m, head, moe_layer_s, dense)
            pipeline_s = max(pipeline_s, (m.num_micro_batches - 1) * last_s + total)
        if m.pp > 1 and m.interleave == 1:  # plain 1F1B's exposed p2p on its own PP group (comm_floor)
            pipeline_s += (pipe.p2p_transfers_on_critical_path(m.pp, m.num_micro_batches)
                           * self.p2p_s(m.micro_batch, m.cp, m.tp, m.group("pp")))
        zero2_s = self.zero2_exposed_floor_s(m, pipeline_s, *self._worst_stage_floors(m, layer, emb, head, dense)
                                             ) if m.zero_stage == 2 else 0.0
        return pipeline_s + zero2_s + self.optimizer_s(m, self.params_per_chip_floor(m))

    def _last_stage_floor_s(self, m: Mapping, head: BlockTimes, moe_layer_s: float, dense: BlockTimes | None) -> float:
        """Least per-micro-batch time of plain 1F1B's last stage (:meth:`evaluate`): the head,
        the MTP modules (each a MoE layer and the head again, as :meth:`_bound_from_blocks`
        counts them) and at least one layer (``pipeline.balance_layers`` leaves none empty).
        ``pipeline.pipeline_time`` is ``M T* + sum T - T*`` with ``T* >= T_last``, so the
        step is at least ``(M - 1) T_last + sum T``: with DeepSeek-V3's head and MTP module
        (about four layers' work) on one stage this exceeds the mean-stage bound from pp 16 on."""
        layer_s = moe_layer_s
        if self.num_dense_layers:  # (a dense layer may be the cheaper one; unsolved: count none)
            layer_s = min(layer_s, sum(self._layer_phases_s(m, dense, self._layer_comm_shared(m, dense, experts=False)))
                          ) if dense is not None else 0.0
        head_s = head.fwd.time_s + head.backward_s("none")
        return layer_s + head_s + self.num_mtp_layers * (moe_layer_s + head_s)

    def _onchip_layers_cap(self, m: Mapping, onchip: OnChipStash) -> int:
        """At most this many of the (MoE) layers keep their stash in SRAM, whatever the layer split
        (:meth:`evaluate`: stage ``i`` of ``n_i`` layers keeps ``min(n_i, floor(free / (S f_i)))``,
        ``f_i`` its in-flight micro-batches, or with full recompute all ``n_i`` only when
        ``peak + S + n_i f_i ckpt`` fits: :meth:`OnChipStash.layers_on_chip`); so the sum over the
        stages of what each stage's SRAM admits, capped by the layers. Memoised on what it reads."""
        key = (id(onchip), m.pp, m.num_micro_batches, m.interleave, m.recompute == "full", self._checkpoint_bytes(m))
        memo = self.__dict__.setdefault("_onchip_cap_memo", {})
        if key not in memo:
            layers, sram, full, ckpt = self.num_moe_layers, float(self.system.chip.sram_bytes), key[4], key[5]
            caps = 0
            for i in range(m.pp):
                in_flight = mem.in_flight_micro_batches(m.pp, i, m.num_micro_batches, m.interleave)
                caps += (_full_recompute_cap(onchip, sram, layers, in_flight, ckpt) if full
                         else onchip.layers_on_chip(sram, layers, in_flight))
            memo[key] = min(layers, caps)
        return memo[key]

    def p2p_s(self, micro_batch: int, cp: int, tp: int, pp_group) -> float:
        """One point-to-point transfer between pipeline stages: a micro-batch's activations
        (``mb x s / cp x h`` elements per rank, split ``tp`` ways: the scatter/gather
        optimisation of Narayanan et al. SC21 sec. 4.1) over the PP group (the cost table's ``p2p``)."""
        act_bytes = micro_batch * (self.model.seq_len // cp) * self.model.hidden * self.training.activation_bytes / tp
        return self.costs.time_s("p2p", act_bytes, pp_group)

    def params_per_chip_floor(self, m: Mapping) -> float:
        """Fewest parameters any chip can hold: all of them split evenly over TP x PP (MoE:
        expert parameters also over ep; their optimizer state, sharded over dp x cp / ep ranks,
        is then ``expert / (dp x cp)`` per chip as the dense part's, so this stays a floor)."""
        total, _, layer_experts, _ = self._param_counts
        if total is None:
            return 0.0
        return (total - self.num_moe_layers * layer_experts * (1 - 1 / m.ep)) / (m.tp * m.pp)

    @cached_property
    def _param_counts(self) -> tuple:
        """(all parameters or None, one MoE-or-dense layer's, its MoE expert parameters, one
        dense layer's of an MoE model or None): what the bounds read on every candidate, counted
        once (summing kernels costs ~50 us each time)."""
        g = self.graphs(1)
        total = g.params() if hasattr(g, "params") else None
        dense = g.dense_layer.params() if self.num_dense_layers else None
        return total, g.layer.params(), expert_params(g.layer), dense

    def optimizer_params_per_chip(self, m: Mapping, params_per_chip: float,
                                  expert_params_per_chip: float = 0.0) -> float:
        """Parameters whose optimizer state and step a chip owns: the distributed optimizer
        shards the dense ones over the dp x cp ranks and the ``expert_params_per_chip`` MoE
        expert parameters over the expert data-parallel ranks, ``dp x cp / ep``
        (Megatron-Core's expert_data_parallel group)."""
        if not m.distributed_optimizer:
            return params_per_chip
        return (params_per_chip - expert_params_per_chip) / m.dp_cp + expert_params_per_chip / m.expert_dp

    def optimizer_s(self, m: Mapping, params_per_chip: float, expert_params_per_chip: float = 0.0) -> float:
        """Adam step time of a chip holding ``params_per_chip`` parameters
        (:meth:`optimizer_params_per_chip`); with optimizer offload, a floor of the host's
        exposed step (:meth:`OffloadPlan.step_floor_s`; the full term is added in :meth:`evaluate`)."""
        owned = self.optimizer_params_per_chip(m, params_per_chip, expert_params_per_chip)
        plan = self.offload_plan(m)
        if plan is not None and plan.optimizer != "none":
            return plan.step_floor_s(owned)
        return memory_time_s(self.system.chip, OPTIMIZER_BYTES_PER_PARAM * owned)

    def memory_relief(self, m: Mapping) -> list[Mapping]:
        """Offloaded twins of a mapping that does not fit (the search adds them then;
        :func:`dfmodel.inter_chip.offload.variants`)."""
        variants = off.variants(m, getattr(self, "knobs", None) or Knobs(), self.system)
        if not variants:
            return []
        # chip memory only falls as more is offloaded (weight offload aside: it also adds a
        # working buffer), so if the leanest variant with and without weight offload cannot fit
        # on the chip, none can: then skip them all after two memory floors instead of five
        # (the search screens each variant that joins as it screens any candidate)
        return variants if any(self._may_fit_on_chip(v) for v in off.leanest(variants)) else []

    def _may_fit_on_chip(self, m: Mapping) -> bool:
        """False when a lower bound proves ``m`` exceeds the chip's memory (host aside)."""
        key = tuple(v for k, v in vars(m).items() if k != "placement")
        memo = self.__dict__.setdefault("_chip_fit", {})
        if key not in memo:
            floor = self.memory_floor_bytes(m) <= self.system.chip.memory.capacity_bytes
            memo[key] = floor and (lambda b: b.total_bytes <= b.capacity_bytes)(self.memory_before_blocks(m))
        return memo[key]

    def offload_plan(self, m: Mapping) -> "off.OffloadPlan | None":
        """What ``m`` offloads to host memory (None: nothing)."""
        if not off.uses_offload(m):
            return None
        key = (m.offload_optimizer, m.offload_activations, m.offload_weights)
        plans = self.__dict__.setdefault("_offload_plans", {})
        if key not in plans:
            state = mem.StateBytesPerParam.of_training(self.training, linear=True)
            plans[key] = off.OffloadPlan.of(m, self.system, self.training, weight_bytes_per_param=state.weights,
                                            optimizer_bytes_per_param=state.optimizer)
        return plans[key]

    # -- memory ---------------------------------------------------------------------------------
    def memory_floor_bytes(self, m: Mapping) -> float:
        """Least memory per chip any choice of recompute / SP / optimizer sharding / layer split
        can reach for these degrees and micro-batching (valid: prunes before any inner solve).
        Memoised on the arguments it passes (the search asks for the same floor of many probes
        that differ only in knobs it does not read), and first on the mapping fields those
        arguments are built from (building them costs more than the look-up)."""
        fast_key = (m.tp, m.pp, m.dp, m.cp, m.ep, m.etp, m.micro_batch, m.num_micro_batches, m.zero_stage,
                    m.offload_optimizer, m.offload_activations, m.offload_weights)
        fast = self.__dict__.setdefault("_memory_floor_fast", {})
        hit = fast.get(fast_key)
        if hit is None:
            hit = fast[fast_key] = self._memory_floor_of(m)
        return hit

    def _memory_floor_of(self, m: Mapping) -> float:
        """:meth:`memory_floor_bytes` computed (memoised on its arguments)."""
        kw = dict(
            num_layers=self.num_layers,
            # the fewest parameters a layer of either kind holds (MoE: experts split by ep)
            params_per_layer=min([self._param_counts[1] - self._param_counts[2] * (1 - 1 / m.ep)]
                                 + ([self._param_counts[3]] if self.num_dense_layers else [])),
            seq_len=self.model.seq_len // m.cp,
            micro_batch=m.micro_batch,
            hidden=self.model.hidden,
            tp=m.tp,
            pp=m.pp,
            dp=m.dp_cp,
            num_micro_batches=m.num_micro_batches,
            zero_stage=m.zero_stage if m.zero_stage >= 2 else None,
            **{"bytes_per_element": self.precision.bytes,
               "bytes_per_param_optimizer": (mem.REMAINDER_BYTES + 8 if self.training.param_remainders
                                             else 12),  # never above the state llm_memory_per_chip counts
               **off.floor_overrides(m)},  # offloaded state is not on the chip
        )
        key = tuple(kw.items()) + ((m.ep_outside_tp, m.expert_dp) if self.num_experts > 1 else ())
        memo = self.__dict__.setdefault("_memory_floor_memo", {})
        if key not in memo:
            memo[key] = mem.memory_lower_bound_bytes(**kw)
            if self.num_experts > 1:
                # MoE: the whole model over the stages, experts at their own sharding (a rank
                # holds E / (ep_outside_tp x tp) of them either way: memory_before_blocks)
                _, layer, experts, dense = self._param_counts
                other = self.num_moe_layers * (layer - experts) + self.num_dense_layers * (dense or 0.0)
                mean = mem.mean_stage_floor_bytes(
                    layer_params=other, expert_params=self.num_moe_layers * experts / (m.ep_outside_tp * m.tp),
                    expert_dp=m.expert_dp, **{k: v for k, v in kw.items() if k not in ("params_per_layer",
                                                                                  "num_micro_batches")})
                memo[key] = max(memo[key], mean)
        return memo[key]

    def _block_key(self, which: str, m: Mapping) -> tuple:
        return ((which, m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel) + ((m.cp,) if m.cp > 1 else ())
                + (self._layer_key_tail(m) if which == "layer" else ()))

    @staticmethod
    def _layer_key_tail(m: Mapping) -> tuple:
        """What the (MoE) layer block's cache key adds: its graph's ep ranks and expert TP 1."""
        ep = m.ep_outside_tp
        return ((("ep", ep),) if ep > 1 else ()) + (("etp1",) if m.whole_experts else ())

    def memory_before_blocks(self, m: Mapping, done: dict | None = None) -> "mem.MemoryBreakdown":
        """A valid lower bound on ``evaluate(m).memory`` (the worst stage), without solving a block.

        A chip holds at least ``1/tp`` of every parameter (TP splits a weight at most ``tp``
        ways; Megatron replicates only the norms), and whatever the layer split, some stage
        holds at least ``ceil(L / pp)`` layers. Memory only grows with parameters and layers
        (:func:`memory.llm_memory_per_chip`), so the worst stage needs at least the least, over
        stages ``i``, of the split with those ``ceil(L / pp)`` layers on stage ``i`` and none
        elsewhere. MoE models with dense layers: a stage's memory is the sum of its layers'
        terms, so it is at least that of the same number of layers all of the cheaper kind
        (the least of the all-MoE and the all-dense split), and at least that of
        ``ceil(L_moe / pp)`` MoE layers alone (some stage holds that many). At least, too, the
        split-free activation floor (:meth:`_split_free_activation_bytes`: the early stages hold
        more micro-batches), its excess counted as activations. test_search.py checks it against
        ``evaluate`` on every candidate. ``done``: splits already computed for ``m``
        (:meth:`screen_bytes`)."""
        key = _memory_knobs(m)
        if key not in self._memory_floors:
            parts = self._split_parts(m)
            splits = self._screen_splits(m, parts[4] is not None)
            best, host = self._least_split(m, *splits[0], parts, done)
            if len(splits) > 1:
                # MoE: the MoE layers alone are spread over the stages too, so some stage holds at
                # least ceil(L_moe / pp) of them (its dense layers only add): a second valid floor,
                # far above the all-dense one when experts dominate (DeepSeek-V3: 58 of 61 layers)
                moe_best, moe_host = self._least_split(m, *splits[1], parts, done)
                host = max(host, moe_host)
                if moe_best.total_bytes > best.total_bytes:
                    best = moe_best
            act = self.activation_floor_bytes(m)  # (split-free: it may exceed every one-stage split)
            if act > best.total_bytes:
                best = replace(best, activations_bytes=best.activations_bytes + (act - best.total_bytes))
            self._memory_floors[key] = best if best.host_capacity_bytes is None else replace(best, host_bytes=host)
        return self._memory_floors[key]

    def _split_parts(self, m: Mapping) -> tuple:
        """Per-chip parameters of (a layer, its experts, the embedding, the head + tied copy, a
        dense layer or None): what :meth:`_least_split` places on the stages."""
        layer_all, layer_experts, emb_all, head_all, dense_all = self._screen_params
        # a rank holds E / ep experts, split tp ways (whole with expert TP 1)
        experts = layer_experts / (m.ep * (1 if m.whole_experts else m.tp))
        layer = (layer_all - layer_experts) / m.tp + experts
        head = head_all / m.tp + mem.tied_embedding_copy_params(
            vocab=self.model.vocab_size, hidden=self.model.hidden, tp=m.tp, pp=m.pp,
            tie_embeddings=self.model.tie_embeddings)
        dense = dense_all / m.tp if self.num_dense_layers else None
        return (layer, experts, emb_all / m.tp, head, dense)

    def _screen_splits(self, m: Mapping, has_dense: bool) -> list[tuple]:
        """(layers on the one loaded stage, layer kinds) of each floor :meth:`memory_before_blocks`
        takes the larger of: ``ceil(L / pp)`` of either kind, and with dense layers in an MoE
        model ``ceil(L_moe / pp)`` MoE layers."""
        out = [(-(-self.num_layers // m.pp), (False, True) if has_dense else (False,))]
        if has_dense and self.num_moe_layers:
            out.append((-(-self.num_moe_layers // m.pp), (False,)))
        return out

    def screen_bytes(self, m: Mapping, capacity_bytes: float) -> float:
        """``memory_before_blocks(m).total_bytes`` when it exceeds ``capacity_bytes`` (exact: a
        pruned group reports it); otherwise some value ``<= capacity_bytes``, found with fewer
        splits. The screen is the larger of its floors, each the least over its splits, so it
        fits as soon as every floor has one split that fits: one split each decides most
        fitting groups (2 of 3 of the screens of DeepSeek-V3 / 1024 H100 fit, each computed 5
        splits of ~50 us). A group that does not fit gets the full screen, exactly as before.
        With two plain 1F1B stages and parameters no placement changes, the floors load one
        stage at a time, so they miss that no split fits both stages at once
        (:meth:`_fitting_splits`): then the least memory of those splits (exact,
        :meth:`memory_before_solves`), which 1142 of DeepSeek-V3 / 512 dragonfly's mappings
        reached only after their pre-solve bound (2 of its 18 serial CPU seconds)."""
        need = self._screen_bytes(m, capacity_bytes)
        if need <= capacity_bytes and not off.uses_offload(m) and self._no_split_fits(m):
            least = self._least_split_memory(m)
            if least is not None:
                return least.total_bytes
        return need

    def _screen_bytes(self, m: Mapping, capacity_bytes: float) -> float:
        """:meth:`screen_bytes` from :meth:`memory_before_blocks`' floors alone."""
        key = _memory_knobs(m)
        if key in self._memory_floors or off.uses_offload(m):  # (offload: the host screen reads it all)
            return self.memory_before_blocks(m).total_bytes
        act = self.activation_floor_bytes(m)  # (it may exceed every one-stage split: memory_before_blocks)
        if act > capacity_bytes:
            return self.memory_before_blocks(m).total_bytes
        memo = self.__dict__.setdefault("_screen_fit_memo", {})
        key += (capacity_bytes,)  # (the value found depends on the capacity asked about)
        if key not in memo:
            parts = self._split_parts(m)
            done: dict = {}
            fits = []
            for k, kinds in self._screen_splits(m, parts[4] is not None):
                fits.append(self._some_split_fits(m, k, kinds, parts, capacity_bytes, done))
                if fits[-1] is None:  # this floor exceeds the capacity: the exact screen, reusing the splits done
                    return self.memory_before_blocks(m, done).total_bytes
            memo[key] = max(fits + [act])
        return memo[key]

    def _some_split_fits(self, m: Mapping, k: int, kinds: tuple, parts: tuple, capacity_bytes: float,
                         done: dict) -> float | None:
        """The worst-stage memory of the first split of :meth:`_least_split`'s that fits in
        ``capacity_bytes`` (None: none does), the middle stage first (fewest micro-batches in
        flight, no embedding or head: most often the least)."""
        for i in sorted({0, max(0, m.pp - 2), m.pp - 1}, key=lambda j: (j != max(0, m.pp - 2), j != m.pp - 1, j)):
            for kind_dense in kinds:
                b = self._split_memory(m, k, i, kind_dense, parts, done)
                if b.total_bytes <= capacity_bytes:
                    return b.total_bytes
        return None

    def leaf_floor_bytes(self, m: Mapping) -> float:
        """The memory floor of a group that fixes ``m``'s recompute and sequence parallelism
        (the search's leaf groups and their parents): the larger of :meth:`memory_floor_bytes`
        (valid for every recompute / SP) and :meth:`activation_floor_bytes` (``m``'s own)."""
        return max(self.memory_floor_bytes(m), self.activation_floor_bytes(m))

    def activation_floor_bytes(self, m: Mapping, recompute: str | None = None) -> float:
        """A valid lower bound on :meth:`memory_before_blocks` (hence on ``evaluate(m).memory``)
        from the saved activations alone, in microseconds instead of the screen's milliseconds.

        The screen is at least, over the splits it tries, the stage holding ``k = ceil(L / pp)``
        layers (of the lighter kind, MoE or dense) -- and with dense layers also ``ceil(L_moe / pp)``
        MoE layers -- and such a stage holds at least one micro-batch in flight
        (:func:`memory.in_flight_micro_batches` >= 1) of each layer's activations at ``m``'s own
        recompute and SP (:func:`memory.llm_layer_activation_bytes`), plus the chip's reserve;
        every other term only adds. With activations offloaded to the host: the reserve only.
        ``recompute``: in place of ``m.recompute`` (a group's least over its choices).
        For DeepSeek-V3 on 64 H100s, 90% of the screened groups failed on activations alone
        (large micro-batches without full recompute): this prunes them when they are built."""
        rc = m.recompute if recompute is None else recompute
        reserve = float(self.system.chip.memory.reserve_bytes)
        if m.offload_activations:
            return reserve
        # (the routed rows counted sharded, as expert TP 1 keeps them: the least over expert TP, so
        # the floor holds for the groups of mappings that ask it with one probe for every expert TP)
        key = (m.tp, m.cp, m.micro_batch, m.sequence_parallel, rc, m.pp, m.num_micro_batches)
        memo = self.__dict__.setdefault("_act_floor_memo", {})
        if key not in memo:
            pigeonhole = reserve + self._layers_act_bytes(m, rc, -(-self.num_layers // m.pp),
                                                          -(-self.num_moe_layers // m.pp))
            memo[key] = max(pigeonhole, self._split_free_activation_bytes(m, rc))
        return memo[key]

    def _layers_act_bytes(self, m: Mapping, rc: str, layers: float, moe_layers: float, divisor: float = 1.0) -> float:
        """Saved activations of ``layers`` layers at the lighter kind's bytes (MoE or dense), or of
        ``moe_layers`` MoE layers when the model has both kinds and that is more, over ``divisor``
        (micro-batch units): the activation floors' common term."""
        per_layer = self._layer_act_bytes(m.tp, m.cp, m.micro_batch, m.sequence_parallel, rc)
        least = per_layer
        if self.num_dense_layers:
            least = min(per_layer, self._layer_act_bytes(m.tp, m.cp, m.micro_batch, m.sequence_parallel, rc,
                                                         dense=True))
        acts = layers * least / divisor
        if self.num_dense_layers and self.num_moe_layers:
            acts = max(acts, moe_layers * per_layer / divisor)
        return acts

    def _split_free_activation_bytes(self, m: Mapping, rc: str) -> float:
        """The reserve plus the least worst-stage activations over every layer split of ``m``'s
        pipeline: stage ``i`` holds ``n_i`` layers of at least ``a`` saved bytes each for
        ``f_i = in_flight_micro_batches(pp, i, M)`` micro-batches (plain 1F1B's count, which
        interleaving never lowers), so a worst stage of ``A`` bytes has ``n_i <= A / (a f_i)``
        and ``L = sum n_i`` gives ``A >= L a / sum_i (1 / f_i)``. The pigeonhole floor above
        (``ceil(L / pp)`` layers at one micro-batch) ignores that the early stages hold the most
        micro-batches: at pp 4 the split-free floor is ~1.8x it (29 against 16 of DeepSeek-V3's
        61 layers). Also with the MoE layers alone (``a`` = an MoE layer's). 0 at pp 1 (the
        pigeonhole floor is exact there). Memoised by :meth:`activation_floor_bytes`."""
        if m.pp == 1:
            return 0.0
        inverse = sum(1.0 / mem.in_flight_micro_batches(m.pp, i, m.num_micro_batches) for i in range(m.pp))
        acts = self._layers_act_bytes(m, rc, self.num_layers, self.num_moe_layers, inverse)
        # (1e-12: a split whose stages meet the bound exactly still passes it, as the sum may round)
        return float(self.system.chip.memory.reserve_bytes) + acts * (1 - 1e-12)

    def _least_split(self, m: Mapping, k: int, kinds: tuple, parts: tuple, done: dict | None = None) -> tuple:
        """(least worst-stage memory, least host bytes) over the splits with ``k`` layers of one
        kind (``kinds``: MoE False, dense True) on one stage and none elsewhere
        (:meth:`memory_before_blocks`). ``parts``: per-chip parameters of a layer, its experts,
        the embedding, the head (+ tied copy) and a dense layer (None without)."""
        best, host = None, float("inf")
        # a middle stage i holds no embedding or head and fewer micro-batches in flight the
        # later it is (memory.in_flight_micro_batches), so of the middle stages the last one
        # (pp - 2) gives the least: three splits instead of pp (each costs O(pp))
        for i in sorted({0, max(0, m.pp - 2), m.pp - 1}):
            for kind_dense in kinds:
                b = self._split_memory(m, k, i, kind_dense, parts, done)
                host = min(host, b.host_bytes)  # offload: the host's floor is its own least split
                if best is None or b.total_bytes < best.total_bytes:
                    best = b
        return best, host

    def _split_memory(self, m: Mapping, k: int, i: int, kind_dense: bool, parts: tuple,
                      done: dict | None = None) -> "mem.MemoryBreakdown":
        """Worst-stage memory of the split with ``k`` layers of one kind (dense or MoE) on stage
        ``i`` and none elsewhere (:meth:`_least_split`); ``done``: the splits of ``m`` computed
        so far, by (k, i, kind), read and filled."""
        if done is not None:
            if (k, i, kind_dense) not in done:
                done[k, i, kind_dense] = self._split_memory(m, k, i, kind_dense, parts)
            return done[k, i, kind_dense]
        layer, experts, emb, head, dense = parts
        stages = [0] * m.pp
        stages[i] = k
        per = dense if kind_dense else layer
        params = [n * per for n in stages]
        params[0] += emb
        params[-1] += head
        return self.memory_check(m, params, [0] * m.pp if kind_dense else stages, layer,
                                 layer_expert_params=experts, dense_per_stage=stages if kind_dense else None,
                                 dense_layer_params=dense or 0.0)

    @cached_property
    def _screen_params(self) -> tuple:
        """(one layer's parameters, its MoE expert parameters, the embedding's, the head's, a
        dense layer's or 0) of the unsharded model: what :meth:`memory_before_blocks` reads on
        every screen (counting kernels costs ~50 us each time)."""
        g = self.graphs(1)
        return (g.layer.params(), expert_params(g.layer), g.embedding.params() if g.embedding is not None else 0.0,
                g.head.params() if g.head is not None else 0.0,
                g.dense_layer.params() if self.num_dense_layers else 0.0)

    def memory_check(self, m: Mapping, params_per_stage: list[float], layers_per_stage: list[int],
                     layer_params: float, layer_sharded: DataflowGraph | None = None,
                     layer_expert_params: float | None = None, dense_per_stage: list[int] | None = None,
                     dense_layer_params: float = 0.0) -> "mem.MemoryBreakdown":
        """Worst stage's memory per chip (weights, grads, optimizer, activations in flight,
        reserve): :func:`memory.llm_memory_per_chip`. ``params_per_stage`` holds the layer
        parameters plus the embedding (first stage) and head and tied copy (last stage);
        ``layers_per_stage`` counts the (MoE) layers of ``layer_params`` parameters on a chip,
        of which ``layer_expert_params`` (default: counted on ``layer_sharded``) are MoE expert
        parameters; ``dense_per_stage`` the dense layers of an MoE model (``dense_layer_params``
        each)."""
        if layer_expert_params is None:
            layer_expert_params = expert_params(layer_sharded)
        dense_n = dense_per_stage or [0] * m.pp
        first = params_per_stage[0] - layers_per_stage[0] * layer_params - dense_n[0] * dense_layer_params
        last = (params_per_stage[-1] - layers_per_stage[-1] * layer_params - dense_n[-1] * dense_layer_params
                if m.pp > 1 else 0.0)
        chip_memory = self.system.chip.memory
        return mem.llm_memory_per_chip(
            model=self.model, training=self.training, attention=self.model.attention or "unfused",
            tp=m.tp, pp=m.pp, dp=m.dp_cp, micro_batch=m.micro_batch, num_micro_batches=m.num_micro_batches,
            interleave=m.interleave, recompute=m.recompute, sequence_parallel=m.sequence_parallel,
            distributed_optimizer=m.distributed_optimizer, layer_params_per_chip=layer_params,
            first_params=first, last_params=last, layers_per_stage=layers_per_stage,
            capacity_bytes=chip_memory.capacity_bytes, reserve_bytes=chip_memory.reserve_bytes,
            cp=m.cp, zero_stage=m.zero_stage, layer_expert_params_per_chip=layer_expert_params, ep=m.ep_outside_tp,
            **({"dense_layers_per_stage": dense_n, "dense_layer_params_per_chip": dense_layer_params}
               if dense_per_stage is not None else {}),
            offload=self.offload_plan(m), act_memo=self.__dict__.setdefault("_act_memo", {}),
            experts_gathered=self._experts_gathered(m))

    # -- the full evaluation ----------------------------------------------------------------------
    #: :func:`dfmodel.inter_chip.search.search` may pass ``cutoff_s`` and ``screen_memory``
    evaluate_accepts_cutoff = True

    def evaluate(self, m: Mapping, cutoff_s: float | None = None,
                 screen_memory: bool = False) -> "Evaluation | MemoryFloorMiss | None":
        """The mapping's time, memory and breakdown. With ``cutoff_s``: None instead when a
        valid lower bound proves the time above it before the costly pipeline simulation (the
        search then needs no more than that), and a :class:`MemoryFloorMiss` holding its exact
        memory when its layer split cannot fit (before the pipeline simulation). With
        ``screen_memory``: a :class:`MemoryFloorMiss` when :meth:`memory_before_blocks` proves,
        before any block solve, that it cannot fit."""
        if screen_memory and self._blocks.get(self._block_key("layer", m)) is None:
            floor = self.memory_before_blocks(m)
            if not floor.fits:
                return MemoryFloorMiss(m, floor)
        if cutoff_s is not None and self._block_key("layer", m) not in self._blocks:
            floor = self.memory_before_solves(m)
            if floor is not None:  # no layer split it may take fits: no block needs solving
                return MemoryFloorMiss(m, floor)
        tp_group, pp_group = m.group("tp"), m.group("pp")
        dp_group = merge_groups(self.system, m.group("cp"), m.group("dp"))  # Megatron-Core dp x cp
        key = (m.micro_batch, m.tp, tp_group, m.sequence_parallel)
        # expert TP 1: the TP group holds E / (ep / tp) experts and splits them over its members
        self.proven_bound_s = None
        if cutoff_s is not None and self._stash_screen(m, cutoff_s):
            return None  # its stash leaves SRAM in most layers: proven past the cutoff before the DRAM phases
        layer = self.block("layer", *key, m.cp, m.ep_outside_tp, whole_experts=m.whole_experts)
        if cutoff_s is not None and self._proves_past(self._bound_from_blocks(m, layer, None, None, None), cutoff_s):
            return None  # the layers alone put it past the cutoff: its embedding and head need no solve
        emb = self.block("embedding", *key, m.cp)
        head = self.block("head", *key, m.cp)
        # exposed communication per layer and micro-batch, by breakdown key: (forward, backward)
        extra = self._layer_comm(m, layer, dp_group)
        t_f, t_b = self._with_offload(m, layer, extra, *self._layer_phases_s(m, layer, extra))
        # an MoE model's dense layers (DeepSeek-V3's first 3): their own block and times
        dense = self.block("dense_layer", *key, m.cp) if self.num_dense_layers else None
        extra_d = self._layer_comm(m, dense, dp_group, experts=False) if dense else {}
        td_f, td_b = (self._with_offload(m, dense, extra_d, *self._layer_phases_s(m, dense, extra_d))
                      if dense else (0.0, 0.0))
        emb_f, emb_b = (emb.fwd.time_s, emb.backward_s("none")) if emb else (0.0, 0.0)
        head_f, head_b = (head.fwd.time_s, head.backward_s("none")) if head else (0.0, 0.0)
        if m.zero_stage == 3:  # their parameters are gathered like a layer's
            emb_f, emb_b = self._fsdp_exposed(emb, emb_f, emb_b, m, dp_group)
            head_f, head_b = self._fsdp_exposed(head, head_f, head_b, m, dp_group)

        # multi-token prediction (DeepSeek-V3): its modules run on the last stage, which the
        # layer split sees as part of that stage's fixed work (NeMo's recipe: 2 layers there)
        mtp_f, mtp_b = self._mtp_s(m, (t_f, t_b), (head_f, head_b))
        per_layer_s = (t_f + t_b if not dense else
                       (td_f + td_b,) * self.num_dense_layers + (t_f + t_b,) * self.num_moe_layers)
        first_s, last_s = emb_f + emb_b, head_f + head_b + mtp_f + mtp_b
        layers = self._layout_split(m) or _balance(self.num_layers, m.pp, m.interleave, per_layer_s, first_s, last_s)
        moe_st, dense_st = self._split_kinds(layers, m)
        params_stage, memory = self._stage_memory(m, layer, emb, head, dense, moe_st, dense_st)
        split_notes: list[str] = []
        if not memory.fits and m.pp > 1 and m.interleave == 1 and self.pipeline_layout is None:
            # the least bottleneck whose stages fit (a layout the workload names is run as named)
            blocks = (layer, emb, head, dense)
            fitting = pipe.balance_layers(self.num_layers, m.pp, 1, per_layer_s, first_s, last_s,
                                          fits=self._stage_fits(m, blocks))
            if fitting is not None:
                split_notes.append(f"layers per stage {list(fitting)}, not the time-balanced {list(layers)}, "
                                   "which does not fit the chip's memory (Megatron-Core: --decoder-first-pipeline-"
                                   "num-layers / --decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout)")
                layers = tuple(fitting)
                moe_st, dense_st = self._split_kinds(layers, m)
                params_stage, memory = self._stage_memory(m, layer, emb, head, dense, moe_st, dense_st)
        if cutoff_s is not None and not memory.fits:
            return MemoryFloorMiss(m, memory)  # (exact, not a floor: the search needs no time for it)
        stages = self._stage_layers(layers, m)
        stage_fwd = [n * t_f + d * td_f for n, d in zip(moe_st, dense_st)]
        stage_bwd = [n * t_b + d * td_b for n, d in zip(moe_st, dense_st)]
        if layer.onchip is not None:  # dataflow chips: the stash stays in SRAM where it fits, per stage
            for i, n in enumerate(moe_st):
                save_f, save_b = self._onchip_saving(layer, m, n, i)
                stage_fwd[i] -= n * save_f
                stage_bwd[i] -= n * (save_b + (save_f if m.recompute == "full" else 0.0))  # full: recomputed fwd too
        stage_fwd[0] += emb_f
        stage_bwd[0] += emb_b
        stage_fwd[-1] += head_f + mtp_f
        stage_bwd[-1] += head_b + mtp_b

        amax_f, amax_b = self._amax_reduce_s(m, layer)  # TE delayed scaling: per model chunk and pass
        stage_fwd = [t + m.interleave * amax_f for t in stage_fwd]
        stage_bwd = [t + m.interleave * amax_b for t in stage_bwd]
        p2p_s = self.p2p_s(m.micro_batch, m.cp, m.tp, pp_group) if m.pp > 1 else 0.0
        pt = pipe.pipeline_time(stage_fwd, stage_bwd, m.num_micro_batches, m.interleave, p2p_s)
        if not pt.exact and m.interleave > 1:
            if cutoff_s is not None and (pipe.simulated_lower_bound_s(stage_fwd, stage_bwd, m.num_micro_batches,
                                                                       m.interleave, p2p_s)
                                         + self.optimizer_s(m, self.params_per_chip_floor(m))) > cutoff_s:
                return None  # the step is at least pipeline + optimizer; DP sync and I/O add >= 0
            # the closed form is only a lower bound when p2p exceeds a chunk op: simulate
            pt = pipe.pipeline_time_simulated(stage_fwd, stage_bwd, m.num_micro_batches, m.interleave, p2p_s)

        worst_params = max(params_stage)

        # MoE: expert gradients and optimizer state live on the expert data-parallel ranks,
        # dp x cp / ep (Megatron-Core's expert_data_parallel group), not the dp x cp ranks
        worst_stage = max(range(m.pp), key=lambda i: params_stage[i])
        worst_experts = moe_st[worst_stage] * expert_params(layer.sharded.graph)
        dp_exposed = self._dp_sync_s(m, worst_params, stage_fwd[0], stage_bwd[0], dp_group,
                                     expert_params_per_chip=worst_experts)
        opt_s = self.optimizer_s(m, worst_params, worst_experts)
        plan = self.offload_plan(m)
        offload_s = 0.0
        if plan is not None and plan.optimizer != "none":  # the host CPU runs the step instead
            owned = self.optimizer_params_per_chip(m, worst_params, worst_experts)
            offload_s, opt_s = plan.step_exposed_s(owned, backward_s=stage_bwd[worst_stage], pipeline_s=pt.total_s,
                                                   micro_batches=m.num_micro_batches), 0.0
        step_s = pt.total_s + dp_exposed + opt_s + offload_s
        io = io_terms(self.system, self.training, self.training.global_batch, step_s, self.checkpoint_state(m),
                      source=self.workload.source)
        input_s = io.input_s
        total = step_s + input_s + io.checkpoint_s

        b = max(range(m.pp), key=lambda i: stage_fwd[i] + stage_bwd[i])
        busy = m.num_micro_batches * (stage_fwd[b] + stage_bwd[b])
        # the bottleneck stage's busy time: exposed per-layer communication, the rest by component
        n_moe_b = moe_st[b] + (self.num_mtp_layers if b == m.pp - 1 else 0)  # MTP blocks: MoE layers too
        comm = {k: m.num_micro_batches * n_moe_b * (f + bw) for k, (f, bw) in extra.items()}
        for k, (f, bw) in extra_d.items():
            comm[k] = comm.get(k, 0.0) + m.num_micro_batches * dense_st[b] * (f + bw)
        if m.zero_stage == 3:
            for blk, f0, b0, here in ((emb, emb_f, emb_b, b == 0), (head, head_f, head_b, b == m.pp - 1)):
                if blk and here:
                    exposed = (f0 - blk.fwd.time_s) + (b0 - blk.backward_s("none"))
                    comm["dp_comm"] = comm.get("dp_comm", 0.0) + m.num_micro_batches * exposed
        shares = self._stage_shares(n_moe_b, m, layer, emb if b == 0 else None, head if b == m.pp - 1 else None,
                                    dense=(dense_st[b], dense) if dense else None)
        rest = busy - sum(comm.values())
        breakdown = {k: rest * shares[k] for k in (*COMPONENTS, "host") if k in shares}
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
        if self.system.host is not None:  # (a system without one keeps today's keys exactly)
            breakdown["offload"] = comm.pop("offload", 0.0) + offload_s  # host transfers and CPU step exposed
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
            notes=split_notes + ([f"layers per virtual stage {list(layers)}: training.pipeline_layout "
                                  f"{self.pipeline_layout.text!r}"] if self.pipeline_layout is not None else []),
            io=io,
            split_moved=bool(split_notes),
        )

    def _stage_fits(self, m: Mapping, blocks: tuple):
        """``fits(stage, start, stop)`` of :func:`~dfmodel.algorithms.balance_layers`: whether layers
        ``start .. stop - 1`` fit stage ``stage`` of ``m`` (:meth:`_stage_memory`, the layer,
        embedding, head and dense-layer ``blocks``), the other stages holding none: the worst stage
        is then this one, as the ends' embedding and head alone fit (else nothing fits: False).
        Memoised on what the stage's memory reads: the mapping's memory knobs and TP group (as
        :meth:`memory_before_solves`), the stage and its dense and MoE layers (Llama 3 405B on 512
        B200s: 476 mappings' balanced splits did not fit, 413 had no split that fits)."""
        n_dense = self.num_dense_layers
        memo = self.__dict__.setdefault("_stage_fits_memo", {}).setdefault(
            (_memory_knobs(m), m.group("tp")), {})

        def stage_memory(stage: int, dense: int, moe: int):
            moe_st, dense_st = [0] * m.pp, [0] * m.pp
            moe_st[stage], dense_st[stage] = moe, dense
            return self._stage_memory(m, *blocks, moe_st, dense_st)[1]

        if "ends" not in memo:
            memo["ends"] = stage_memory(0, 0, 0).fits

        def fits(stage: int, start: int, stop: int) -> bool:
            dense = max(0, min(stop, n_dense) - start)
            key = (stage, dense, stop - start - dense)
            if key not in memo:
                memo[key] = memo["ends"] and stage_memory(*key).fits
            return memo[key]
        return fits

    def _split_kinds(self, layers: tuple[int, ...], m: Mapping) -> tuple[list[int], list[int]]:
        """(MoE layers, dense layers) per physical stage of the chunk split ``layers``."""
        dense_st = moe_terms.dense_layers_per_stage(layers, m.pp, self.num_dense_layers)
        return [n - d for n, d in zip(self._stage_layers(layers, m), dense_st)], dense_st

    def _layout_split(self, m: Mapping) -> tuple[int, ...] | None:
        """Transformer layers per virtual stage of the workload's ``training.pipeline_layout``
        (None without one); an InputError when ``m``'s ``pp x vp`` is not its stage count (the
        search never proposes such a mapping)."""
        lay = self.pipeline_layout
        if lay is None:
            return None
        if lay.interleave(m.pp) != m.interleave:
            raise InputError(f"has {lay.num_stages} virtual stages; pp {m.pp} x interleave {m.interleave} runs "
                             f"{m.pp * m.interleave}", source=getattr(self.workload, "source", None),
                             field="training.pipeline_layout")
        return lay.decoder_counts

    def _splits_evaluate_may_take(self, m: Mapping) -> list[tuple[int, ...]] | None:
        """Every chunk split :meth:`evaluate` may give ``m`` (``_balance``): the whole model
        with pp 1, Megatron's equal chunks when interleaved (they read no time), and each
        ``(s, L - s)``, ``1 <= s < L``, with two plain 1F1B stages (``balance_layers`` keeps a
        layer a stage), the balanced ones first. None with more stages (too many splits)."""
        n = self.num_layers
        if self.pipeline_layout is not None:
            return [self._layout_split(m)]
        if m.pp == 1:
            return [(n,)]
        if m.interleave > 1:
            try:
                return [_balance(n, m.pp, m.interleave, 1.0, 0.0, 0.0)]
            except ValueError:  # (evaluate raises it)
                return None
        if m.pp == 2:
            return [(s, n - s) for s in sorted(range(1, n), key=lambda s: abs(2 * s - n))]
        return None

    def memory_before_solves(self, m: Mapping) -> "mem.MemoryBreakdown | None":
        """The least worst-stage memory of ``m`` over every layer split :meth:`evaluate` may
        take (:meth:`_splits_evaluate_may_take`) when none fits the chip, else None (also where
        the splits are not enumerated). Exact, not a floor, per split: :meth:`_stage_memory`
        reads the blocks' parameters per chip (:meth:`_block_params`), never their solved times,
        which only pick the split. So a mapping none of whose splits fits needs no intra-chip solve
        (DeepSeek-V3 on 512 dragonfly chips: 59 layer blocks were solved and then did not
        fit). Memoised on what memory reads: first with the TP group, then with the blocks'
        parameters in its place (mappings whose TP groups are placed differently share them)."""
        key = (_memory_knobs(m), m.group("tp"))
        memo = self.__dict__.setdefault("_split_memory_memo", {})
        if key not in memo:
            memo[key] = self._least_split_memory(m)
        return memo[key]

    def _least_split_memory(self, m: Mapping) -> "mem.MemoryBreakdown | None":
        splits = self._splits_evaluate_may_take(m)
        if splits is None:
            return None
        try:
            params = tuple(self._block_params(which, m) for which in ("layer", "embedding", "head", "dense_layer"))
        except InfeasibleError:  # (the block solve reports it)
            return None
        if not self.num_dense_layers:
            params = params[:3] + (None,)
        key = (_memory_knobs(m), params)
        memo = self.__dict__.setdefault("_split_memory_by_params", {})
        if key not in memo:
            memo[key] = self._least_split_memory_of(m, splits, params)
        return memo[key]

    def _least_split_memory_of(self, m: Mapping, splits: list, params: tuple) -> "mem.MemoryBreakdown | None":
        """:meth:`_least_split_memory` over ``splits`` with the blocks' ``params``."""
        least = None
        for layers in splits:
            memory = self._stage_memory_of(m, params, *self._split_kinds(layers, m))[1]
            if memory.fits:
                return None
            if least is None or memory.total_bytes < least.total_bytes:
                least = memory
        return least

    def _block_params(self, which: str, m: Mapping, placed: bool = True) -> tuple[float, float] | None:
        """(parameters, MoE expert parameters) per chip of block ``which`` of ``m`` as :meth:`block`
        shards it (None when the model has no such block): what :meth:`_stage_memory` reads.
        Without any sharding solved where every plan gives the same
        (:func:`~dfmodel.inter_chip.sharding.plan_free_params`, Megatron's layouts), memoised
        without the TP group's placement: the memory screen of DeepSeek-V3 on 8192 dragonfly
        chips sharded the embedding, head and dense layer of every TP group placement (20k
        shardings) only to count their parameters."""
        layer = which == "layer"
        graph = getattr(self.graphs(m.micro_batch, m.cp, m.ep_outside_tp if layer else 1), which)
        if graph is None:
            return None
        whole = m.whole_experts and layer and m.tp > 1
        key = (id(graph), m.tp, m.sequence_parallel, whole)
        memo = self.__dict__.setdefault("_block_params_memo", {})
        hit = memo.get(key)
        if hit is not None and hit[0] is graph:  # (the graph is held: its id is not reused meanwhile)
            return hit[1]
        params = plan_free_params(graph, self.system, m.tp, sequence_parallel=m.sequence_parallel,
                                  megatron_layouts=True, whole_experts=whole)
        if params is None:  # (the plan decides: m's own, not memoised, another placement may pick another)
            if not placed:
                raise _PlacementDependent(which)
            g = self._shard_block(graph, m.tp, m.group("tp"), m.sequence_parallel, whole).graph
            return g.params(), expert_params(g)
        memo[key] = (graph, params)
        return params

    def _stage_memory(self, m: Mapping, layer: BlockTimes, emb, head, dense, moe_st: list[int],
                      dense_st: list[int]) -> tuple[list[float], "mem.MemoryBreakdown"]:
        """:meth:`_stage_memory_of` with the solved blocks' parameters."""
        params = ((layer.params_per_chip, expert_params(layer.sharded.graph)),
                  *((b.params_per_chip, 0.0) if b else None for b in (emb, head, dense)))
        return self._stage_memory_of(m, params, moe_st, dense_st)

    def _stage_memory_of(self, m: Mapping, params: tuple, moe_st: list[int],
                         dense_st: list[int]) -> tuple[list[float], "mem.MemoryBreakdown"]:
        """(parameters per chip of each stage, the worst stage's memory) of ``m``'s layer split
        (``moe_st`` MoE and ``dense_st`` dense layers per stage): the embedding on the first
        stage, the head, MTP modules and tied copy on the last (:meth:`memory_check`). ``params``:
        (parameters, expert parameters) per chip of the layer, embedding, head and dense layer
        (None: no such block; :meth:`_block_params`). It reads no time, so :meth:`evaluate` asks
        it before the pipeline simulation: a mapping that cannot fit needs none."""
        (layer_p, layer_e), emb, head, dense = params
        dense_p = dense[0] if dense else 0.0
        params_stage = [n * layer_p + d * dense_p for n, d in zip(moe_st, dense_st)]
        params_stage[0] += emb[0] if emb else 0.0
        params_stage[-1] += head[0] if head else 0.0
        params_stage[-1] += self._mtp_params_per_chip(m, layer_p)
        params_stage[-1] += mem.tied_embedding_copy_params(
            vocab=self.model.vocab_size, hidden=self.model.hidden, tp=m.tp, pp=m.pp,
            tie_embeddings=self.model.tie_embeddings)
        moe_mem = moe_st[:-1] + [moe_st[-1] + self.num_mtp_layers]  # the MTP blocks' weights and stash
        memory = self.memory_check(m, params_stage, moe_mem, layer_p, layer_expert_params=layer_e,
                                   dense_per_stage=dense_st if dense else None, dense_layer_params=dense_p)
        return params_stage, memory

    @property
    def num_mtp_layers(self) -> int:
        """Multi-token prediction modules (``moe.mtp_layers``; 0 for a dense model)."""
        moe = getattr(self.model, "moe", None)
        return moe.mtp_layers if moe is not None else 0

    def _mtp_s(self, m: Mapping, layer_s: tuple[float, float], head_s: tuple[float, float]) -> tuple[float, float]:
        """(forward, backward) the MTP modules add to the last stage per micro-batch
        (:func:`experts.mtp_stage_s`; 0 without them)."""
        if not self.num_mtp_layers:
            return 0.0, 0.0
        proj = moe_terms.mtp_projection_s(self.system.chip, tokens=m.micro_batch * self.model.seq_len / m.cp,
                                          hidden=self.model.hidden, tp=m.tp, precision=self.precision)
        return moe_terms.mtp_stage_s(self.model.moe, layer_s=layer_s, head_s=head_s, projection_s=proj)

    def _mtp_params_per_chip(self, m: Mapping, layer_params: float) -> float:
        """Parameters the MTP modules put on a last-stage chip: per module one (MoE) layer's
        and its ``2d x d / tp`` projection; and, with more than one stage, a copy of the
        vocabulary-parallel word embeddings (Megatron-Core's GPTModel builds the embedding on the
        stage that runs MTP, as the tied-embedding copy of :func:`memory.tied_embedding_copy_params`)."""
        n = self.num_mtp_layers
        if not n:
            return 0.0
        h = self.model.hidden
        copy = mem.tied_embedding_copy_params(vocab=self.model.vocab_size, hidden=h, tp=m.tp, pp=m.pp,
                                              tie_embeddings=not self.model.tie_embeddings)
        return n * (layer_params + 2 * h * h / m.tp) + copy

    def checkpoint_state(self, m: Mapping):
        """What a checkpoint of this mapping saves and who writes it (None: no checkpointing)."""
        ckpt = self.training.checkpoint
        if ckpt is None:
            return None
        return checkpoint_state(self.graphs(1).params(), num_chips=self.system.num_chips, tp=m.tp, pp=m.pp,
                                dp=m.dp_cp, checkpoint=ckpt)

    # -- communication terms of the record's dimensions -----------------------------------------
    def _layer_phases_s(self, m: Mapping, layer: BlockTimes, extra: dict[str, tuple[float, float]]) -> tuple[float, float]:
        """(forward, backward) time of one layer and micro-batch with its exposed communication
        ``extra`` (from :meth:`_layer_comm`) and Megatron's tp_comm_overlap (:func:`_layer_times_s`)."""
        t_f, t_b = _layer_times_s(layer, m, self.system.chip.compute_tiles, self._ub_config)
        c_f, c_b = self._serial_kernels_of(layer)  # TE's FP8 casts, the query / key norms (serial)
        redo_f = c_f if m.recompute == "full" else 0.0  # full recompute re-runs the forward's casts and GEMMs
        redo_f += self._mla_up_redo_s(m) + self._moe_redo_s(m, layer)
        f = t_f + c_f + sum(f for f, _ in extra.values())
        b = t_b + c_b + redo_f + sum(b for _, b in extra.values())
        # an eager framework's host queues the layer no faster than _host_floor_s: the GPU's wait
        # shows in the backward (the CPU runs ahead once the forward's kernels are queued)
        return f, max(b, self._host_floor_s(layer) - f)

    def _serial_kernels_of(self, layer: BlockTimes) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of ``layer``'s memory-bound kernels that run
        on their own beside what the intra-chip pass timed: TE's FP8 cast / transpose kernels
        (:meth:`_fp8_prep_of`) and the query / key RMSNorms (:meth:`_qk_norm_of`); a full
        recompute re-runs the forward's."""
        c_f, c_b = self._fp8_prep_of(layer)
        q_f, q_b = self._qk_norm_of(layer)
        return c_f + q_f, c_b + q_b

    def _qk_norm_of(self, block: BlockTimes) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of ``block``'s query / key RMSNorms
        (:func:`_qk_norm_s`), 0 without ``model.qk_norm``."""
        if not getattr(self.model, "qk_norm", False):
            return 0.0, 0.0
        return _qk_norm_s(block, self.system.chip, self.training.activation_bytes)

    def _fp8_prep_of(self, block: BlockTimes) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of TE's FP8 cast / transpose kernels in
        ``block`` (:func:`_fp8_prep_s` at this run's recipe), run serially beside its GEMMs. (A
        Hopper GEMM's serial epilogue is in its kernel's own time,
        :func:`dfmodel.system.processor.compute_time_s`.)"""
        return _fp8_prep_s(block, self.system.chip, *self._fp8_kind)

    @property
    def _ub_config(self) -> tuple[tuple[str, int], ...] | None:
        """The run's userbuffers SMs per exchange (None: NeMo's tuned tables), for :func:`_layer_times_s`."""
        return self.training.userbuffers_config()

    @property
    def _fp8_kind(self) -> tuple[str, bool]:
        """(FP8 recipe, whether MoE tokens are dispatched in FP8): what :func:`_fp8_prep_s` reads."""
        moe = getattr(self.model, "moe", None)
        return self.training.fp8.recipe, bool(moe is not None and moe.dispatch_fp8)

    def _amax_reduce_s(self, m: Mapping, layer: BlockTimes) -> tuple[float, float]:
        """(forward, backward) seconds per model chunk and micro-batch of Transformer Engine's
        delayed-scaling amax reduction: at the exit of the outermost ``fp8_autocast`` (Megatron-Core
        wraps each TransformerBlock, i.e. each model chunk, in one) TE concatenates the amaxes of
        the chunk's FP8 tensors and all-reduces them (MAX, ``async_op=False``) over the
        autocast's ``fp8_group``, then the first module's backward does the same for the
        gradients (TE v1.x fp8.py ``fp8_autocast_exit`` -> ``reduce_and_update_fp8_tensors``;
        linear.py backward ``reduce_and_update_bwd_fp8_tensors``). Megatron-Core passes
        ``get_amax_reduction_group(with_context_parallel=True)``: every tp x cp x dp rank of the
        pipeline stage. The message is a few KiB (fp32 per tensor: input, weight, output of each
        GEMM forward; two gradients backward), so the time is the collective's latency over that
        group, which grows with the data-parallel width. 0 unless the run is FP8 with
        ``delayed`` scaling, eagerly (a CUDA-graphed step reduces once per graph), over >1 rank."""
        if (self.precision != Precision.fp8 or self.training.fp8.recipe != "delayed"
                or self.training.cuda_graphs or m.tp * m.dp_cp == 1):
            return 0.0, 0.0
        layers_per_chunk = -(-self.num_layers // (m.pp * m.interleave))
        return _kept_on(layer, "_amax_reduce_s", (m.group("tp"), m.group("cp"), m.group("dp"), layers_per_chunk),
                        lambda: self._amax_reduce_uncached_s(m, layer, layers_per_chunk))

    def _amax_reduce_uncached_s(self, m: Mapping, layer: BlockTimes, layers_per_chunk: int) -> tuple[float, float]:
        gemms = sum(1 for k in layer.sharded.graph.kernels
                    if k.phase == Phase.forward and k.kind.is_matrix and k.weight_bytes > 0 and k.precision == "fp8")
        group = merge_groups(self.system, m.group("tp"), m.group("cp"), m.group("dp"))
        n = gemms * layers_per_chunk
        return (self.costs.time_s("all_reduce", FP8_AMAX_BYTES * 3 * n, group) if n else 0.0,
                self.costs.time_s("all_reduce", FP8_AMAX_BYTES * 2 * n, group) if n else 0.0)

    def _host_floor_s(self, layer: BlockTimes) -> float:
        """:func:`_host_floor_s` of this run (0 when its layers run as CUDA graphs)."""
        if self.training.cuda_graphs:
            return 0.0
        return _host_floor_s(layer, self.system.chip, self.precision.value)

    def _mla_up_redo_s(self, m: Mapping) -> float:
        """Backward time of recomputing MLA's up projections per layer and micro-batch
        (:func:`experts.mla_up_recompute_s`); 0 with full recompute, which re-runs them anyway."""
        mla = getattr(self.model, "mla", None)
        if mla is None or m.recompute == "full" or not mla.recompute_up_proj:
            return 0.0
        return moe_terms.mla_up_recompute_s(self.system.chip, mla, tokens=m.micro_batch * self.model.seq_len / m.cp,
                                            heads=self.model.num_heads, tp=m.tp, precision=self.precision)

    def _moe_redo_s(self, m: Mapping, layer: BlockTimes) -> float:
        """Backward time of an MoE layer's fine-grained recompute per micro-batch
        (``moe.recompute_activation`` / ``recompute_norm``: :func:`experts.moe_recompute_bytes` at
        the chip's DRAM bandwidth); 0 for a dense block, without the fields, and with full
        recompute, which re-runs the whole forward anyway."""
        moe = getattr(self.model, "moe", None)
        fields = (getattr(moe, "recompute_activation", False), getattr(moe, "recompute_norm", False))
        if m.recompute == "full" or not any(fields):
            return 0.0
        if not _kept_on(layer, "_holds_experts", None, lambda: any(k.expert for k in layer.sharded.graph.kernels)):
            return 0.0
        e, g = self.training.activation_bytes, mem.fp8_linear_input_bytes(self.training)
        return memory_time_s(self.system.chip, moe_terms.moe_recompute_bytes(
            self.model, tokens=m.micro_batch * self.model.seq_len / m.cp, tp=m.tp,
            sequence_parallel=m.sequence_parallel, bytes_per_element=e, linear_input_bytes=e if g is None else g))

    def _layer_parts(self, m: Mapping, layer: BlockTimes) -> dict[str, float]:
        """One layer's time by component, as :meth:`_layer_phases_s` times it (with
        tp_comm_overlap: the TP communication under its GEMMs)."""
        if m.tp_comm_overlap and m.tp > 1:
            sms = self.system.chip.compute_tiles
            f, b = _userbuffers_parts(layer.fwd, m.tp, sms, self._ub_config), _userbuffers_parts(layer.bwd, m.tp, sms, self._ub_config)
            redo = {"none": None, "selective": layer.attention_core.parts_s, "full": f}[m.recompute]
            parts = {k: f[k] + b[k] + (redo[k] if redo else 0.0) for k in COMPONENTS}
        else:
            parts = layer.parts(m.recompute)
        c_f, c_b = self._serial_kernels_of(layer)  # memory-bound kernels of their own
        parts["memory"] += c_f + c_b + (c_f if m.recompute == "full" else 0.0)
        parts["compute"] += self._mla_up_redo_s(m)
        parts["memory"] += self._moe_redo_s(m, layer)
        # the GPU waiting on the host (_layer_phases_s's floor; the layer's exposed communication
        # is not in these parts, so the wait's share can only be overstated, never missed)
        host_s = self._host_floor_s(layer) - sum(parts.values())
        if host_s > 0:
            parts["host"] = host_s
        return parts

    def _with_offload(self, m: Mapping, layer: BlockTimes, extra: dict[str, tuple[float, float]],
                      t_f: float, t_b: float) -> tuple[float, float]:
        """(forward, backward) with offload's host transfers: they hide behind the rest of the
        layer's pass and only the excess is exposed (recorded in ``extra["offload"]``)."""
        x_f, x_b = self._offload_layer_s(m, layer.params_per_chip)
        if not (x_f or x_b):
            return t_f, t_b
        extra["offload"] = (off.exposed_s(x_f, t_f), off.exposed_s(x_b, t_b))
        return t_f + extra["offload"][0], t_b + extra["offload"][1]

    def _layer_comm(self, m: Mapping, layer: BlockTimes, dp_group, experts: bool = True) -> dict[str, tuple[float, float]]:
        """Exposed communication of one layer and micro-batch, (forward, backward) per key
        (``experts=False``: an MoE model's dense layer, no all-to-alls)."""
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
        if m.ep > 1 and experts:
            out["ep_comm"] = self._ep_comm(m, layer)
        if m.zero_stage == 3:
            f, b = self._fsdp_exposed(layer, layer.fwd.time_s, layer.backward_s(m.recompute), m, dp_group)
            out["dp_comm"] = (f - layer.fwd.time_s, b - layer.backward_s(m.recompute))
        return out

    def _layer_comm_shared(self, m: Mapping, layer: BlockTimes, experts: bool = True) -> dict:
        """:meth:`_layer_comm` on the mapping's dp x cp group, memoised on the block and the
        mapping fields it reads (the refined bounds ask once per candidate: ~150k times on
        llama3_70b / dgx_h100). The dict is shared: callers must not change it (``evaluate``
        calls :meth:`_layer_comm` itself). Without cp, ep or ZeRO-3 there is nothing to add."""
        if m.cp == 1 and m.ep == 1 and m.zero_stage != 3:
            return {}
        key = (id(layer), experts, m.placement, m.cp, m.cp_comm, m.recompute, m.micro_batch, m.tp, m.ep, m.etp,
               m.overlap_moe_expert_parallel_comm, m.num_micro_batches, m.pp, m.zero_stage, m.dp,
               m.overlap_param_gather)
        memo = self.__dict__.setdefault("_layer_comm_memo", {})
        if key not in memo:
            dp_group = merge_groups(self.system, m.group("cp"), m.group("dp"))
            memo[key] = self._layer_comm(m, layer, dp_group, experts)
        return memo[key]

    def _offload_layer_s(self, m: Mapping, layer_params: float, least: bool = False) -> tuple[float, float]:
        """Host-link time of one layer and micro-batch, (forward, backward):
        :meth:`OffloadPlan.layer_transfer_s` with this layer's saved activations and the 16-bit
        weights of ``layer_params`` parameters per chip (streamed as the ZeRO-3 shard). ``least``:
        the least over expert TP (the routed rows kept sharded), for floors of groups that span it."""
        plan = self.offload_plan(m)
        if plan is None or not (plan.activations or plan.weights):
            return 0.0, 0.0
        act = self._layer_act_bytes(m.tp, m.cp, m.micro_batch, m.sequence_parallel, m.recompute,
                                    experts_gathered=self._experts_gathered(m) and not least)
        weights = layer_params * self.training.activation_bytes / (m.dp_cp if m.zero_stage == 3 else 1)
        return plan.layer_transfer_s(act_bytes=act, weight_bytes=weights)

    def _experts_gathered(self, m: Mapping) -> bool:
        """Whether ``m``'s MoE dispatcher all-gathers the routed rows over TP (expert TP = tp > 1,
        not expert TP 1) and the expert FC1 keeps them whole for its weight gradient, as
        Megatron-Core does on the chips that run it (``Chip.eager``;
        :func:`memory.moe_mla_activation_delta_bytes`, :func:`sharding.comm_phase`)."""
        return self.model.moe is not None and m.tp > 1 and not m.whole_experts and self.system.chip.eager

    def _layer_act_bytes(self, tp: int, cp: int, micro_batch: int, sp: bool, recompute: str,
                         dense: bool = False, experts_gathered: bool = False) -> float:
        """:func:`memory.llm_layer_activation_bytes` of one (MoE) layer, or with ``dense`` of an
        MoE model's dense layer (the model without its moe block, as ``llm_memory_per_chip``
        counts it), memoised on what it reads (every offloaded leaf's bound asks for it: ~20 us
        a call, 10^5 calls on DeepSeek-V3 / 64 H100)."""
        key = (tp, cp, micro_batch, sp, recompute, dense, experts_gathered)
        memo = self.__dict__.setdefault("_layer_act_memo", {})
        if key not in memo:
            model = self.model.model_copy(update={"moe": None}) if dense else self.model
            memo[key] = mem.llm_layer_activation_bytes(
                model=model, training=self.training, attention=self.model.attention or "unfused", tp=tp,
                cp=cp, micro_batch=micro_batch, sequence_parallel=sp, recompute=recompute,
                experts_gathered=experts_gathered)
        return memo[key]

    @cached_property
    def _param_gather_bytes(self) -> float:
        """Bytes per parameter the distributed optimizer all-gathers after its step: the 16-bit
        parameters, or 1 byte with FP8 weights (Megatron ``--fp8-param-gather`` / NeMo
        ``fp8_params``: the updated master weights are cast to FP8 before the all-gather)."""
        t = self.training
        if t.precision.value == "fp8" and t.fp8.fp8_weights:
            return 1.0
        return t.activation_bytes

    @cached_property
    def _kv_head_dim(self) -> float:
        """Mean of the key and value head dims (K + V bytes = 2 x this per head): the model's head
        width (h / a unless it sets ``head_dim``), or MLA's ``(qk_nope + qk_rope + v_head) / 2``
        (it exchanges every head's full K and V)."""
        mla = getattr(self.model, "mla", None)
        return (mla.qk_head_dim + mla.v_head_dim) / 2 if mla else self.model.head_width

    def _expert_dp_group(self, m: Mapping):
        """Megatron-Core's expert data-parallel group: the ranks holding the same experts,
        ``tp x dp x cp / (ep x etp)`` of them (parallel_state.py): ``dp x cp / ep`` with expert
        TP = TP (Megatron-LM's default: ``expert_tensor_parallel_size`` is set to
        ``tensor_model_parallel_size`` when unset, megatron/training/arguments.py), ``tp x dp x
        cp / ep`` with expert TP 1. Expert gradients are reduced and ZeRO-sharded over it."""
        ranks = (m.group("tp"),) if m.whole_experts else ()  # expert TP 1: ep spans the TP ranks
        return moe_terms.complement_group(self.system, merge_groups(self.system, *ranks, m.group("cp"), m.group("dp")),
                                          m.group("ep"))

    def _grad_groups(self, m: Mapping, params: float, expert_params_per_chip: float, group) -> list[tuple[float, tuple]]:
        """(parameters, group) pairs whose gradients sync together: the non-expert ones over
        the dp x cp ``group``, the experts over the expert data-parallel group. When both groups
        are the same ranks (ep = 1) they are one collective (one bucketed communicator), so a
        1-expert MoE syncs exactly as the dense MLP it equals."""
        edp = self._expert_dp_group(m) if expert_params_per_chip else group
        if edp == tuple(group):
            return [(params, group)]
        return [(params - expert_params_per_chip, group), (expert_params_per_chip, edp)]

    def ep_pair_s(self, group: tuple, tokens: int) -> float:
        """One dispatch + combine over the ep ``group`` for ``tokens`` tokens per rank (the
        forward pair of :meth:`_ep_comm`; the backward sends the same pair transposed). It reads
        the group and the token count only, so mappings that differ in anything else (pp, dp,
        the other groups' placement, ZeRO...) share it: memoised on those two."""
        memo = self.__dict__.setdefault("_ep_pair_memo", {})
        key = (group, tokens)
        if key not in memo:
            moe, e = self.model.moe, self.training.activation_bytes
            # the cost table's all_to_all takes the whole local buffer (S/p to each member): every
            # routed row; node-limited routing and FP8 dispatch (DeepSeek-V3) in experts.token_a2a_s
            a2a = partial(moe_terms.token_a2a_s, self.costs, group, self.system.network[0].name,
                          rows=routed_rows(tokens, moe), hidden=self.model.hidden, moe=moe)
            # forward: dispatch + combine; backward: the combine's transpose (sent as a dispatch) +
            # the dispatch's transpose (as a combine)
            memo[key] = a2a(bytes_per_element=moe_terms.dispatch_bytes_per_element(moe, e)) + a2a(bytes_per_element=e)
        return memo[key]

    def _ep_comm(self, m: Mapping, layer: BlockTimes | None = None) -> tuple[float, float]:
        """Exposed MoE token all-to-alls of one layer and micro-batch over the ep group.

        Megatron-Core's ``MoEAlltoAllTokenDispatcher``: forward = dispatch + combine, backward =
        their two transposes, each an all-to-all in which a rank sends
        :func:`~dfmodel.graph.builders.moe.dispatch_bytes_per_rank` (its ``T / tp`` sequence-
        parallel tokens x top_k x capacity x imbalance rows of ``h`` activations, the ``(ep-1)/ep``
        bound for other ranks). Without overlap they sit on the critical path between router
        and experts and are exposed whole. Full recomputation runs the forward pair again.

        ``overlap_moe_expert_parallel_comm`` (Megatron-Core's flag of that name, which pairs the
        forward of micro-batch ``i + 1`` with the backward of ``i`` layer by layer; DeepSeek-V3's
        DualPipe, arXiv:2412.19437 sec. 3.2.1, which pairs a forward and a backward chunk): the
        layer's all-to-alls ``a`` run under the computation ``c`` of the paired forward +
        backward of the layer, which loses the SMs the communication kernels hold; exposed
        ``max(a - c, f a)`` (:func:`~dfmodel.inter_chip.experts.overlapped_a2a_exposed_s`,
        ``f`` = 20 of 132 SMs), split over forward and backward as the all-to-alls are. Applied
        to the steady state; the ``pp - 1`` warm-up forwards and cool-down backwards of the first
        stage have no partner and are exposed whole (:func:`~dfmodel.inter_chip.experts.with_unpaired`).
        DualPipe's own smaller bubble and its two parameter copies are not modelled (1F1B's bubble).
        """
        tokens = m.micro_batch * (self.model.seq_len // m.cp) // m.tp
        pair_s = self.ep_pair_s(m.group("ep"), tokens)
        again = pair_s if m.recompute == "full" else 0.0
        fwd_s, bwd_s = pair_s, pair_s + again
        if (layer is not None and m.overlap_moe_expert_parallel_comm
                and moe_terms.a2a_overlap_applies(ep=m.ep, num_micro_batches=m.num_micro_batches)):
            compute_s = layer.fwd.time_s + layer.backward_s(m.recompute)
            exposed = moe_terms.overlapped_a2a_exposed_s(fwd_s + bwd_s, compute_s, moe_terms.a2a_sm_fraction())
            # the pipeline's warm-up forwards and cool-down backwards have no partner: exposed whole
            share = moe_terms.with_unpaired(exposed / (fwd_s + bwd_s), pp=m.pp, num_micro_batches=m.num_micro_batches)
            return fwd_s * share, bwd_s * share
        return fwd_s, bwd_s

    def _fsdp_exposed(self, blk: BlockTimes | None, fwd_s: float, bwd_s: float, m: Mapping, group) -> tuple[float, float]:
        """ZeRO-3 / FSDP times of one block per micro-batch: (forward, backward) with the
        parameter gathers and gradient reduce-scatter.

        Forward: all-gather the block's ``P e`` parameter bytes over the dp x cp ranks;
        backward: all-gather them again and reduce-scatter the ``P e`` gradient bytes (PyTorch
        FSDP ``FULL_SHARD``; Rajbhandari et al. 2020 sec. 5.3: 3x the traffic of a plain
        all-reduce's half). With prefetch (``overlap_param_gather``) the gather of the next
        block runs under this block's compute: only the excess is exposed, ``max(0, comm -
        compute)``; without it the collectives are exposed whole. (Not counted: the SMs NCCL's
        channels take from the compute they hide behind, as :meth:`_dp_sync_s` counts them; with
        it, ZeRO-3's near-continuous gathers lose their winners and the search's ZeRO-3 floors
        are not yet tight enough to keep DeepSeek-V3's GPU cells within 10 s.)
        """
        if blk is None or m.dp_cp == 1:
            return fwd_s, bwd_s
        # 16-bit parameters gathered, gradients reduce-scattered in the framework's reduce precision;
        # MoE experts over the expert data-parallel ranks (dp x cp / ep), the rest over dp x cp
        ag, rs = self._fsdp_collectives_s(m, blk.params_per_chip, expert_params(blk.sharded.graph), group)
        if m.overlap_param_gather:
            return max(fwd_s, ag), max(bwd_s, ag + rs)
        return fwd_s + ag, bwd_s + ag + rs

    def _fsdp_collectives_s(self, m: Mapping, params: float, experts: float, group) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of a block's ``params`` per-chip parameters, of
        which ``experts`` MoE expert ones, in ZeRO-3 (:meth:`_fsdp_exposed`)."""
        parts = self._grad_groups(m, params, experts, group)
        ag = sum(self.costs.time_s("all_gather", p * self.training.activation_bytes, g) for p, g in parts)
        rs = sum(self.costs.time_s("reduce_scatter", p * self.training.grad_bytes, g) for p, g in parts)
        return ag, rs

    def _dp_sync_s(self, m: Mapping, params: float, fwd0_s: float, bwd0_s: float, group,
                   expert_params_per_chip: float = 0.0) -> float:
        """Exposed gradient synchronisation over the dp x cp ranks at the end of the iteration.

        Stage 0 runs the last backward, so its gradients sync last (its backward is the window).
        ZeRO 0: all-reduce; 1: reduce-scatter of gradients + all-gather of the updated parameters
        (Megatron's distributed optimizer); 2: as 1, but the gradients are reduce-scattered
        after every micro-batch's backward (DeepSpeed ZeRO-2 with gradient accumulation), the
        first ``m - 1`` under the next micro-batch's backward; 3: the per-block collectives of
        :meth:`_fsdp_exposed`, nothing at the end. A collective whose overlap flag is off is
        exposed whole; the others hide as :func:`pipeline.dp_sync_exposed_s` says, the gradient
        reductions under stage 0's last backward (``bwd0_s``) and the parameter all-gathers under
        the next step's first forward (``fwd0_s``).

        MoE: the ``expert_params_per_chip`` of ``params`` are reduced (and gathered) over the
        expert data-parallel ranks, ``dp x cp / ep`` (Megatron-Core keeps expert parameters in
        their own buffers, synchronised over ``expert_data_parallel_group``), after the others
        on the same stream.
        """
        if m.dp_cp == 1 or m.zero_stage == 3:
            return 0.0
        parts = self._grad_groups(m, params, expert_params_per_chip, group)
        reduce_s = gather_s = 0.0
        bucket = pipe.megatron_bucket_elements(m.dp_cp)
        for n, g in parts:
            if n <= 0:
                continue
            # one collective per bucket (Megatron-LM DDP / distributed optimizer buckets), each
            # paying its own latency steps (a ring over the dp x cp ranks: n - 1 of them)
            k = max(1, math.ceil(n / bucket))
            grad_bytes = n * self.training.grad_bytes / k  # fp32 for bf16/fp8 (Megatron)
            if m.zero_stage == 0:
                reduce_s += k * self.costs.time_s("all_reduce", grad_bytes, g)
            else:  # gradients reduce-scattered, 16-bit parameters all-gathered
                reduce_s += k * self.costs.time_s("reduce_scatter", grad_bytes, g)
                gather_s += k * self.costs.time_s("all_gather", n * self._param_gather_bytes / k, g)
        exposed = (reduce_s if not m.overlap_grad_reduce else 0.0) + (gather_s if not m.overlap_param_gather else 0.0)
        # the reduce-scatters drain under this step's last backward; the all-gathers of the updated
        # parameters run under the NEXT step's first forward, bucket by bucket in forward order, the
        # first bucket's exposed (core_r0.8.0 distrib_optimizer.py: step() dispatches all-gather 0,
        # each bucket's forward pre-hook waits for its own and dispatches the next)
        for sync_s, window_s, on in ((reduce_s, bwd0_s, m.overlap_grad_reduce),
                                     (gather_s, fwd0_s, m.overlap_param_gather)):
            if on and sync_s:
                exposed += pipe.dp_sync_exposed_s(
                    sync_s=sync_s, grad_elements=params, chunk_backward_s=window_s / m.interleave,
                    interleave=m.interleave, pp=m.pp, overlap_fraction=self.system.dp_overlap,
                    bucket_elements=bucket, last_bucket_elements=self.model.vocab_size * self.model.hidden / m.tp)
        total_s = reduce_s + gather_s
        if m.zero_stage == 2 and m.num_micro_batches > 1:
            window = bwd0_s * self.system.dp_overlap if m.overlap_grad_reduce else 0.0
            exposed += (m.num_micro_batches - 1) * max(0.0, reduce_s - window)
            total_s += (m.num_micro_batches - 1) * reduce_s
        # the compute the hidden part ran beside lost the SMs of its channels (when the sync
        # outlasts its windows part of that loss hides behind the exposed rest: an upper estimate)
        return exposed + max(0.0, total_s - exposed) * self._collective_sm_fraction

    @cached_property
    def _collective_sm_fraction(self) -> float:
        """Share of the chip's SMs an NCCL collective holds while it hides behind compute: its
        16 ring channels, one CTA each (:data:`~dfmodel.netmodels.nccl.NCCL_RING_CHANNELS`), on
        chips whose collectives run as kernels beside the compute (GPUs: ``Chip.eager``); 0
        elsewhere."""
        chip = self.system.chip
        if not chip.eager:
            return 0.0
        sms = chip.compute_tiles
        return nccl.overlapped_collective_s(1.0, min(nccl.NCCL_RING_CHANNELS, sms - 1), sms)

    def _stage_layers(self, layers: tuple[int, ...], m: Mapping) -> list[int]:
        """Layers per physical stage (interleaved chunks summed)."""
        if len(layers) == m.pp:
            return list(layers)
        return [sum(layers[i::m.pp]) for i in range(m.pp)]

    def _stage_shares(self, n_layers: int, m: Mapping, layer: BlockTimes, emb, head,
                      dense: tuple[int, BlockTimes] | None = None) -> dict[str, float]:
        parts = {k: n_layers * v for k, v in self._layer_parts(m, layer).items()}
        if dense is not None:
            for k, v in self._layer_parts(m, dense[1]).items():
                parts[k] = parts.get(k, 0.0) + dense[0] * v
        for blk in (emb, head):
            if blk:
                for k, v in blk.parts("none").items():
                    parts[k] += v
        total = sum(parts.values()) or 1.0
        return {k: v / total for k, v in parts.items()}


__all__ = ["LLMModel", "Evaluation", "compute_time_s"]
