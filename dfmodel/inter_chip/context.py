"""Context parallelism as Megatron-Core runs it: the graphs and the K/V exchange cost of one
cp rank.

The sequence of ``s`` tokens is cut into ``2 cp`` equal chunks; rank ``r`` holds chunks ``r``
and ``2cp - 1 - r``, so every rank has the same share of the causal attention work
(Megatron-Core ``get_batch_on_this_cp_rank``; Transformer Engine ``AttnFuncWithCPAndKVP2P``).
Every token-wise kernel (norms, QKV/projection/MLP GEMMs) sees ``s / cp`` tokens; the attention
core (scores, softmax, attention x V and their gradients) has ``s / cp`` queries against all
``s`` keys: ``cp`` times the work of a graph built for ``s / cp`` tokens.

K/V exchange, per layer and micro-batch, with ``kv`` bytes of K and V on a rank
(``2 (s / cp) b h_kv e`` over the TP group):

- ``ring`` (Transformer Engine ``cp_comm_type="p2p"``): ``cp - 1`` steps; at each, every rank
  sends its K/V block to the next rank while it computes attention with the block in hand.
  Forward exposed: ``(cp - 1) max(0, t_p2p(kv) - t_attn_fwd / cp)``. Backward sends K/V and
  their gradients (``2 kv``) around the ring under the attention backward blocks:
  ``(cp - 1) max(0, t_p2p(2 kv) - t_attn_bwd / cp)``.
- ``all_gather`` (Llama 3, Dubey et al. 2024, arXiv:2407.21783, sec. 3.3.2): all-gather K and V
  before attention (not overlapped: exposed), and in backward all-gather them again and
  reduce-scatter their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Tensor


def is_attention_core(kernel) -> bool:
    """Attention-core kernels of either phase: no weights, matrix or reduction, group
    ``attention`` (scores, softmax, attention x V and their gradients): work ~ queries x keys."""
    return (
        "attention" in kernel.group
        and kernel.weight_bytes == 0
        and kernel.kind in (KernelKind.matmul, KernelKind.reduction)
    )


def cp_rank_graph(graph: DataflowGraph, cp: int, local_tokens: int) -> DataflowGraph:
    """One cp rank's layer from ``graph`` built for ``s / cp`` tokens per sequence
    (``local_tokens``): the attention core attends to ``cp`` times as many keys.

    Each core kernel's FLOP and output bytes scale by ``cp``, and its key dimension (the first of
    ``n``, ``k`` equal to ``local_tokens``) grows ``cp``-fold; a tensor between two core kernels
    (score / probability matrices) scales by ``cp``.
    """
    if cp == 1:
        return graph
    core = {k.name for k in graph.kernels if is_attention_core(k)}
    kernels = []
    for k in graph.kernels:
        if k.name not in core:
            kernels.append(k)
            continue
        dims = dict(k.dims)
        for key in ("n", "k"):
            if dims.get(key) == local_tokens:
                dims[key] = local_tokens * cp
                break
        out_scaled = k.output_bytes * cp if _is_quadratic_output(graph, k.name, core) else k.output_bytes
        kernels.append(replace(k, dims=dims, flop=k.flop * cp, output_bytes=out_scaled))
    tensors = [
        Tensor(t.name, t.producer, t.consumer, t.bytes * cp, t.operand, t.shape)
        if t.producer in core and t.consumer in core else t
        for t in graph.tensors
    ]
    return DataflowGraph(kernels, tensors, name=f"{graph.name}.cp{cp}", meta={**graph.meta, "cp": cp})


def _is_quadratic_output(graph: DataflowGraph, name: str, core: set[str]) -> bool:
    consumers = [t.consumer for t in graph.tensors if t.producer == name and t.consumer is not None]
    return bool(consumers) and all(c in core for c in consumers)


@dataclass(frozen=True)
class CPExchange:
    """Exposed K/V exchange time of one layer and micro-batch on one cp rank."""

    fwd_s: float
    bwd_s: float


def kv_bytes_per_rank(*, seq_len: int, micro_batch: int, cp: int, tp: int, num_kv_heads: int, head_dim: int,
                      bytes_per_element: float) -> float:
    """K and V of this rank's ``s / cp`` tokens, over the TP group (each chip >= 1 KV head).

    >>> kv_bytes_per_rank(seq_len=8192, micro_batch=1, cp=2, tp=8, num_kv_heads=8, head_dim=128,
    ...                   bytes_per_element=2) == 2 * 4096 * 1 * 128 * 2
    True
    """
    kv_heads = max(num_kv_heads / tp, 1.0)
    return 2 * (seq_len / cp) * micro_batch * kv_heads * head_dim * bytes_per_element


def cp_exchange(kind: str, cp: int, kv_bytes: float, attn_fwd_s: float, attn_bwd_s: float, costs, group) -> CPExchange:
    """Exposed K/V exchange per layer and micro-batch (see the module docstring)."""
    if cp == 1:
        return CPExchange(0.0, 0.0)
    if kind == "ring":
        step_f = costs.time_s("p2p", kv_bytes, group)
        step_b = costs.time_s("p2p", 2 * kv_bytes, group)
        return CPExchange(
            (cp - 1) * max(0.0, step_f - attn_fwd_s / cp),
            (cp - 1) * max(0.0, step_b - attn_bwd_s / cp),
        )
    if kind == "all_gather":
        gathered = kv_bytes * cp
        ag = costs.time_s("all_gather", gathered, group)
        rs = costs.time_s("reduce_scatter", gathered, group)
        return CPExchange(ag, ag + rs)
    raise ValueError(f"cp_comm must be ring or all_gather, got {kind!r}")


def with_params_of(graph: DataflowGraph | None, reference: DataflowGraph | None) -> DataflowGraph | None:
    """``graph`` (built for ``s / cp`` tokens) with the parameter counts of ``reference`` (built
    for all ``s``): a cp rank holds whole weights, e.g. the full learned position table."""
    if graph is None or reference is None:
        return graph
    params = {k.name: k.params for k in reference.kernels}
    kernels = [replace(k, params=params.get(k.name, k.params)) for k in graph.kernels]
    return DataflowGraph(kernels, list(graph.tensors), name=graph.name, meta=dict(graph.meta))
