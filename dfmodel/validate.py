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
               if (_get(c, "parallelism", "cp") or 1) > 1 else None),
    lambda c: (f"needs the {_get(c, 'model', 'ffn_type')} MLP (ffn_type)"
               if _get(c, "model", "ffn_type") not in (None, "gelu") else None),
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
        r = optimize(w, system, num_chips=n, **knobs_of(case))
    except DFModelError as exc:
        return Row(case.id, n, "", 0, None, measured, None, message=str(exc))
    row = Row(case.id, n, describe(r.parallelism), r.parallelism.micro_batch, r.iteration_time_s, measured,
              r.iteration_time_s / measured - 1)
    if free:
        try:
            best = optimize(w, system, num_chips=n)
            row.free_predicted_s, row.free_mapping = best.iteration_time_s, describe(best.parallelism)
        except DFModelError as exc:
            row.message = f"free search: {exc}"
    return row


def validate_cases(path: str | Path, system: Any = DEFAULT_SYSTEM, *, free: bool = False) -> list[Row]:
    """Evaluate every case in ``path`` on ``system`` (default: the dgx_a100 preset)."""
    path, data = read_case_items(path)
    rows = []
    for i, item in enumerate(data):
        reason = not_evaluable(item)
        rows.append(skipped_row(item, reason) if reason else evaluate_case(parse_case(item, path, i), system, free=free))
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
