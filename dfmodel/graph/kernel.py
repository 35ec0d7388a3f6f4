"""Vertices and edges of a dataflow graph: :class:`Kernel` and :class:`Tensor`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class KernelKind(str, Enum):
    """What a kernel computes; decides which throughput (matrix or vector) and cost model apply."""

    matmul = "matmul"  # dims: b (batch/heads), m (rows), n (columns), k (reduction)
    elementwise = "elementwise"  # dims: m (rows), n (columns)
    reduction = "reduction"  # softmax, layernorm, loss: dims m, n
    embedding = "embedding"  # table look-ups: memory-bound, extra_memory_bytes = rows gathered
    fft = "fft"  # one stage of butterflies: dims n (points), batch
    lu_panel = "lu_panel"  # LU panel factorisation: dims m (rows), n (block size)
    comm = "comm"  # explicit communication: collective, comm_bytes, comm_group

    @property
    def is_matrix(self) -> bool:
        return self in (KernelKind.matmul,)


class Phase(str, Enum):
    forward = "forward"
    backward = "backward"  # data gradients
    weight_grad = "weight_grad"


@dataclass(frozen=True)
class Kernel:
    """One compute kernel (a vertex).

    ``flop`` is the arithmetic work; ``weight_bytes`` the parameters it reads (resident in SRAM
    when fused); ``output_bytes`` the size of its result; ``extra_memory_bytes`` explicit DRAM
    traffic beyond inputs/outputs/weights (embedding rows gathered, optimizer reads);
    ``params`` the number of trainable parameters it owns (counted on forward kernels only, so
    the graph's parameter count is a plain sum). ``precision`` overrides the workload precision
    for this kernel's math; ``efficiency`` names the chip efficiency factor it runs at when it is
    neither a plain matmul nor a vector kernel (``"attention"``: fused attention). Communication kernels (``kind=comm``) name a
    collective (``all_reduce``, ``all_to_all``, ``broadcast``, ...), its bytes and the group.

    >>> k = Kernel("qkv", KernelKind.matmul, {"m": 2048, "n": 3 * 1024, "k": 1024},
    ...            flop=2 * 2048 * 3072 * 1024, output_bytes=2048 * 3072 * 2)
    >>> k.dims["n"]
    3072
    """

    name: str
    kind: KernelKind
    dims: dict[str, int]
    flop: float
    output_bytes: float
    weight_bytes: float = 0.0
    extra_memory_bytes: float = 0.0
    params: float = 0.0
    phase: Phase = Phase.forward
    group: str = ""  # e.g. "attention", "mlp", "embedding": for reports and sharding rules
    weight: str | None = None  # name of the weight read; kernels sharing it (fwd/bwd/wgrad) share SRAM
    collective: str | None = None
    comm_bytes: float = 0.0
    comm_group: str | None = None
    # Math precision of this kernel when it differs from the workload's (Transformer Engine FP8
    # runs only the linear-layer GEMMs in FP8; attention, norms and element-wise stay 16-bit).
    precision: str | None = None
    # Efficiency factor of the chip spec that applies instead of matmul/vector ("attention": a
    # fused FlashAttention kernel).
    efficiency: str | None = None
    # An MoE expert's kernel: its weights, gradients and optimizer state are split over the ep
    # ranks and its gradients reduced over dp x cp / ep (dfmodel.graph.builders.moe).
    expert: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["phase"] = self.phase.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Kernel":
        d = dict(d)
        d["kind"] = KernelKind(d["kind"])
        d["phase"] = Phase(d.get("phase", "forward"))
        return cls(**d)


@dataclass(frozen=True)
class Tensor:
    """A tensor flowing from ``producer`` to one ``consumer`` (an edge).

    A tensor read by several kernels is one edge per consumer, all with the same ``name``.
    ``producer=None`` marks a graph input (read from DRAM, e.g. the previous layer's output);
    ``consumer=None`` a graph output (written to DRAM). ``operand`` names which input of the
    consumer it feeds (``a``/``b`` of a matmul, ``x``, ``grad``...). ``shape`` is optional and
    used by sharding rules.
    """

    name: str
    producer: str | None
    consumer: str | None
    bytes: float
    operand: str = "x"
    shape: tuple[int, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Tensor":
        d = dict(d)
        d["shape"] = tuple(d.get("shape", ()))
        return cls(**d)
