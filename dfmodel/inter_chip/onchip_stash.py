"""Saved activations kept in on-chip SRAM between forward and backward (dataflow chips).

The LLM path solves a layer's forward and backward kernels as two intra-chip problems, so every
tensor a backward kernel reads from the forward (the *stash*: saved GEMM inputs, norm
statistics, attention outputs...) is an output of the forward graph and an input of the
backward graph: written to DRAM and read back once per micro-batch. A GPU does exactly that
(HBM is its only large memory), but a dataflow chip with a large SRAM keeps the stash on chip
while it fits: Cerebras' weight-streaming mode "store[s] weights in external memory and
activations in on-chip memory", working on one layer at a time with the weights streamed in
(Cerebras blog, "Efficient large-scale GPT training using a Cerebras wafer-scale cluster", 2022;
M. James, "Scaling up and out: training massive models on Cerebras systems using weight
streaming", 2021; the WSE-2 has 40 GB of SRAM), and SambaNova's RDUs keep intermediate tensors in their PMU SRAM across fused sections
(Prabhakar et al., "SambaNova SN10 RDU", Hot Chips 33, 2021; the DFModel paper, arXiv
2412.16432, sec. 4, keeps a tensor on chip when producer and consumer share the chip's SRAM).

Model (one chip, the busiest pipeline stage):

- ``S``: bytes of the stash of one layer and micro-batch (tensors produced by a forward kernel
  and consumed by a backward kernel of the sharded layer graph, each counted once);
- the on-chip plans: the forward graph without those outputs and the backward graph without
  those inputs, solved by the same intra-chip pass (:func:`solve_onchip`);
- the SRAM left for the stash while the partitions run: ``sram - peak partition SRAM`` of the
  on-chip plans (partitions use SRAM one at a time; the stash lives across all of them);
- a stage of ``n`` layers holds ``in_flight`` micro-batches (1F1B; see
  :func:`dfmodel.inter_chip.memory.in_flight_micro_batches`), so ``k = min(n, floor(free /
  (S in_flight)))`` layers keep their stash on chip and the others go through DRAM. Layers are
  identical, so the stage's time is exactly ``k`` on-chip layers plus ``n - k`` DRAM layers
  (:func:`layer_times`).

With ``recompute: full`` only the layer inputs (checkpoints) live across the stack and one
layer's stash lives from its recomputed forward to its backward (see
:meth:`OnChipStash.layers_on_chip`). The DRAM memory check stays conservative (it still counts
the stash in DRAM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dfmodel.graph.graph import DataflowGraph


@dataclass(frozen=True)
class OnChipStash:
    """A layer's stash and its forward/backward times when it stays on chip."""

    stash_bytes: float  # S: one layer, one micro-batch, one chip
    fwd_s: float  # forward time with the stash kept on chip (no DRAM write)
    bwd_s: float  # backward time with the stash kept on chip (no DRAM read)
    peak_sram_bytes: float  # largest partition SRAM of the two on-chip plans

    def layers_on_chip(self, sram_bytes: float, layers: int, in_flight: float, *, full_recompute: bool = False,
                       checkpoint_bytes: float = 0.0) -> int:
        """How many of a stage's ``layers`` keep their stash on chip (``k`` in the module doc).

        With full recompute only the layers' inputs (``checkpoint_bytes`` each) live across the
        stack; one layer's stash lives from its recomputed forward to its backward, one layer
        at a time: every layer keeps it on chip when ``peak + S + n in_flight ckpt`` fits the
        SRAM, none otherwise."""
        if full_recompute:
            need = self.peak_sram_bytes + self.stash_bytes + layers * in_flight * checkpoint_bytes
            return layers if need <= sram_bytes else 0
        free = sram_bytes - self.peak_sram_bytes
        if self.stash_bytes <= 0:
            return layers
        if free <= 0 or in_flight <= 0:
            return 0
        return max(0, min(layers, math.floor(free / (self.stash_bytes * in_flight))))


def stash_tensors(graph: DataflowGraph, fwd: set[str], bwd: set[str]) -> dict[tuple[str, str], float]:
    """{(tensor name, producer): bytes} of the tensors a forward kernel makes for a backward one."""
    out: dict[tuple[str, str], float] = {}
    for t in graph.tensors:
        if t.producer in fwd and t.consumer in bwd:
            out[(t.name, t.producer)] = float(t.bytes)
    return out


def _subgraph_without(graph: DataflowGraph, names: list[str], drop, name: str) -> DataflowGraph:
    """``graph.subgraph(names)`` without the tensors whose *original* entry ``drop`` selects."""
    sub = graph.subgraph(names, name=name)
    keep = set(names)
    # subgraph keeps a tensor iff its producer or its consumer is kept, in order: align them
    originals = [t for t in graph.tensors if t.producer in keep or t.consumer in keep]
    if len(originals) != len(sub.tensors):  # pragma: no cover - subgraph's contract changed
        raise RuntimeError("subgraph tensors do not align with the graph's")
    tensors = [s for o, s in zip(originals, sub.tensors) if not drop(o)]
    return DataflowGraph(sub.kernels, tensors, name=sub.name, meta=sub.meta)


def onchip_graphs(graph: DataflowGraph, fwd_names: list[str], bwd_names: list[str]):
    """(forward, backward) subgraphs with the stash kept on chip (neither written by the forward
    nor read by the backward), and the stash bytes ``S``."""
    fwd, bwd = set(fwd_names), set(bwd_names)
    stash = stash_tensors(graph, fwd, bwd)

    def is_stash(t) -> bool:
        return t.producer in fwd and t.consumer in bwd

    g_f = _subgraph_without(graph, fwd_names, is_stash, f"{graph.name}.fwd_onchip")
    g_b = _subgraph_without(graph, bwd_names, is_stash, f"{graph.name}.bwd_onchip")
    return g_f, g_b, float(sum(stash.values()))


def layer_times(dram_fwd_s: float, dram_bwd_s: float, onchip: OnChipStash | None, *, sram_bytes: float,
                layers: int, in_flight: float, full_recompute: bool = False,
                checkpoint_bytes: float = 0.0) -> tuple[float, float, int]:
    """Mean (forward, backward) time per layer of a stage of ``layers`` layers, and ``k``
    (with full recompute the forward's time applies to the first forward and to the recomputed
    one alike: neither writes the stash when it stays on chip).

    >>> st = OnChipStash(stash_bytes=10.0, fwd_s=1.0, bwd_s=2.0, peak_sram_bytes=0.0)
    >>> layer_times(1.5, 3.0, st, sram_bytes=20.0, layers=4, in_flight=1)   # 2 of 4 fit
    (1.25, 2.5, 2)
    >>> layer_times(1.5, 3.0, st, sram_bytes=5.0, layers=4, in_flight=1)    # none fits
    (1.5, 3.0, 0)
    """
    if onchip is None or layers <= 0:
        return dram_fwd_s, dram_bwd_s, 0
    k = onchip.layers_on_chip(sram_bytes, layers, in_flight, full_recompute=full_recompute,
                              checkpoint_bytes=checkpoint_bytes)
    share = k / layers
    # never slower than DRAM (the on-chip plan drops traffic, it adds none)
    f = dram_fwd_s - share * max(0.0, dram_fwd_s - onchip.fwd_s)
    b = dram_bwd_s - share * max(0.0, dram_bwd_s - onchip.bwd_s)
    return f, b, k
