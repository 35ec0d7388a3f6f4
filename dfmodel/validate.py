"""Fidelity check: predicted vs measured iteration times of published training runs.

A cases file (the shipped data set ``megatron_a100``, i.e. ``calibration/megatron_a100.yaml``, is one) lists runs with the model,
the global batch, the chip count, the mapping used (TP/PP/DP, micro-batch, recompute, sequence
parallelism, interleaving) and the measured iteration time. Each case is evaluated with its
mapping fixed; a knob the case leaves out (often the micro-batch) is chosen by the optimizer.
``free=True`` also runs the optimizer with nothing fixed, to compare the optimum with the
published (expert) mapping.

>>> cases = load_cases("megatron_a100")           # a shipped data set, by name
>>> len(cases), cases[0].id
(18, 'meg21-gpt-1.7B')
>>> rows = validate_cases("megatron_a100")          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import re

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from dfmodel.errors import DFModelError, InputError
from dfmodel.graph.fp8 import RecipeName
from dfmodel.graph.workload import MLAConfig, MoEConfig
from dfmodel.system.schema import Strict
from dfmodel.yamlio import field_path, validation_message

DEFAULT_SYSTEM = "dgx_a100"


class CaseModel(Strict):
    hidden: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    ffn_hidden: int | None = Field(default=None, gt=0)
    vocab_size: int = Field(default=0, ge=0)
    num_kv_heads: int | None = Field(default=None, gt=0)
    #: a head's width when it is not hidden / num_heads (Megatron-Core ``kv_channels``)
    head_dim: int | None = Field(default=None, gt=0)
    #: Megatron-Core ``qk_layernorm`` (Qwen3): workload ``model.qk_norm``
    qk_norm: bool | None = None
    #: sliding-window attention (TE / Megatron-Core ``window_size``): workload ``model.sliding_window``
    #: and ``model.full_attention_every``
    sliding_window: int | None = Field(default=None, gt=0)
    full_attention_every: int | None = Field(default=None, gt=0)
    ffn_type: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    attention: Literal["flash", "unfused"] | None = None
    dropout: bool | None = None
    tie_embeddings: bool | None = None
    #: mixture of experts / multi-head latent attention: the ``kind: llm`` workload blocks
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None


class CaseTraining(Strict):
    global_batch: int = Field(gt=0)
    micro_batch: int | None = Field(default=None, gt=0)
    precision: str = "bf16"
    #: what the run's framework reduced gradients in (e.g. NeMo's distributed_fused_adam
    #: ``grad_sync_dtype: bf16``); None: the workload default (fp32 main gradients, Megatron)
    grad_reduce: Literal["fp32", "bf16", "fp16"] | None = None
    #: FP8 runs that kept their parameters in FP8 (NeMo ``fp8_params`` / TE ``fp8_model_init``)
    fp8_weights: bool | None = None
    #: the FP8 recipe the run used (:mod:`dfmodel.graph.fp8`); None on an FP8 run: unknown, the
    #: workload default (TE's ``delayed``) is shown as picked and ``--range`` covers the others
    fp8_recipe: RecipeName | None = None
    #: NeMo 1.x distributed_fused_adam with bf16 weights keeps fp32 masters as 16-bit remainders
    param_remainders: bool | None = None
    #: the optimizer state's dtype (NeMo 1.x ``optim.dtype``): workload ``training.optimizer_dtype``
    optimizer_dtype: Literal["fp32", "bf16"] | None = None
    #: the run replayed its layers as CUDA graphs (no host floor: chip ``efficiency.host_linear_s``)
    cuda_graphs: bool | None = None
    #: the run's userbuffers SMs per TE exchange (workload ``training.userbuffers_sms``; ``te_default``:
    #: tp_comm_overlap without a ub_tp_comm_overlap_cfg); None: NeMo's tuned configs
    userbuffers_sms: Literal["te_default"] | dict[str, int] | None = None
    #: the run's Megatron-Core ``cross_entropy_loss_fusion`` (its config file; NeMo 1.x copies the
    #: key into TransformerConfig): workload ``training.cross_entropy`` megatron_fused (true) or
    #: unfused (false); None: the system's default (unfused on GPUs, Megatron-Core's default)
    cross_entropy_loss_fusion: bool | None = None
    #: the run's Megatron-Core ``cross_entropy_fusion_impl`` (read only with the fusion on):
    #: ``native`` (megatron/core/fusions/fused_cross_entropy.py: workload ``megatron_fused``) or
    #: ``te`` (Transformer Engine's ``parallel_cross_entropy``: workload ``te``); None: native
    cross_entropy_fusion_impl: Literal["native", "te"] | None = None

    @model_validator(mode="after")
    def _impl_needs_fusion(self) -> "CaseTraining":
        if self.cross_entropy_fusion_impl is not None and self.cross_entropy_loss_fusion is not True:
            raise ValueError("cross_entropy_fusion_impl is read only with cross_entropy_loss_fusion: true "
                             "(Megatron-Core ignores it otherwise); set both, or neither")
        return self


class CaseSystem(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # descriptive fields (links, nodes)
    num_chips: int = Field(gt=0)
    chip: str = ""


class CaseParallelism(Strict):
    """The published mapping; a knob left out (None) is unknown: the optimizer picks it and the
    report says which value it picked (an unknown knob must not silently tune a case)."""

    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    dp: int = Field(gt=0)
    cp: int = Field(default=1, gt=0)
    activation_recompute: Literal["none", "selective", "full"] | None = None
    sequence_parallel: bool | None = None
    virtual_pipeline: int | None = Field(default=None, gt=0)
    distributed_optimizer: bool | None = None
    #: ZeRO stage as the run sharded its state over the dp x cp ranks: 1 Megatron's distributed
    #: optimizer, 3 fully sharded data parallelism (Megatron FSDP, PyTorch FSDP, ZeRO-3: parameters,
    #: gradients and optimizer state; the performance tables' "FSDP 1"); None: the optimizer picks
    #: (from ``distributed_optimizer`` when that is given)
    zero_stage: Literal[0, 1, 2, 3] | None = None
    #: Megatron's tp_comm_overlap (TE userbuffers) as the run set it; None: the optimizer picks
    tp_comm_overlap: bool | None = None
    #: whether the DP gradient reduction ran under the backward (Megatron-Core DDP
    #: ``--overlap-grad-reduce``, NeMo ``overlap_grad_sync``); false for Megatron-LM before
    #: Megatron-Core (2021-2022), which reduced the gradients after the last backward
    #: (``optimizer.reduce_model_grads`` in megatron/training.py ``train_step``); None: the default (on)
    overlap_grad_reduce: bool | None = None
    #: expert parallelism (MoE), carved out of the dp x cp ranks
    ep: int = Field(default=1, gt=0)
    #: Megatron-Core expert_tensor_parallel_size as the run set it (None: = tp, Megatron's
    #: default); modelled: 1 or tp (another value is skipped with that reason,
    #: :data:`NOT_YET_EVALUABLE`)
    expert_tensor_parallel: int | None = Field(default=None, gt=0)
    #: Megatron-Core --overlap-moe-expert-parallel-comm / DeepSeek DualPipe; None: optimizer picks
    overlap_moe_expert_parallel_comm: bool | None = None
    #: Megatron-Core --pipeline-model-parallel-layout as the run set it (the workload's
    #: ``training.pipeline_layout``); None: Megatron's even split
    pipeline_layout: str | None = None


class CaseMeasured(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # metric names, MFU/HFU, ...
    iteration_time_s: float = Field(gt=0)


class Case(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # config_source, ...
    id: str
    #: where the numbers come from; also names the framework that ran (:func:`framework_of`)
    source: str = ""
    notes: str = ""
    model: CaseModel
    training: CaseTraining
    system: CaseSystem
    parallelism: CaseParallelism
    measured: CaseMeasured


@dataclass
class Row:
    """One case's outcome (times in seconds; error = predicted / measured - 1).

    ``chosen``: the value the optimizer picked for every knob the case leaves out;
    ``range_s``: (best, worst) prediction over every value of those knobs that fits (when asked).
    """

    id: str
    num_chips: int
    mapping: str
    micro_batch: int
    predicted_s: float | None
    measured_s: float
    error: float | None
    free_predicted_s: float | None = None
    free_mapping: str | None = None
    message: str = ""
    system: str = ""
    chosen: dict = field(default_factory=dict)
    range_s: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def read_case_items(path: str | Path) -> tuple[Path, list]:
    """The raw case mappings of a cases file or shipped data set name (one-line errors)."""
    import yaml

    path = resolve_cases(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    except UnicodeDecodeError:
        raise InputError("not a UTF-8 text file", source=str(path)) from None
    except yaml.YAMLError as exc:
        raise InputError(f"malformed YAML: {getattr(exc, 'problem', exc)}", source=str(path)) from None
    if not isinstance(data, list):
        raise InputError("expected a YAML list of cases", source=str(path), field="<root>")
    return path, data


def parse_case(item: Any, path: Path, i: int) -> Case:
    from pydantic import ValidationError

    try:
        return Case.model_validate(item)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(validation_message(err), source=str(path), field=f"{i}.{field_path(err['loc'])}") from None


def load_cases(path: str | Path) -> list[Case]:
    """Validated cases; a bad case is a one-line :class:`InputError` naming file and field."""
    path, data = read_case_items(path)
    return [parse_case(item, path, i) for i, item in enumerate(data)]


def _get(item: Any, *keys: str) -> Any:
    for k in keys:
        item = item.get(k) if isinstance(item, dict) else None
    return item


# What the model cannot evaluate yet, one check per feature: each returns the reason or None.
# A case that fails one becomes a row with that message instead of stopping the whole file.
NOT_YET_EVALUABLE = [
    lambda c: (f"family {c['family']}: validate evaluates LLM training cases only"
               if c.get("family") not in (None, "llm", "llm_training") else None),
    lambda c: (f"needs context parallelism (cp={_get(c, 'parallelism', 'cp')})"
               if (_get(c, "parallelism", "cp") or 1) > 1 and not supports_knob("cp") else None),
    # expert TP is modelled as TP (Megatron-LM's default) or 1 (experts unsplit)
    lambda c: (f"needs expert tensor parallelism {_get(c, 'parallelism', 'expert_tensor_parallel')} "
               f"(modelled: 1 or tp = {_get(c, 'parallelism', 'tp')})"
               if _get(c, "parallelism", "expert_tensor_parallel") not in (None, 1, _get(c, "parallelism", "tp"))
               else None),
]


def not_evaluable(item: Any) -> str | None:
    """Why this raw case cannot be evaluated yet, or None when it can."""
    if not isinstance(item, dict):
        return None
    return next((reason for check in NOT_YET_EVALUABLE if (reason := check(item))), None)


def skipped_row(item: dict, reason: str) -> Row:
    measured = _get(item, "measured", "iteration_time_s")
    n = _get(item, "system", "num_chips")
    return Row(str(item.get("id", "?")), n if isinstance(n, int) else 0, "", 0, None,
               float(measured) if isinstance(measured, (int, float)) else float("nan"), None, message=reason)


def resolve_cases(name_or_path: str | Path) -> Path:
    """A cases file: a path, or the name of a shipped calibration data set (``megatron_a100``).

    >>> resolve_cases("megatron_a100").name
    'megatron_a100.yaml'
    """
    from dfmodel.presets import resolve, unknown_preset_message

    path = resolve(name_or_path, "calibration")
    if not path.exists():
        raise InputError(unknown_preset_message(name_or_path, "calibration"), source=str(name_or_path))
    return path


#: Preset per chip a case names (matched on the chip name's first word; GB200 before B200).
CHIP_PRESETS = (("GB200", "gb200_nvl72"), ("A100", "dgx_a100"), ("H100", "dgx_h100"), ("H200", "dgx_h200"),
                ("H800", "dgx_h800"), ("B200", "dgx_b200"), ("MI300X", "mi300x"), ("V100", "v100_fdr"))


def system_of(case_chip: str, system: Any = None) -> Any:
    """The system a case runs on: ``system`` when given (not ``auto``), else the preset of the
    case's chip (:data:`CHIP_PRESETS`), else the A100 preset.

    >>> system_of("H200-SXM5-141GB (HBM3e 141 GB; otherwise as H100 SXM5)")
    'dgx_h200'
    """
    if system not in (None, "auto"):
        return system
    name = (case_chip.split() or [""])[0].lower()
    for key, preset in CHIP_PRESETS:
        if key.lower() in name:
            return preset
    return DEFAULT_SYSTEM


def workload_of(case: Case) -> dict[str, Any]:
    """The ``kind: llm`` workload dict of a case.

    Architecture defaults where a case is silent, by the framework recipe of its MLP type:
    GELU models are Megatron GPT (tied embeddings, hidden/attention dropout 0.1); SwiGLU
    (Llama 3.1) and squared-ReLU (Nemotron-4) models are NeMo recipes with untied embeddings and
    no dropout (NeMo llama31_* / nemotron4_* recipes: hidden_dropout = attention_dropout = 0,
    share_embeddings_and_output_weights = False). ``attention`` left out is decided by the
    system (flash on GPUs). Mixed 16-bit precision is modelled as bf16.
    """
    model = {k: v for k, v in case.model.model_dump().items() if v is not None}
    gpt = case.model.ffn_type == "gelu"
    model.setdefault("dropout", gpt)
    model.setdefault("tie_embeddings", gpt)
    if case.model.ffn_type != "gelu":
        model.setdefault("position_embedding", "rotary")
    precision, _ = case_precision(case)
    training = {"global_batch": case.training.global_batch, "precision": precision}
    training.update(framework_defaults(case))
    if case.training.grad_reduce is not None:
        training["grad_reduce"] = case.training.grad_reduce
    if case.training.param_remainders is not None:
        training["param_remainders"] = case.training.param_remainders
    if case.training.optimizer_dtype is not None:
        training["optimizer_dtype"] = case.training.optimizer_dtype
    if case.training.cuda_graphs is not None:
        training["cuda_graphs"] = case.training.cuda_graphs
    if case.training.userbuffers_sms is not None:
        training["userbuffers_sms"] = case.training.userbuffers_sms
    if case.training.cross_entropy_loss_fusion is not None:
        fused = "te" if case.training.cross_entropy_fusion_impl == "te" else "megatron_fused"
        training["cross_entropy"] = fused if case.training.cross_entropy_loss_fusion else "unfused"
    if case.parallelism.pipeline_layout is not None:
        training["pipeline_layout"] = case.parallelism.pipeline_layout
    if precision == "fp8":
        fp8 = {"fp8_weights": case.training.fp8_weights, "recipe": fp8_recipe_of(case)}
        training["fp8"] = {k: v for k, v in fp8.items() if v is not None}
    return {"kind": "llm", "name": case.id, "model": model, "training": training}


#: How published tables spell an FP8 recipe inside the precision ("FP8-CS", "fp8_ds", "MXFP8":
#: the Megatron Bridge performance summary's and NeMo performance scripts' compute_dtype names).
_RECIPE_SPELLINGS = (("mxfp8", re.compile(r"mxfp8|fp8[-_ ]?mx")),
                     ("current", re.compile(r"fp8[-_ ]?cs\b|current|tensorwise")),
                     ("delayed", re.compile(r"fp8[-_ ]?ds\b|delayed")),
                     ("blockwise", re.compile(r"block|fp8[-_ ]?sc\b|subchannel")))


def case_precision(case: Case) -> tuple[str, str | None]:
    """(workload precision, FP8 recipe the text names or None) of a case's ``training.precision``.

    Mixed 16-bit ("bf16/fp16 mixed") is modelled as bf16; any FP8 spelling is ``fp8``; other
    text is passed on for the workload schema to accept or reject.

    >>> [case_precision(Case.model_construct(training=CaseTraining.model_construct(precision=p)))
    ...  for p in ("FP8-CS", "bf16/fp16 mixed", "MXFP8", "fp8")]
    [('fp8', 'current'), ('bf16', None), ('fp8', 'mxfp8'), ('fp8', None)]
    """
    text = case.training.precision.lower()
    if "fp8" in text:
        return "fp8", next((name for name, spelled in _RECIPE_SPELLINGS if spelled.search(text)), None)
    if "bf16" in text or "fp16" in text:
        return "bf16", None
    return case.training.precision, None


#: Sources of runs made with NVIDIA's NeMo recipes: NeMo itself, NVIDIA's dgxc-benchmarking (its
#: 'Expected Performance' tables run NeMo recipes), MLPerf Training (the GPU LLM submissions,
#: NVIDIA's and its partners', run NVIDIA's NeMo / Megatron-Core implementation), and Megatron
#: Bridge, NeMo's successor (its performance summary runs its perf_recipes).
_NEMO_SOURCE = re.compile(r"nemo|dgxc-benchmarking|mlperf|megatron[- ]bridge", re.IGNORECASE)
_BRIDGE_SOURCE = re.compile(r"megatron[- ]bridge", re.IGNORECASE)


def framework_of(case: Case) -> str:
    """``megatron_bridge`` or ``nemo`` when the case's source or notes name such a run, else
    ``megatron_lm`` (Megatron-LM's own training script: the A100 papers)."""
    text = f"{case.source} {case.notes}"
    if _BRIDGE_SOURCE.search(text):
        return "megatron_bridge"
    return "nemo" if _NEMO_SOURCE.search(text) else "megatron_lm"


def framework_defaults(case: Case) -> dict[str, Any]:
    """Training fields the case's framework sets where the case is silent (a field the case
    gives wins). NVIDIA's performance recipes reduce gradients in bf16: NeMo's
    (``grad_reduce_in_fp32 = False`` in every ``pretrain_performance_optimizations`` of
    nemo/collections/llm/recipes, e.g. llama3_70b.py, llama31_405b.py, nemotron4_340b.py,
    gpt3_175b.py, and for every run of scripts/performance/helpers.py ``set_precision_configs``;
    NeMo 1.x's distributed_fused_adam ``grad_sync_dtype: bf16`` in the dgxc-benchmarking configs)
    and Megatron Bridge's (perf_recipes/_common.py: "benchmark-mode default" ``grad_reduce_in_fp32
    = False``; its ordinary recipes keep fp32). Megatron-LM's default, fp32 main gradients for
    bf16 (megatron/training/arguments.py without ``--grad-reduce-in-bf16``), is the workload's
    own default. 16-bit runs only: an fp32 run reduces in fp32."""
    if framework_of(case) != "megatron_lm" and case_precision(case)[0] in ("bf16", "fp8"):
        return {"grad_reduce": "bf16"}
    return {}


def fp8_recipe_of(case: Case) -> str | None:
    """The FP8 recipe of an FP8 case: its ``fp8_recipe``, else the one its precision text names,
    else its framework's default (:func:`unknown_workload_knobs`); None for other precisions."""
    precision, named = case_precision(case)
    if precision != "fp8":
        return None
    return case.training.fp8_recipe or named or unknown_workload_knobs(case)["fp8_recipe"]


def framework_defaults_used(case: Case) -> dict[str, str]:
    """The :func:`framework_defaults` the case did not override, for the table's picked column."""
    return {k: f"{v} ({framework_of(case)} default)" for k, v in framework_defaults(case).items()
            if getattr(case.training, k) is None}


#: Knobs a case may leave out, and the values the range of predictions covers.
UNKNOWN_KNOB_VALUES = {
    "recompute": ("none", "selective", "full"),
    "sequence_parallel": (False, True),
    "distributed_optimizer": (False, True),
}


#: FP8 recipes the range of an FP8 run that does not name its recipe covers (``mxfp8`` drops out
#: on a chip that cannot run it: the model refuses it with an InputError).
UNKNOWN_FP8_RECIPES = ("delayed", "current", "blockwise", "mxfp8")


def unknown_workload_knobs(case: Case) -> dict[str, Any]:
    """Workload fields the case leaves out that change the prediction, with the value the
    workload defaults to (shown as picked): the FP8 recipe of an FP8 run (TE's ``delayed``)."""
    precision, named = case_precision(case)
    if precision == "fp8" and case.training.fp8_recipe is None and named is None:
        # Megatron Bridge's H100/B200 performance recipes run FP8 with current scaling
        # (perf_recipes/llama/h100/llama3.py ``_perf_precision("fp8_cs")``); NeMo's use delayed
        # scaling (bf16_with_fp8_mixed ``fp8_recipe = "delayed"``; helpers.py: "ds" by default),
        # as TE does by default
        return {"fp8_recipe": "current" if framework_of(case) == "megatron_bridge" else "delayed"}
    return {}


def workload_variants(case: Case, w: dict) -> list[dict]:
    """``w`` once per value of the case's unknown workload fields (:func:`unknown_workload_knobs`)."""
    if "fp8_recipe" not in unknown_workload_knobs(case):
        return [w]
    return [{**w, "training": {**w["training"], "fp8": {**w["training"].get("fp8", {}), "recipe": r}}}
            for r in UNKNOWN_FP8_RECIPES]


def knobs_of(case: Case) -> dict[str, Any]:
    """The mapping the case published, as ``optimize`` keyword arguments (None = unknown).

    ``cp`` is passed only when it is not 1 (builds without context parallelism cannot take it).
    """
    p = case.parallelism
    knobs = {
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "micro_batch": case.training.micro_batch,
        "recompute": p.activation_recompute,
        "sequence_parallel": p.sequence_parallel,
        "interleave": p.virtual_pipeline,
        "distributed_optimizer": p.distributed_optimizer,
        # no published run here moves state or activations to host memory (Megatron-LM / NeMo /
        # Megatron Bridge recipes leave cpu offloading off): fixed off, never a silent pick that
        # rescues a mapping the model thinks does not fit (the report then says it does not fit)
        "offload_optimizer": "none", "offload_activations": False, "offload_weights": False,
    }
    if p.cp != 1:
        knobs["cp"] = p.cp
    if p.zero_stage is not None:
        knobs["zero_stage"] = p.zero_stage
        if p.distributed_optimizer is not None and p.distributed_optimizer != (p.zero_stage >= 1):
            raise InputError(f"{case.id}: parallelism.distributed_optimizer {p.distributed_optimizer} contradicts "
                             f"zero_stage {p.zero_stage} (the distributed optimizer is stage 1, implied by 2 and 3)",
                             field="parallelism.zero_stage")
        knobs["distributed_optimizer"] = p.zero_stage >= 1  # (what the stage implies: not an unknown)
    if p.tp_comm_overlap is not None:
        knobs["tp_comm_overlap"] = p.tp_comm_overlap
    if p.overlap_grad_reduce is not None:
        knobs["overlap_grad_reduce"] = p.overlap_grad_reduce
    if p.ep != 1:  # MoE knobs; unknown ones (None) are picked and shown as picked
        knobs["ep"] = p.ep
        knobs["overlap_moe_expert_parallel_comm"] = p.overlap_moe_expert_parallel_comm
        etp = p.expert_tensor_parallel
        knobs["etp"] = None if etp is None else (1 if etp == 1 and p.tp > 1 else 0)
    return knobs


def supports_knob(name: str) -> bool:
    """Whether this build's ``optimize`` takes the knob (context parallelism lands separately)."""
    import inspect

    from dfmodel.optimizer import optimize

    from dfmodel.inter_chip.config import OPTION_NAMES

    return name in inspect.signature(optimize).parameters or name in OPTION_NAMES  # options: **kwargs


def chosen_values(knobs: dict[str, Any], parallelism) -> dict[str, Any]:
    """What the optimizer picked for every knob the case left out."""
    attr = {"micro_batch": "micro_batch", "recompute": "recompute", "sequence_parallel": "sequence_parallel",
            "interleave": "interleave", "distributed_optimizer": "distributed_optimizer",
            "overlap_moe_expert_parallel_comm": "overlap_moe_expert_parallel_comm", "etp": "etp"}
    return {k: getattr(parallelism, attr[k]) for k, v in knobs.items() if v is None and k in attr}


def prediction_range(w: dict | list[dict], system: Any, n: int, knobs: dict[str, Any],
                     picked_mb: int) -> tuple[float, float] | None:
    """(best, worst) iteration time over every value of the unknown knobs that fits, and over
    the workload variants ``w`` when it is a list (:func:`workload_variants`).

    The micro-batch is held at the optimizer's pick when the case leaves it out (it is an
    optimizer choice, not an unknown of the published run's physics, in every case file here).
    """
    import itertools

    from dfmodel.optimizer import optimize

    unknown = [k for k in UNKNOWN_KNOB_VALUES if knobs.get(k) is None]
    times = []
    for wv, values in itertools.product(w if isinstance(w, list) else [w],
                                        itertools.product(*(UNKNOWN_KNOB_VALUES[k] for k in unknown))):
        fixed = {**knobs, **dict(zip(unknown, values))}
        if fixed.get("micro_batch") is None:
            fixed["micro_batch"] = picked_mb
        try:
            times.append(optimize(wv, system, num_chips=n, alternatives=0, **fixed).iteration_time_s)
        except DFModelError:
            continue
    return (min(times), max(times)) if times else None


def describe(parallelism, pipeline: dict | None = None) -> str:
    """The mapping in one short label; with a result's ``pipeline``, the layers per stage when
    they were moved off the time-balanced split to fit memory (``layers 13/11/...``)."""
    p = parallelism
    moved = pipeline and pipeline.get("split_moved")
    return (f"TP{p.tp} PP{p.pp}{f' CP{p.cp}' if getattr(p, 'cp', 1) > 1 else ''} DP{p.dp} mb{p.micro_batch}"
            f" v{p.interleave} {p.recompute}{' SP' if p.sequence_parallel else ''}"
            f"{f' ZeRO{p.zero_stage}' if getattr(p, 'zero_stage', 0) >= 2 else ''}"
            f"{f' EP{p.ep}' if getattr(p, 'ep', 1) > 1 else ''}"
            f"{' ETP1' if getattr(p, 'etp', 0) == 1 and p.tp > 1 else ''}"
            f"{' a2a-overlap' if getattr(p, 'overlap_moe_expert_parallel_comm', False) else ''}"
            f"{' layers ' + '/'.join(map(str, pipeline['layers_per_stage'])) if moved else ''}")


def optimize_as_megatron(w: dict, system: Any, n: int, knobs: dict[str, Any]):
    """``optimize`` within what Megatron-LM / NeMo runs: the optimizer is sharded (distributed
    optimizer = ZeRO 1) or not, never ZeRO 2/3 (Megatron has no such stages), so an unknown
    ``distributed_optimizer`` is searched over those two values only."""
    from dfmodel.optimizer import optimize

    if knobs.get("distributed_optimizer") is not None or knobs.get("zero_stage") is not None:
        return optimize(w, system, num_chips=n, alternatives=0, **knobs)
    results, error = [], None
    for sharded in (False, True):
        try:
            results.append(optimize(w, system, num_chips=n, alternatives=0, **{**knobs, "distributed_optimizer": sharded}))
        except DFModelError as exc:
            error = exc
    if not results:
        raise error
    return min(results, key=lambda r: r.iteration_time_s)


def evaluate_case(case: Case, system: Any = None, *, free: bool = False, ranges: bool = False,
                  workload_overrides: dict | None = None) -> Row:
    """Predict one case with its published mapping (and, with ``free``, with none fixed).

    ``system`` None or ``auto``: the preset of the case's chip. ``ranges``: also the best and
    worst prediction over the unknown knobs. ``workload_overrides`` update the workload's
    ``model`` block (e.g. ``{"attention": "unfused"}`` for runs that predate FlashAttention).
    """
    from dfmodel.optimizer import optimize

    system = system_of(case.system.chip, system)
    w, n = workload_of(case), case.system.num_chips
    w["model"].update(workload_overrides or {})
    measured = case.measured.iteration_time_s
    sname = system if isinstance(system, str) else getattr(system, "name", "")
    knobs = knobs_of(case)
    missing = [k for k in knobs if k not in ("tp", "pp", "dp") and not supports_knob(k)]
    if missing:
        return Row(case.id, n, "", 0, None, measured, None, system=sname,
                   message=f"skipped: needs {', '.join(f'{k}={knobs[k]}' for k in missing)}, not in this build")
    try:
        r = optimize_as_megatron(w, system, n, knobs)
    except DFModelError as exc:
        return Row(case.id, n, "", 0, None, measured, None, message=str(exc), system=sname)
    row = Row(case.id, n, describe(r.parallelism, r.pipeline), r.parallelism.micro_batch, r.iteration_time_s, measured,
              r.iteration_time_s / measured - 1, system=sname,
              chosen=chosen_values(knobs, r.parallelism) | framework_defaults_used(case) | unknown_workload_knobs(case))
    if ranges or unknown_workload_knobs(case):  # an unknown recipe always shows what it spans
        row.range_s = prediction_range(workload_variants(case, w), system, n, knobs, r.parallelism.micro_batch)
    if free:
        try:
            best = optimize(w, system, num_chips=n, alternatives=0)  # only the optimum is shown
            row.free_predicted_s, row.free_mapping = best.iteration_time_s, describe(best.parallelism, best.pipeline)
        except DFModelError as exc:
            row.message = f"free search: {exc}"
    return row


def validate_cases(path: str | Path, system: Any = None, *, free: bool = False, ranges: bool = False,
                   workload_overrides: dict | None = None, on_case: Callable[[Row], None] | None = None,
                   workers: int | None = None) -> list[Row]:
    """Evaluate every case in ``path`` on ``system`` (default: the preset of each case's chip);
    a case the model cannot evaluate yet becomes a row saying why. ``on_case(row)`` is called as
    each case finishes, in the file's order (progress). The cases run on ``workers`` processes
    (default: every usable core, :mod:`dfmodel.parallel`), each case's search serial; the rows
    are the same, in the same order, as with ``workers=1``."""
    from dfmodel.parallel import ordered_map, single_core

    path, data = read_case_items(path)

    def one(job) -> Row:
        i, item = job
        reason = not_evaluable(item)
        return skipped_row(item, reason) if reason else evaluate_case(
            parse_case(item, path, i), system, free=free, ranges=ranges, workload_overrides=workload_overrides)

    with single_core() if workers == 1 else contextlib.nullcontext():  # -j 1: the search serial too
        return ordered_map(one, list(enumerate(data)), workers=workers, on_result=on_case)


def summary(rows: list[Row]) -> dict[str, float]:
    """Mean and max absolute relative error over the cases that could be evaluated."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    return {
        "cases": len(rows),
        "evaluated": len(errors),
        "mean_abs_error": sum(errors) / len(errors) if errors else float("nan"),
        "max_abs_error": max(errors) if errors else float("nan"),
    }


# --------------------------------------------------------------------------------------------
# DLRM, HPL and FFT cases (calibration/other_families.yaml, shipped)
# --------------------------------------------------------------------------------------------


class FamilyCase(Strict):
    """One published DLRM / HPL / FFT measurement (the other_families.yaml schema)."""

    model_config = Strict.model_config | {"extra": "ignore"}
    id: str
    family: Literal["dlrm_training", "hpl", "fft"]
    value: float = Field(gt=0)
    units: str
    workload: dict = Field(default_factory=dict)
    system: dict = Field(default_factory=dict)
    extra_measured: list[dict] | None = None


#: HPL block size when a case does not publish it: NVIDIA's HPL for A100/H100 (HPC-Benchmarks
#: container) uses NB = 288 (A100) and 1024 (H100) in its sample HPL.dat files; other values
#: are covered by the prediction range.
HPL_NB = {"A100": 288, "H100": 1024}
#: Fraction of the machine's HBM the HPL matrix fills when N is not published (NVIDIA's sample
#: HPL.dat files size N to ~85-90 % of GPU memory; the range covers 70 % and 50 %).
HPL_MEMORY_FRACTIONS = (0.9, 0.7, 0.5)


def is_family_file(path: str | Path) -> bool:
    """Whether a cases file holds DLRM / HPL / FFT cases (entries with a ``family`` key)."""
    import yaml

    try:
        data = yaml.safe_load(resolve_cases(path).read_text())
    except (OSError, yaml.YAMLError, InputError):
        return False  # the LLM loader reports the problem with the file and field
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "family" in data[0]


def load_family_cases(path: str | Path) -> list[FamilyCase]:
    import yaml
    from pydantic import ValidationError

    path = resolve_cases(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    if not isinstance(data, list):
        raise InputError("expected a YAML list of cases", source=str(path), field="<root>")
    out = []
    for i, item in enumerate(data):
        try:
            out.append(FamilyCase.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise InputError(validation_message(err), source=str(path), field=f"{i}.{field_path(err['loc'])}") from None
    return out


def _ints(text) -> list[int]:
    """Integers of a list or of a text such as '[1, 2]' or '1024-1024-512-256-1 (note)'."""
    import re

    if isinstance(text, list):
        return [int(x) for x in text]
    head = str(text).split("(")[0]
    return [int(x) for x in re.findall(r"\d+", head)]


def _chips(case: FamilyCase) -> int:
    s = case.system
    return int(s.get("chip_count") or s.get("gpus") or s.get("num_chips"))


def _extra(case: FamilyCase, metric_word: str) -> float | None:
    for m in case.extra_measured or []:
        if metric_word in str(m.get("metric", "")):
            return float(m["value"])
    return None


def family_case_inputs(case: FamilyCase) -> list[tuple[dict, float, dict]]:
    """[(workload dict, measured seconds, knobs the case left out and their values)] -- one
    entry per value of the unknown knobs (the first is the nominal choice)."""
    chip = str(case.system.get("chip", ""))
    n = _chips(case)
    if case.family == "dlrm_training":
        w = case.workload
        rows = _ints(w["table_rows"])
        workload = {"kind": "dlrm", "name": case.id,
                    # MLPerf v2.0 DLRM on Criteo 1TB: one-hot categorical features (one look-up
                    # per table and sample)
                    "embedding": {"num_tables": int(w["embedding_tables"]), "rows_per_table": rows,
                                  "dim": int(w["embedding_dim"]), "lookups_per_table": 1},
                    "dense_features": int(w["dense_features"]), "bottom_mlp": _ints(w["bottom_mlp"]),
                    "top_mlp": _ints(w["top_mlp"]), "interaction": "dot",
                    "training": {"global_batch": int(w["global_batch"]), "precision": "fp16",
                                 "optimizer": str(w.get("optimizer", "sgd")).lower(),
                                 "cuda_graphs": bool(w.get("cuda_graphs", False))}}
        throughput = _extra(case, "throughput")
        if throughput is None:
            raise InputError("a DLRM case needs a 'median logged throughput' in extra_measured", field=case.id)
        return [(workload, int(w["global_batch"]) / throughput, {})]
    if case.family == "fft":
        w = case.workload
        grid = _ints(w["grid"])
        per_transform = case.value / 1000.0 / (2 * int(w.get("iterations", 1)))  # fwd + bwd per iteration
        workload = {"kind": "fft", "name": case.id, "dims": grid, "batch": 1, "precision": "fp64",
                    "decomposition": "pencil"}
        return [(workload, per_transform, {})]
    # HPL: Rmax -> time of the factorisation; N, NB, P x Q are not published
    from dfmodel.inter_chip.hpl import hpl_useful_flop
    from dfmodel.yamlio import read_yaml
    from dfmodel.presets import resolve

    preset = read_yaml(resolve(system_of(chip), "systems"))
    capacity = _capacity_of(chip, preset)
    rate = case.value * (1e15 if "PFLOP" in case.units else 1e12)
    nb = next((v for k, v in HPL_NB.items() if k in chip), 512)
    p = int(math.isqrt(n))
    while n % p:
        p -= 1
    out = []
    for frac in HPL_MEMORY_FRACTIONS:
        order = int(math.sqrt(frac * n * capacity / 8) // nb * nb)
        workload = {"kind": "hpl", "name": case.id, "n": order, "nb": nb, "p": p, "q": n // p}
        out.append((workload, hpl_useful_flop(order) / rate, {"n": order, "nb": nb, "p": p, "q": n // p,
                                                               "memory_fraction": frac}))
    return out


def _capacity_of(chip: str, preset: dict) -> float:
    """HBM bytes of the case's chip (the 40 GB A100 of Selene 2020 differs from the preset's)."""
    import re

    from dfmodel.system.units import parse_quantity

    m = re.search(r"(\d+)\s*GB", chip)
    if m:
        return float(m.group(1)) * 1e9
    return parse_quantity(preset["chip"]["memory"]["capacity_bytes"], "bytes")


def with_sharp(preset: str) -> dict:
    """The ``preset`` system with in-network reduction (``sharp``) on its NCCL network
    dimensions: a case whose job ran with SHARP (``system.sharp: true``, e.g. Slurm
    ``--network=sharp``)."""
    from dfmodel.presets import resolve
    from dfmodel.yamlio import read_yaml

    spec = read_yaml(resolve(preset, "systems"))
    for dim in spec["network"]:
        if dim.get("nccl_transport") == "net":
            dim["sharp"] = True
    return spec


def evaluate_family_case(case: FamilyCase, system: Any = None) -> Row:
    """Predict one DLRM / HPL / FFT case on the preset of its chip (or ``system``)."""
    from dfmodel.optimizer import optimize

    target = system_of(str(case.system.get("chip", "")), system)
    n = _chips(case)
    sname = target if isinstance(target, str) else getattr(target, "name", "")
    if case.system.get("sharp") and isinstance(target, str):
        target = with_sharp(target)
    rows = []
    for workload, measured, picked in family_case_inputs(case):
        try:
            r = optimize(workload, target, num_chips=n)
        except DFModelError as exc:
            rows.append(Row(case.id, n, "", 0, None, measured, None, message=str(exc), system=sname, chosen=picked))
            continue
        p = r.parallelism
        rows.append(Row(case.id, n, f"TP{p.tp} PP{p.pp} DP{p.dp} mb{p.micro_batch}", p.micro_batch,
                        r.iteration_time_s, measured, r.iteration_time_s / measured - 1, system=sname,
                        chosen=picked))
    done = [r for r in rows if r.predicted_s is not None]
    first = done[0] if done else rows[0]  # the nominal choice, or the first one that fits
    if len(rows) > 1 and done:
        errs = [r.predicted_s / r.measured_s for r in done]
        first.range_s = (min(errs) * first.measured_s, max(errs) * first.measured_s)
    return first


def validate_family_cases(path: str | Path, system: Any = None, *, workers: int | None = None) -> list[Row]:
    """Every DLRM / HPL / FFT case of ``path``, on ``workers`` processes (rows in file order)."""
    from dfmodel.parallel import ordered_map

    return ordered_map(lambda c: evaluate_family_case(c, system), load_family_cases(path), workers=workers)
