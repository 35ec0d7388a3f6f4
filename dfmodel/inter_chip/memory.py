"""Memory per chip for LLM training: activations, model state (weights, gradients, optimizer).

Every formula lives here once; all quantities are bytes per chip.

Sources:

- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  arXiv:2205.05198 (2022): sec. 4.1 (activation memory per layer, term by term), Table 2
  (tensor / sequence parallelism, selective / full recomputation), sec. 4.2.3 (pipeline: micro-
  batches in flight), sec. 4.3 (input embedding and output layer).
- Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020, sec. 3.1 (mixed-precision Adam: 2 + 2 + 12 bytes/param) and sec. 5.1 (P_os, optimizer
  state partitioned over data parallelism = Megatron's distributed optimizer).

Symbols: ``s`` sequence length, ``b`` micro-batch size, ``h`` hidden size, ``a`` attention
heads, ``t`` tensor-parallel degree, ``f`` FFN hidden size, ``e`` bytes per activation element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dfmodel.cli_format import fmt_bytes
from dfmodel.graph.fp8 import recipe_cost
from dfmodel.graph.workload import fc1_width_factor
from dfmodel.inter_chip.pipeline import warmup_forwards

Recompute = Literal["none", "selective", "full"]

#: Dropout masks are stored as one byte per element (Korthikanti et al. 2022, sec. 4.1).
DROPOUT_MASK_BYTES = 1


def _positive(**kw: float) -> None:
    for k, x in kw.items():
        if not x > 0:
            raise ValueError(f"{k} must be > 0, got {x}")


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    num_heads: int,
    tp: int,
    sequence_parallel: bool,
    recompute: Recompute,
    ffn_hidden: int | None = None,
    num_kv_heads: int | None = None,
    bytes_per_element: float = 2,
    dropout: bool = True,
    gated_mlp: bool = False,
    attention: Literal["flash", "unfused"] = "unfused",
    key_len: int | None = None,
    linear_input_bytes: float | None = None,
    head_dim: float | None = None,
    qk_norm: bool = False,
) -> float:
    """Activation bytes one transformer layer keeps per chip for one micro-batch (until its backward).

    ``head_dim`` (default ``h / a``): a head's width ``d``; Q and the attention output are
    ``a d`` wide (``h`` unless the model sets its own, Qwen3's 2h), K and V ``h_kv = kv d``.
    ``qk_norm``: the RMSNorms of Q and K (Megatron-Core ``qk_layernorm``) keep their inputs for
    their backward, a second Q and K (the attention keeps the normed ones).

    ``key_len`` (default ``seq_len``) is the number of keys each query attends to: with context
    parallelism a rank holds ``seq_len = s / cp`` queries against all ``s`` keys, so the
    ``s^2`` rows become ``s/cp * s``.

    Korthikanti et al. 2022, sec. 4.1 and Table 2, generalised term by term. With ``e`` bytes
    per element, ``h_kv = num_kv_heads * h / a`` (GQA/MQA), ``f = ffn_hidden`` (default ``4h``),
    dropout masks of 1 byte, the tensors saved for the backward pass are:

    ============================================  =================  ==========================
    tensor kept for backward                      bytes              divided by
    ============================================  =================  ==========================
    LayerNorm-1 input                             ``e s b h``        ``t`` only with SP
    QKV GEMM input (LayerNorm-1 output)           ``e s b h``        ``t`` only with SP
    Q                                             ``e s b h``        ``t``
    K and V                                       ``2 e s b h_kv``   ``t`` (each chip >= 1 head)
    softmax output (for its backward)             ``e a s^2 b``      ``t``; dropped by selective
    softmax dropout mask                          ``a s^2 b``        ``t``; dropped by selective
    dropout output (input of attention x V)       ``e a s^2 b``      ``t``; dropped by selective
    attention output (projection GEMM input)      ``e s b h``        ``t``
    attention dropout mask                        ``s b h``          ``t`` only with SP
    LayerNorm-2 input                             ``e s b h``        ``t`` only with SP
    FC1 input (LayerNorm-2 output)                ``e s b h``        ``t`` only with SP
    activation input (FC1 output; x2 if gated)    ``e s b f``        ``t``
    FC2 input (activation output)                 ``e s b f``        ``t``
    MLP dropout mask                              ``s b h``          ``t`` only with SP
    ============================================  =================  ==========================

    Without dropout the three dropout rows vanish and the softmax output itself is the input of
    attention x V (kept once). For GPT (``f = 4h``, ``h_kv = h``, ``e = 2``, dropout) this
    is Table 2: ``sbh(10 + 24/t + 5as/(ht))`` without SP, ``sbh/t(34 + 5as/h)`` with SP;
    selective recomputation drops the ``s^2`` rows (``sbh(10 + 24/t)``, ``34 sbh/t``).
    ``attention="flash"`` (FlashAttention: Dao et al. 2022, sec. 3.1) never stores them either,
    nor a dropout mask (it regenerates it from the RNG state); it keeps the fp32 row
    log-sum-exp, ``4 a s b / t`` bytes, and the attention output it already shares with the
    projection. Full recomputation keeps only the
    layer input, ``e s b h`` (``/t`` with SP); the one layer being recomputed during backward is
    a transient that Table 2 omits (see ``working_activation_bytes`` of :func:`memory_per_chip`).

    >>> s, b, h, a = 2048, 1, 12288, 96
    >>> activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=8,
    ...     sequence_parallel=True, recompute="selective") == s * b * h * 34 / 8
    True
    """
    _positive(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, num_heads=num_heads, tp=tp,
              bytes_per_element=bytes_per_element)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a, t, e = seq_len, micro_batch, hidden, num_heads, tp, bytes_per_element
    f = 4 * h if ffn_hidden is None else ffn_hidden
    kv = a if num_kv_heads is None else num_kv_heads
    _positive(ffn_hidden=f, num_kv_heads=kv)
    sp = t if sequence_parallel else 1  # divisor of the tensors TP replicates unless SP shards them
    sbh = s * b * h
    g = e if linear_input_bytes is None else linear_input_bytes  # saved linear-GEMM inputs
    if recompute == "full":
        return e * sbh / sp  # layer input only
    mask = DROPOUT_MASK_BYTES if dropout else 0
    # Replicated across the TP group unless sequence parallelism splits them along s.
    replicated = (
        e * sbh  # LayerNorm-1 input
        + g * sbh  # QKV GEMM input
        + mask * sbh  # attention dropout mask
        + e * sbh  # LayerNorm-2 input
        + g * sbh  # FC1 input
        + mask * sbh  # MLP dropout mask
    ) / sp
    d = h / a if head_dim is None else head_dim
    kv_heads_per_chip = max(kv / t, 1.0)  # with fewer KV heads than t, each chip keeps one
    sbad = s * b * a * d  # Q's and the attention output's elements (sbh unless d != h / a)
    sharded = (
        e * sbad / t  # Q
        + 2 * e * s * b * d * kv_heads_per_chip  # K and V
        + (e * sbad / t + e * s * b * d * kv_heads_per_chip if qk_norm else 0.0)  # Q and K before their norms
        + g * sbad / t  # attention output (projection GEMM input)
        + (2 if gated_mlp else 1) * e * s * b * f / t  # activation-function input (FC1 output)
        + g * s * b * f / t  # FC2 input
    )
    if attention == "flash":
        quadratic = 4.0 * a * s * b / t  # fp32 log-sum-exp per query row and head
    elif recompute == "selective":
        quadratic = 0.0
    else:
        per_score = e + (mask + e if dropout else 0)  # softmax out (+ mask + dropout out)
        quadratic = per_score * a * s * (s if key_len is None else key_len) * b / t
    return replicated + sharded + quadratic


def moe_mla_activation_delta_bytes(model, *, seq_len: int, micro_batch: int, tp: int, sequence_parallel: bool,
                                   bytes_per_element: float, recompute: str,
                                   linear_input_bytes: float | None = None, experts_gathered: bool = False) -> float:
    """What an MoE MLP and multi-head latent attention change in one layer's saved activations
    relative to :func:`activation_bytes_per_layer` (which counts a dense MLP of ``ffn_hidden``
    and ``h / a``-dim heads). 0 for a dense, standard-attention model or with full recompute.

    MoE (Megatron-Core moe_layer / experts; routed rows ``R = s b x top_k x capacity x
    imbalance``, expert width ``f_e``, expert TP = tp): the dense FC1/FC2 activations ``(2|1 + 1)
    e s b f / t`` become ``(2|1 + 1) e R f_e / t``; the permuted FC1 input ``e R h`` and the
    expert outputs kept for the router-probability gradient ``e R h`` (both ``/t`` with SP,
    as the dense FC1 input), and the fp32 top-k probabilities and int32 indices ``8 s b k``;
    with ``experts_gathered`` (expert TP = tp > 1) the permuted FC1 input is kept whole (``e R h``):
    Megatron-Core's dispatcher all-gathers the routed rows over TP and the expert linears, which do
    no TP communication of their own, save what they were given (TE ``Linear`` with ``is_expert``,
    ``explicit_expert_comm``; core_r0.9 token_dispatcher.py ``gather_from_sequence_parallel_region``);
    shared experts add a dense MLP of ``num_shared x f_e``. Megatron-Core's fine-grained
    recompute drops what it recomputes: ``moe.recompute_activation`` (``moe_act``) the routed
    FC2 input ``R f_e / t``, ``moe.recompute_norm`` (``layernorm``) the pre-MLP norm's output,
    counted as the dense table's FC1 input (``s b h``, ``/t`` with SP), and with MLA the input
    norm's as well (the dense table's QKV input).
    MLA (:mod:`dfmodel.graph.builders.mla`): Q, K, V and the attention output have ``a`` heads of
    ``qk_nope + qk_rope`` (Q, K) and ``v_head_dim`` (V, output) instead of ``h / a``; the latent
    ``e s b (q_lora + kv_lora + rope)`` (``/t`` with SP) is kept for the up projection's weight
    gradient.

    The tensors that are inputs of linear GEMMs (FC2's input, the permuted FC1 input, the
    attention output, the MLA latents) are kept at ``linear_input_bytes`` (FP8 training: 1 byte,
    as :func:`activation_bytes_per_layer` keeps the dense ones; default: ``bytes_per_element``),
    so the MoE / MLA change is counted in the same precisions as the dense tensors it replaces.
    """
    if recompute == "full":
        return 0.0
    s, b, t, e, h = seq_len, micro_batch, tp, bytes_per_element, model.hidden
    g = e if linear_input_bytes is None else linear_input_bytes  # saved linear-GEMM inputs
    sp = t if sequence_parallel else 1
    gated = fc1_width_factor(model.ffn_type)
    delta = 0.0
    moe = getattr(model, "moe", None)
    if moe is not None:
        rows = s * b * moe.routed_token_factor
        fe = moe.expert_ffn_hidden
        delta -= (gated * e + g) * s * b * model.ffn / t  # the dense FC1 outputs, FC2 input
        delta += (gated * e + g) * rows * fe / t
        if moe.num_experts > 1 or moe.num_shared_experts:  # routing (one expert: the identity)
            fc1_in = g * rows * h / (1 if experts_gathered else sp)  # permuted FC1 input
            delta += fc1_in + e * rows * h / sp + 8 * s * b * moe.top_k  # expert outputs, probs and indices
        delta += (gated * e + g) * s * b * moe.num_shared_experts * fe / t
        if getattr(moe, "recompute_activation", False):  # the routed experts' FC2 input, recomputed in the backward
            delta -= g * rows * fe / t
        if getattr(moe, "recompute_norm", False):  # the pre-MLP norm's output (what the dense table counts as FC1 input)
            delta -= g * s * b * h / sp
    mla = getattr(model, "mla", None)
    if mla is not None:
        a, kv = model.num_heads, model.kv_heads
        dense = (e + g) * s * b * h / t + 2 * e * s * b * (h / a) * max(kv / t, 1.0)  # Q, output; K and V
        # Q, K, V at the activation precision, the output (projection input) as a linear input
        latent = s * b * a * (e * (2 * mla.qk_head_dim + mla.v_head_dim) + g * mla.v_head_dim) / t
        delta += latent - dense + g * s * b * mla.latent_out / sp
        if getattr(mla, "recompute_up_proj", False):  # Q, K, V discarded, recomputed from the latents
            delta -= s * b * a * e * (2 * mla.qk_head_dim + mla.v_head_dim) / t
        if getattr(moe, "recompute_norm", False):  # MLA's input norm is a module of its own: its output too
            delta -= g * s * b * h / sp
    return delta


def embedding_activation_bytes(
    *, seq_len: int, micro_batch: int, hidden: int, tp: int, sequence_parallel: bool, dropout: bool = True
) -> float:
    """Activation bytes of the input embedding per micro-batch: its dropout mask, ``sbh`` bytes.

    Korthikanti et al. 2022, sec. 4.3 (``sbhp/t`` for ``p`` micro-batches in flight with SP).
    Held by the first pipeline stage, once per in-flight micro-batch.

    >>> embedding_activation_bytes(seq_len=2048, micro_batch=1, hidden=1024, tp=4, sequence_parallel=True)
    524288.0
    """
    _positive(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, tp=tp)
    if not dropout:
        return 0.0
    return DROPOUT_MASK_BYTES * seq_len * micro_batch * hidden / (tp if sequence_parallel else 1)


def head_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    vocab: int,
    tp: int,
    sequence_parallel: bool,
    bytes_per_element: float = 2,
    logits_bytes_per_element: float = 4,
) -> float:
    """Activation bytes of the output layer per micro-batch (final LayerNorm, LM head, loss).

    Korthikanti et al. 2022, sec. 4.3: final LayerNorm input ``e sbh`` and LM-head GEMM input
    ``e sbh`` (both ``/t`` with SP), and the fp32 logits kept by the cross entropy, ``4 sbv/t``
    (vocabulary-parallel head). GPT with SP: ``4sbh/t (1 + v/h)``. Held by the last stage.

    >>> s, b, h, v, t = 2048, 1, 1024, 51200, 4
    >>> head_activation_bytes(seq_len=s, micro_batch=b, hidden=h, vocab=v, tp=t,
    ...                       sequence_parallel=True) == 4 * s * b * h / t * (1 + v / h)
    True
    """
    _positive(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, vocab=vocab, tp=tp)
    sbh = seq_len * micro_batch * hidden
    sp = tp if sequence_parallel else 1
    return (
        2 * bytes_per_element * sbh / sp  # final LayerNorm input + LM-head GEMM input
        + logits_bytes_per_element * seq_len * micro_batch * vocab / tp  # fp32 logits
    )


def in_flight_micro_batches(pp: int, stage: int, num_micro_batches: int, interleave: int = 1) -> float:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak under 1F1B.

    Counted in units of "one micro-batch through all of this stage's layers".

    - 1F1B (PipeDream-Flush; Narayanan et al. SC21 sec. 2.2.1): ``min(pp - stage, m)``. The
      stage runs ``pp - stage - 1`` warm-up forwards and one more before its first backward.
    - Interleaved 1F1B with ``v`` chunks (Narayanan et al. SC21 sec. 2.2.2; Megatron-LM's
      warm-up ``2(pp - stage - 1) + (v - 1) pp`` chunk-forwards): ``min(warm-up + 1, m v) / v``.
      For the first stage this is ``pp + (pp - 1)/v = pp (1 + (pp - 1)/(pp v))``, the factor of
      Korthikanti et al. 2022 sec. 4.2.3. Interleaving never lowers any stage's count.

    The simulator of :mod:`dfmodel.inter_chip.pipeline` reproduces these peaks (tested).

    >>> in_flight_micro_batches(4, 0, 16), in_flight_micro_batches(4, 3, 16)
    (4.0, 1.0)
    >>> in_flight_micro_batches(4, 0, 16, interleave=2)  # 4 * (1 + 3/8)
    5.5
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    v = interleave
    held = min(warmup_forwards(pp, stage, num_micro_batches, v) + 1, num_micro_batches * v)
    return held / v


# --------------------------------------------------------------------------------------------
# Model state and the per-chip breakdown
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """Bytes of parameters, gradients and optimizer state on one chip."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def model_state_bytes(
    params_per_chip: float,
    *,
    dp: int,
    distributed_optimizer: bool,
    bytes_per_param_weights: float = 2,
    bytes_per_param_grads: float = 2,
    bytes_per_param_optimizer: float = 12,
    zero_stage: int | None = None,
) -> ModelState:
    """Weights, gradients and optimizer state of ``params_per_chip`` parameters.

    ``zero_stage`` (when given, it replaces ``distributed_optimizer``): ZeRO (Rajbhandari et al.
    2020, sec. 5.1-5.3) shards over the ``dp`` ranks the optimizer state (stage >= 1), the
    gradients (>= 2) and the weights (3).

    Mixed-precision Adam (Rajbhandari et al., ZeRO, SC 2020, sec. 3.1): 16-bit weights (2) and
    gradients (2) plus fp32 master weights, momentum and variance (12): 16 bytes/param. The
    distributed optimizer (Megatron-LM; ZeRO stage 1, P_os, sec. 5.1) shards the optimizer
    bytes over the ``dp`` data-parallel replicas: ``2 + 2 + 12/dp``. Megatron-LM with bf16
    keeps fp32 gradient buffers: pass ``bytes_per_param_grads=4`` (18 bytes/param unsharded).

    >>> model_state_bytes(1e9, dp=8, distributed_optimizer=False).total_bytes / 1e9
    16.0
    >>> model_state_bytes(1e9, dp=8, distributed_optimizer=True).total_bytes / 1e9
    5.5
    """
    if params_per_chip < 0:
        raise ValueError(f"params_per_chip must be >= 0, got {params_per_chip}")
    shards = state_shards(dp=dp, distributed_optimizer=distributed_optimizer, zero_stage=zero_stage)
    return sharded_state(params_per_chip, shards, bytes_per_param_weights, bytes_per_param_grads,
                         bytes_per_param_optimizer)


def state_shards(*, dp: int, distributed_optimizer: bool, zero_stage: int | None = None) -> tuple[int, int, int]:
    """How many ways (weights, gradients, optimizer state) are sharded: ZeRO stage >= 1 shards
    the optimizer over the ``dp`` ranks, >= 2 the gradients, 3 the weights (Rajbhandari et al.
    2020, sec. 5.1-5.3; :func:`model_state_bytes`).

    >>> state_shards(dp=8, distributed_optimizer=False, zero_stage=2)
    (1, 8, 8)
    """
    _positive(dp=dp)
    stage = (1 if distributed_optimizer else 0) if zero_stage is None else zero_stage
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    return (dp if stage >= 3 else 1, dp if stage >= 2 else 1, dp if stage >= 1 else 1)


def sharded_state(params: float, shards: tuple[int, int, int], bytes_per_param_weights: float,
                  bytes_per_param_grads: float, bytes_per_param_optimizer: float) -> ModelState:
    """:func:`model_state_bytes` of ``params`` parameters with the shard counts of
    :func:`state_shards` (computed once by a caller that asks for many parameter counts)."""
    return ModelState(*sharded_bytes(params, shards, (bytes_per_param_weights, bytes_per_param_grads,
                                                      bytes_per_param_optimizer)))


def sharded_bytes(params: float, shards: tuple[int, int, int], bytes_per_param: tuple[float, float, float]
                  ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of ``params`` parameters at ``bytes_per_param`` each,
    over the shard counts of :func:`state_shards`: :func:`sharded_state` without building a
    :class:`ModelState` (the memory screen asks it ~750k times a search).

    >>> sharded_bytes(10.0, (1, 2, 4), (2.0, 4.0, 8.0))
    (20.0, 20.0, 20.0)
    """
    return (params * bytes_per_param[0] / shards[0], params * bytes_per_param[1] / shards[1],
            params * bytes_per_param[2] / shards[2])


@dataclass
class MemoryBreakdown:
    """Memory one chip needs, by kind, against its capacity (bytes).

    ``labels`` renames kinds in messages (HPL books its local matrix as ``weights``).

    >>> m = MemoryBreakdown(2e9, 2e9, 12e9, 70e9, capacity_bytes=80e9)
    >>> m.fits, m.shortfall_bytes / 1e9
    (False, 6.0)
    """

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    capacity_bytes: float
    labels: dict[str, str] = field(default_factory=dict)
    reserve_bytes: float = 0.0  # runtime, communication buffers, workspaces, fragmentation
    # state offloaded to host DRAM per chip, and the chip's share of its host's usable DRAM
    # (dfmodel.inter_chip.offload); None: no host tier in use
    host_bytes: float = 0.0
    host_capacity_bytes: float | None = None

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes
                + self.reserve_bytes)

    @property
    def host_fits(self) -> bool:
        return self.host_capacity_bytes is None or self.host_bytes <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes and self.host_fits

    @property
    def shortfall_bytes(self) -> float:
        """How much more memory the chip would need (0 when it fits)."""
        return max(0.0, self.total_bytes - self.capacity_bytes)

    def to_dict(self) -> dict[str, float]:
        """Keys as in the Result JSON: weights, gradients, optimizer, activations, total, capacity."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "total": self.total_bytes,
            "capacity": self.capacity_bytes,
            "reserve": self.reserve_bytes,
            **({"host": self.host_bytes, "host_capacity": self.host_capacity_bytes}
               if self.host_capacity_bytes is not None else {}),
        }

    def summary(self) -> str:
        """One line for an infeasibility message: what is needed, by kind, against capacity.

        >>> MemoryBreakdown(2**30, 2**30, 0, 3 * 2**30, 4 * 2**30).summary()
        'needs 5.0 GiB per chip (weights 1.0, gradients 1.0, activations 3.0), a chip has 4.0 GiB, short by 1 GiB'
        """
        g = 2.0**30
        parts = [
            f"{self.labels.get(kind, kind)} {getattr(self, kind + '_bytes') / g:.1f}"
            for kind in ("weights", "gradients", "optimizer", "activations", "reserve")
            if getattr(self, kind + "_bytes") > 0
        ]
        s = (f"needs {self.total_bytes / g:.1f} GiB per chip ({', '.join(parts) or 'nothing'}), "
             f"a chip has {self.capacity_bytes / g:.1f} GiB")
        s += f", short by {fmt_bytes(self.shortfall_bytes)}" if self.shortfall_bytes > 0 else ""
        if not self.host_fits:
            s += (f"; offloaded state needs {self.host_bytes / g:.1f} GiB of host memory per chip, its share "
                  f"of the host is {self.host_capacity_bytes / g:.1f} GiB")
        return s


def memory_per_chip(
    *,
    params_per_chip: float,
    dp: int,
    distributed_optimizer: bool,
    activation_bytes_per_layer: float,
    layers_on_chip: float,
    in_flight_micro_batches: float,
    capacity_bytes: float,
    extra_params: float = 0.0,
    extra_activation_bytes_per_micro_batch: float = 0.0,
    working_activation_bytes: float = 0.0,
    bytes_per_param_weights: float = 2,
    bytes_per_param_grads: float = 2,
    bytes_per_param_optimizer: float = 12,
    zero_stage: int | None = None,
) -> MemoryBreakdown:
    """Assemble one chip's memory: model state plus activations of the micro-batches in flight.

    ``activations = (activation_bytes_per_layer * layers_on_chip
    + extra_activation_bytes_per_micro_batch) * in_flight_micro_batches + working_activation_bytes``

    (Korthikanti et al. 2022, sec. 4.2.3 and 4.3). ``params_per_chip`` are this chip's layer
    parameters (already divided by TP); ``extra_params`` the embedding / LM-head parameters it
    holds (first / last stage); ``extra_activation_bytes_per_micro_batch`` the embedding
    (:func:`embedding_activation_bytes`) or head (:func:`head_activation_bytes`) activations.
    ``working_activation_bytes`` is an optional transient, e.g. the one layer being recomputed
    under full recomputation (Table 2 omits it; the lead decides whether to count it).

    >>> m = memory_per_chip(params_per_chip=1e9, dp=1, distributed_optimizer=False,
    ...                     activation_bytes_per_layer=1e8, layers_on_chip=10,
    ...                     in_flight_micro_batches=4, capacity_bytes=80e9)
    >>> m.total_bytes / 1e9, m.fits
    (20.0, True)
    """
    if min(activation_bytes_per_layer, layers_on_chip, in_flight_micro_batches, extra_params,
           extra_activation_bytes_per_micro_batch, working_activation_bytes) < 0:
        raise ValueError("memory_per_chip: sizes and counts must be >= 0")
    state = model_state_bytes(
        params_per_chip + extra_params,
        dp=dp,
        distributed_optimizer=distributed_optimizer,
        bytes_per_param_weights=bytes_per_param_weights,
        bytes_per_param_grads=bytes_per_param_grads,
        bytes_per_param_optimizer=bytes_per_param_optimizer,
        zero_stage=zero_stage,
    )
    activations = (
        activation_bytes_per_layer * layers_on_chip + extra_activation_bytes_per_micro_batch
    ) * in_flight_micro_batches + working_activation_bytes
    return MemoryBreakdown(
        weights_bytes=state.weights_bytes,
        gradients_bytes=state.gradients_bytes,
        optimizer_bytes=state.optimizer_bytes,
        activations_bytes=activations,
        capacity_bytes=float(capacity_bytes),
    )


# --------------------------------------------------------------------------------------------
# Lower bound for pruning the search
# --------------------------------------------------------------------------------------------


def _least_state_bytes(params: float, dp: int, zero_stage: int | None, bytes_per_param_weights: float,
                       bytes_per_param_grads: float, bytes_per_param_optimizer: float) -> float:
    """Model-state bytes of ``params`` under the least sharding any mapping may choose: the
    distributed optimizer at least (ZeRO stage >= 1), the given stage when it is fixed. The one
    state term of the memory floors below."""
    return model_state_bytes(
        params, dp=dp, distributed_optimizer=True,
        zero_stage=None if zero_stage is None else max(zero_stage, 1),
        bytes_per_param_weights=bytes_per_param_weights, bytes_per_param_grads=bytes_per_param_grads,
        bytes_per_param_optimizer=bytes_per_param_optimizer,
    ).total_bytes


def memory_lower_bound_bytes(
    *,
    num_layers: int,
    params_per_layer: float,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    tp: int,
    pp: int,
    dp: int,
    num_micro_batches: int,
    bytes_per_element: float = 2,
    bytes_per_param_weights: float = 2,
    bytes_per_param_grads: float = 2,
    bytes_per_param_optimizer: float = 12,
    zero_stage: int | None = None,
) -> float:
    """A lower bound on the peak memory per chip of any mapping with these (tp, pp, dp, b, m).

    ``zero_stage`` given: the model state is sharded as that stage does (stage >= 1 as the
    distributed optimizer below; stage 3 also weights and gradients).

    Valid for every recompute / sequence-parallel / optimizer-sharding choice, every layer split
    over stages and every interleaving: it takes the least memory of each choice (full
    recomputation with SP, ``e s b h / t`` per layer and micro-batch; distributed optimizer),
    per-chip parameters ``params_per_layer / tp`` per layer (replicated parameters such as
    LayerNorms only add), no embedding or head, and plain 1F1B in-flight counts
    ``f_i = min(pp - i, m)`` (interleaving only raises them). With ``w`` model-state and ``a``
    activation bytes per layer, stage ``i`` holding ``l_i`` layers needs ``l_i (w + a f_i)``; the
    smallest possible maximum over stages, over real ``l_i >= 0`` summing to ``L``, equalises
    them: ``L / sum_i 1 / (w + a f_i)``. If this exceeds the capacity, the configuration can
    never fit.

    >>> # one stage holds both layers: 2 * (10 params * 16 B + 2 B of layer input)
    >>> memory_lower_bound_bytes(num_layers=2, params_per_layer=10, seq_len=1, micro_batch=1,
    ...     hidden=1, tp=1, pp=1, dp=1, num_micro_batches=1)
    324.0
    """
    _positive(num_layers=num_layers, seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, tp=tp,
              pp=pp, dp=dp, num_micro_batches=num_micro_batches)
    w = _least_state_bytes(params_per_layer / tp, dp, zero_stage, bytes_per_param_weights,
                           bytes_per_param_grads, bytes_per_param_optimizer)
    a = bytes_per_element * seq_len * micro_batch * hidden / tp  # full recompute + SP
    if w <= 0 and a <= 0:  # everything per layer offloaded (dfmodel.inter_chip.offload): no floor
        return 0.0
    inv = sum(1.0 / (w + a * min(pp - i, num_micro_batches)) for i in range(pp))
    return num_layers / inv


def mean_stage_floor_bytes(
    *,
    layer_params: float,
    expert_params: float,
    num_layers: int,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    tp: int,
    pp: int,
    dp: int,
    expert_dp: int,
    bytes_per_element: float = 2,
    bytes_per_param_weights: float = 2,
    bytes_per_param_grads: float = 2,
    bytes_per_param_optimizer: float = 12,
    zero_stage: int | None = None,
) -> float:
    """A lower bound on the worst stage's memory per chip from the whole model's state: the worst
    stage holds at least the mean over the ``pp`` stages, and the stages together hold every
    layer once -- ``layer_params`` non-expert parameters split ``tp`` ways with their state
    sharded over ``dp`` (the dp x cp ranks), ``expert_params`` MoE expert parameters (already
    split over the expert-parallel and TP ranks) with their state sharded over ``expert_dp``
    (Megatron-Core's expert data-parallel group, as :func:`llm_memory_per_chip` counts them) --
    and each layer at least one micro-batch's least activations (full recompute + SP, ``e s b h
    / tp``; in flight ``min(pp - i, m) >= 1``). Sharding as in :func:`memory_lower_bound_bytes`
    (the distributed optimizer at least). Unlike that bound it does not take every layer at the
    lightest kind: for an MoE model with dense layers (DeepSeek-V3: 3 of 61) and experts whose
    state is sharded over fewer ranks it is the tighter one; for a dense model it is never above
    it (``L / sum 1/x_i >= L min x_i / pp``).

    >>> # 2 layers of 10 params (16 B each) + 2 B of activations, over 2 stages
    >>> mean_stage_floor_bytes(layer_params=20, expert_params=0, num_layers=2, seq_len=1,
    ...     micro_batch=1, hidden=1, tp=1, pp=2, dp=1, expert_dp=1)
    162.0
    """
    _positive(num_layers=num_layers, tp=tp, pp=pp, dp=dp, expert_dp=expert_dp)
    per_param = (bytes_per_param_weights, bytes_per_param_grads, bytes_per_param_optimizer)
    state = (_least_state_bytes(layer_params / tp, dp, zero_stage, *per_param)
             + _least_state_bytes(expert_params, expert_dp, zero_stage, *per_param))
    act = bytes_per_element * seq_len * micro_batch * hidden / tp * num_layers
    return (state + act) / pp


# --------------------------------------------------------------------------------------------
# LLM training as the frameworks lay it out (Megatron-LM / Transformer Engine)
# --------------------------------------------------------------------------------------------

#: Token ids held per token for the embedding's backward: int64 (Megatron-LM
#: theoretical_memory_usage.py, "Input to embedding": ``8 s b`` per micro-batch in flight).
TOKEN_ID_BYTES = 8

#: Optimizer state per parameter besides the fp32 master copy: Adam's two fp32 moments (8);
#: SGD's fp32 momentum (4); Adagrad's fp32 accumulator (4).
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 4, "adagrad": 4}

#: Transformer Engine keeps, next to each 16-bit linear weight, its FP8 copy and the FP8
#: transpose the data-gradient GEMM reads (1 + 1 bytes/param), cached across micro-batches
#: (TE Linear ``is_first_microbatch``); with FP8 parameters (``fp8_model_init``) the weight is the
#: FP8 copy and only the transpose is extra. Delayed / current scaling; the block-scaled recipes
#: add their scales to each copy (:func:`fp8_weight_cache_bytes`).
FP8_WEIGHT_CACHE_BYTES = 2


def fp8_weight_cache_bytes(recipe: str = "delayed") -> float:
    """Bytes per parameter of the two cached FP8 copies of a linear weight (row-wise, and the
    transpose or column-wise copy) under FP8 ``recipe``, scales included
    (:data:`dfmodel.graph.fp8.RECIPES` ``weight_copy_bytes``: MXFP8 adds one E8M0 scale per 32).

    >>> fp8_weight_cache_bytes(), fp8_weight_cache_bytes("mxfp8")
    (2.0, 2.0625)
    """
    return FP8_WEIGHT_CACHE_BYTES * recipe_cost(recipe).weight_copy_bytes


@dataclass(frozen=True)
class StateBytesPerParam:
    """Bytes per parameter of model weights, main gradients and optimizer state (incl. master)."""

    weights: float
    gradients: float
    optimizer: float

    @classmethod
    def of_training(cls, training, linear: bool = True) -> "StateBytesPerParam":
        """:meth:`of` with every field a workload's ``training`` sets (its precision, gradient
        bytes, optimizer and its state dtype, FP8 weights and recipe, parameter remainders)."""
        p = training.precision.value
        return cls.of(precision=p, grad_bytes=training.grad_bytes, optimizer=training.optimizer,
                      fp8_weights=p == "fp8" and training.fp8.fp8_weights, linear=linear,
                      param_remainders=getattr(training, "param_remainders", False), fp8_recipe=training.fp8.recipe,
                      optimizer_dtype=getattr(training, "optimizer_dtype", "fp32"))

    @classmethod
    def of(cls, *, precision: str, grad_bytes: float, optimizer: str = "adam", fp8_weights: bool = False,
           linear: bool = True, param_remainders: bool = False, fp8_recipe: str = "delayed",
           optimizer_dtype: str = "fp32") -> "StateBytesPerParam":
        """Megatron-LM's mixed-precision layout (theoretical_memory_usage.py: "bf16 model params,
        fp32 main gradients, fp32 main params, and fp32 Adam states", 18 bytes/param, or
        ``6 + 12/d`` with the distributed optimizer).

        16-bit weights (2; fp32 training: 4) plus, for FP8 linear layers, the FP8 weight cache;
        main gradients of ``grad_bytes``; optimizer: an fp32 master copy when the weights are not
        fp32 (4) plus the optimizer's own state.

        >>> StateBytesPerParam.of(precision="bf16", grad_bytes=4)
        StateBytesPerParam(weights=2, gradients=4, optimizer=12)
        >>> StateBytesPerParam.of(precision="fp8", grad_bytes=4).weights
        4.0

        ``param_remainders`` (Apex DistributedFusedAdam ``store_param_remainders``, NeMo 1.x with
        bf16 weights): the master copy is the 16-bit weight plus a 16-bit remainder, 2 bytes.

        >>> StateBytesPerParam.of(precision="bf16", grad_bytes=2, param_remainders=True).optimizer
        10

        ``optimizer_dtype`` bf16 (Apex DistributedFusedAdam ``dtype``, NeMo 1.x ``optim.dtype: bf16``):
        the optimizer's state in bf16, and with 16-bit weights no master copy at all (NeMo v2.0.0
        megatron_base_model.py ``setup_optimization``: ``store_params = False`` when the optimizer
        dtype is the model's), but FP8-only weights keep a bf16 one (``fp8_params``: ``store_params``).

        >>> StateBytesPerParam.of(precision="bf16", grad_bytes=2, optimizer_dtype="bf16").optimizer
        4.0
        """
        weights = 4 if precision == "fp32" else 2
        if precision == "fp8" and linear:
            cache = fp8_weight_cache_bytes(fp8_recipe)
            weights = cache if fp8_weights else weights + cache
        if optimizer_dtype == "bf16":
            master = 2 if precision == "fp8" and fp8_weights and linear else 0
            return cls(weights, grad_bytes, master + OPTIMIZER_STATE_BYTES[optimizer] / 2)
        master = 0 if precision == "fp32" else (REMAINDER_BYTES if param_remainders else 4)
        return cls(weights, grad_bytes, master + OPTIMIZER_STATE_BYTES[optimizer])


#: The low 16 bits of an fp32 master weight whose high 16 bits are the bf16 model weight (Apex
#: ``DistributedFusedAdam(store_param_remainders=True)``).
REMAINDER_BYTES = 2

#: Bytes of a saved linear-GEMM input in FP8 training: TE keeps the FP8 (E4M3) cast of the
#: forward GEMM's input for the FP8 weight-gradient GEMM (see :func:`activation_bytes_per_layer`).
FP8_SAVED_INPUT_BYTES = 1


def fp8_linear_input_bytes(training) -> float | None:
    """Element size of the saved linear-GEMM inputs: 1 byte in FP8 training (TE's default
    ``DelayedScaling`` runs the weight-gradient GEMM in FP8, ``override_linear_precision =
    (False, False, False)``), else None (the activation precision).

    >>> from types import SimpleNamespace as N
    >>> fp8_linear_input_bytes(N(precision=N(value="fp8"))), fp8_linear_input_bytes(N(precision=N(value="bf16")))
    (1.0, None)

    Block-scaled recipes keep the copy's scales too (MXFP8: one byte per 32 elements).
    """
    if training.precision.value != "fp8":
        return None
    fp8 = getattr(training, "fp8", None)
    return FP8_SAVED_INPUT_BYTES * recipe_cost(fp8.recipe if fp8 is not None else "delayed").copy_bytes


def tied_embedding_copy_params(*, vocab: int, hidden: int, tp: int, pp: int, tie_embeddings: bool) -> float:
    """Parameters of the word-embedding copy the last pipeline stage holds for a tied LM head.

    Megatron-LM keeps the output layer's weight on the last stage as its own copy of the
    (vocabulary-parallel) word embeddings and all-reduces the two copies' gradients between the
    first and last stage (``shared_embedding_or_output_weight``). With one stage, or untied
    embeddings (the head owns its parameters), there is no copy.

    >>> tied_embedding_copy_params(vocab=1000, hidden=64, tp=4, pp=2, tie_embeddings=True)
    16000.0
    """
    return vocab * hidden / tp if (tie_embeddings and pp > 1 and vocab > 0) else 0.0


def llm_layer_activation_bytes(*, model, training, attention: str, tp: int, cp: int, micro_batch: int,
                               sequence_parallel: bool, recompute: Recompute, experts_gathered: bool = False) -> float:
    """Activation bytes one decoder layer of ``model`` saves per chip and micro-batch:
    :func:`activation_bytes_per_layer` with the workload's shape (cp rank: ``s / cp`` queries
    against all ``s`` keys; SwiGLU, FlashAttention, dropout, FP8 saved inputs) plus the MoE / MLA
    change (:func:`moe_mla_activation_delta_bytes`, with ``experts_gathered``)."""
    m, e, s_local = model, training.activation_bytes, model.seq_len // cp
    common = dict(seq_len=s_local, key_len=m.seq_len if cp > 1 else None, micro_batch=micro_batch, hidden=m.hidden,
                  num_heads=m.num_heads, tp=tp, sequence_parallel=sequence_parallel, ffn_hidden=m.ffn,
                  num_kv_heads=m.kv_heads, bytes_per_element=e, dropout=getattr(m, "dropout", True),
                  gated_mlp=fc1_width_factor(m.ffn_type) == 2, attention=attention,
                  linear_input_bytes=fp8_linear_input_bytes(training), head_dim=m.head_width,
                  qk_norm=getattr(m, "qk_norm", False))
    return activation_bytes_per_layer(recompute=recompute, **common) + moe_mla_activation_delta_bytes(
        m, seq_len=s_local, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel, bytes_per_element=e,
        recompute=recompute, linear_input_bytes=common["linear_input_bytes"], experts_gathered=experts_gathered)


class _StageSetup:
    """What :func:`llm_memory_per_chip` reads of a mapping's knobs alone, not of its layer split or
    parameter counts: per-layer activations, bytes per parameter, shard counts, the embedding's
    and head's activations, micro-batches in flight per stage. The search asks the memory of
    tens of thousands of splits of a few thousand knob settings (DeepSeek-V3 on 512 H100s: 78k
    calls), so these are computed once per setting (kept in the caller's ``act_memo``)."""

    def __init__(self, model, training, attention, tp, pp, dp, micro_batch, num_micro_batches, interleave,
                 recompute, sequence_parallel, distributed_optimizer, cp, zero_stage, ep, experts_gathered,
                 act_memo):
        m = model
        self._args = (model, training, attention, tp, cp, micro_batch, sequence_parallel, experts_gathered)
        self._act_memo = act_memo if act_memo is not None else {}
        self._in_flight = (pp, num_micro_batches, interleave, {})
        self.e = e = training.activation_bytes
        s_local = m.seq_len // cp
        self.act_layer = self.layer_act(False, recompute)
        layer_state = StateBytesPerParam.of_training(training, linear=True)
        other_state = StateBytesPerParam.of_training(training, linear=False)
        sbt = s_local * micro_batch
        self.emb_act = TOKEN_ID_BYTES * sbt + embedding_activation_bytes(
            seq_len=s_local, micro_batch=micro_batch, hidden=m.hidden, tp=tp, sequence_parallel=sequence_parallel,
            dropout=getattr(m, "dropout", True))
        self.head_act = head_activation_bytes(seq_len=s_local, micro_batch=micro_batch, hidden=m.hidden,
                                              vocab=m.vocab_size, tp=tp, sequence_parallel=sequence_parallel,
                                              bytes_per_element=e) if m.vocab_size else 0.0
        self.shards = state_shards(dp=dp, distributed_optimizer=distributed_optimizer, zero_stage=zero_stage)
        self.expert_shards = state_shards(dp=max(1, dp // ep), distributed_optimizer=distributed_optimizer,
                                          zero_stage=zero_stage)
        self.layer_bytes = (layer_state.weights, layer_state.gradients, layer_state.optimizer)
        self.other_bytes = (other_state.weights, other_state.gradients, other_state.optimizer)

    def layer_act(self, dense: bool, rc) -> float:
        """:func:`llm_layer_activation_bytes` of a dense or MoE layer at recompute ``rc``."""
        model, training, attention, t, cp, micro_batch, sequence_parallel, experts_gathered = self._args
        key = (dense, attention, t, cp, micro_batch, sequence_parallel, rc, experts_gathered)
        memo = self._act_memo
        if key not in memo:
            memo[key] = llm_layer_activation_bytes(
                model=model.model_copy(update={"moe": None}) if dense else model, training=training,
                attention=attention, tp=t, cp=cp, micro_batch=micro_batch, sequence_parallel=sequence_parallel,
                recompute=rc, experts_gathered=experts_gathered)
        return memo[key]

    def in_flight(self, stage: int) -> float:
        """:func:`in_flight_micro_batches` of ``stage``."""
        pp, m, v, memo = self._in_flight
        if stage not in memo:
            memo[stage] = in_flight_micro_batches(pp, stage, m, v)
        return memo[stage]


def llm_memory_per_chip(
    *,
    model,
    training,
    attention: str,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    num_micro_batches: int,
    interleave: int,
    recompute: Recompute,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    layer_params_per_chip: float,
    first_params: float,
    last_params: float,
    layers_per_stage: list[int],
    capacity_bytes: float,
    reserve_bytes: float = 0.0,
    cp: int = 1,
    zero_stage: int | None = None,
    layer_expert_params_per_chip: float = 0.0,
    ep: int = 1,
    dense_layers_per_stage: list[int] | None = None,
    dense_layer_params_per_chip: float = 0.0,
    offload=None,
    act_memo: dict | None = None,
    experts_gathered: bool = False,
) -> MemoryBreakdown:
    """The worst stage's memory per chip of LLM training, every term wired as Megatron lays it out.

    With context parallelism a rank keeps the activations of ``s / cp`` tokens against all
    ``s`` keys (``key_len``); ``dp`` is then the dp x cp ranks that share weights and shard the
    optimizer (Megatron-Core). ``zero_stage`` (when given, it replaces
    ``distributed_optimizer``) shards the state as ZeRO does; stage 3 also holds, unsharded, the
    16-bit weights of the layer running and of the one prefetched and one layer's gradients
    until their reduce-scatter (PyTorch FSDP ``FULL_SHARD`` with backward prefetch): ``3 P_layer``.

    - model state per parameter from :class:`StateBytesPerParam` (fp32 main gradients,
      optimizer sharded over ``dp`` with the distributed optimizer); the layer parameters of an
      FP8 run also hold the FP8 weight cache; ``first_params`` / ``last_params`` are the
      embedding / head (and tied-copy) parameters of the first / last stage;
    - activations per layer (:func:`llm_layer_activation_bytes`: SwiGLU's two FC1 outputs,
      FlashAttention's absence of ``s^2`` tensors, dropout masks only with dropout), times the
      micro-batches the stage holds (:func:`in_flight_micro_batches`); the first stage adds the
      embedding activations (token ids, dropout mask: :func:`embedding_activation_bytes`), the
      last the head's (fp32 logits: :func:`head_activation_bytes`);
    - with full recomputation, the one layer whose activations are rebuilt during its backward
      (the working buffer Table 2 of Korthikanti et al. omits);
    - the chip's ``reserve_bytes`` (runtime and library memory the model cannot use).

    An MoE model's dense layers (``moe.first_dense_layers``; DeepSeek-V3: 3) are counted apart:
    ``layers_per_stage`` are then the MoE layers, ``dense_layers_per_stage`` the dense ones, each
    with ``dense_layer_params_per_chip`` parameters (no experts) and a dense MLP's activations.

    ``act_memo``: a dict the caller keeps per (model, training) in which the per-layer
    activation bytes are memoised (the search asks for the same layer shapes many times).
    """
    knobs = (attention, tp, pp, dp, micro_batch, num_micro_batches, interleave, recompute, sequence_parallel,
             distributed_optimizer, cp, zero_stage, ep, experts_gathered)
    setup = act_memo.get(("stage setup",) + knobs) if act_memo is not None else None
    if setup is None:
        setup = _StageSetup(model, training, *knobs, act_memo=act_memo)
        if act_memo is not None:
            act_memo[("stage setup",) + knobs] = setup
    act_layer, e, emb_act, head_act = setup.act_layer, setup.e, setup.emb_act, setup.head_act
    shards, expert_shards, layer_bytes, other_bytes = setup.shards, setup.expert_shards, setup.layer_bytes, setup.other_bytes

    def working_of(dense: bool, params):
        """One layer's working buffer: its activations rebuilt under full recompute, ZeRO-3's gathers."""
        return ((setup.layer_act(dense, "none") if recompute == "full" else 0.0)
                + (3 * params * e if zero_stage == 3 else 0.0))

    working_moe = working_of(False, layer_params_per_chip)
    dense_n = dense_layers_per_stage or [0] * len(layers_per_stage)
    act_dense = working_dense = 0.0
    has_dense = any(dense_n)
    if has_dense:  # (an MoE model's dense layers: the model without its moe block)
        act_dense, working_dense = setup.layer_act(True, recompute), working_of(True, dense_layer_params_per_chip)
    worst, host = None, 0.0
    capacity, reserve = float(capacity_bytes), float(reserve_bytes)
    # stages alike in what the terms read (layers, dense layers, the ends' extras and, when it
    # multiplies anything, the micro-batches in flight) have the same breakdown: computed once
    # (a search's memory floors put all layers on one stage of up to ~100: the rest are alike)
    seen: set = set()
    seen_middle: set = set()
    for stage, layers in enumerate(layers_per_stage):
        dense = dense_n[stage]
        if 0 < stage < pp - 1:
            # a middle stage with the same layers as an earlier middle stage holds the same state
            # and no more micro-batches in flight (in_flight_micro_batches never grows with the
            # stage): it cannot be the (first) worst, so it is skipped -- the answer is the same.
            # With offload too: its chip and host bytes (offload.stage_memory) only grow with the
            # activations in flight, so it cannot raise the host's maximum either
            if (layers, dense) in seen_middle:
                continue
            seen_middle.add((layers, dense))
        extra_params = (first_params if stage == 0 else 0.0) + (last_params if stage == pp - 1 else 0.0)
        extra_act = (emb_act if stage == 0 else 0.0) + (head_act if stage == pp - 1 else 0.0)
        alike = (layers, dense, extra_params, extra_act,
                 setup.in_flight(stage) if layers or dense or extra_act else None)  # (offload moves only layers' activations)
        if alike in seen:
            continue
        seen.add(alike)
        # the largest working buffer among the layer kinds this stage runs
        working = (max(working_moe if layers else 0.0, working_dense if dense else 0.0) if has_dense
                   else working_moe)
        own = layers * (layer_params_per_chip - layer_expert_params_per_chip) + dense * dense_layer_params_per_chip
        if min(own, layers * layer_expert_params_per_chip, extra_params) < 0:
            raise ValueError(f"params_per_chip must be >= 0, got {min(own, extra_params)}")
        sw, sg, so = sharded_bytes(own, shards, layer_bytes)
        if layer_expert_params_per_chip:
            # MoE experts (already split by ep): their state is sharded over the expert data
            # parallel ranks, dp x cp / ep (Megatron-Core expert_data_parallel group)
            xw, xg, xo = sharded_bytes(layers * layer_expert_params_per_chip, expert_shards, layer_bytes)
            sw, sg, so = sw + xw, sg + xg, so + xo
        ew, eg, eo = sharded_bytes(extra_params, shards, other_bytes)
        in_flight = alike[4] if alike[4] is not None else 1.0  # (None: it multiplies no activations)
        b = MemoryBreakdown(
            weights_bytes=sw + ew,
            gradients_bytes=sg + eg,
            optimizer_bytes=so + eo,
            activations_bytes=(act_layer * layers + act_dense * dense + extra_act) * in_flight + working,
            capacity_bytes=capacity,
            reserve_bytes=reserve,
        )
        if offload is not None:  # state moved to host DRAM (dfmodel.inter_chip.offload)
            b = offload.stage_memory(b, layers=layers, layer_state=ModelState(sw, sg, so), layer_act_bytes=act_layer,
                                     in_flight=in_flight, layer_params=layer_params_per_chip,
                                     fsdp_buffer=zero_stage == 3)
            host = max(host, b.host_bytes)
        if worst is None or b.total_bytes > worst.total_bytes:
            worst = b
    if offload is not None:
        worst.host_bytes = host  # (worst was built in this call: no one else holds it)
    return worst
