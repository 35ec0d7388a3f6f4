"""Workload specs: one pydantic model per family, chosen by ``kind`` (a discriminated union).

A workload YAML names a family and its hyper-parameters; a builder (:mod:`dfmodel.graph.build`)
expands it into a :class:`~dfmodel.graph.graph.DataflowGraph`. Families and their fields::

    kind: llm                          # GPT / Llama style decoder-only transformer
    name: gpt3_175b
    description: ""                    # every family has name + description
    model:
      hidden: 12288                    # h
      num_heads: 96                    # a, must divide hidden (head dim d = h / a)
      head_dim: null                   # d when it is not h / a (Qwen3: 128 at h 2048, a 32)
      qk_norm: false                   # RMSNorm of each query and key head (Qwen3, OLMo 2)
      sliding_window: null             # each query sees the last W tokens (Mistral 4096, GPT-OSS 128)
      full_attention_every: null       # with a window: layers N, 2N, ... keep full attention
      num_kv_heads: 96                 # default num_heads; must divide num_heads (GQA / MQA)
      num_layers: 96
      seq_len: 2048
      ffn_hidden: 49152                # default 4 * hidden
      ffn_type: gelu                   # gelu | swiglu (gate and up projections) | squared_relu
      dropout: true                    # hidden/attention dropout masks kept for the backward
      vocab_size: 51200                # default 0 = no embedding / LM head graphs
      tie_embeddings: true             # LM head reuses the token embedding (Megatron default)
      position_embedding: learned      # learned (seq_len x hidden table) | rotary (no params)
      attention: null                  # flash | unfused | null (= flash on GPUs, unfused on dataflow)
    training:
      global_batch: 1536               # sequences per iteration
      micro_batch: null                # optional fixed micro-batch (sequences); must divide it
      precision: bf16                  # fp32 | bf16 | fp16 | fp8
      optimizer: adam                  # adam | sgd | adagrad
      input_bytes_per_sample: 8192     # bytes read by the input pipeline per sample (0 = ignore)
      data: {...}                      # optional input pipeline (dfmodel.graph.data_pipeline)
      checkpoint: {...}                # optional checkpointing (same module)
      grad_reduce: null                # fp32 | bf16 | fp16 (null: fp32 for bf16/fp8, Megatron)
      fp8: {attention: false, fp8_allgather: true, fp8_weights: false, amax_history_len: 1024,
            recipe: delayed}                 # delayed | current | mxfp8 | blockwise (TE recipes)
      param_remainders: false          # fp32 master kept as bf16 weight + 16-bit remainder (Apex)
      optimizer_dtype: fp32            # bf16: Adam moments in bf16, no master (NeMo 1.x optim.dtype)

    kind: dlrm
    embedding: {num_tables: 26, rows_per_table: [..26 ints..] or one int, dim: 128,
                lookups_per_table: [..] or one int (pooling factor)}
    dense_features: 13
    bottom_mlp: [512, 256, 128]        # last width must equal embedding.dim (dot interaction)
    top_mlp: [1024, 1024, 512, 256, 1]
    interaction: dot
    training: {global_batch: 65536, precision: fp32}

    kind: hpl                          # HPL.dat's N, NB, P, Q (lower case here)
    n: 2457600                         # matrix order
    nb: 384                            # block size
    p: 32                              # process rows
    q: 32                              # process columns
    precision: fp64
    max_steps: 64                      # the N/NB steps are grouped into at most this many

    kind: fft
    dims: [4096, 4096, 4096]           # [n], [nx, ny] or [nx, ny, nz] complex points
    batch: 1
    precision: fp32                    # of each real component: a point is 2 x bytes
    decomposition: pencil              # pencil | slab (slab: 3-D only)

    kind: graph                        # an explicit graph
    precision: bf16
    batch: 1                           # the batch the graph stands for (fixed)
    kernels: [{name, kind, dims, flop, output_bytes, weight_bytes, extra_memory_bytes, params,
               phase, group, collective, comm_bytes, comm_group}, ...]
    tensors: [{name, producer, consumer, bytes, operand, shape}, ...]   # null = graph in/out

Byte fields accept unit strings ("4 KiB"). Every bad input raises one-line
:class:`~dfmodel.errors.InputError` naming the file, the field path and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    RootModel,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dfmodel.errors import InputError
from dfmodel.graph.data_pipeline import Checkpointing, DataPipeline
from dfmodel.graph.fp8 import RecipeName
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.pipeline_layout import parse_pipeline_layout
from dfmodel.presets import resolve
from dfmodel.system.schema import Precision, Strict
from dfmodel.system.units import Bytes, BytesOrZero, NonNegativeFloat
from dfmodel.yamlio import read_yaml, validate

KINDS = ("llm", "dlrm", "hpl", "fft", "graph")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


def _training_precision(p: Precision) -> Precision:
    # fp64 is for HPC families; no accelerator trains networks in it and chips rarely list it
    if p == Precision.fp64:
        raise ValueError("training precision must be one of fp32, bf16, fp16, fp8, got fp64")
    return p


TrainingPrecision = Annotated[Precision, AfterValidator(_training_precision)]


class _Base(Strict):
    """Fields every workload has; ``_source`` remembers the file for later error messages."""

    name: str = Field(min_length=1)
    description: str = ""
    _source: str = PrivateAttr(default="<workload>")

    @property
    def source(self) -> str:
        """The file (or ``<dict>``) this workload was loaded from, for error messages."""
        return self._source


class FP8Recipe(Strict):
    """How FP8 training runs (``training.precision: fp8``), with Transformer Engine's defaults.

    Transformer Engine (TE) ``DelayedScaling`` (transformer_engine/common/recipe/__init__.py,
    NVIDIA/TransformerEngine @ d0067d0: ``fp8_format=HYBRID`` (E4M3 forward, E5M2 gradients),
    ``amax_history_len=1024``, ``reduce_amax=True``, ``fp8_dpa=False``, ``fp8_mha=False``)
    runs only the linear layers' GEMMs (QKV, attention projection, FC1, FC2: forward, data- and
    weight-gradient) in FP8. Attention's batched matmuls, softmax, norms and element-wise ops
    stay 16-bit, activations are stored and exchanged in 16 bit, and every FP8 GEMM operand is
    first cast (with an amax reduction) by a kernel that reads 16 bit and writes 8 bit.

    - ``attention``: attention in FP8 too (TE ``fp8_dpa``; default off);
    - ``fp8_allgather``: the sequence-parallel all-gathers of the layer-norm outputs (QKV and
      FC1 inputs) move FP8 (1 byte) instead of 16 bit. Default on, as TE runs them: its
      ``LayerNormLinear`` / ``LayerNormMLP`` write the layer norm's output in FP8 and gather that,
      with and without userbuffers (TE v1.11 layernorm_linear.py ``ln_out_dtype = uint8 if fp8
      and not return_layernorm_output``; Megatron-Core's ``TELayerNormColumnParallelLinear``
      keeps ``return_layernorm_output=False``; ``initialize_ub``: "AllGather buffers use fp8 when
      using fp8 recipe"); likewise a row-parallel layer's incoming gradient, which TE casts on the
      rank's shard and gathers in FP8 for its data- and weight-gradient GEMMs (TE v1.11 module/base.py
      ``grad_output_preprocess``); off for a framework that casts after a 16-bit gather;
    - ``fp8_weights``: the model keeps its parameters only in FP8 (TE ``fp8_model_init`` /
      Megatron ``--fp8-param-gather``): 1 byte/param instead of a 16-bit weight plus a cached
      FP8 copy and its transpose (2 + 2 bytes/param); default off;
    - ``amax_history_len``: the per-tensor amax history TE keeps (fp32 each) for delayed scaling;
    - ``recipe``: how the FP8 scales are found (TE's recipe classes; costs and sources in
      :mod:`dfmodel.graph.fp8`): ``delayed`` (``DelayedScaling``, the default: amax history of
      earlier steps), ``current`` (``Float8CurrentScaling``: an amax pass over each tensor before
      its cast), ``mxfp8`` (``MXFP8BlockScaling``, Blackwell only: E8M0 scales per 32 elements,
      row- and column-wise copies) or ``blockwise`` (``Float8BlockScaling``: fp32 scales per 1x128
      / 128x128 tile, DeepSeek-V3 style).
    """

    attention: bool = False
    fp8_allgather: bool = True
    fp8_weights: bool = False
    amax_history_len: PositiveInt = 1024
    recipe: RecipeName = "delayed"


#: Transformer Engine userbuffers exchanges that hold SMs (:data:`dfmodel.netmodels.nccl.UB_SM_EXCHANGES`)
UBExchange = Literal["proj_fprop", "fc2_fprop", "qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"]


class Training(Strict):
    """How a network family is trained: batch, precision, optimizer and input pipeline.

    ``input_bytes_per_sample`` is what the input pipeline reads from storage per sample (a
    sequence for an LLM, a record for DLRM); 0 means the input pipeline is not modelled.
    ``grad_reduce``: precision of the data-parallel gradient reduction and of the main gradient
    buffer. Default (null): fp32 for bf16 and fp8 (Megatron-LM: "bfloat16 requires gradient
    accumulation and all-reduce to be done in fp32", megatron/training/arguments.py,
    ``accumulate_allreduce_grads_in_fp32``), the training precision otherwise. ``fp8``: the FP8
    recipe (only read when ``precision`` is fp8).
    """

    global_batch: PositiveInt
    micro_batch: PositiveInt | None = None
    precision: TrainingPrecision = Precision.bf16
    optimizer: Literal["adam", "sgd", "adagrad"] = "adam"
    input_bytes_per_sample: BytesOrZero = 0.0
    # optional input pipeline and checkpointing (dfmodel.graph.data_pipeline; issue 8)
    data: DataPipeline | None = None
    checkpoint: Checkpointing | None = None
    grad_reduce: Literal["fp32", "bf16", "fp16"] | None = None
    fp8: FP8Recipe = FP8Recipe()
    #: LLM: the layers are replayed as CUDA graphs (Transformer Engine ``make_graphed_callables``,
    #: Megatron-Core ``--cuda-graph-impl``), so the framework's per-module host time
    #: (the chip's ``efficiency.host_linear_s``) is not a floor of a layer's time, and each kernel
    #: costs the chip's in-graph ``graph_kernel_overhead_s`` instead of the eager launch. Default: eager.
    cuda_graphs: bool = False
    #: Apex DistributedFusedAdam ``store_param_remainders`` (NeMo 1.x distributed_fused_adam with
    #: bf16 O2 weights): the fp32 master weight is the bf16 weight plus a 16-bit remainder, so the
    #: optimizer keeps 2 bytes/param of it instead of 4 (megatron_base_model.py setup_optimization)
    param_remainders: bool = False
    #: dtype of the optimizer's state (Apex DistributedFusedAdam / NeMo 1.x ``optim.dtype``): bf16
    #: keeps Adam's moments in bf16 and, with 16-bit weights, no fp32 master copy
    #: (:meth:`dfmodel.inter_chip.memory.StateBytesPerParam.of`); fp32: Megatron's layout
    optimizer_dtype: Literal["fp32", "bf16"] = "fp32"
    #: LLM with Megatron's tp_comm_overlap: the SMs each Transformer Engine userbuffers exchange
    #: holds beside its GEMM, as the run's ``ub_tp_comm_overlap_cfg`` sets ``num_sm`` (keys: TE's
    #: SM-holding exchanges proj_fprop, fc2_fprop, qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad; one
    #: left out holds TE's default 16). ``te_default``: a run without a config (every exchange 16).
    #: Default (null): NeMo's tuned H100 configs (:data:`dfmodel.netmodels.nccl.USERBUFFERS_SMS_BY_TP`).
    userbuffers_sms: Literal["te_default"] | dict[UBExchange, NonNegativeInt] | None = None
    #: LLM: how the softmax cross-entropy over the vocabulary runs
    #: (:func:`dfmodel.graph.builders.llm.cross_entropy_extra_bytes` counts each one's passes):
    #: ``unfused``: Megatron-Core's VocabParallelCrossEntropy as eager PyTorch kernels over fp32
    #: logits (``cross_entropy_loss_fusion: false``, the default of ModelParallelConfig in
    #: core_r0.8-r0.10, the versions NeMo 24.07 / 24.11 run); ``megatron_fused``: its
    #: ``cross_entropy_loss_fusion: true`` form (megatron/core/fusions/fused_cross_entropy.py: four
    #: torch.compile regions); ``te``: its ``cross_entropy_fusion_impl: te`` form (Transformer
    #: Engine's Triton kernels: two passes forward, one backward); ``single_pass``: one fused pass
    #: each way. Default (null): unfused on
    #: kernel-by-kernel chips, single_pass on dataflow chips (their compiler fuses the element-wise
    #: chain); :func:`resolve_fusion`.
    cross_entropy: Literal["unfused", "megatron_fused", "te", "single_pass"] | None = None
    #: LLM: the FFN activation as one fused kernel (True) or as the eager PyTorch ops the framework
    #: writes (False; squared ReLU = ``torch.pow(F.relu(x), 2)``, NeMo utils.py ``squared_relu``).
    #: Default (null): on kernel-by-kernel chips True for gelu and swiglu (Megatron-Core
    #: ``bias_activation_fusion``: bias_gelu_impl / bias_swiglu_impl) and False for relu / squared
    #: relu (core_r0.8 mlp.py MLP.forward fuses gelu and swiglu only and raises for any other, so
    #: such runs set bias_activation_fusion off); True on dataflow chips. :func:`resolve_fusion`.
    activation_fusion: bool | None = None
    #: LLM: the token embedding's weight gradient is a dense vocab/tp x hidden tensor each micro-batch
    #: (PyTorch's CUDA ``embedding_dense_backward`` zero-fills one, which the framework's gradient
    #: hook then adds into the main gradient: Megatron-Core core_r0.8 distributed_data_parallel.py
    #: ``_make_param_hook``). Default (null): True on kernel-by-kernel chips, False on dataflow
    #: chips (a scatter-add into the accumulator); :func:`resolve_fusion`.
    embedding_dense_grad: bool | None = None
    #: LLM: the pipeline split as Megatron-Core's ``--pipeline-model-parallel-layout`` writes it
    #: (:mod:`dfmodel.graph.pipeline_layout`: ``'Et|(tt|)*30mL'`` = the embedding and one layer on
    #: the first virtual stage, two layers on each of the next 30, MTP and loss alone on the last).
    #: The search then runs only ``pp x vp`` equal to its stage count, each stage with the layers
    #: it names, instead of the time-balanced (1F1B) or equal (interleaved) split. Default: none.
    pipeline_layout: str | None = None

    @field_validator("pipeline_layout")
    @classmethod
    def _layout_parses(cls, v: str | None) -> str | None:
        if v is not None:
            parse_pipeline_layout(v)  # (ValueError: one line naming what is allowed)
        return v

    def userbuffers_config(self) -> tuple[tuple[str, int], ...] | None:
        """``userbuffers_sms`` as sorted (exchange, SMs) pairs (hashable; () = TE's defaults), or None."""
        if self.userbuffers_sms is None:
            return None
        return () if self.userbuffers_sms == "te_default" else tuple(sorted(self.userbuffers_sms.items()))

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the main gradients and of their data-parallel reduction."""
        if self.grad_reduce is not None:
            return Precision(self.grad_reduce).bytes
        return 4 if self.precision in (Precision.bf16, Precision.fp8) else self.precision.bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes per stored / exchanged activation element: FP8 training keeps them in 16 bit."""
        return 2 if self.precision == Precision.fp8 else self.precision.bytes

    @field_validator("micro_batch")
    @classmethod
    def _divides(cls, v: int | None, info: ValidationInfo) -> int | None:
        g = info.data.get("global_batch")
        if v is not None and g is not None and g % v:
            raise ValueError(f"must divide training.global_batch ({g}), got {v}")
        return v


# -- llm ---------------------------------------------------------------------------------------------


def not_above(other: str, message: str = "must be at most {other} ({bound}), got {value}"):
    """A pydantic field validator: the value may not exceed the (already validated) field
    ``other``; ``message`` is formatted with ``other``, ``bound`` and ``value``.

    >>> from pydantic import BaseModel, field_validator
    >>> class Grid(BaseModel):
    ...     n: int
    ...     nb: int
    ...     _nb_le_n = field_validator("nb")(not_above("n"))
    >>> Grid(n=4, nb=8)
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for Grid
    nb
      Value error, must be at most n (4), got 8 [type=value_error, input_value=8, input_type=int]
    ...
    """

    def check(cls, v, info: ValidationInfo):
        bound = info.data.get(other)
        if bound is not None and v > bound:
            raise ValueError(message.format(other=other, bound=bound, value=v))
        return v

    return classmethod(check)


class MoEConfig(Strict):
    """``model.moe``: a mixture-of-experts MLP in every layer after ``first_dense_layers``.

    Follows Megatron-Core's MoE layer (megatron/core/transformer/moe/): a router GEMM and
    top-k softmax pick ``top_k`` of ``num_experts`` routed experts per token, tokens are
    dispatched to the experts' ranks with an all-to-all, the experts run as one grouped GEMM and
    the results return with a second all-to-all; ``num_shared_experts`` run on every token as a
    dense MLP of ``num_shared_experts * expert_ffn_hidden`` (DeepSeekMoE, Dai et al. 2024).
    ``capacity_factor`` (Fedus et al. 2021, Switch Transformer eq. 3) and ``load_imbalance``
    (busiest expert's tokens over the mean) scale the routed tokens each rank computes; both
    1.0 = dropless and perfectly balanced (Megatron-Core's default). ``max_nodes_per_token``
    and ``dispatch_fp8`` are DeepSeek-V3's communication savings (see the fields).
    """

    num_experts: PositiveInt
    top_k: PositiveInt
    expert_ffn_hidden: PositiveInt
    num_shared_experts: Annotated[int, Field(ge=0)] = 0
    first_dense_layers: Annotated[int, Field(ge=0)] = 0
    capacity_factor: Annotated[float, Field(ge=1.0)] = 1.0
    load_imbalance: Annotated[float, Field(ge=1.0)] = 1.0
    #: node-limited routing with a per-node dispatcher (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2 /
    #: 3.2.2; the DeepEP kernels, also Megatron-Core's flex dispatcher): each token goes to at
    #: most M = 4 nodes and crosses InfiniBand once per node, then NVLink forwards it to its
    #: experts there; None: every routed copy crosses the scale-out network (Megatron-Core's
    #: alltoall dispatcher sends one copy per expert even under group-limited routing)
    max_nodes_per_token: PositiveInt | None = None
    #: dispatch in FP8 (sec. 3.3.3: the activations before the up-projections and the gradients
    #: before the down-projections are quantised to FP8 with 1x128 tile scales before their
    #: all-to-all; the combine and its backward stay BF16); False: all at the activation precision
    dispatch_fp8: bool = False
    #: multi-token prediction modules trained beside the model (DeepSeek-V3, arXiv:2412.19437
    #: sec. 2.2: module k = RMSNorms, a projection of the concatenated [h; emb] (2d -> d), one
    #: Transformer block, and the shared output head with its own cross-entropy; sec. 4.2: depth
    #: D = 1). Megatron-Core runs them on the last pipeline stage (MultiTokenPredictionBlock,
    #: post_process), NeMo's DeepSeek-V3 pretrain recipe sets mtp_num_layers = 1. 0: none
    mtp_layers: Annotated[int, Field(ge=0)] = 0
    #: precision of the router GEMMs (Megatron-Core ``moe_router_dtype``, added for
    #: numerically stable routing with many experts): "fp32" runs the logits GEMM and its two
    #: backward GEMMs in fp32 on the CUDA cores (PyTorch's default allow_tf32 = False for
    #: matmul); None: the layer's element-wise precision (Megatron-Core's default)
    router_dtype: Literal["fp32"] | None = None
    #: Megatron-Core ``recompute_modules: [moe_act]`` (moe/experts.py ``activation_recompute``:
    #: CheckpointWithoutOutput around the routed experts' activation; in FP8 ``linear_fc2`` is set
    #: to save its original input, so no quantised copy stays either): the experts' FC2 input is
    #: not kept for the backward but recomputed there from the FC1 output. False: kept
    recompute_activation: bool = False
    #: Megatron-Core ``recompute_modules: [layernorm]`` (transformer_layer.py
    #: ``recompute_pre_mlp_layernorm`` / ``recompute_input_layernorm``): the MoE layer's pre-MLP
    #: RMSNorm output (the router's input) is not kept but recomputed in the backward, and so is
    #: the input norm's where it is a module of its own (MLA); with Transformer Engine the other
    #: layers' input norm is fused into the QKV linear (``input_layernorm`` is IdentityOp in
    #: gpt_layer_specs.py) and is not recomputed. False: kept
    recompute_norm: bool = False

    _k_le_experts = field_validator("top_k")(
        not_above("num_experts", "must be at most model.moe.num_experts ({bound}), got {value}"))

    @property
    def routed_token_factor(self) -> float:
        """Expert-GEMM rows per token on the busiest rank: ``top_k x capacity x imbalance``."""
        return self.top_k * self.capacity_factor * self.load_imbalance




class MLAConfig(Strict):
    """``model.mla``: multi-head latent attention (DeepSeek-V2 arXiv:2405.04434 sec. 2.1.2;
    defaults are DeepSeek-V2/V3's: q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64,
    qk_nope_head_dim 128, v_head_dim 128). See :mod:`dfmodel.graph.builders.mla`."""

    q_lora_rank: PositiveInt = 1536
    kv_lora_rank: PositiveInt = 512
    qk_rope_head_dim: PositiveInt = 64
    qk_nope_head_dim: PositiveInt = 128
    v_head_dim: PositiveInt = 128
    #: recompute the up projections (and RoPE) in the backward instead of keeping Q, K and V:
    #: Megatron-Core ``recompute_modules: [mla_up_proj]`` (multi_latent_attention.py,
    #: ``recompute_up_proj``: CheckpointWithoutOutput around qkv_up_proj_and_rope_apply, outputs
    #: discarded after the core attention); DeepSeek-V3 sec. 3.2.3 "Recomputation of RMSNorm and
    #: MLA Up-Projection". Costs the up-projection GEMMs once more per backward; no effect with
    #: full recompute (which re-runs them anyway). False: Q, K, V are saved
    recompute_up_proj: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_in(self) -> int:
        """Features the up projections read: ``q_lora + kv_lora``."""
        return self.q_lora_rank + self.kv_lora_rank

    @property
    def latent_out(self) -> int:
        """Features the down projections write: ``q_lora + kv_lora + rope``."""
        return self.latent_in + self.qk_rope_head_dim


def fc1_width_factor(ffn_type: str) -> int:
    """FC1's output width per FFN width: 2 for SwiGLU, whose gate and up projections run as one
    fused GEMM (Shazeer 2020, "GLU Variants Improve Transformer"; Megatron-Core's
    ``gated_linear_unit``), 1 for GELU and squared ReLU. The one place the factor is written.

    >>> fc1_width_factor("swiglu"), fc1_width_factor("gelu")
    (2, 1)
    """
    return 2 if ffn_type == "swiglu" else 1


class LLMArchitecture(Strict):
    """Decoder-only transformer hyper-parameters (see the module doc for each field)."""

    hidden: PositiveInt
    # width of one attention head (Megatron-Core ``kv_channels``, HF ``head_dim``); None: hidden /
    # num_heads. Qwen3 (128 with hidden 2048 / 32 heads and 4096 / 64: 2x that) and GPT-OSS (64
    # with hidden 2880 / 64 heads) set their own, which sizes Q, K, V, the attention and out_proj
    head_dim: PositiveInt | None = None
    num_heads: PositiveInt
    num_layers: PositiveInt
    seq_len: PositiveInt
    ffn_hidden: PositiveInt | None = None  # filled with 4 * hidden when absent
    vocab_size: Annotated[int, Field(ge=0)] = 0
    num_kv_heads: PositiveInt | None = None  # filled with num_heads when absent
    ffn_type: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    tie_embeddings: bool = True
    position_embedding: Literal["learned", "rotary"] = "learned"
    # flash: one fused attention kernel per direction, no s x s tensor in memory (FlashAttention,
    # Dao et al. 2022; FA-2, Dao 2023); unfused: score, softmax and context as separate kernels.
    # null = decided by the system: flash on kernel-by-kernel chips (GPUs: every current
    # framework), unfused on dataflow chips (their compiler fuses the separate kernels itself).
    attention: Literal["flash", "unfused"] | None = None
    # hidden and attention dropout (GPT-3 / Megatron GPT: 0.1, which keeps 1-byte masks for the
    # backward); Llama and Nemotron recipes train without dropout (NeMo llama31 / nemotron4:
    # hidden_dropout = attention_dropout = 0)
    dropout: bool = True
    # RMSNorm of every query and key head before the attention (Megatron-Core ``qk_layernorm``,
    # HF ``q_norm`` / ``k_norm``: Qwen3, OLMo 2, Gemma 3): two more memory-bound kernels each way
    # on GPUs and the un-normed Q and K saved for their backward (a dataflow compiler fuses them)
    qk_norm: bool = False
    # sliding-window attention: each query attends to the last ``sliding_window`` tokens, itself
    # included (Mistral 7B: 4096; GPT-OSS: 128; Gemma 3: 1024), so a fused attention kernel computes
    # only the key tiles the window touches (FlashAttention-2 / TE ``window_size``); the unfused
    # path still computes and masks the whole s x s matrix. None: full causal attention
    sliding_window: PositiveInt | None = None
    # with sliding_window: layers N, 2N, ... keep full attention, the others slide (GPT-OSS 2,
    # Gemma 3 6: HF ``sliding_window_pattern`` / ``layer_types``); None: every layer slides
    full_attention_every: PositiveInt | None = None
    # mixture of experts (None: every layer has the dense MLP of ffn_hidden)
    moe: MoEConfig | None = None
    # multi-head latent attention (None: standard multi-/grouped-query attention)
    mla: MLAConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        # Fill defaults before field validation so the stored model is explicit; leave bad
        # values alone so the field validators report them at their own path.
        if isinstance(data, dict):
            data = dict(data)
            hidden, heads = data.get("hidden"), data.get("num_heads")
            if data.get("ffn_hidden") is None and type(hidden) is int:
                data["ffn_hidden"] = 4 * hidden
            if data.get("num_kv_heads") is None and type(heads) is int:
                data["num_kv_heads"] = heads
        return data

    @field_validator("num_heads")
    @classmethod
    def _heads_divide_hidden(cls, v: int, info: ValidationInfo) -> int:
        h = info.data.get("hidden")
        if h is not None and h % v and info.data.get("head_dim") is None:
            raise ValueError(f"must divide model.hidden ({h}) unless model.head_dim is given, got {v}")
        return v

    @field_validator("num_kv_heads")
    @classmethod
    def _kv_divide_heads(cls, v: int | None, info: ValidationInfo) -> int | None:
        a = info.data.get("num_heads")
        if v is not None and a is not None and a % v:
            raise ValueError(f"must divide model.num_heads ({a}), got {v}")
        return v

    @field_validator("full_attention_every")
    @classmethod
    def _needs_a_window(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("sliding_window") is None:
            raise ValueError("says which layers keep full attention among sliding-window ones: "
                             "give model.sliding_window too, or leave it out")
        return v

    @field_validator("mla")
    @classmethod
    def _mla_all_heads(cls, v: MLAConfig | None, info: ValidationInfo) -> MLAConfig | None:
        a, kv = info.data.get("num_heads"), info.data.get("num_kv_heads")
        if v is not None and a is not None and kv is not None and kv != a:
            raise ValueError(f"MLA gives every head its own keys and values: num_kv_heads must equal num_heads ({a}), got {kv}")
        if v is not None and info.data.get("head_dim") is not None:
            raise ValueError("MLA sets its own head widths (qk_nope_head_dim, qk_rope_head_dim, v_head_dim): "
                             "leave model.head_dim out")
        return v

    @field_validator("moe")
    @classmethod
    def _dense_layers_fit(cls, v: MoEConfig | None, info: ValidationInfo) -> MoEConfig | None:
        n = info.data.get("num_layers")
        if v is not None and n is not None and v.first_dense_layers >= n:
            raise ValueError(f"first_dense_layers must be below model.num_layers ({n}), got {v.first_dense_layers}")
        return v

    @property
    def attention_dim(self) -> int:
        """``num_heads x head_dim``: the width of Q and of the attention output (``hidden`` unless
        the model sets its own ``head_dim``)."""
        return self.num_heads * self.head_width

    @property
    def head_width(self) -> int:
        """The head width the model runs: ``head_dim``, else ``hidden / num_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden


class _Trained:
    """Workloads with a ``training`` block take their precision and batch from it."""

    @property
    def precision(self) -> Precision:
        return self.training.precision

    @property
    def default_batch(self) -> int:
        """Samples per iteration when no batch is given (sequences for an LLM)."""
        return self.training.global_batch


class LLMWorkload(_Trained, _Base):
    """``kind: llm``: a GPT/Llama decoder-only transformer and its training setup.

    >>> w = load_workload({"kind": "llm", "name": "tiny", "model": {"hidden": 64, "num_heads": 4,
    ...     "num_layers": 2, "seq_len": 16}, "training": {"global_batch": 8}})
    >>> w.model.ffn_hidden, w.model.num_kv_heads, w.training.precision.value
    (256, 4, 'bf16')
    """

    kind: Literal["llm"]
    model: LLMArchitecture
    training: Training



# -- dlrm --------------------------------------------------------------------------------------------


class EmbeddingTables(Strict):
    """Sparse features: ``num_tables`` tables of ``rows`` x ``dim``; each sample looks up
    ``lookups_per_table`` rows per table (the pooling factor) and sums them."""

    num_tables: PositiveInt
    rows_per_table: list[PositiveInt]
    dim: PositiveInt
    lookups_per_table: list[PositiveInt] = Field(default=1, validate_default=True)  # type: ignore[assignment]
    #: How often each row is looked up: null = uniformly over a table's rows; a number s >= 0
    #: (one, or one per table) = a rank-frequency power law p(k) ~ k^-s over the rows (Zipf;
    #: click logs are power-law distributed, e.g. Naumov et al. 2019 sec. 2 on DLRM's sparse
    #: features). Read by the frequency-hybrid sharding (frequent rows replicated, HugeCTR).
    zipf_exponent: list[NonNegativeFloat] | None = None

    @field_validator("zipf_exponent", mode="before")
    @classmethod
    def _broadcast_zipf(cls, v: Any, info: ValidationInfo) -> Any:
        t = info.data.get("num_tables")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return [float(v)] * (t or 1)
        if isinstance(v, list) and t is not None and len(v) != t:
            raise ValueError(f"must be one number or a list of num_tables ({t}) numbers, got {len(v)}")
        return v

    def zipf(self) -> list[float]:
        """Per-table power-law exponent (0 = uniform)."""
        return list(self.zipf_exponent) if self.zipf_exponent is not None else [0.0] * self.num_tables

    @field_validator("rows_per_table", "lookups_per_table", mode="before")
    @classmethod
    def _broadcast(cls, v: Any, info: ValidationInfo) -> Any:
        # One integer stands for every table. Expanding here (rather than typing the field as
        # int | list) keeps pydantic's union branch names out of error paths.
        t = info.data.get("num_tables")
        if type(v) is int:
            if v < 1:
                raise ValueError(f"must be > 0, got {v}")
            return [v] * (t or 1)
        return v

    @field_validator("rows_per_table", "lookups_per_table")
    @classmethod
    def _one_per_table(cls, v: list[int], info: ValidationInfo) -> list[int]:
        t = info.data.get("num_tables")
        if t is not None and len(v) != t:
            raise ValueError(f"must be one integer or a list of num_tables ({t}) integers, got {len(v)}")
        return v

    def rows(self) -> list[int]:
        return list(self.rows_per_table)

    def lookups(self) -> list[int]:
        return list(self.lookups_per_table)


class DLRMTraining(Training):
    """DLRM training: :class:`Training` plus how the framework launches the step.

    ``cuda_graphs``: the whole iteration is replayed as one CUDA graph (HugeCTR
    ``use_holistic_cuda_graph = True`` in NVIDIA's MLPerf v1.0-v2.0 DLRM configs, e.g.
    training_results_v2.0 NVIDIA/benchmarks/dlrm/implementations/hugectr/dgx_a100.py), so each
    kernel costs the chip's ``efficiency.graph_kernel_overhead_s`` instead of the eager launch.
    """

    cuda_graphs: bool = False


class DLRMWorkload(_Trained, _Base):
    """``kind: dlrm``: Deep Learning Recommendation Model (Naumov et al. 2019, arXiv:1906.00091).

    >>> w = load_workload({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2,
    ...     "rows_per_table": [10, 20], "dim": 4}, "dense_features": 3, "bottom_mlp": [8, 4],
    ...     "top_mlp": [8, 1], "training": {"global_batch": 16}})
    >>> w.embedding.rows(), w.embedding.lookups()
    ([10, 20], [1, 1])
    """

    kind: Literal["dlrm"]
    embedding: EmbeddingTables
    dense_features: PositiveInt
    bottom_mlp: list[PositiveInt] = Field(min_length=1)
    top_mlp: list[PositiveInt] = Field(min_length=1)
    interaction: Literal["dot"] = "dot"
    training: DLRMTraining

    @field_validator("bottom_mlp")
    @classmethod
    def _bottom_matches_dim(cls, v: list[int], info: ValidationInfo) -> list[int]:
        emb = info.data.get("embedding")
        if emb is not None and v[-1] != emb.dim:
            raise ValueError(f"last width must equal embedding.dim ({emb.dim}) for the dot interaction, got {v[-1]}")
        return v



# -- hpl ---------------------------------------------------------------------------------------------


class HPLWorkload(_Base):
    """``kind: hpl``: High-Performance Linpack, LU with partial pivoting of an n x n matrix.

    Fields are HPL.dat's N, NB, P, Q in lower case (field paths in errors stay readable); the
    upper-case spellings are accepted too and renamed on load.

    >>> load_workload({"kind": "hpl", "name": "h", "n": 1000, "nb": 100, "p": 2, "q": 2}).precision.value
    'fp64'
    """

    kind: Literal["hpl"]
    n: PositiveInt
    nb: PositiveInt
    p: PositiveInt = 1
    q: PositiveInt = 1
    precision: Precision = Precision.fp64
    max_steps: PositiveInt = 64

    @model_validator(mode="before")
    @classmethod
    def _hpl_dat_names(cls, data: Any) -> Any:
        # users copy N/NB/P/Q from HPL.dat; accept them unless the lower-case key is also given
        if isinstance(data, dict):
            data = dict(data)
            for upper in ("N", "NB", "P", "Q"):
                if upper in data and upper.lower() not in data:
                    data[upper.lower()] = data.pop(upper)
        return data

    _nb_le_n = field_validator("nb")(not_above("n", "must be <= n ({bound}), got {value}"))

    @property
    def default_batch(self) -> int:
        return 1


# -- fft ---------------------------------------------------------------------------------------------


class FFTWorkload(_Base):
    """``kind: fft``: a distributed complex FFT of ``dims`` points, ``batch`` times.

    >>> load_workload({"kind": "fft", "name": "f", "dims": [64, 64, 64]}).decomposition
    'pencil'
    """

    kind: Literal["fft"]
    dims: list[Annotated[int, Field(ge=2)]] = Field(min_length=1, max_length=3)
    batch: PositiveInt = 1
    precision: Precision = Precision.fp32
    decomposition: Literal["pencil", "slab"] = "pencil"

    @field_validator("decomposition")
    @classmethod
    def _slab_is_3d(cls, v: str, info: ValidationInfo) -> str:
        dims = info.data.get("dims")
        if v == "slab" and dims is not None and len(dims) != 3:
            raise ValueError(f"slab applies to 3-D transforms only (dims has {len(dims)}); use pencil")
        return v

    @property
    def point_bytes(self) -> int:
        """Bytes of one complex point (two real components)."""
        return 2 * self.precision.bytes

    @property
    def default_batch(self) -> int:
        return self.batch


# -- explicit graph ----------------------------------------------------------------------------------


class KernelSpec(Strict):
    """One kernel of an explicit graph (fields of :class:`~dfmodel.graph.kernel.Kernel`)."""

    name: str = Field(min_length=1)
    kind: KernelKind
    dims: dict[str, PositiveInt] = Field(default_factory=dict)
    flop: NonNegativeFloat = 0.0
    output_bytes: Bytes
    weight_bytes: BytesOrZero = 0.0
    extra_memory_bytes: BytesOrZero = 0.0
    params: NonNegativeFloat = 0.0
    phase: Phase = Phase.forward
    group: str = ""
    collective: Literal[COLLECTIVES] | None = Field(default=None, validate_default=True)  # type: ignore[valid-type]
    comm_bytes: BytesOrZero = 0.0
    comm_group: str | None = None

    @field_validator("collective")
    @classmethod
    def _comm_needs_collective(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if kind == KernelKind.comm and v is None:
            raise ValueError(f"a comm kernel needs a collective, one of {', '.join(COLLECTIVES)}")
        if kind is not None and kind != KernelKind.comm and v is not None:
            raise ValueError("only kind: comm kernels take a collective")
        return v


class TensorSpec(Strict):
    """One tensor (edge) of an explicit graph; a null producer/consumer is a graph input/output."""

    name: str = Field(min_length=1)
    producer: str | None = None
    consumer: str | None = None
    bytes: Bytes
    operand: str = "x"
    shape: list[PositiveInt] = Field(default_factory=list)


class GraphWorkload(_Base):
    """``kind: graph``: an explicit dataflow graph, for demos and workloads without a builder.

    Cycles and unknown kernel names are reported at load time with the tensor's field path.
    """

    kind: Literal["graph"]
    precision: Precision = Precision.bf16
    batch: PositiveInt = 1
    kernels: list[KernelSpec] = Field(min_length=1)
    tensors: list[TensorSpec] = Field(default_factory=list)

    @property
    def default_batch(self) -> int:
        return self.batch


# -- the union ---------------------------------------------------------------------------------------


class _UnknownKind(Strict):
    """Where the discriminator sends a missing or unknown ``kind``: always fails, at ``kind``."""

    model_config = ConfigDict(extra="allow")
    kind: Any = Field(default=None, validate_default=True)

    @field_validator("kind")
    @classmethod
    def _reject(cls, v: Any) -> Any:
        allowed = ", ".join(KINDS)
        if v is None:
            raise ValueError(f"required field is missing; allowed: {allowed}")
        raise ValueError(f"unknown workload kind {v!r}; allowed: {allowed}")


_TAGS = {"llm": "LLMWorkload", "dlrm": "DLRMWorkload", "hpl": "HPLWorkload", "fft": "FFTWorkload",
         "graph": "GraphWorkload"}


def _kind_tag(v: Any) -> str:
    # Tags are class names on purpose: yamlio.field_path skips loc items that start upper case,
    # so errors read `model.hidden`, not `llm.model.hidden`.
    kind = v.get("kind") if isinstance(v, dict) else getattr(v, "kind", None)
    return _TAGS.get(kind, "UnknownKind") if isinstance(kind, str) else "UnknownKind"


Workload = Annotated[
    Union[
        Annotated[LLMWorkload, Tag("LLMWorkload")],
        Annotated[DLRMWorkload, Tag("DLRMWorkload")],
        Annotated[HPLWorkload, Tag("HPLWorkload")],
        Annotated[FFTWorkload, Tag("FFTWorkload")],
        Annotated[GraphWorkload, Tag("GraphWorkload")],
        Annotated[_UnknownKind, Tag("UnknownKind")],
    ],
    Discriminator(_kind_tag),
]
"""Any workload; pick the family by ``kind``. Use in other schemas as a field type."""

WORKLOAD_TYPES = (LLMWorkload, DLRMWorkload, HPLWorkload, FFTWorkload, GraphWorkload)
AnyWorkload = Union[LLMWorkload, DLRMWorkload, HPLWorkload, FFTWorkload, GraphWorkload]


class WorkloadFile(RootModel[Workload]):
    """A whole workload YAML document."""


def load_workload(spec: str | Path | dict[str, Any] | AnyWorkload) -> AnyWorkload:
    """Validated workload from a path, a preset name (``gpt3_175b``), a dict or a model.

    >>> load_workload("gpt3_175b").model.hidden
    12288
    >>> try:
    ...     load_workload({"kind": "llm", "name": "x", "model": {"hidden": 100, "num_heads": 3,
    ...         "num_layers": 1, "seq_len": 8}, "training": {"global_batch": 1}})
    ... except InputError as e:
    ...     print(e)
    <dict>: model.num_heads: must divide model.hidden (100) unless model.head_dim is given, got 3
    """
    if isinstance(spec, WORKLOAD_TYPES):
        w = spec.model_copy(deep=True)
        w._source = spec._source
    else:
        if isinstance(spec, dict):
            source, data = "<dict>", spec
        elif isinstance(spec, (str, Path)):
            path = resolve(spec, "workloads")
            if not path.exists():
                from dfmodel.presets import unknown_preset_message

                raise InputError(unknown_preset_message(spec, "workloads"), source=str(spec))
            source, data = str(path), read_yaml(path)
        else:
            raise InputError(f"expected a path, preset name, dict or workload, got {type(spec).__name__}")
        w = validate(WorkloadFile, data, source).root
        w._source = source
    if isinstance(w, GraphWorkload):
        # cycles, unknown kernel names and duplicates are checked by DataflowGraph; do it now so
        # a bad file fails at load time, with the file and the field path
        from dfmodel.graph.builders.explicit import build_explicit

        build_explicit(w)
    return w


def resolve_attention(workload: AnyWorkload, execution: str) -> AnyWorkload:
    """The workload with ``model.attention`` decided for a chip of this ``execution`` style.

    An explicit ``flash`` / ``unfused`` is kept. ``null`` becomes ``flash`` on kernel-by-kernel
    chips (GPUs, TPUs: FlashAttention or an equivalent fused kernel is the default of
    Megatron-Core / Transformer Engine, PyTorch SDPA and JAX on TPU) and ``unfused`` on dataflow
    chips, whose compiler fuses the separate score / softmax / context kernels itself (the
    intra-chip pass does that fusion). Other families are returned unchanged.

    >>> w = load_workload("gpt3_175b")
    >>> resolve_attention(w, "kernel_by_kernel").model.attention, resolve_attention(w, "dataflow").model.attention
    ('flash', 'unfused')
    """
    if not isinstance(workload, LLMWorkload) or workload.model.attention is not None:
        return workload
    w = workload.model_copy(deep=True)
    w._source = workload._source
    w.model.attention = "flash" if execution == "kernel_by_kernel" else "unfused"
    return w


def resolve_fusion(workload: AnyWorkload, eager: bool) -> AnyWorkload:
    """The workload with ``training.cross_entropy``, ``activation_fusion`` and
    ``embedding_dense_grad`` decided for a chip that runs an ``eager`` framework's kernels
    (:attr:`dfmodel.system.schema.Chip.eager`: GPUs under PyTorch / Megatron-Core) or a fusing
    compiler's programs (dataflow chips; XLA on TPUs); an explicit value is kept, other families
    are returned unchanged. Eager chips run what Megatron-Core runs by default (see the fields);
    the others fuse both element-wise chains.

    >>> w = load_workload("gpt3_175b")
    >>> t = resolve_fusion(w, eager=True).training
    >>> t.cross_entropy, t.activation_fusion
    ('unfused', True)
    >>> resolve_fusion(w, eager=False).training.cross_entropy
    'single_pass'
    """
    if not isinstance(workload, LLMWorkload):
        return workload
    t = workload.training
    if None not in (t.cross_entropy, t.activation_fusion, t.embedding_dense_grad):
        return workload
    gpu = eager
    w = workload.model_copy(deep=True)
    w._source = workload._source
    if t.cross_entropy is None:
        w.training.cross_entropy = "unfused" if gpu else "single_pass"
    if t.activation_fusion is None:
        w.training.activation_fusion = not gpu or workload.model.ffn_type in MEGATRON_FUSED_ACTIVATIONS
    if t.embedding_dense_grad is None:
        w.training.embedding_dense_grad = gpu
    return w


def resolve_for_chip(workload: AnyWorkload, chip) -> AnyWorkload:
    """The workload with every chip-dependent default decided for ``chip`` (a
    :class:`dfmodel.system.schema.Chip`): :func:`resolve_attention` by its execution style and
    :func:`resolve_fusion` by whether it runs an eager framework (``chip.eager``)."""
    return resolve_fusion(resolve_attention(workload, chip.execution), chip.eager)


#: FFN activations Megatron-Core fuses with their bias (core_r0.8 megatron/core/transformer/mlp.py
#: MLP.forward under ``bias_activation_fusion``: bias_gelu_impl, bias_swiglu_impl)
MEGATRON_FUSED_ACTIVATIONS = frozenset(("gelu", "swiglu"))


#: the former name of :class:`LLMArchitecture` (it collided with the cost model
#: :class:`dfmodel.inter_chip.llm.LLMModel`); kept so existing imports keep working
LLMModel = LLMArchitecture
