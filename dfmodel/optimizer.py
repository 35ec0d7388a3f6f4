"""``optimize``: the product's main job -- the fastest mapping of a workload on a system.

>>> from dfmodel import optimize                                            # doctest: +SKIP
>>> r = optimize("workloads/gpt3_175b.yaml", "systems/dgx_h100.yaml", num_chips=1024)
>>> r.parallelism.tp, r.iteration_time_s
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dfmodel.errors import InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.search import search_options
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
    alternatives: int = 5,
    progress=None,
) -> Result:
    """Search every valid mapping of ``workload`` on ``system`` and return the fastest.

    Any knob given is fixed; the others are searched. ``workload``/``system`` are paths, preset
    names, dicts or loaded objects. Raises :class:`~dfmodel.errors.InputError` on bad input and
    :class:`~dfmodel.errors.InfeasibleError` when no mapping fits (with what did not fit).

    ``time_limit_s`` caps the whole call (every inner MILP gets at most the time left): when it
    passes, the best mapping found is returned with ``solver.status == "time_limit"``, its proven
    ``solver.lower_bound_s`` and ``solver.gap`` (:class:`~dfmodel.errors.TimeLimitError` if none
    was evaluated yet). ``alternatives`` runners-up are reported in ``Result.alternatives``;
    ``progress`` receives :class:`~dfmodel.inter_chip.search.Progress` snapshots.
    """
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError(f"must be > 0 seconds, got {time_limit_s!r}", field="time_limit_s")
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise InputError(f"must be an integer >= 0, got {alternatives!r}", field="alternatives")
    with deadline_scope(time_limit_s), search_options(alternatives=alternatives, progress=progress):
        return _optimize(workload, system, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, recompute=recompute,
                         sequence_parallel=sequence_parallel, interleave=interleave,
                         distributed_optimizer=distributed_optimizer, num_chips=num_chips, solver=solver,
                         time_limit_s=time_limit_s)


def _optimize(workload, system, *, tp, pp, dp, micro_batch, recompute, sequence_parallel, interleave,
              distributed_optimizer, num_chips, solver, time_limit_s) -> Result:
    if solver not in ("auto", "highs", "gurobi"):
        raise InputError(f"must be auto, highs or gurobi, got {solver!r}", field="solver")
    w = load_workload(workload)
    s = load_system(system, num_chips=num_chips)
    knobs = Knobs(tp, pp, dp, micro_batch, recompute, sequence_parallel, interleave, distributed_optimizer)
    from dfmodel.inter_chip.registry import family_for

    family = family_for(w.kind, source=getattr(w, "source", None))
    return family.solve(w, s, knobs, solver=solver, time_limit_s=time_limit_s)


def cost_and_power(system) -> tuple[float, float]:
    return system_cost_usd(system), system_power_w(system)


__all__ = ["optimize", "Result", "Parallelism", "SolverInfo"]
