"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv:2405.04434 sec. 2.1; DeepSeek-V3,
arXiv:2412.19437 sec. 2.1.1) as its own attention kind (``model.mla``).

Per token ``x`` (hidden ``h``), with ``a`` heads:

- down projections (one GEMM here, ``fwd.mla_down``): ``c_Q = W_DQ x`` (``q_lora_rank``),
  ``c_KV = W_DKV x`` (``kv_lora_rank``) and the decoupled rotary key ``k_R = W_KR x``
  (``qk_rope_head_dim``, shared by all heads), each latent RMS-normalised;
- up projections (the layer's ``fwd.qkv`` GEMM, from the latents): ``q = W_UQ c_Q`` with
  ``a x (qk_nope + qk_rope)`` features, ``[k_C; v] = W_UKV c_KV`` with ``a x (qk_nope + v_head)``;
- attention over ``a`` heads with query/key head dim ``qk_nope + qk_rope`` and value head dim
  ``v_head_dim``; out projection from ``a x v_head_dim``.

Training materialises every head's keys and values (the latent cache only helps inference), so
the attention kernels are standard attention with these head dims. DeepSeek's projections have
no biases; the two latent RMSNorm gains are counted as parameters, their FLOP (< 0.01 % of the
layer) are not modelled.
"""

from __future__ import annotations

from dfmodel.graph.kernel import KernelKind, Phase

MM = KernelKind.matmul


def mla_up_params(mla, a: int) -> int:
    """Up-projection weights: ``q_lora x a (nope + rope) + kv_lora x a (nope + v)``.

    >>> from dfmodel.graph.workload import MLAConfig
    >>> mla_up_params(MLAConfig(), 128) == 1536 * 128 * 192 + 512 * 128 * 256
    True
    """
    return mla.q_lora_rank * a * mla.qk_head_dim + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)


def mla_up_flop(mla, T: int, a: int) -> float:
    """FLOP of the up projections for ``T`` tokens: ``2 T x`` their weights."""
    return 2.0 * T * mla_up_params(mla, a)


def mla_down_params(mla, h: int) -> int:
    """Down-projection weights ``h x (q_lora + kv_lora + rope)`` plus the two latent RMSNorm gains.

    >>> from dfmodel.graph.workload import MLAConfig
    >>> mla_down_params(MLAConfig(), 7168) == 7168 * (1536 + 512 + 64) + 1536 + 512
    True
    """
    return h * mla.latent_out + mla.q_lora_rank + mla.kv_lora_rank


def _mla_down_forward(g, mla, T: int, h: int, pr) -> None:
    n = mla.latent_out
    params = mla_down_params(mla, h)
    cast = {"extra_memory_bytes": 2 * T * h} if pr.fp8 else {}
    g.kernel("fwd.mla_down", MM, {"m": T, "n": n, "k": h}, flop=2.0 * T * h * n, output_bytes=T * n * pr.act,
             group="attention", params=params, weight_bytes=params * pr.linear_weight, **pr.linear_kw, **cast)


def _mla_down_backward(g, mla, T: int, h: int, pr) -> None:
    n = mla.latent_out
    params = mla_down_params(mla, h)
    g.kernel("bwd.mla_down", MM, {"m": T, "n": h, "k": n}, flop=2.0 * T * h * n, output_bytes=T * h * pr.act,
             phase=Phase.backward, group="attention", weight_bytes=params * pr.linear_weight, **pr.linear_kw)
    g.kernel("wgrad.mla_down", MM, {"m": h, "n": n, "k": T}, flop=2.0 * T * h * n, output_bytes=params * pr.grad,
             phase=Phase.weight_grad, group="attention", weight_bytes=params * pr.grad, **pr.linear_kw)


def _mla_tensors(g, mla, b: int, s: int, h: int, pr) -> None:
    T, p, n = b * s, pr.act, mla.latent_out
    g.tensor("ln1_out", "fwd.ln1", ["fwd.mla_down", "wgrad.mla_down"], T * h * pr.allgather, "a", (b, s, h))
    g.tensor("latent", "fwd.mla_down", ["fwd.qkv", "wgrad.qkv"], T * n * p, "a", (b, s, n))
    g.tensor("d_latent", "bwd.qkv", ["bwd.mla_down", "wgrad.mla_down"], T * mla.latent_in * p, ["a", "b"],
             (b, s, mla.latent_in))
    g.tensor("dW.mla_down", "wgrad.mla_down", None, mla_down_params(mla, h) * pr.grad, "x")
    g.tensor("d_ln1_out", "bwd.mla_down", "bwd.ln1", T * h * p, "grad", (b, s, h))
