"""``optimize``: the product's main job -- the fastest mapping of a workload on a system.

>>> from dfmodel import optimize
>>> r = optimize("tiny_mlp", "dgx_a100", num_chips=8)
>>> r.num_chips, r.iteration_time_s > 0, r.solver.status
(8, True, 'optimal')
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from dfmodel.errors import InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip import parallel_search
from dfmodel.inter_chip.config import OPTION_NAMES, Knobs
from dfmodel.inter_chip.search import search_options
from dfmodel.parallel import resolve_workers
from dfmodel.result import Parallelism, Result, SolverInfo
from dfmodel.system import load_system
from dfmodel.solvers.deadline import deadline_scope
from dfmodel.system.cost import system_cost_usd, system_power_w


def optimize(
    workload: str | Path | dict[str, Any] | Any,
    system: str | Path | dict[str, Any] | Any,
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    micro_batch: int | None = None,
    recompute: str | None = None,
    sequence_parallel: bool | None = None,
    interleave: int | None = None,
    distributed_optimizer: bool | None = None,
    num_chips: int | None = None,
    solver: str = "auto",
    time_limit_s: float | None = None,
    precision: str | None = None,
    pipeline_layout: str | None = None,
    cp: int | None = None,
    ep: int | None = None,
    zero: int | None = None,
    alternatives: int = 5,
    progress=None,
    workers: int | None = None,
    **options: Any,
) -> Result:
    """Search every valid mapping of ``workload`` on ``system`` and return the fastest.

    Any knob given is fixed; the others are searched. ``cp``/``ep`` fix the context- and
    expert-parallel degrees, ``zero`` the ZeRO stage (0-3; ``distributed_optimizer=True`` is
    stage 1); further strategy options of the parallelism record (``cp_comm``,
    ``overlap_grad_reduce``, ``overlap_param_gather``: :data:`dfmodel.inter_chip.config.OPTIONS`)
    are keyword arguments of the same name. ``workload``/``system`` are paths, preset
    names, dicts or loaded objects. ``precision`` (fp64, fp32, bf16, fp16, fp8) overrides the
    workload's own (its ``training.precision`` or top-level ``precision``), ``pipeline_layout`` an
    LLM workload's ``training.pipeline_layout`` (Megatron-Core's layout string). Raises :class:`~dfmodel.errors.InputError` on bad input and
    :class:`~dfmodel.errors.InfeasibleError` when no mapping fits (with what did not fit).

    ``time_limit_s`` caps the whole call (every inner MILP gets at most the time left): when it
    passes, the best mapping found is returned with ``solver.status == "time_limit"``, its proven
    ``solver.lower_bound_s`` and ``solver.gap`` (:class:`~dfmodel.errors.TimeLimitError` if none
    was evaluated yet). ``alternatives`` runners-up are reported in ``Result.alternatives``;
    ``progress`` receives :class:`~dfmodel.inter_chip.search.Progress` snapshots.

    ``workers`` processes share the search (default: every core this process may use, one
    inside a worker of a parallel sweep or validation; :mod:`dfmodel.inter_chip.parallel_search`).
    The answer does not depend on it: the same mapping, time and status as ``workers=1``, which
    runs the serial search in this process.
    """
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError(f"must be > 0 seconds, got {time_limit_s!r}", field="time_limit_s")
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise InputError(f"must be an integer >= 0, got {alternatives!r}", field="alternatives")
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise InputError(f"unknown option {unknown[0]!r}; the options are {', '.join(OPTION_NAMES)}", field=unknown[0])
    if "zero_stage" in options:  # the record's own name for ``zero`` (Result.parallelism.zero_stage)
        stage = options.pop("zero_stage")
        if zero is not None and stage != zero:
            raise InputError(f"zero={zero!r} and zero_stage={stage!r} contradict; give one", field="zero_stage")
        zero = stage
    knobs = dict(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, recompute=recompute, sequence_parallel=sequence_parallel,
                 interleave=interleave, distributed_optimizer=distributed_optimizer, cp=cp, ep=ep, zero_stage=zero,
                 **options)
    workers = resolve_workers(workers)
    parallel = partial(parallel_search.parallel_search, workers=workers) if workers > 1 else None
    with deadline_scope(time_limit_s), search_options(alternatives=alternatives, progress=progress, parallel=parallel):
        return _optimize(workload, system, knobs, num_chips=num_chips, solver=solver, time_limit_s=time_limit_s,
                         precision=precision, pipeline_layout=pipeline_layout)


def _optimize(workload, system, knobs: dict[str, Any], *, num_chips, solver, time_limit_s, precision,
              pipeline_layout=None) -> Result:
    if solver not in ("auto", "highs", "gurobi"):
        raise InputError(f"must be auto, highs or gurobi, got {solver!r}", field="solver")
    w = load_workload(workload)
    if precision is not None:
        w = with_precision(w, precision)
    if pipeline_layout is not None:
        w = with_pipeline_layout(w, pipeline_layout)
    s = load_system(system, num_chips=num_chips)
    from dfmodel.inter_chip.registry import family_for

    family = family_for(w.kind, source=getattr(w, "source", None))
    return family.solve(w, s, Knobs(**knobs), solver=solver, time_limit_s=time_limit_s)


def with_precision(workload: Any, precision: str) -> Any:
    """A copy of ``workload`` computing in ``precision`` (validated like the YAML field).

    >>> with_precision(load_workload("gpt3_13b"), "fp32").precision.value
    'fp32'
    """
    return _with_field(workload, "precision", precision, "--precision")


def with_pipeline_layout(workload: Any, layout: str) -> Any:
    """A copy of an LLM ``workload`` split over its pipeline as Megatron-Core's layout string says
    (``training.pipeline_layout``, validated like the YAML field).

    >>> with_pipeline_layout(load_workload("gpt3_13b"), "E(t*4|)*9t*4L").training.pipeline_layout
    'E(t*4|)*9t*4L'
    """
    if getattr(workload, "kind", None) != "llm":
        raise InputError(f"a {getattr(workload, 'kind', '?')} workload has no pipeline layout (LLM workloads only)",
                         source=getattr(workload, "source", None), field="training.pipeline_layout (--pipeline-layout)")
    return _with_field(workload, "pipeline_layout", layout, "--pipeline-layout")


def _with_field(workload: Any, name: str, value: Any, flag: str) -> Any:
    """A copy of ``workload`` with its training's (or, without a training block, its own) field
    ``name`` set to ``value``, validated as in the YAML; errors name the field and the ``flag``."""
    from pydantic import ValidationError

    from dfmodel.yamlio import validation_message

    w = workload.model_copy(deep=True)
    holder = w.training if hasattr(getattr(w, "training", None), name) else w
    field = f"training.{name}" if holder is not w else name
    try:
        setattr(holder, name, value)
    except ValidationError as exc:
        raise InputError(validation_message(exc.errors()[0]), source=getattr(w, "source", None) or w.name,
                         field=f"{field} ({flag})") from None
    return w


def cost_and_power(system) -> tuple[float, float]:
    return system_cost_usd(system), system_power_w(system)


__all__ = ["optimize", "Result", "Parallelism", "SolverInfo"]
