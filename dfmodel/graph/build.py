"""From a workload spec to dataflow graphs: :func:`build_graph`, :func:`build_graphs`, :func:`summary`.

An LLM iteration is ``num_layers`` identical decoder layers plus the token embedding and the LM
head, so it is described by a :class:`GraphSet` (the layer graph and a repeat count) rather
than one huge graph; the other families are one whole graph (``num_layers = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dfmodel.errors import InputError
from dfmodel.graph.builders import (
    build_dlrm,
    build_explicit,
    build_fft,
    build_hpl,
    build_llm_dense_layer,
    build_llm_embedding,
    build_llm_head,
    build_llm_layer,
)
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Phase
from dfmodel.graph.workload import (
    AnyWorkload,
    DLRMWorkload,
    FFTWorkload,
    GraphWorkload,
    HPLWorkload,
    LLMWorkload,
    load_workload,
)

WorkloadLike = str | Path | dict[str, Any] | AnyWorkload


@dataclass(frozen=True)
class GraphSet:
    """The graphs of one training iteration (or one HPC run).

    ``layer`` repeats ``num_layers`` times; ``embedding`` and ``head`` (LLMs with a vocabulary)
    run once. An MoE model's first ``num_dense_layers`` layers (DeepSeek-V3: 3 of 61) are
    ``dense_layer`` instead; ``layer`` (the MoE layer) then repeats ``num_layers -
    num_dense_layers`` times. Totals are per iteration of ``batch`` samples (the batch the graphs were built for).

    >>> gs = build_graphs("gpt3_175b", batch=1)
    >>> gs.num_layers, gs.kernels_per_layer
    (96, 30)
    >>> round(gs.params() / 1e9, 1)
    174.6
    """

    layer: DataflowGraph
    num_layers: int = 1
    embedding: DataflowGraph | None = None
    head: DataflowGraph | None = None
    dense_layer: DataflowGraph | None = None
    num_dense_layers: int = 0

    @property
    def num_moe_layers(self) -> int:
        """How many times ``layer`` repeats (all layers unless some are dense)."""
        return self.num_layers - (self.num_dense_layers if self.dense_layer is not None else 0)

    def parts(self) -> list[tuple[DataflowGraph, int]]:
        """(graph, repeat count) for every graph of the iteration."""
        out = [(self.layer, self.num_moe_layers)]
        if self.dense_layer is not None and self.num_dense_layers:
            out.append((self.dense_layer, self.num_dense_layers))
        out += [(g, 1) for g in (self.embedding, self.head) if g is not None]
        return out

    def total_flop(self, phase: Phase | None = None) -> float:
        """FLOP per iteration: ``layer * num_layers + embedding + head`` (optionally one phase)."""
        return sum(g.total_flop(phase) * n for g, n in self.parts())

    def matmul_flop(self, phase: Phase | None = None) -> float:
        return sum(g.matmul_flop(phase) * n for g, n in self.parts())

    def params(self) -> float:
        """Trainable parameters of the whole model (tied embeddings counted once)."""
        return sum(g.params() * n for g, n in self.parts())

    @property
    def kernels_per_layer(self) -> int:
        return len(self.layer)

    @property
    def kernels_total(self) -> int:
        """Kernels per iteration counting every layer (layers * per-layer + embedding + head)."""
        return sum(len(g) * n for g, n in self.parts())


def _batch(w: AnyWorkload, batch: int | None) -> int:
    if batch is None:
        return w.default_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"must be a positive integer, got {batch!r}", source=w.source, field="batch")
    return batch


def build_graphs(workload: WorkloadLike, *, batch: int | None = None, ep: int = 1) -> GraphSet:
    """All graphs of one iteration for ``batch`` samples (default: the workload's global batch).

    ``batch`` is sequences (llm), samples (dlrm) or independent transforms (fft); HPL has no
    batch (one factorisation: ``batch`` must be None or 1); an explicit graph stands for the
    fixed batch it declares. ``ep``: the LLM layer is one of ``ep`` expert-parallel ranks' (MoE).

    >>> gs = build_graphs("llama3_70b", batch=1)
    >>> gs.embedding.name, gs.head.name
    ('llama3_70b.embedding', 'llama3_70b.head')
    """
    w = load_workload(workload)
    b = _batch(w, batch)
    if isinstance(w, LLMWorkload):
        dense = build_llm_dense_layer(w, b)
        return GraphSet(build_llm_layer(w, b, ep), w.model.num_layers, build_llm_embedding(w, b), build_llm_head(w, b),
                        dense, w.model.moe.first_dense_layers if dense is not None else 0)
    if isinstance(w, DLRMWorkload):
        return GraphSet(build_dlrm(w, b))
    if isinstance(w, FFTWorkload):
        return GraphSet(build_fft(w, b))
    if isinstance(w, HPLWorkload):
        if b != 1:
            raise InputError(f"an HPL run is one factorisation; batch must be 1, got {b}", source=w.source,
                             field="batch")
        return GraphSet(build_hpl(w))
    if isinstance(w, GraphWorkload):
        if b != w.batch:
            raise InputError(f"an explicit graph is written for batch {w.batch} and cannot be rebuilt for {b}",
                             source=w.source, field="batch")
        return GraphSet(build_explicit(w))
    raise InputError(f"no builder for workload kind {getattr(w, 'kind', '?')!r}")  # pragma: no cover


def build_graph(workload: WorkloadLike, *, batch: int | None = None) -> DataflowGraph:
    """The repeated graph: one decoder layer (fwd + bwd + wgrad) for an LLM, else the whole graph.

    >>> g = build_graph("gpt3_175b", batch=1)
    >>> g.kernel("fwd.qkv").dims
    {'m': 2048, 'n': 36864, 'k': 12288}
    """
    return build_graphs(workload, batch=batch).layer


def summary(workload: WorkloadLike, *, batch: int | None = None) -> dict[str, Any]:
    """Key numbers of a workload's graphs, per iteration of ``batch`` samples (for the CLI).

    >>> s = summary("gpt3_175b")
    >>> s["family"], s["kernels"], s["num_layers"]
    ('llm', 30, 96)
    """
    w = load_workload(workload)
    gs = build_graphs(w, batch=batch)
    total = gs.total_flop()
    return {
        "workload": w.name,
        "family": w.kind,
        "batch": gs.layer.meta.get("batch"),
        "precision": w.precision.value,
        "num_layers": gs.num_layers,
        "kernels": gs.kernels_per_layer,
        "tensors": len(gs.layer.tensors),
        "kernels_total": gs.kernels_total,
        "flop_per_layer": gs.layer.total_flop(),
        "flop_per_iteration": total,
        "matmul_flop_per_iteration": gs.matmul_flop(),
        "flop_forward": gs.total_flop(Phase.forward),
        "flop_backward": gs.total_flop(Phase.backward),
        "flop_weight_grad": gs.total_flop(Phase.weight_grad),
        "params": gs.params(),
        # bytes to hold every parameter once in the workload precision
        "weight_bytes": gs.params() * w.precision.bytes,
    }
