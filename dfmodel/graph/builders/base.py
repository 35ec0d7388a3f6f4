"""A small accumulator the family builders share: add kernels and tensors, then freeze a graph."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor


class GraphBuilder:
    """Collects kernels and tensors in insertion order (which is also the tie-break of the
    graph's topological order, so builders add kernels in execution order).

    >>> b = GraphBuilder()
    >>> b.kernel("a", KernelKind.elementwise, {"m": 2}, flop=2, output_bytes=8)
    'a'
    >>> b.kernel("b", KernelKind.elementwise, {"m": 2}, flop=2, output_bytes=8)
    'b'
    >>> b.tensor("t", "a", ["b", None], 8)
    >>> b.build("demo").outputs()[0].name
    't'
    """

    def __init__(self) -> None:
        self.kernels: list[Kernel] = []
        self.tensors: list[Tensor] = []

    def kernel(
        self,
        name: str,
        kind: KernelKind,
        dims: dict[str, int],
        *,
        flop: float,
        output_bytes: float,
        phase: Phase = Phase.forward,
        **extra: object,
    ) -> str:
        """Add a kernel; returns its name so calls can be chained into tensors."""
        self.kernels.append(
            Kernel(name, kind, dict(dims), flop=float(flop), output_bytes=float(output_bytes), phase=phase, **extra)  # type: ignore[arg-type]
        )
        return name

    def tensor(
        self,
        name: str,
        producer: str | None,
        consumers: str | None | Iterable[str | None],
        nbytes: float,
        operand: str | Iterable[str] = "x",
        shape: tuple[int, ...] = (),
    ) -> None:
        """Add one edge per consumer (a tensor read by several kernels); ``None`` = graph output.

        ``operand`` is one name for all consumers or one per consumer.
        """
        cons = [consumers] if consumers is None or isinstance(consumers, str) else list(consumers)
        ops = [operand] * len(cons) if isinstance(operand, str) else list(operand)
        if len(ops) != len(cons):
            raise ValueError(f"tensor {name}: {len(cons)} consumers but {len(ops)} operands")
        for c, op in zip(cons, ops):
            self.tensors.append(Tensor(name, producer, c, float(nbytes), op, tuple(shape)))

    def build(self, name: str, meta: dict | None = None, source: str | None = None) -> DataflowGraph:
        return DataflowGraph(
            [_with_weight_name(k) for k in self.kernels], self.tensors, name=name, meta=meta, source=source
        )


PHASE_PREFIXES = ("fwd.", "bwd.", "wgrad.")


def _with_weight_name(k: Kernel) -> Kernel:
    """Kernels reading a weight name it by their name without the phase prefix, so that
    ``fwd.qkv``, ``bwd.qkv`` and ``wgrad.qkv`` share weight ``qkv`` (sharded once, held in SRAM
    once)."""
    if k.weight is not None or k.weight_bytes <= 0:
        return k
    for prefix in PHASE_PREFIXES:
        if k.name.startswith(prefix):
            return replace(k, weight=k.name[len(prefix):])
    return replace(k, weight=k.name)
