"""LLM (GPT / Llama decoder-only transformer) graphs: one decoder layer, the token embedding and
the LM head, each with forward, backward (data-gradient) and weight-gradient kernels.

Notation: b sequences, s = seq_len, h = hidden, a = num_heads, kv = num_kv_heads, d = h/a,
f = ffn_hidden, T = b*s tokens, p = bytes per element. Matmul dims are ``b`` (batched heads),
``m`` (rows), ``n`` (columns), ``k`` (reduction); vector kernels use ``m`` x ``n``.

Closed forms the graphs satisfy (checked in tests/test_builders_llm.py):

- forward matmul FLOP per layer: ``2T h (a+2kv)d + 4 b s^2 h + 2T h^2 + 2T h f_in + 2T f h``
  with ``f_in = f`` (gelu) or ``2f`` (swiglu); for GPT (kv = a, f = 4h, gelu) that is
  ``24 b s h^2 + 4 b s^2 h`` (Narayanan et al., SC'21, eq. 2 without the logit layer);
- backward + weight-gradient matmul FLOP = 2 x forward matmul FLOP, exactly;
- parameters per layer: ``(h+1)(a+2kv)d + (h+1)h + (h+1)f_in + (f+1)h + 4h`` (biases on every
  linear, two layernorms with gain and bias); GPT: ``12h^2 + 13h``;
- embedding: ``V h`` (+ ``s h`` learned positions); head: final layernorm ``2h`` plus ``V h``
  unless ``tie_embeddings`` (Megatron ties the LM head to the token embedding, so its
  parameters are counted once, on the embedding). GPT-3 175B: 96 (12h^2+13h) + 51200 h +
  2048 h + 2h = 174.6e9.

Biases are modelled on every linear layer (GPT-2/3 style); Llama has none and uses RMSNorm,
which changes its parameter count by < 0.02 %. Bias additions are counted in the next
element-wise kernel (residual or activation) and bias gradients in the kernel that first
sees the gradient, so matmul kernels carry exactly ``2bmnk``. Rotary position embeddings are
applied inside attention at negligible cost and are not modelled as a kernel.
"""

from __future__ import annotations

import math

from dfmodel.graph.builders.base import GraphBuilder
from dfmodel.graph.builders.moe import (ExpertShape, _moe_combine_backward, _moe_combine_forward, _moe_forward,
                                       _moe_permute_backward, _moe_tensors, expert_shape, has_router, routed_rows,
                                       sort_chunks_bytes)
from dfmodel.graph.builders.mla import _mla_down_backward, _mla_down_forward, _mla_tensors, mla_up_flop, mla_up_params
from dfmodel.graph.builders.formulas import INDEX_BYTES, LOSS_BYTES, matmul_flop, vector_flop
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.workload import LLMWorkload, fc1_width_factor

MM, EW, RED, EMB = KernelKind.matmul, KernelKind.elementwise, KernelKind.reduction, KernelKind.embedding
FWD, BWD, WG = Phase.forward, Phase.backward, Phase.weight_grad


def linear_params(k: int, n: int, bias: bool = True) -> int:
    """Parameters of a linear layer from k to n features: ``k*n`` (+ ``n`` bias)."""
    return k * n + (n if bias else 0)


def layernorm_params(h: int) -> int:
    """Gain and bias of a layernorm over h features: ``2h``."""
    return 2 * h


#: Block size along the sequence of FlashAttention's tiles (FA-2 uses 64-128 row/column blocks;
#: cuDNN's fused attention on Hopper 128): with a causal mask only tiles on or below the diagonal
#: are computed.
FLASH_BLOCK = 128

#: Extra DRAM bytes per element of an FP8 GEMM's activation or gradient operand: a Transformer
#: Engine cast(-transpose) kernel reads the 16-bit tensor (2) and writes its FP8 copy (1), which
#: the GEMM then reads (1) instead of the 16-bit tensor the edge already charges (2). Charged on
#: forward and data-gradient GEMMs; the weight-gradient GEMM reuses the FP8 copies they made.
FP8_CAST_EXTRA_BYTES = 2


def cross_entropy_extra_bytes(mode: str | None, p: int) -> tuple[int, int]:
    """Extra DRAM bytes per logit (one element of the tokens x vocab/tp tile) of the cross-entropy
    as ``training.cross_entropy`` runs it, forward and backward, beyond what the graph's edges
    charge (forward: one read of the p-byte logits; backward: that read again and the p-byte
    gradient's write, the ``single_pass`` form; None counts as that too).

    ``unfused``: Megatron-LM core_r0.8.0 (NeMo 24.07; core_r0.10 the same)
    megatron/core/tensor_parallel/cross_entropy.py, ``_VocabParallelCrossEntropy``, each line an
    eager PyTorch kernel over the whole tile:

    - forward: ``.float()`` reads p, writes 4 (nothing when p is 4); ``torch.max(dim=-1)`` reads 4;
      the in-place ``-= logits_max`` reads and writes 4; in-place ``torch.exp`` 4 + 4;
      ``.sum(dim=-1)`` reads 4; ``exp_logits.div_(sum)`` 4 + 4 (the fp32 softmax saved for the
      backward). The target gather, the log and the three TP all-reduces touch one value per token;
    - backward: the one-hot subtract is a scatter of one value per token;
      ``grad_input.mul_(grad_output)`` reads and writes the fp32 softmax (4 + 4); autograd's
      backward of ``.float()`` casts it back (reads 4, writes p).

    ``megatron_fused`` (``cross_entropy_loss_fusion: true``): core_r0.8.0
    megatron/core/fusions/fused_cross_entropy.py, the same steps in four ``jit_fuser`` regions
    (megatron/core/jit.py: torch.compile from PyTorch 2.2), each one pass that keeps what it returns
    or mutates: ``calculate_logits_max`` reads p, writes the fp32 copy (4) with the max fused in;
    ``calculate_predicted_logits`` subtracts, exponentiates and sums in place (4 + 4);
    ``calculate_cross_entropy_loss`` divides in place (4 + 4); backward ``calculate_gradients``
    reads the softmax (4), writes back its in-place update (4, an input mutation torch.compile
    keeps) and the 16-bit gradient (p).

    >>> cross_entropy_extra_bytes("unfused", 2)   # bf16 logits: 38 - 2 forward, 14 - 4 backward
    (36, 10)
    >>> cross_entropy_extra_bytes("unfused", 4)   # fp32 training: no casts
    (28, 0)
    >>> cross_entropy_extra_bytes("megatron_fused", 2)   # 22 - 2 forward, 10 - 4 backward
    (20, 6)

    ``te`` (Megatron-Core ``cross_entropy_loss_fusion: true`` with ``cross_entropy_fusion_impl:
    te``, Megatron Bridge's performance recipes: scripts/performance/utils/overrides.py
    ``_set_common_perf_overrides``): Transformer Engine's Triton kernels over the p-byte logits
    (TE 2.x transformer_engine/pytorch/triton/cross_entropy.py as of e6d97ffc7, 2026-03):
    ``online_softmax_kernel`` reads them (p), ``cross_entropy_kernel`` reads them again and writes
    the gradient in place (p + p); the backward's ``element_mul_kernel`` reads and writes it
    (p + p), skipped only for a scalar gradient of 1.0, and Megatron-Core asks per-token losses
    (language_module.py ``compute_language_model_loss``), so it runs.

    >>> cross_entropy_extra_bytes("single_pass", 2), cross_entropy_extra_bytes(None, 2)
    ((0, 0), (0, 0))
    >>> cross_entropy_extra_bytes("te", 2)   # 3p forward, 2p backward
    (4, 0)
    """
    if mode == "te":
        return 3 * p - p, 2 * p - 2 * p
    if mode == "unfused":
        cast_fwd, cast_bwd = (0, 0) if p == 4 else (p + 4, 4 + p)
        fwd = cast_fwd + 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4)
        bwd = (4 + 4) + cast_bwd
    elif mode == "megatron_fused":
        fwd = (p + (0 if p == 4 else 4)) + (4 + 4) + (4 + 4)
        bwd = 4 + 4 + p
    else:
        return 0, 0
    return fwd - p, bwd - 2 * p


def eager_activation_extra_bytes(ffn_type: str, p: int) -> tuple[int, int]:
    """Extra DRAM bytes per element of the f-wide activation input when the framework runs the
    FFN activation unfused, forward and backward, beyond the graph's one fused kernel (forward
    reads fc1's output and writes the activation, p + p; backward reads the gradient and fc1's
    output and writes the input gradient, 3p). Fused activations (gelu, swiglu: Megatron-Core's
    bias_gelu_impl / bias_swiglu_impl) and relu (one kernel each way) add nothing.

    Squared ReLU (Nemotron-4): NeMo v2.0.0rc0 (NeMo 24.07) nemo/collections/nlp/modules/common/
    megatron/utils.py ``squared_relu(x) = torch.pow(torch.nn.functional.relu(x), 2)``, run by
    Megatron-Core core_r0.8 mlp.py ``self.activation_func(...)`` (no bias fusion for it):

    - forward: relu (p + p), pow (p + p): 2 kernels, 4p;
    - backward: PyTorch FunctionsManual.cpp ``pow_backward`` = ``grad * (2 * self.pow(1))``:
      ``self.pow(1)`` copies (p + p), ``2 * .`` (p + p), ``grad * .`` (2p + p); then relu's
      ``threshold_backward(grad, result)`` (2p + p): 4 kernels, 10p. ReLU saves its output,
      which is also pow's input, so no tensor more is kept for the backward.

    >>> eager_activation_extra_bytes("squared_relu", 2), eager_activation_extra_bytes("gelu", 2)
    ((4, 14), (0, 0))
    """
    if ffn_type != "squared_relu":
        return 0, 0
    return 4 * p - 2 * p, 10 * p - 3 * p


def embedding_dense_grad_bytes(p: int, grad_bytes: int) -> int:
    """DRAM bytes per token-table element of the dense embedding gradient a GPU framework makes
    each micro-batch: PyTorch's CUDA ``embedding_dense_backward`` (aten/src/ATen/native/cuda/
    EmbeddingBackwardKernel.cu ``embedding_backward_cuda_kernel``: ``at::zeros({num_weights,
    dim})``) zero-fills a p-byte vocab/tp x hidden tensor before it scatters the rows; then
    Megatron-Core's gradient hook (core_r0.8 distributed_data_parallel.py ``_make_param_hook``:
    ``param.main_grad.add_(param.grad.data)``) reads it and reads and writes the main gradient.

    >>> embedding_dense_grad_bytes(2, 4)   # bf16 table, fp32 main gradient
    12
    """
    return p + p + 2 * grad_bytes


def causal_fraction(seq_len: int, block: int = FLASH_BLOCK) -> float:
    """Fraction of the s x s score tiles a causal fused-attention kernel computes.

    With ``n = ceil(s / block)`` tiles per side, the tiles on or below the diagonal are
    ``n (n + 1) / 2`` of ``n^2`` (FlashAttention-2, Dao 2023, sec. 3.1.1: blocks above the
    diagonal are skipped, which is its 1.7-1.8x causal speed-up).
    Megatron-LM's own FLOP count (``num_floating_point_operations`` in
    megatron/training/training.py) likewise halves the core-attention term for the causal mask.

    >>> causal_fraction(128), causal_fraction(8192)
    (1.0, 0.5078125)
    """
    n = -(-seq_len // block)
    return (n + 1) / (2 * n)


def window_fraction(seq_len: int, window: int, block: int = FLASH_BLOCK) -> float:
    """Fraction of the s x s score tiles a causal fused-attention kernel computes when each query
    attends to the last ``window`` tokens only (itself included).

    Query tile ``i`` (rows ``i B .. i B + B - 1``) needs the key tiles from the one holding its
    first row's earliest key, ``i B - window + 1``, up to the diagonal: FlashAttention-2 (and TE /
    cuDNN with ``window_size``) skip every other tile, as they skip those above the diagonal.
    A window of the whole sequence is :func:`causal_fraction`; a window of one tile still
    touches two tiles per query tile (its rows' windows straddle a tile boundary).

    >>> window_fraction(8192, 8192) == causal_fraction(8192), window_fraction(8192, 128)
    (True, 0.031005859375)
    """
    n = -(-seq_len // block)
    tiles = sum(i - max(0, (i * block - window + 1) // block) + 1 for i in range(n))
    return tiles / (n * n)


def attention_tile_fraction(model) -> float:
    """Mean over the layers of the s x s score tiles a causal fused-attention kernel computes:
    :func:`causal_fraction`, or with ``model.sliding_window`` :func:`window_fraction` on the
    sliding layers and the causal fraction on the ``L // N`` layers of ``full_attention_every``
    ``N`` (layers N, 2N, ...). One layer block stands for every layer, so it carries the mean:
    exact for the model's total and for a pipeline stage holding the same mix.

    >>> from types import SimpleNamespace as M
    >>> round(attention_tile_fraction(M(seq_len=4096, num_layers=36, sliding_window=128, full_attention_every=2)), 4)
    0.2886
    """
    s, window = model.seq_len, getattr(model, "sliding_window", None)
    if window is None or window >= s:
        return causal_fraction(s)
    every = getattr(model, "full_attention_every", None)
    full = model.num_layers // every if every else 0
    return (full * causal_fraction(s) + (model.num_layers - full) * window_fraction(s, window)) / model.num_layers


def attention_mode(w: LLMWorkload) -> str:
    """``flash`` or ``unfused``; an unresolved workload (``model.attention: null``) builds the
    unfused graph (the system decides: :func:`dfmodel.graph.workload.resolve_attention`)."""
    return w.model.attention or "unfused"


def _meta(w: LLMWorkload, batch: int, part: str) -> dict:
    m = w.model
    return {
        "family": "llm",
        "part": part,
        "workload": w.name,
        "batch": batch,
        "seq_len": m.seq_len,
        "tokens": batch * m.seq_len,
        "hidden": m.hidden,
        "num_heads": m.num_heads,
        "num_kv_heads": m.kv_heads,
        "head_dim": m.head_width,
        "ffn_hidden": m.ffn,
        "ffn_type": m.ffn_type,
        "num_layers": m.num_layers,
        "vocab_size": m.vocab_size,
        "tie_embeddings": m.tie_embeddings,
        "precision": w.precision.value,
        "bytes_per_element": w.precision.bytes,
        "activation_bytes_per_element": w.training.activation_bytes,
        "grad_bytes_per_element": w.training.grad_bytes,
        "attention": attention_mode(w),
    }


class _Precisions:
    """Bytes per element and per-kernel precisions of one LLM workload.

    bf16 / fp16 / fp32: everything in the training precision, gradients in ``grad_bytes``.
    fp8 (Transformer Engine defaults, :class:`~dfmodel.graph.workload.FP8Recipe`): the linear
    GEMMs run in FP8 and read cached FP8 weights (1 byte); attention (unless ``fp8.attention``),
    norms and element-wise kernels run in bf16; activations are stored and exchanged in bf16
    (the layernorm outputs TP all-gathers in FP8 with ``fp8.fp8_allgather``).
    """

    def __init__(self, w: LLMWorkload) -> None:
        t = w.training
        self.fp8 = w.precision.value == "fp8"
        self.act = t.activation_bytes
        self.weight = self.act  # 16-bit parameters of norms and embeddings
        self.grad = t.grad_bytes
        self.linear_weight = 1 if self.fp8 else w.precision.bytes
        self.allgather = 1 if self.fp8 and t.fp8.fp8_allgather else self.act
        self.linear_kw = {"precision": "fp8"} if self.fp8 else {}
        self.attention_kw = {"precision": "bf16"} if self.fp8 and not t.fp8.attention else {}
        self.vector_kw = {"precision": "bf16"} if self.fp8 else {}


def _wide_read(elements: int, pr: _Precisions, gathered_fp8: bool = True) -> dict:
    """Extra DRAM bytes of a 16-bit kernel that reads the 16-bit form of an incoming gradient whose
    graph edge carries its FP8 copy (``d_y`` / ``d_r1``: the edge is what the TP all-gather and the
    GEMMs move, :func:`build_llm_layer`), so the kernel's read is counted at 16 bit."""
    extra = elements * (pr.act - pr.allgather) if gathered_fp8 else 0
    return {"extra_memory_bytes": extra} if extra else {}


def build_llm_layer(w: LLMWorkload, batch: int, ep: int = 1, *, part: str = "layer") -> DataflowGraph:
    """One decoder layer for ``batch`` sequences: forward, backward and weight-gradient kernels.

    Graph inputs: ``x`` (the previous layer's output) and ``dy`` (the next layer's gradient);
    outputs: ``y``, ``dx`` and the weight gradients ``dW.*``. Backward kernels read the saved
    forward activations they need (edges from forward to backward kernels), which is what makes
    activation memory and fusion visible to the mapping passes.

    With ``model.moe`` the MLP is the MoE layer of one of ``ep`` expert-parallel ranks
    (:mod:`dfmodel.graph.builders.moe`): router, permute, the grouped expert GEMMs (the
    ``fc1``/``fc2`` kernels, batched over the local experts and marked ``expert``), unpermute
    and the shared experts. The ``first_dense_layers`` of an MoE model (DeepSeek-V3: 3 of 61)
    are :func:`build_llm_dense_layer`. ``part`` names the graph (``<workload>.<part>``).

    >>> from dfmodel.graph.workload import load_workload
    >>> w = load_workload({"kind": "llm", "name": "t", "model": {"hidden": 64, "num_heads": 4,
    ...     "num_layers": 1, "seq_len": 32}, "training": {"global_batch": 2}})
    >>> g = build_llm_layer(w, 2)
    >>> g.matmul_flop(Phase.forward) == 24 * 2 * 32 * 64**2 + 4 * 2 * 32**2 * 64
    True
    >>> g.params() == 12 * 64**2 + 13 * 64
    True
    """
    m = w.model
    b, s, h, a, kv, d, f = batch, m.seq_len, m.hidden, m.num_heads, m.kv_heads, m.head_width, m.ffn
    T, ba = b * s, batch * m.num_heads
    # query/key and value head dims (d for standard attention; MLA: nope + rope, and v_head_dim)
    mla = m.mla
    dq, dv = (mla.qk_head_dim, mla.v_head_dim) if mla is not None else (d, d)
    nqkv = (a + kv) * dq + kv * dv
    # inputs of the qkv GEMM: ln1's h features, or MLA's compressed latents (q_lora + kv_lora)
    nin = mla.latent_in if mla is not None else h
    moe = m.moe
    routed = has_router(w)
    # MLP rows and experts: the dense MLP is one "expert" on all T tokens
    ex = expert_shape(T, moe, ep) if moe is not None else ExpertShape(1, T, f)
    f, nE, R = ex.ffn, ex.experts_local, ex.rows_per_expert  # R: rows per local expert (padding dims)
    # routed rows on this rank (T for a dense MLP): the FLOP and bytes; they do not depend on
    # ep (every rank computes as many rows as its tokens send), only the padding dims R do
    TR = math.ceil(routed_rows(T, moe) - 1e-9) if moe is not None else T
    # rows of the expert GEMMs' FP8 inputs (tokens before fc1, gradients before fc2's dgrad) this
    # rank casts: with an FP8 dispatch the sender quantises each token once before the all-to-all
    # (DeepSeek-V3 sec. 3.3.3), not each of its top-k routed copies
    TQ = T if moe is not None and moe.dispatch_fp8 else TR
    # the sort of the received rows by local expert (and its inverse) when they arrived by all-to-all:
    # dispatched rows (and the dispatched gradients of the combine's backward) at the dispatch's
    # element size, combined rows at the activation precision
    sort_d, sort_c = sort_chunks_bytes(TR, h, moe, w.training.activation_bytes, experts_local=nE, ep=ep) \
        if routed else (0.0, 0.0)
    f_in = fc1_width_factor(m.ffn_type) * f
    act, act_bwd = m.ffn_type, f"{m.ffn_type}_bwd"
    qkv_p, out_p = (mla_up_params(mla, a) if mla else linear_params(h, nqkv)), linear_params(a * dv, h)
    fc1_p, fc2_p, ln_p = nE * linear_params(h, f_in), nE * linear_params(f, h), layernorm_params(h)

    def mm(rows: int, n: int, k: int) -> dict:
        """Dims of a (grouped) expert GEMM: batched over the local experts when there are several."""
        return {"b": nE, "m": rows, "n": n, "k": k} if nE > 1 else {"m": rows, "n": n, "k": k}

    xk = {"expert": True} if moe is not None else {}
    tok = T * h  # elements of one token-by-hidden activation
    pr = _Precisions(w)
    p, pw, gb = pr.act, pr.linear_weight, pr.grad  # activation, linear-weight and gradient bytes
    lin, att, vec = pr.linear_kw, pr.attention_kw, pr.vector_kw
    flash = attention_mode(w) == "flash"
    g = GraphBuilder()

    def weights(params: int) -> dict:
        return {"params": params, "weight_bytes": params * pw, **lin}

    def cast(elements: int) -> dict:
        """Cast traffic of an FP8 GEMM's activation/gradient operand (nothing in 16 bit)."""
        return {"extra_memory_bytes": FP8_CAST_EXTRA_BYTES * elements} if pr.fp8 else {}

    def wgrad(params: int) -> dict:
        # accumulates into the main-gradient buffer (gb bytes/param): read-modify-write
        return {"weight_bytes": params * gb, **lin}

    # ---- forward ------------------------------------------------------------------------------
    g.kernel("fwd.ln1", RED, {"m": T, "n": h}, flop=vector_flop("layernorm", tok), output_bytes=tok * p,
             group="norm", params=ln_p, weight_bytes=ln_p * pr.weight, **vec)
    if mla:
        _mla_down_forward(g, mla, T, h, pr)
    g.kernel("fwd.qkv", MM, {"m": T, "n": nqkv, "k": nin}, flop=mla_up_flop(mla, T, a) if mla else matmul_flop(1, T, nqkv, h),
             output_bytes=T * nqkv * p, group="attention", **weights(qkv_p), **cast(T * nin))
    if flash:
        # one fused kernel: S = QK^T, online softmax, O = PV; only O and the row log-sum-exp
        # (fp32) reach HBM (FlashAttention, Dao et al. 2022, Algorithm 1; FA-2 Algorithm 1)
        cf = attention_tile_fraction(w.model)
        fa_fwd = cf * (matmul_flop(ba, s, s, dq) + matmul_flop(ba, s, dv, s))
        g.kernel("fwd.flash_attn", MM, {"b": ba, "m": s, "n": s, "k": dq}, flop=fa_fwd,
                 output_bytes=T * a * dv * p + ba * s * LOSS_BYTES, group="attention",
                 efficiency="attention", **att)
    else:
        # GQA: each of the a query heads attends to its group's shared K/V head; FLOP as for MHA
        g.kernel("fwd.attn_score", MM, {"b": ba, "m": s, "n": s, "k": dq}, flop=matmul_flop(ba, s, s, dq),
                 output_bytes=ba * s * s * p, group="attention", **att)
        g.kernel("fwd.softmax", RED, {"m": ba * s, "n": s}, flop=vector_flop("softmax", ba * s * s),
                 output_bytes=ba * s * s * p, group="attention", **vec)
        g.kernel("fwd.attn_v", MM, {"b": ba, "m": s, "n": dv, "k": s}, flop=matmul_flop(ba, s, dv, s),
                 output_bytes=T * a * dv * p, group="attention", **att)
    g.kernel("fwd.out_proj", MM, {"m": T, "n": h, "k": a * dv}, flop=matmul_flop(1, T, h, a * dv),
             output_bytes=tok * p, group="attention", **weights(out_p), **cast(T * a * dv))
    g.kernel("fwd.residual1", EW, {"m": T, "n": h}, flop=vector_flop("residual", tok) + vector_flop("bias", tok),
             output_bytes=tok * p, group="attention", **vec)
    g.kernel("fwd.ln2", RED, {"m": T, "n": h}, flop=vector_flop("layernorm", tok), output_bytes=tok * p,
             group="norm", params=ln_p, weight_bytes=ln_p * pr.weight, **vec)
    if routed:
        _moe_forward(g, w, T, TR, pr, sort_d)
    g.kernel("fwd.fc1", MM, mm(R, f_in, h), flop=matmul_flop(1, TR, f_in, h),
             output_bytes=TR * f_in * p, group="mlp", **weights(fc1_p), **cast(TQ * h), **xk)
    act_f, act_b = (0, 0) if w.training.activation_fusion is not False else eager_activation_extra_bytes(m.ffn_type, p)
    g.kernel("fwd.act", EW, {"m": TR, "n": f}, flop=vector_flop(act, TR * f) + vector_flop("bias", TR * f_in),
             output_bytes=TR * f * p, group="mlp", extra_memory_bytes=act_f * TR * f, **vec)
    g.kernel("fwd.fc2", MM, mm(R, h, f), flop=matmul_flop(1, TR, h, f), output_bytes=TR * h * p,
             group="mlp", **weights(fc2_p), **cast(TR * f), **xk)
    if routed:
        _moe_combine_forward(g, w, T, TR, pr, sort_c)
    g.kernel("fwd.residual2", EW, {"m": T, "n": h}, flop=vector_flop("residual", tok) + vector_flop("bias", tok),
             output_bytes=tok * p, group="mlp", **vec)

    # ---- backward (data gradients) and weight gradients, in execution order --------------------
    # Weight-gradient kernels also carry weight_bytes: with gradient accumulation over
    # micro-batches they read and write the dW buffer (output_bytes = the weight bytes), which
    # holds the main gradients (fp32 for bf16/fp8 training: Megatron-LM's gradient-accumulation
    # fusion accumulates the wgrad GEMM's result into main_grad directly).
    g.kernel("bwd.residual2", EW, {"m": T, "n": h}, flop=vector_flop("bias_grad", tok), output_bytes=tok * p,
             phase=BWD, group="mlp", **vec)
    if routed:
        _moe_combine_backward(g, w, T, TR, pr, sort_d)
    g.kernel("bwd.fc2", MM, mm(R, f, h), flop=matmul_flop(1, TR, f, h), output_bytes=TR * f * p,
             phase=BWD, group="mlp", weight_bytes=fc2_p * pw, **lin, **cast(TQ * h), **xk)
    g.kernel("wgrad.fc2", MM, {"b": nE, "m": f, "n": h, "k": R} if nE > 1 else {"m": f, "n": h, "k": R},
             flop=matmul_flop(1, f, h, TR), output_bytes=fc2_p * gb, phase=WG, group="mlp", **wgrad(fc2_p), **xk)
    g.kernel("bwd.act", EW, {"m": TR, "n": f}, flop=vector_flop(act_bwd, TR * f) + vector_flop("bias_grad", TR * f_in),
             output_bytes=TR * f_in * p, phase=BWD, group="mlp", extra_memory_bytes=act_b * TR * f, **vec)
    g.kernel("bwd.fc1", MM, mm(R, h, f_in), flop=matmul_flop(1, TR, h, f_in), output_bytes=TR * h * p,
             phase=BWD, group="mlp", weight_bytes=fc1_p * pw, **lin, **cast(TR * f_in), **xk)
    g.kernel("wgrad.fc1", MM, {"b": nE, "m": h, "n": f_in, "k": R} if nE > 1 else {"m": h, "n": f_in, "k": R},
             flop=matmul_flop(1, h, f_in, TR), output_bytes=fc1_p * gb, phase=WG, group="mlp", **wgrad(fc1_p), **xk)
    if routed:
        _moe_permute_backward(g, w, T, TR, pr, sort_c)
    g.kernel("bwd.ln2", RED, {"m": T, "n": h}, flop=vector_flop("layernorm_bwd", tok), output_bytes=tok * p,
             phase=BWD, group="norm", weight_bytes=ln_p * pr.weight, **vec)
    g.kernel("bwd.residual1", EW, {"m": T, "n": h},
             flop=vector_flop("residual", tok) + vector_flop("bias_grad", tok), output_bytes=tok * p,
             phase=BWD, group="attention", **_wide_read(tok, pr, not routed), **vec)
    g.kernel("bwd.out_proj", MM, {"m": T, "n": a * dv, "k": h}, flop=matmul_flop(1, T, a * dv, h),
             output_bytes=T * a * dv * p, phase=BWD, group="attention", weight_bytes=out_p * pw, **lin, **cast(tok))
    g.kernel("wgrad.out_proj", MM, {"m": a * dv, "n": h, "k": T}, flop=matmul_flop(1, a * dv, h, T),
             output_bytes=out_p * gb, phase=WG, group="attention", **wgrad(out_p))
    if flash:
        # FA-2 backward (Dao 2023, sec. 3.2 / Algorithm 2): recompute S = QK^T and P from the
        # saved log-sum-exp, then dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = dS K,
        # dK = dS^T Q: five s x s x d matmuls against the forward's two, 2.5x its FLOP.
        g.kernel("bwd.flash_attn", MM, {"b": ba, "m": s, "n": s, "k": dq}, flop=2.5 * fa_fwd,
                 output_bytes=(T * (a + kv) * dq + T * kv * dv) * p, phase=BWD, group="attention",
                 efficiency="attention", **att)
    else:
        # attention has no weights: each forward matmul has two data-gradient matmuls
        g.kernel("bwd.attn_v.dp", MM, {"b": ba, "m": s, "n": s, "k": dv}, flop=matmul_flop(ba, s, s, dv),
                 output_bytes=ba * s * s * p, phase=BWD, group="attention", **att)  # dP = dCtx V^T
        g.kernel("bwd.attn_v.dv", MM, {"b": ba, "m": s, "n": dv, "k": s}, flop=matmul_flop(ba, s, dv, s),
                 output_bytes=T * kv * dv * p, phase=BWD, group="attention", **att)  # dV = P^T dCtx
        g.kernel("bwd.softmax", RED, {"m": ba * s, "n": s}, flop=vector_flop("softmax_bwd", ba * s * s),
                 output_bytes=ba * s * s * p, phase=BWD, group="attention", **vec)
        g.kernel("bwd.attn_score.dq", MM, {"b": ba, "m": s, "n": dq, "k": s}, flop=matmul_flop(ba, s, dq, s),
                 output_bytes=T * a * dq * p, phase=BWD, group="attention", **att)  # dQ = dS K
        g.kernel("bwd.attn_score.dk", MM, {"b": ba, "m": s, "n": dq, "k": s}, flop=matmul_flop(ba, s, dq, s),
                 output_bytes=T * kv * dq * p, phase=BWD, group="attention", **att)  # dK = dS^T Q
    up_flop = mla_up_flop(mla, T, a) if mla else matmul_flop(1, T, h, nqkv)  # data and weight grads: as forward
    g.kernel("bwd.qkv", MM, {"m": T, "n": nin, "k": nqkv}, flop=up_flop, output_bytes=T * nin * p,
             phase=BWD, group="attention", weight_bytes=qkv_p * pw, **lin, **cast(T * nqkv))
    g.kernel("wgrad.qkv", MM, {"m": nin, "n": nqkv, "k": T}, flop=up_flop,
             output_bytes=qkv_p * gb, phase=WG, group="attention", **wgrad(qkv_p))
    if mla:
        _mla_down_backward(g, mla, T, h, pr)
    g.kernel("bwd.ln1", RED, {"m": T, "n": h}, flop=vector_flop("layernorm_bwd", tok), output_bytes=tok * p,
             phase=BWD, group="norm", weight_bytes=ln_p * pr.weight, **_wide_read(tok, pr), **vec)

    # ---- tensors ------------------------------------------------------------------------------
    act_shape = (b, s, h)
    # bytes of what the TP all-gathers move into an FP8 GEMM (1 with FP8 all-gather): the layer norms'
    # outputs, and a row-parallel layer's incoming gradient (``d_y`` before FC2, ``d_r1`` before the
    # projection), which TE casts on the rank's shard and gathers in FP8 (TE v1.11 module/base.py
    # ``grad_output_preprocess``: "FP8 case with gather", with and without userbuffers); its data- and
    # weight-gradient GEMMs read that FP8 copy, the residual and norm backward the 16-bit one
    ag = pr.allgather
    g.tensor("x", None, ["fwd.ln1", "fwd.residual1", "bwd.ln1"], tok * p, ["x", "residual", "saved"], act_shape)
    if mla:
        _mla_tensors(g, mla, b, s, h, pr)
    else:
        g.tensor("ln1_out", "fwd.ln1", ["fwd.qkv", "wgrad.qkv"], tok * ag, "a", act_shape)
        g.tensor("d_ln1_out", "bwd.qkv", "bwd.ln1", tok * p, "grad", act_shape)
    if flash:
        g.tensor("q", "fwd.qkv", ["fwd.flash_attn", "bwd.flash_attn"], T * a * dq * p, ["a", "saved"], (b, s, a, dq))
        g.tensor("k", "fwd.qkv", ["fwd.flash_attn", "bwd.flash_attn"], T * kv * dq * p, ["b", "saved"],
                 (b, s, kv, dq))
        g.tensor("v", "fwd.qkv", ["fwd.flash_attn", "bwd.flash_attn"], T * kv * dv * p, ["b", "saved"],
                 (b, s, kv, dv))
        g.tensor("ctx", "fwd.flash_attn", ["fwd.out_proj", "wgrad.out_proj", "bwd.flash_attn"], T * a * dv * p,
                 ["a", "a", "saved"], (b, s, a, dv))
        g.tensor("lse", "fwd.flash_attn", "bwd.flash_attn", ba * s * LOSS_BYTES, "saved", (b, a, s))
    else:
        g.tensor("q", "fwd.qkv", ["fwd.attn_score", "bwd.attn_score.dk"], T * a * dq * p, ["a", "b"], (b, s, a, dq))
        g.tensor("k", "fwd.qkv", ["fwd.attn_score", "bwd.attn_score.dq"], T * kv * dq * p, "b", (b, s, kv, dq))
        g.tensor("v", "fwd.qkv", ["fwd.attn_v", "bwd.attn_v.dp"], T * kv * dv * p, "b", (b, s, kv, dv))
        g.tensor("scores", "fwd.attn_score", "fwd.softmax", ba * s * s * p, "x", (b, a, s, s))
        g.tensor("probs", "fwd.softmax", ["fwd.attn_v", "bwd.softmax", "bwd.attn_v.dv"], ba * s * s * p,
                 ["a", "saved", "a"], (b, a, s, s))
        g.tensor("ctx", "fwd.attn_v", ["fwd.out_proj", "wgrad.out_proj"], T * a * dv * p, "a", (b, s, a, dv))
    g.tensor("attn_out", "fwd.out_proj", "fwd.residual1", tok * p, "x", act_shape)
    g.tensor("r1", "fwd.residual1", ["fwd.ln2", "fwd.residual2", "bwd.ln2"], tok * p, ["x", "residual", "saved"],
             act_shape)
    rshape = lambda n: (nE, R, n) if moe is not None else (b, s, n)  # noqa: E731 -- MLP row shapes
    if routed:
        _moe_tensors(g, w, T, TR, pr, act_shape, rshape(h))
    else:
        g.tensor("ln2_out", "fwd.ln2", ["fwd.fc1", "wgrad.fc1"], tok * ag, "a", act_shape)
        g.tensor("mlp_out", "fwd.fc2", "fwd.residual2", tok * p, "x", act_shape)
        g.tensor("d_y", "bwd.residual2", ["bwd.fc2", "wgrad.fc2", "bwd.residual1"], tok * ag,
                 ["a", "b", "grad_skip"], act_shape)
        g.tensor("d_ln2_out", "bwd.fc1", "bwd.ln2", tok * p, "grad", act_shape)
    g.tensor("fc1_out", "fwd.fc1", ["fwd.act", "bwd.act"], TR * f_in * p, ["x", "saved"], rshape(f_in))
    g.tensor("act_out", "fwd.act", ["fwd.fc2", "wgrad.fc2"], TR * f * p, "a", rshape(f))
    g.tensor("y", "fwd.residual2", None, tok * p, "x", act_shape)

    g.tensor("dy", None, "bwd.residual2", tok * p, "grad", act_shape)
    g.tensor("d_act", "bwd.fc2", "bwd.act", TR * f * p, "grad", rshape(f))
    g.tensor("dW.fc2", "wgrad.fc2", None, fc2_p * gb, "x")
    g.tensor("d_fc1", "bwd.act", ["bwd.fc1", "wgrad.fc1"], TR * f_in * p, ["a", "b"], rshape(f_in))
    g.tensor("dW.fc1", "wgrad.fc1", None, fc1_p * gb, "x")
    g.tensor("dW.ln2", "bwd.ln2", None, ln_p * gb, "x")
    g.tensor("d_ln2_in", "bwd.ln2", "bwd.residual1", tok * p, "grad", act_shape)
    g.tensor("d_r1", "bwd.residual1", ["bwd.out_proj", "wgrad.out_proj", "bwd.ln1"], tok * ag,
             ["a", "b", "grad_skip"], act_shape)
    g.tensor("dW.out_proj", "wgrad.out_proj", None, out_p * gb, "x")
    if flash:
        g.tensor("d_ctx", "bwd.out_proj", "bwd.flash_attn", T * a * dv * p, "grad", (b, s, a, dv))
        g.tensor("dq", "bwd.flash_attn", ["bwd.qkv", "wgrad.qkv"], T * a * dq * p, ["a", "b"], (b, s, a, dq))
        g.tensor("dk", "bwd.flash_attn", ["bwd.qkv", "wgrad.qkv"], T * kv * dq * p, ["a", "b"], (b, s, kv, dq))
        g.tensor("dv", "bwd.flash_attn", ["bwd.qkv", "wgrad.qkv"], T * kv * dv * p, ["a", "b"], (b, s, kv, dv))
    else:
        g.tensor("d_ctx", "bwd.out_proj", ["bwd.attn_v.dp", "bwd.attn_v.dv"], T * a * dv * p, ["a", "b"],
                 (b, s, a, dv))
        g.tensor("d_probs", "bwd.attn_v.dp", "bwd.softmax", ba * s * s * p, "grad", (b, a, s, s))
        g.tensor("dv", "bwd.attn_v.dv", ["bwd.qkv", "wgrad.qkv"], T * kv * dv * p, ["a", "b"], (b, s, kv, dv))
        g.tensor("d_scores", "bwd.softmax", ["bwd.attn_score.dq", "bwd.attn_score.dk"], ba * s * s * p, "a",
                 (b, a, s, s))
        g.tensor("dq", "bwd.attn_score.dq", ["bwd.qkv", "wgrad.qkv"], T * a * dq * p, ["a", "b"], (b, s, a, dq))
        g.tensor("dk", "bwd.attn_score.dk", ["bwd.qkv", "wgrad.qkv"], T * kv * dq * p, ["a", "b"], (b, s, kv, dq))
    g.tensor("dW.qkv", "wgrad.qkv", None, qkv_p * gb, "x")
    g.tensor("dW.ln1", "bwd.ln1", None, ln_p * gb, "x")
    g.tensor("dx", "bwd.ln1", None, tok * p, "x", act_shape)
    return g.build(f"{w.name}.{part}", _meta(w, batch, part))


def build_llm_dense_layer(w: LLMWorkload, batch: int) -> DataflowGraph | None:
    """One of the dense decoder layers that precede an MoE model's MoE layers
    (``model.moe.first_dense_layers``), or None when there are none.

    DeepSeek-V3 (arXiv:2412.19437 sec. 4.2, config.json ``first_k_dense_replace: 3``,
    ``intermediate_size: 18432``): the first three layers keep a dense SwiGLU FFN of
    ``ffn_hidden`` and the same attention (MLA) as every other layer; no router, no experts.

    >>> from dfmodel.graph.workload import load_workload
    >>> w = load_workload("deepseek_v3")
    >>> g = build_llm_dense_layer(w, 1)
    >>> g.name, g.kernel("fwd.fc1").dims["n"], any(k.expert for k in g.kernels)
    ('deepseek_v3.dense_layer', 36864, False)
    """
    moe = w.model.moe
    if moe is None or moe.first_dense_layers == 0:
        return None
    dense = w.model_copy(update={"model": w.model.model_copy(update={"moe": None})})
    return build_llm_layer(dense, batch, part="dense_layer")


def build_llm_embedding(w: LLMWorkload, batch: int) -> DataflowGraph | None:
    """Token (and learned position) embedding: a look-up and its gradient scatter; None if
    ``vocab_size`` is 0.

    The tables are parameters (``params``) but not streamed weights (``weight_bytes = 0``): a
    look-up reads only the gathered rows, counted in ``extra_memory_bytes``. The one exception is
    the dense table gradient a GPU framework writes (``training.embedding_dense_grad``,
    :func:`embedding_dense_grad_bytes`), the weight gradient's ``weight_bytes``. Token ids have no
    data gradient, so the backward is the weight-gradient scatter-add alone.

    >>> from dfmodel.graph.workload import load_workload
    >>> w = load_workload("gpt3_175b")
    >>> build_llm_embedding(w, 1).params() == 51200 * 12288 + 2048 * 12288
    True
    """
    m = w.model
    if m.vocab_size == 0:
        return None
    T, h, V = batch * m.seq_len, m.hidden, m.vocab_size
    pr = _Precisions(w)
    p = pr.act
    tables = 2 if m.position_embedding == "learned" else 1  # rows gathered per token
    params = V * h + (m.seq_len * h if tables == 2 else 0)
    gathered = tables * T * h * p
    g = GraphBuilder()
    # Vocabulary-parallel (Megatron-LM VocabParallelEmbedding, Shoeybi et al. 2019 sec. 3): each
    # TP member holds V/t rows, looks up the tokens that fall in its range, and the partial
    # outputs are all-reduced (reduce-scattered with sequence parallelism). Both kernels name
    # the table as their weight so they share that one strategy (strategies.VOCAB_PARALLEL).
    g.kernel("fwd.embed", EMB, {"m": T, "n": h, "k": V}, flop=vector_flop("embedding_pool", (tables - 1) * T * h),
             output_bytes=T * h * p, extra_memory_bytes=gathered, params=params, group="vocab_embedding",
             weight="embed.table", **pr.vector_kw)
    # scatter-add of the gradient rows: read-modify-write of every touched row; on GPUs
    # (training.embedding_dense_grad) also the dense table gradient of every micro-batch, traffic
    # of the table's shape (weight_bytes: split with the table, the same at any micro-batch)
    dense = V * h * embedding_dense_grad_bytes(p, pr.grad) if w.training.embedding_dense_grad else 0
    g.kernel("wgrad.embed", EMB, {"m": T, "n": h, "k": V}, flop=vector_flop("embedding_scatter", tables * T * h),
             output_bytes=T * h * p, extra_memory_bytes=2 * gathered, weight_bytes=dense, phase=WG,
             group="vocab_embedding",
             weight="embed.table", **pr.vector_kw)
    g.tensor("tokens", None, ["fwd.embed", "wgrad.embed"], T * INDEX_BYTES, "index", (batch, m.seq_len))
    g.tensor("emb", "fwd.embed", None, T * h * p, "x", (batch, m.seq_len, h))
    g.tensor("d_emb", None, "wgrad.embed", T * h * p, "grad", (batch, m.seq_len, h))
    g.tensor("dW.embed", "wgrad.embed", None, T * h * pr.grad, "x")
    return g.build(f"{w.name}.embedding", _meta(w, batch, "embedding"))


def build_llm_head(w: LLMWorkload, batch: int) -> DataflowGraph | None:
    """Final layernorm, LM-head matmul and softmax cross-entropy with their gradients; None if
    ``vocab_size`` is 0.

    With ``tie_embeddings`` the LM head multiplies by the token-embedding table: it reads
    (``weight_bytes``) and produces a gradient for it, but owns no parameters of its own.

    >>> from dfmodel.graph.workload import load_workload
    >>> build_llm_head(load_workload("gpt3_175b"), 1).params() == 2 * 12288  # tied: ln_f only
    True
    """
    m = w.model
    if m.vocab_size == 0:
        return None
    b, s, h, V = batch, m.seq_len, m.hidden, m.vocab_size
    pr = _Precisions(w)
    p, gb = pr.act, pr.grad  # the output layer stays 16-bit under FP8 (Megatron: not a TE layer)
    T, ln_p = b * s, layernorm_params(h)
    head_p = 0 if m.tie_embeddings else linear_params(h, V, bias=False)
    g = GraphBuilder()
    g.kernel("fwd.ln_f", RED, {"m": T, "n": h}, flop=vector_flop("layernorm", T * h), output_bytes=T * h * p,
             group="norm", params=ln_p, weight_bytes=ln_p * p, **pr.vector_kw)
    g.kernel("fwd.lm_head", MM, {"m": T, "n": V, "k": h}, flop=matmul_flop(1, T, V, h), output_bytes=T * V * p,
             group="head", params=head_p, weight_bytes=V * h * p, **pr.vector_kw)
    # Megatron-Core's cross-entropy makes several fp32 passes over the logits each way
    ce_f, ce_b = cross_entropy_extra_bytes(w.training.cross_entropy, p)
    g.kernel("fwd.loss", RED, {"m": T, "n": V}, flop=vector_flop("cross_entropy", T * V),
             output_bytes=T * LOSS_BYTES, group="head", extra_memory_bytes=ce_f * T * V, **pr.vector_kw)
    g.kernel("bwd.loss", EW, {"m": T, "n": V}, flop=vector_flop("cross_entropy_bwd", T * V),
             output_bytes=T * V * p, phase=BWD, group="head", extra_memory_bytes=ce_b * T * V, **pr.vector_kw)
    g.kernel("bwd.lm_head", MM, {"m": T, "n": h, "k": V}, flop=matmul_flop(1, T, h, V), output_bytes=T * h * p,
             phase=BWD, group="head", weight_bytes=V * h * p, **pr.vector_kw)
    g.kernel("wgrad.lm_head", MM, {"m": h, "n": V, "k": T}, flop=matmul_flop(1, h, V, T),
             output_bytes=V * h * gb, phase=WG, group="head", weight_bytes=V * h * gb, **pr.vector_kw)
    g.kernel("bwd.ln_f", RED, {"m": T, "n": h}, flop=vector_flop("layernorm_bwd", T * h), output_bytes=T * h * p,
             phase=BWD, group="norm", weight_bytes=ln_p * p, **pr.vector_kw)

    g.tensor("y_last", None, ["fwd.ln_f", "bwd.ln_f"], T * h * p, ["x", "saved"], (b, s, h))
    g.tensor("lnf_out", "fwd.ln_f", ["fwd.lm_head", "wgrad.lm_head"], T * h * p, "a", (b, s, h))
    g.tensor("logits", "fwd.lm_head", ["fwd.loss", "bwd.loss"], T * V * p, ["x", "saved"], (b, s, V))
    g.tensor("labels", None, ["fwd.loss", "bwd.loss"], T * INDEX_BYTES, "labels", (b, s))
    g.tensor("loss", "fwd.loss", None, T * LOSS_BYTES, "x", (b, s))
    # log-sum-exp per token, saved by fused cross-entropy kernels for the backward
    g.tensor("lse", "fwd.loss", "bwd.loss", T * LOSS_BYTES, "saved", (b, s))
    g.tensor("d_logits", "bwd.loss", ["bwd.lm_head", "wgrad.lm_head"], T * V * p, ["a", "b"], (b, s, V))
    g.tensor("d_lnf_out", "bwd.lm_head", "bwd.ln_f", T * h * p, "grad", (b, s, h))
    g.tensor("dW.lm_head", "wgrad.lm_head", None, V * h * gb, "x")
    g.tensor("dW.ln_f", "bwd.ln_f", None, ln_p * gb, "x")
    g.tensor("dy_last", "bwd.ln_f", None, T * h * p, "x", (b, s, h))
    return g.build(f"{w.name}.head", _meta(w, batch, "head"))
