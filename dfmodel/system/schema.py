"""System specs: one chip type and a network of dimensions (pydantic models, one per concept).

A spec mirrors these classes one to one::

    name: dgx_a100
    chip:
      name: A100-SXM4-80GB
      peak_flops: {bf16: 312 TFLOPS, fp32: 19.5 TFLOPS}   # or one number for every precision
      vector_flops: 39 TFLOPS         # non-matrix (element-wise, reductions); default = peak
      sram_bytes: 40 MiB
      compute_tiles: 108              # SMs / PCUs / cores shared by fused kernels
      memory: {kind: HBM2e, capacity_bytes: 80 GiB, bandwidth_Bps: 2039 GB/s,
               reserve_bytes: 3 GiB}  # context, NCCL buffers, workspaces, fragmentation
      execution: kernel_by_kernel     # or dataflow (kernels fuse into partitions)
      overlap: true                   # compute/memory/network of a partition overlap (max) or add
      efficiency: {matmul: 0.8, vector: 0.6,   # matmul also {bf16: .., fp8: .., fp64: ..}
                   attention: 0.55,              # fused (Flash) attention; default = matmul memory: 0.85, matmul_tile: [128, 128, 64],
                   kernel_overhead_s: 5 us}
      price_usd: 15000
      power_w: 400
    network:                          # innermost dimension first
      - {name: nvlink, topology: switch, size: 8, link_bandwidth_Bps: 300 GB/s, latency_s: 2 us}
      - {name: ib, topology: switch, size: 128, link_bandwidth_Bps: 25 GB/s, latency_s: 5 us}
    storage: {...}                    # optional: storage tiers for input and checkpoints,
                                      # see dfmodel.system.storage
    host: {...}                       # optional: host DRAM for offload (dfmodel.system.host)

Bandwidth semantics (``link_bandwidth_Bps``, one direction): ring = between two neighbours (a
bidirectional ring sends both ways at once); fully_connected = between each pair of members;
switch = each member's injection bandwidth into the switch. Sizes accept unit strings (see
:mod:`dfmodel.system.units`). Unknown fields are errors.

Cost and power (USD, W): ``chip.price_usd``/``power_w`` and ``chip.memory.price_usd``/``power_w``
per chip; per network dimension ``link_price_usd``/``link_power_w`` per link and
``switch_price_usd``/``switch_power_w`` per switch of ``switch_radix`` ports. How links and
switches are counted per topology, and the totals every result carries as ``cost_usd`` and
``power_w`` (with ``throughput_per_usd = samples_per_s / cost_usd`` and ``throughput_per_w =
samples_per_s / power_w``), are in :mod:`dfmodel.system.cost`.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from dfmodel.system.units import (
    Bytes,
    BytesOrZero,
    BytesPerSec,
    Fraction,
    FlopsPerSec,
    NonNegativeFloat,
    PositiveFloat,
    Seconds,
)
from dfmodel.system.storage import Storage  # noqa: F401 -- re-exported; the schema of ``System.storage``
from dfmodel.system.host import Host  # noqa: F401 -- re-exported; the schema of ``System.host``


class Precision(str, Enum):
    """Numeric precision of a workload's tensors and math."""

    fp64 = "fp64"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"

    @property
    def bytes(self) -> int:
        return {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[self.value]


class Strict(BaseModel):
    """Base for every spec model: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class Memory(Strict):
    """Off-chip memory of one chip (DDR, HBM, or an external weight store such as MemoryX)."""

    kind: str = Field(pattern=r"^(DDR|LPDDR|GDDR|HBM|external)[0-9A-Za-z]*$")
    capacity_bytes: Bytes
    bandwidth_Bps: BytesPerSec
    price_usd: NonNegativeFloat = 0.0
    power_w: NonNegativeFloat = 0.0
    # Memory a chip cannot give to the model: runtime context, communication buffers, library
    # workspaces and allocator fragmentation. Mappings must fit in capacity minus this.
    reserve_bytes: BytesOrZero = 0.0

    @property
    def usable_bytes(self) -> float:
        """Capacity left for weights, gradients, optimizer state and activations."""
        return max(0.0, self.capacity_bytes - self.reserve_bytes)


class Efficiency(Strict):
    """Achieved fractions of peak, all physically plausible (in (0, 1]).

    - ``matmul``: fraction of matrix peak reached by a large matmul once its dims are padded
      to ``matmul_tile`` (systolic array / MMA tile shape: padding is the shape penalty). One
      number for every precision, or one per precision (``{bf16: 0.75, fp8: 0.6, fp64: 0.8}``):
      FP8 GEMMs reach a smaller fraction of their doubled peak than BF16 ones (the tensor cores
      finish first and the same epilogue, scaling and memory traffic remain), and DGEMM at fp64
      reaches its own (HPL Rmax/Rpeak). A precision missing from the table is an error;
    - ``attention``: fraction of the 16-bit matrix peak reached by a fused attention kernel
      (FlashAttention: both attention matmuls and the online softmax in one kernel, so the
      softmax's exponentials and the causal-mask bookkeeping share the SMs with the MMAs; FA-2,
      Dao 2023, reports 50-73 % of A100 peak forward, less backward). Default: the matmul
      efficiency;
    - ``vector``: fraction of ``vector_flops`` reached by element-wise and reduction kernels;
    - ``memory``: fraction of DRAM bandwidth reached by streaming kernels;
    - ``kernel_overhead_s``: fixed time per kernel launch (kernel-by-kernel) or per partition
      (dataflow: reconfiguration) -- the small-op penalty.
    - ``graph_kernel_overhead_s``: the same per-kernel time when the framework captures the whole
      iteration in a CUDA graph (HugeCTR's ``use_holistic_cuda_graph``, MLPerf): the CPU launch
      goes and only the GPU's gap between graph nodes remains. Read only by workloads that say
      they run as a graph (DLRM ``training.cuda_graphs``); default: ``kernel_overhead_s``.
    - ``host_linear_s``: host (CPU) time an eager framework spends on one linear module per
      micro-batch, forward + backward, per precision of its GEMM (Transformer Engine ``te.Linear``:
      Python module logic, the cast / amax / scale bookkeeping of FP8 and the kernel launches).
      The CPU queues a layer's kernels no faster than this, so one layer's forward + backward never
      takes less than the sum over its linear modules (a host-bound floor that FP8, whose GEMMs
      halve while its host work triples, reaches first). Read by LLM training unless the workload
      runs as CUDA graphs (``training.cuda_graphs``); a precision not listed has no floor; default
      none (no floor).
    """

    matmul: Fraction | dict[Precision, Fraction] = 1.0
    attention: Fraction | None = None
    vector: Fraction = 1.0
    memory: Fraction = 1.0
    matmul_tile: tuple[PositiveInt, PositiveInt, PositiveInt] = (1, 1, 1)
    kernel_overhead_s: Seconds = 0.0
    graph_kernel_overhead_s: Seconds | None = None
    host_linear_s: dict[Precision, Seconds] | None = None

    @field_validator("graph_kernel_overhead_s")
    @classmethod
    def _graph_not_slower(cls, v: float | None, info) -> float | None:
        # a graph replays the same kernels without the CPU launch: never a larger overhead
        eager = info.data.get("kernel_overhead_s")
        if v is not None and eager is not None and v > eager:
            raise ValueError(f"must be at most kernel_overhead_s ({eager:g} s), got {v:g} s")
        return v

    def graph_overhead_s(self) -> float:
        """Per-kernel overhead inside a CUDA graph (the eager one when the chip gives none)."""
        return self.kernel_overhead_s if self.graph_kernel_overhead_s is None else self.graph_kernel_overhead_s

    def matmul_at(self, precision: "Precision | str") -> float:
        """Matmul efficiency at ``precision`` (one number = every precision)."""
        if not isinstance(self.matmul, dict):
            return float(self.matmul)
        p = Precision(precision)
        if p not in self.matmul:
            allowed = ", ".join(k.value for k in self.matmul)
            raise ValueError(f"efficiency.matmul has no entry for {p.value} (has {allowed})")
        return float(self.matmul[p])

    def host_linear_at(self, precision: "Precision | str") -> float:
        """Host time of one linear module per micro-batch at ``precision`` (0: no floor)."""
        if not self.host_linear_s:
            return 0.0
        return float(self.host_linear_s.get(Precision(precision), 0.0))

    def attention_at(self, precision: "Precision | str") -> float:
        """Fused-attention efficiency (FlashAttention runs in 16 bit; see the class doc)."""
        return float(self.attention) if self.attention is not None else self.matmul_at(precision)


class Chip(Strict):
    """One accelerator: compute, on-chip SRAM, off-chip memory, execution style, cost and power."""

    name: str
    peak_flops: FlopsPerSec | dict[Precision, FlopsPerSec]
    vector_flops: FlopsPerSec | dict[Precision, FlopsPerSec] | None = None
    sram_bytes: Bytes
    compute_tiles: PositiveInt = 1
    memory: Memory
    execution: Literal["kernel_by_kernel", "dataflow"] = "kernel_by_kernel"
    overlap: bool = True
    efficiency: Efficiency = Efficiency()
    #: FP8 tensor-core GEMMs take operands in any layout (Blackwell, compute capability 10.x), so
    #: Transformer Engine keeps no transposed FP8 copy for the weight-gradient GEMM
    #: (``transformer_engine/pytorch/utils.py`` ``is_non_tn_fp8_gemm_supported``: true for
    #: sm 10.x-11.x and >= 13.0). False (Hopper, Ada): cuBLASLt FP8 GEMMs are "TN" only.
    fp8_gemm_any_layout: bool = False
    #: A kernel-by-kernel chip whose programs come from a fusing compiler (XLA on TPUs: element-wise
    #: chains fused into their neighbours) rather than an eager framework that launches each op
    #: (PyTorch / Megatron-Core on GPUs). Decides the LLM defaults of ``training.cross_entropy``,
    #: ``activation_fusion`` and ``embedding_dense_grad`` (:attr:`eager`,
    #: :func:`dfmodel.graph.workload.resolve_fusion`).
    compiled: bool = False
    #: Whether a GEMM tile's epilogue (store D; load C first when accumulating into main
    #: gradients) runs after its mainloop on the warps that hold the accumulators ("serial":
    #: Hopper, whose wgmma accumulators live in registers; cuBLAS / CUTLASS sm90 cooperative
    #: kernels) or overlaps the next tile's MMAs ("overlapped", the roofline: Blackwell's
    #: double-buffered tensor-memory accumulators). Read by
    #: :func:`dfmodel.system.processor.gemm_epilogue_exposed_s`. Default "overlapped".
    gemm_epilogue: Literal["overlapped", "serial"] = "overlapped"
    price_usd: NonNegativeFloat = 0.0
    power_w: NonNegativeFloat = 0.0

    @property
    def eager(self) -> bool:
        """Whether the chip runs an eager framework's kernels one by one (GPUs): kernel by kernel
        and not :attr:`compiled`."""
        return self.execution == "kernel_by_kernel" and not self.compiled

    def peak(self, precision: Precision | str) -> float:
        """Matrix peak FLOP/s at ``precision``; a precision the chip does not list is an error."""
        return self._rate(self.peak_flops, "peak_flops", precision)

    def vector_peak(self, precision: Precision | str) -> float:
        """Non-matrix FLOP/s at ``precision`` (one number = every precision); defaults to the
        matrix peak for chips that do not separate them."""
        if self.vector_flops is None:
            return self.peak(precision)
        return self._rate(self.vector_flops, "vector_flops", precision)

    def _rate(self, rates, field: str, precision: Precision | str) -> float:
        if not isinstance(rates, dict):
            return float(rates)
        p = Precision(precision)
        if p not in rates:
            allowed = ", ".join(k.value for k in rates)
            raise ValueError(f"chip {self.name} has no {field} for {p.value} (has {allowed})")
        return float(rates[p])


class NetworkDim(Strict):
    """One network dimension: a 1-D topology of ``size`` members (see module doc for bandwidth)."""

    name: str
    topology: Literal["ring", "fully_connected", "switch"]
    size: PositiveInt
    link_bandwidth_Bps: BytesPerSec
    latency_s: Seconds = 0.0
    efficiency: Fraction = 1.0
    bidirectional: bool = True
    link_price_usd: NonNegativeFloat = 0.0
    link_power_w: NonNegativeFloat = 0.0
    switch_radix: PositiveInt | None = None
    switch_price_usd: NonNegativeFloat = 0.0
    switch_power_w: NonNegativeFloat = 0.0
    # NVLink SHARP (in-switch reduction, NVSwitch Gen3+): NCCL's NVLS efficiency on this switch
    # (tuning.cc nvlsEfficiency: Hopper 0.85, Blackwell 0.74); null = no in-network reduction.
    nvls_efficiency: Fraction | None = None
    # Whether TP all-gathers / reduce-scatters over this dimension can be split and run under
    # their GEMMs (the ``tp_comm_overlap`` option). Transformer Engine's userbuffers need the
    # chips to map each other's memory: the TP group shares CUDA IPC / multicast / MNNVL fabric
    # handles (TE common/comm_gemm_overlap/userbuffers/userbuffers-host.cpp,
    # create_communicator_grouped2), so NVLink/NVSwitch, xGMI and PCIe peer-to-peer qualify and
    # InfiniBand/Ethernet do not. XLA's collective matmul does the same over TPU ICI (Wang et
    # al., ASPLOS'23). false: the option is not offered for a TP group that uses this dimension.
    comm_gemm_overlap: bool = False
    # NCCL's LL / LL128 / Simple protocols as choices per collective (latency_s is Simple's).
    nccl_protocols: bool = False
    # The NCCL transport this dimension's steps cross (NCCL_HW_NVLINK / PCI / NET). Set, the
    # ring and tree collectives on it take NCCL's own latency model instead of latency_s: a
    # base latency per collective plus a per-step latency per protocol (dfmodel.netmodels.nccl,
    # tuning.cc); all-to-all and p2p keep latency_s. Needs nccl_protocols.
    nccl_transport: Literal["nvlink", "pci", "net"] | None = None
    # In-network reduction on this switch (InfiniBand SHARP: NCCL's CollNet with the SHARP plugin,
    # or a framework's own SHARP all-reduce; a job asks for it, e.g. Slurm --network=sharp): an
    # all-reduce candidate whose members each send and receive the buffer once
    # (dfmodel.netmodels.nccl.sharp_all_reduce_s). Off unless the run enabled it.
    sharp: bool = False
    # Whether a collective's phase on this dimension can overlap its phases on other dimensions
    # (chunks flowing through the phases, as NCCL does over NVLink and InfiniBand). false: the
    # phases run in series -- host-staged MPI without a GPU-aware transport copies the whole
    # buffer device->host, exchanges it, and copies it back (dfmodel.netmodels.collectives).
    pipelined: bool = True

    @field_validator("nccl_transport")
    @classmethod
    def _transport_needs_protocols(cls, transport, info):
        if transport is not None and not info.data.get("nccl_protocols"):
            raise ValueError("nccl_transport needs nccl_protocols: true (NCCL's latency model is per protocol)")
        return transport

    @property
    def effective_bandwidth_Bps(self) -> float:
        return self.link_bandwidth_Bps * self.efficiency


class System(Strict):
    """A machine: ``prod(dim.size)`` identical chips on a multi-dimensional network."""

    name: str
    description: str = ""
    chip: Chip
    network: list[NetworkDim] = Field(min_length=1)
    storage: Storage | None = None
    # host DRAM that training state can be offloaded to (dfmodel.system.host); None: no offload
    host: Host | None = None
    # Fraction of the last micro-batch's backward pass that can hide the data-parallel gradient
    # synchronisation (bucketed all-reduce overlapped with backward; 0 = fully exposed).
    dp_overlap: Fraction | Literal[0] = 1.0

    @field_validator("network")
    @classmethod
    def _unique_dim_names(cls, dims: list[NetworkDim]) -> list[NetworkDim]:
        names = [d.name for d in dims]
        if len(set(names)) != len(names):
            raise ValueError(f"dimension names must be unique, got {names}")
        return dims

    @property
    def num_chips(self) -> int:
        return math.prod(d.size for d in self.network)

    def dim(self, name: str) -> NetworkDim:
        for d in self.network:
            if d.name == name:
                return d
        raise KeyError(f"system {self.name} has no network dimension {name!r}")
