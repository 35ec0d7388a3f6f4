"""Fidelity check: predicted vs measured iteration times of published training runs.

A cases file (``../shared/calibration/megatron_a100.yaml`` is one) lists runs with the model,
the global batch, the chip count, the mapping used (TP/PP/DP, micro-batch, recompute, sequence
parallelism, interleaving) and the measured iteration time. Each case is evaluated with its
mapping fixed; a knob the case leaves out (often the micro-batch) is chosen by the optimizer.
``free=True`` also runs the optimizer with nothing fixed, to compare the optimum with the
published (expert) mapping.

>>> rows = validate_cases("../shared/calibration/megatron_a100.yaml")     # doctest: +SKIP
>>> summary(rows)["mean_abs_error"]                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from dfmodel.errors import DFModelError, InputError
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


class CaseTraining(Strict):
    global_batch: int = Field(gt=0)
    micro_batch: int | None = Field(default=None, gt=0)
    precision: str = "bf16"


class CaseSystem(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # descriptive fields (links, nodes)
    num_chips: int = Field(gt=0)
    chip: str = ""


class CaseParallelism(Strict):
    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    dp: int = Field(gt=0)
    activation_recompute: str = "none"
    sequence_parallel: bool = False
    virtual_pipeline: int | None = Field(default=None, gt=0)
    distributed_optimizer: bool = False


class CaseMeasured(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # metric names, MFU/HFU, ...
    iteration_time_s: float = Field(gt=0)


class Case(Strict):
    model_config = Strict.model_config | {"extra": "ignore"}  # source, notes
    id: str
    model: CaseModel
    training: CaseTraining
    system: CaseSystem
    parallelism: CaseParallelism
    measured: CaseMeasured


@dataclass
class Row:
    """One case's outcome (times in seconds; error = predicted / measured - 1)."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def load_cases(path: str | Path) -> list[Case]:
    """Validated cases; a bad case is a one-line :class:`InputError` naming file and field."""
    import yaml
    from pydantic import ValidationError

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    except yaml.YAMLError as exc:
        raise InputError(f"malformed YAML: {getattr(exc, 'problem', exc)}", source=str(path)) from None
    if not isinstance(data, list):
        raise InputError("expected a YAML list of cases", source=str(path), field="<root>")
    cases = []
    for i, item in enumerate(data):
        try:
            cases.append(Case.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise InputError(validation_message(err), source=str(path), field=f"{i}.{field_path(err['loc'])}") from None
    return cases


def workload_of(case: Case) -> dict[str, Any]:
    """The ``kind: llm`` workload dict of a case (Megatron GPT: GELU MLP, tied embeddings)."""
    model = {k: v for k, v in case.model.model_dump().items() if v is not None}
    precision = "bf16" if "bf16" in case.training.precision or "fp16" in case.training.precision else case.training.precision
    training = {"global_batch": case.training.global_batch, "precision": precision}
    return {"kind": "llm", "name": case.id, "model": model, "training": training}


def knobs_of(case: Case) -> dict[str, Any]:
    """The mapping the case published, as ``optimize`` keyword arguments."""
    p = case.parallelism
    return {
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "micro_batch": case.training.micro_batch,
        "recompute": p.activation_recompute,
        "sequence_parallel": p.sequence_parallel,
        "interleave": p.virtual_pipeline,
        "distributed_optimizer": p.distributed_optimizer,
    }


def describe(parallelism) -> str:
    p = parallelism
    return (f"TP{p.tp} PP{p.pp} DP{p.dp} mb{p.micro_batch} v{p.interleave} {p.recompute}"
            f"{' SP' if p.sequence_parallel else ''}")


def evaluate_case(case: Case, system: Any = DEFAULT_SYSTEM, *, free: bool = False) -> Row:
    """Predict one case with its published mapping (and, with ``free``, with none fixed)."""
    from dfmodel.optimizer import optimize

    w, n = workload_of(case), case.system.num_chips
    measured = case.measured.iteration_time_s
    try:
        r = optimize(w, system, num_chips=n, alternatives=0, **knobs_of(case))
    except DFModelError as exc:
        return Row(case.id, n, "", 0, None, measured, None, message=str(exc))
    row = Row(case.id, n, describe(r.parallelism), r.parallelism.micro_batch, r.iteration_time_s, measured,
              r.iteration_time_s / measured - 1)
    if free:
        try:
            best = optimize(w, system, num_chips=n, alternatives=0)  # only the optimum is shown
            row.free_predicted_s, row.free_mapping = best.iteration_time_s, describe(best.parallelism)
        except DFModelError as exc:
            row.message = f"free search: {exc}"
    return row


def validate_cases(path: str | Path, system: Any = DEFAULT_SYSTEM, *, free: bool = False,
                   on_case: Callable[[Row], None] | None = None) -> list[Row]:
    """Evaluate every case in ``path`` on ``system`` (default: the dgx_a100 preset);
    ``on_case(row)`` is called as each case finishes (progress)."""
    rows = []
    for c in load_cases(path):
        rows.append(evaluate_case(c, system, free=free))
        if on_case is not None:
            on_case(rows[-1])
    return rows


def summary(rows: list[Row]) -> dict[str, float]:
    """Mean and max absolute relative error over the cases that could be evaluated."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    return {
        "cases": len(rows),
        "evaluated": len(errors),
        "mean_abs_error": sum(errors) / len(errors) if errors else float("nan"),
        "max_abs_error": max(errors) if errors else float("nan"),
    }
