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
from dfmodel.result import Parallelism, Result, SolverInfo
from dfmodel.system import load_system
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
) -> Result:
    """Search every valid mapping of ``workload`` on ``system`` and return the fastest.

    Any knob given is fixed; the others are searched. ``workload``/``system`` are paths, preset
    names, dicts or loaded objects. Raises :class:`~dfmodel.errors.InputError` on bad input and
    :class:`~dfmodel.errors.InfeasibleError` when no mapping fits (with what did not fit).
    """
    if solver not in ("auto", "highs", "gurobi"):
        raise InputError(f"must be auto, highs or gurobi, got {solver!r}", field="solver")
    w = load_workload(workload)
    s = load_system(system, num_chips=num_chips)
    knobs = Knobs(tp, pp, dp, micro_batch, recompute, sequence_parallel, interleave, distributed_optimizer)
    if w.kind == "llm":
        from dfmodel.inter_chip.llm_result import solve_llm

        return solve_llm(w, s, knobs, solver=solver, time_limit_s=time_limit_s)
    from dfmodel.inter_chip.families import solve_family

    return solve_family(w, s, knobs, solver=solver, time_limit_s=time_limit_s)


def cost_and_power(system) -> tuple[float, float]:
    return system_cost_usd(system), system_power_w(system)


__all__ = ["optimize", "Result", "Parallelism", "SolverInfo"]
