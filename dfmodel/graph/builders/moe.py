"""Mixture-of-experts MLP of an LLM layer (``model.moe``), as Megatron-Core runs it.

Megatron-Core's MoE layer (megatron/core/transformer/moe/moe_layer.py, router.py,
token_dispatcher.py, experts.py) per layer and micro-batch:

1. router: a ``h x E`` GEMM on every token, softmax and top-k (``router.py``);
2. permute + dispatch all-to-all: each token's hidden vector is copied once per chosen expert
   and sent to the expert's ep rank (``MoEAlltoAllTokenDispatcher``);
3. grouped expert GEMMs (``experts.py`` GroupedMLP / TEGroupedMLP): every local expert runs
   fc1 -> activation -> fc2 on the rows routed to it;
4. combine all-to-all + unpermute: the rows go back and are summed with their router weights;
5. shared experts (DeepSeekMoE, Dai et al. 2024): a dense MLP of ``num_shared x
   expert_ffn_hidden`` on every token, added to the routed output.

The all-to-alls are communication over the ep group and are costed by the inter-chip model
(:meth:`dfmodel.inter_chip.llm.LLMModel._ep_comm`); this module builds the kernels one rank
computes. With ``ep`` ranks each rank holds ``E / ep`` experts and, by symmetry, receives as many
routed rows as its own tokens send: ``T x top_k x capacity_factor x load_imbalance`` rows, split
over its local experts. Grouped-GEMM efficiency at small per-expert batches is the tile padding
the processor model already applies: the expert GEMMs are batched matmuls with ``b = E / ep``
experts of ``m = ceil(rows / (E / ep))`` rows each, and ``m`` is padded to the chip's
``matmul_tile`` per expert (a grouped GEMM pads every expert's rows to the CTA tile: CUTLASS
grouped GEMM / MegaBlocks, Gale et al. 2023, sec. 5.1, which is why small per-expert batches lose
efficiency).

Expert kernels carry ``expert=True``: their weights, gradients and optimizer state are the ones
split by ep (and reduced over the dp x cp / ep ranks), never decided from names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dfmodel.graph.workload import LLMWorkload, MoEConfig, fc1_width_factor


@dataclass(frozen=True)
class ExpertShape:
    """What one rank's routed expert GEMMs look like."""

    experts_local: int  # E / ep
    rows_per_expert: int  # routed token rows per local expert (ceil)
    ffn: int  # expert_ffn_hidden

    @property
    def rows(self) -> int:
        return self.experts_local * self.rows_per_expert


def routed_rows(tokens: int, moe: MoEConfig) -> float:
    """Expert-GEMM rows one rank computes for ``tokens`` tokens (before padding to experts):
    ``T x top_k x capacity_factor x load_imbalance``.

    >>> from dfmodel.graph.workload import MoEConfig
    >>> routed_rows(4096, MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048))
    32768.0
    """
    return tokens * moe.routed_token_factor


def expert_shape(tokens: int, moe: MoEConfig, ep: int) -> ExpertShape:
    """Local experts and their rows on one of ``ep`` ranks.

    >>> from dfmodel.graph.workload import MoEConfig
    >>> cfg = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048)
    >>> expert_shape(4096, cfg, 1), expert_shape(4096, cfg, 64).rows_per_expert
    (ExpertShape(experts_local=256, rows_per_expert=128, ffn=2048), 8192)
    """
    if moe.num_experts % ep:
        raise ValueError(f"ep ({ep}) must divide num_experts ({moe.num_experts})")
    local = moe.num_experts // ep
    return ExpertShape(local, math.ceil(routed_rows(tokens, moe) / local - 1e-9), moe.expert_ffn_hidden)


def has_router(w: LLMWorkload) -> bool:
    """A layer with real routing (more than one expert, or shared experts to combine)."""
    moe = w.model.moe
    return moe is not None and (moe.num_experts > 1 or moe.num_shared_experts > 0)


def dispatch_bytes_per_rank(tokens: int, moe: MoEConfig, hidden: int, bytes_per_element: int, ep: int) -> float:
    """Bytes one rank sends in ONE dispatch (or combine) all-to-all over ``ep`` ranks:
    ``T x top_k x capacity x imbalance x h x bytes x (ep - 1) / ep`` (the rows whose expert lives
    on another rank; uniform routing).

    >>> from dfmodel.graph.workload import MoEConfig
    >>> cfg = MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden=14336)
    >>> dispatch_bytes_per_rank(4096, cfg, 4096, 2, 8) == 4096 * 2 * 4096 * 2 * 7 / 8
    True
    >>> dispatch_bytes_per_rank(4096, cfg, 4096, 2, 1)
    0.0
    """
    return routed_rows(tokens, moe) * hidden * bytes_per_element * (ep - 1) / ep


def expert_params(graph) -> float:
    """Parameters of a graph's expert kernels (``Kernel.expert``): the ones ep splits.

    Memoised on the graph, as :meth:`DataflowGraph.params` is (a built graph is never mutated):
    the search's memory checks ask it ~50k times (DeepSeek-V3 on 512 H100s)."""
    if graph is None:
        return 0.0
    p = graph.__dict__.get("_expert_params")
    if p is None:
        p = graph._expert_params = float(sum(k.params for k in graph.kernels if getattr(k, "expert", False)))
    return p


__all__ = ["sort_chunks_bytes", "expert_params", "ExpertShape", "routed_rows", "expert_shape", "has_router", "dispatch_bytes_per_rank"]


# -- kernels and tensors of the routing around the expert GEMMs ---------------------------------
# Called from dfmodel.graph.builders.llm.build_llm_layer, which emits the expert GEMMs themselves
# (its fc1 / act / fc2 kernels, batched over the local experts). ``pr`` is that module's
# per-kernel precision record; ``T`` tokens, ``TR`` routed rows on this rank.
# Router logits and probabilities are fp32 (Megatron-Core router.py casts to fp32 for the
# softmax / top-k: ``moe_router_dtype``), indices int32.
ROUTER_BYTES = 4


def linear_params(k: int, n: int) -> int:
    """A linear layer's parameters with bias, as :func:`dfmodel.graph.builders.llm.linear_params`
    (kept here so this module does not import the LLM builder that calls it)."""
    return k * n + n


def _kinds():
    from dfmodel.graph.kernel import KernelKind, Phase

    return KernelKind.matmul, KernelKind.elementwise, KernelKind.reduction, Phase.backward, Phase.weight_grad


def _shared_ffn(w: LLMWorkload) -> tuple[int, int]:
    """Shared experts' hidden width and fc1 output width (swiglu: gate and up fused)."""
    moe = w.model.moe
    fs = moe.num_shared_experts * moe.expert_ffn_hidden
    return fs, fc1_width_factor(w.model.ffn_type) * fs


def sort_chunks_bytes(routed_rows_: int, hidden: int, moe: MoEConfig, activation_bytes: float, *,
                      experts_local: int, ep: int) -> tuple[float, float]:
    """HBM bytes of the ``sort_chunks_by_idxs`` passes of Megatron-Core's alltoall dispatcher:
    (a pass over dispatched rows, a pass over rows about to be combined).

    ``MoEAlltoAllTokenDispatcher`` (megatron/core/transformer/moe/token_dispatcher.py): "permute
    -> A2A(EP) -> AG(TP) -> sort_chunk (if num_local_experts > 1)" and "sort_chunk (if
    num_local_experts > 1) -> RS(TP) -> A2A(EP) -> unpermute". The rows an all-to-all delivers
    are ordered by source rank; the grouped GEMM needs them by local expert, so they are copied
    once more (read + write every routed row; TE's fused ``moe_sort_chunks_by_index`` is the
    same copy), and back before the combine; the backward runs both copies on the gradients.
    Dispatched rows (the forward's, and the gradients the combine's backward sends) are at the
    dispatch's element size (FP8 with tile scales under ``moe.dispatch_fp8``), the rest at
    ``activation_bytes``. With one expert per rank, or no ep group (the first permute already
    groups the rows by expert), there is nothing to sort; nor with a per-node dispatcher
    (``moe.max_nodes_per_token``: DeepEP, Megatron-Core's flex dispatcher), which sends each
    token once per destination and expands it into expert-major rows once at the receiver
    (``get_permuted_hidden_states_by_experts``): one permutation, the one ``fwd.permute`` charges.

    >>> cfg = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048)
    >>> sort_chunks_bytes(16384, 7168, cfg, 2, experts_local=4, ep=64) == (2 * 16384 * 7168 * 2,) * 2
    True
    >>> sort_chunks_bytes(16384, 7168, cfg, 2, experts_local=1, ep=8), sort_chunks_bytes(16384, 7168, cfg, 2, experts_local=4, ep=1)
    ((0.0, 0.0), (0.0, 0.0))
    """
    from dfmodel.inter_chip.experts import dispatch_bytes_per_element

    if experts_local <= 1 or ep <= 1 or moe.max_nodes_per_token is not None:
        return 0.0, 0.0
    rows_bytes = 2.0 * routed_rows_ * hidden  # read + write of every row, per byte of element
    return rows_bytes * dispatch_bytes_per_element(moe, activation_bytes), rows_bytes * activation_bytes


def _router_kw(moe: MoEConfig, pr) -> dict:
    """Precision of the router GEMMs: ``moe.router_dtype`` when set (Megatron-Core's
    ``moe_router_dtype``: the router's input and weight are cast to fp32 and the logits GEMM
    runs in fp32 -- on CUDA cores, PyTorch leaves TF32 off for matmuls by default), else the
    element-wise precision of the rest of the layer."""
    return {"precision": moe.router_dtype} if moe.router_dtype else pr.vector_kw


def _moe_forward(g, w: LLMWorkload, T: int, TR: int, pr, sort_bytes: float = 0.0) -> None:
    """Router GEMM, softmax + top-k, permute (one row copy per chosen expert) with the sort of
    the received rows by local expert (:func:`sort_chunks_bytes`), shared experts."""
    from dfmodel.graph.builders.formulas import matmul_flop, vector_flop

    MM, EW, RED, _, _ = _kinds()
    moe, h, p = w.model.moe, w.model.hidden, pr.act
    E = moe.num_experts
    g.kernel("fwd.router", MM, {"m": T, "n": E, "k": h}, flop=matmul_flop(1, T, E, h),
             output_bytes=T * E * ROUTER_BYTES, group="router", params=h * E, weight_bytes=h * E * pr.weight,
             **_router_kw(moe, pr))
    g.kernel("fwd.route", RED, {"m": T, "n": E}, flop=vector_flop("softmax", T * E),
             output_bytes=T * moe.top_k * 2 * ROUTER_BYTES, group="router", **pr.vector_kw)
    g.kernel("fwd.permute", EW, {"m": TR, "n": h}, flop=TR * h, output_bytes=TR * h * p, group="router",
             extra_memory_bytes=sort_bytes, **pr.vector_kw)
    fs, fs_in = _shared_ffn(w)
    if fs:
        _shared_forward(g, w, T, fs, fs_in, pr)


def _shared_forward(g, w, T, fs, fs_in, pr) -> None:
    from dfmodel.graph.builders.formulas import matmul_flop, vector_flop

    MM, EW, _, _, _ = _kinds()
    h, p, act = w.model.hidden, pr.act, w.model.ffn_type
    p1, p2 = linear_params(h, fs_in), linear_params(fs, h)
    cast = (lambda n: {"extra_memory_bytes": 2 * n}) if pr.fp8 else (lambda n: {})
    g.kernel("fwd.shared_fc1", MM, {"m": T, "n": fs_in, "k": h}, flop=matmul_flop(1, T, fs_in, h),
             output_bytes=T * fs_in * p, group="mlp", params=p1, weight_bytes=p1 * pr.linear_weight,
             **pr.linear_kw, **cast(T * h))
    g.kernel("fwd.shared_act", EW, {"m": T, "n": fs}, flop=vector_flop(act, T * fs) + vector_flop("bias", T * fs_in),
             output_bytes=T * fs * p, group="mlp", **pr.vector_kw)
    g.kernel("fwd.shared_fc2", MM, {"m": T, "n": h, "k": fs}, flop=matmul_flop(1, T, h, fs),
             output_bytes=T * h * p, group="mlp", params=p2, weight_bytes=p2 * pr.linear_weight,
             **pr.linear_kw, **cast(T * fs))


def _moe_combine_forward(g, w: LLMWorkload, T: int, TR: int, pr, sort_bytes: float = 0.0) -> None:
    """Unpermute: each token's top-k expert rows weighted by their probabilities, plus the
    shared experts' output; before it the rows go back to source-rank order (the sort's inverse)."""
    _, EW, _, _, _ = _kinds()
    h = w.model.hidden
    g.kernel("fwd.unpermute", EW, {"m": T, "n": h}, flop=2 * TR * h + T * h, output_bytes=T * h * pr.act,
             group="router", extra_memory_bytes=sort_bytes, **pr.vector_kw)


def _moe_combine_backward(g, w: LLMWorkload, T: int, TR: int, pr, sort_bytes: float = 0.0) -> None:
    """Gradient of the unpermute (rows back to the experts, and the router-probability
    gradient ``<dy, expert_out>`` per chosen expert), then the shared experts' backward."""
    from dfmodel.graph.builders.formulas import matmul_flop, vector_flop

    MM, EW, _, BWD, WG = _kinds()
    moe, h, p, gb = w.model.moe, w.model.hidden, pr.act, pr.grad
    g.kernel("bwd.unpermute", EW, {"m": TR, "n": h}, flop=3 * TR * h, output_bytes=TR * h * p,
             phase=BWD, group="router", extra_memory_bytes=sort_bytes, **pr.vector_kw)
    fs, fs_in = _shared_ffn(w)
    if not fs:
        return
    p1, p2 = linear_params(h, fs_in), linear_params(fs, h)
    act_bwd = f"{w.model.ffn_type}_bwd"
    lin = pr.linear_kw
    g.kernel("bwd.shared_fc2", MM, {"m": T, "n": fs, "k": h}, flop=matmul_flop(1, T, fs, h),
             output_bytes=T * fs * p, phase=BWD, group="mlp", weight_bytes=p2 * pr.linear_weight, **lin)
    g.kernel("wgrad.shared_fc2", MM, {"m": fs, "n": h, "k": T}, flop=matmul_flop(1, fs, h, T),
             output_bytes=p2 * gb, phase=WG, group="mlp", weight_bytes=p2 * gb, **lin)
    g.kernel("bwd.shared_act", EW, {"m": T, "n": fs},
             flop=vector_flop(act_bwd, T * fs) + vector_flop("bias_grad", T * fs_in),
             output_bytes=T * fs_in * p, phase=BWD, group="mlp", **pr.vector_kw)
    g.kernel("bwd.shared_fc1", MM, {"m": T, "n": h, "k": fs_in}, flop=matmul_flop(1, T, h, fs_in),
             output_bytes=T * h * p, phase=BWD, group="mlp", weight_bytes=p1 * pr.linear_weight, **lin)
    g.kernel("wgrad.shared_fc1", MM, {"m": h, "n": fs_in, "k": T}, flop=matmul_flop(1, h, fs_in, T),
             output_bytes=p1 * gb, phase=WG, group="mlp", weight_bytes=p1 * gb, **lin)


def _moe_permute_backward(g, w: LLMWorkload, T: int, TR: int, pr, sort_bytes: float = 0.0) -> None:
    """Sum each token's expert-row gradients (permute backward), then the router's backward."""
    from dfmodel.graph.builders.formulas import matmul_flop, vector_flop

    MM, EW, RED, BWD, WG = _kinds()
    moe, h, p, gb = w.model.moe, w.model.hidden, pr.act, pr.grad
    E = moe.num_experts
    g.kernel("bwd.permute", EW, {"m": TR, "n": h}, flop=TR * h, output_bytes=T * h * p, phase=BWD,
             group="router", extra_memory_bytes=sort_bytes, **pr.vector_kw)
    g.kernel("bwd.route", RED, {"m": T, "n": E}, flop=vector_flop("softmax_bwd", T * E),
             output_bytes=T * E * ROUTER_BYTES, phase=BWD, group="router", **pr.vector_kw)
    g.kernel("bwd.router", MM, {"m": T, "n": h, "k": E}, flop=matmul_flop(1, T, h, E), output_bytes=T * h * p,
             phase=BWD, group="router", weight_bytes=h * E * pr.weight, **_router_kw(moe, pr))
    g.kernel("wgrad.router", MM, {"m": h, "n": E, "k": T}, flop=matmul_flop(1, h, E, T), output_bytes=h * E * gb,
             phase=WG, group="router", weight_bytes=h * E * gb, **_router_kw(moe, pr))


def _moe_tensors(g, w: LLMWorkload, T: int, TR: int, pr, act_shape: tuple, routed_shape: tuple) -> None:
    """Every edge around the expert GEMMs (the GEMMs' own edges are the dense MLP's)."""
    moe, h, p = w.model.moe, w.model.hidden, pr.act
    E, k = moe.num_experts, moe.top_k
    b, s = act_shape[0], act_shape[1]
    tok = T * h
    shared = moe.num_shared_experts > 0
    fs, fs_in = _shared_ffn(w)
    ln2_cons = ["fwd.router", "wgrad.router", "fwd.permute"] + (["fwd.shared_fc1", "wgrad.shared_fc1"] if shared else [])
    ln2_ops = ["a", "a", "x"] + (["a", "a"] if shared else [])
    # 16-bit even with FP8 all-gather: an MoE layer's pre-MLP norm is a standalone TENorm (Megatron-Core
    # gpt_layer_specs.py: pre_mlp_layernorm=TENorm if num_experts), not a LayerNormLinear that writes FP8;
    # the router, the permute and the dispatcher's TP all-gather take its bf16 output
    g.tensor("ln2_out", "fwd.ln2", ln2_cons, tok * p, ln2_ops, act_shape)
    g.tensor("router_logits", "fwd.router", "fwd.route", T * E * ROUTER_BYTES, "x", (b, s, E))
    g.tensor("router_probs", "fwd.route", ["fwd.permute", "fwd.unpermute", "bwd.route"],
             T * k * 2 * ROUTER_BYTES, ["x", "x", "saved"], (b, s, k))
    g.tensor("routed_in", "fwd.permute", ["fwd.fc1", "wgrad.fc1"], TR * h * p, "a", routed_shape)
    g.tensor("expert_out", "fwd.fc2", ["fwd.unpermute", "bwd.unpermute"], TR * h * p, ["x", "saved"],
             routed_shape)
    g.tensor("mlp_out", "fwd.unpermute", "fwd.residual2", tok * p, "x", act_shape)
    d_y_cons = ["bwd.unpermute", "bwd.residual1"] + (["bwd.shared_fc2", "wgrad.shared_fc2"] if shared else [])
    d_y_ops = ["grad", "grad_skip"] + (["a", "b"] if shared else [])
    g.tensor("d_y", "bwd.residual2", d_y_cons, tok * p, d_y_ops, act_shape)
    g.tensor("d_expert_out", "bwd.unpermute", ["bwd.fc2", "wgrad.fc2"], TR * h * p, ["a", "b"], routed_shape)
    g.tensor("d_router_probs", "bwd.unpermute", "bwd.route", T * k * ROUTER_BYTES, "grad", (b, s, k))
    g.tensor("d_routed_in", "bwd.fc1", "bwd.permute", TR * h * p, "grad", routed_shape)
    g.tensor("d_ln2_out", "bwd.permute", "bwd.ln2", tok * p, "grad", act_shape)
    g.tensor("d_router_logits", "bwd.route", ["bwd.router", "wgrad.router"], T * E * ROUTER_BYTES, ["a", "b"],
             (b, s, E))
    g.tensor("d_router_in", "bwd.router", "bwd.ln2", tok * p, "grad", act_shape)
    g.tensor("dW.router", "wgrad.router", None, h * E * pr.grad, "x")
    if shared:
        g.tensor("shared_fc1_out", "fwd.shared_fc1", ["fwd.shared_act", "bwd.shared_act"], T * fs_in * p,
                 ["x", "saved"], (b, s, fs_in))
        g.tensor("shared_act_out", "fwd.shared_act", ["fwd.shared_fc2", "wgrad.shared_fc2"], T * fs * p, "a",
                 (b, s, fs))
        g.tensor("shared_out", "fwd.shared_fc2", "fwd.unpermute", tok * p, "x", act_shape)
        g.tensor("d_shared_act", "bwd.shared_fc2", "bwd.shared_act", T * fs * p, "grad", (b, s, fs))
        g.tensor("d_shared_fc1", "bwd.shared_act", ["bwd.shared_fc1", "wgrad.shared_fc1"], T * fs_in * p,
                 ["a", "b"], (b, s, fs_in))
        g.tensor("dW.shared_fc2", "wgrad.shared_fc2", None, (h * fs + h) * pr.grad, "x")
        g.tensor("dW.shared_fc1", "wgrad.shared_fc1", None, (h * fs_in + fs_in) * pr.grad, "x")
        g.tensor("d_shared_in", "bwd.shared_fc1", "bwd.ln2", tok * p, "grad", act_shape)

