"""Communication no schedule hides, as floors for the search's group bounds (issue 12).

The LLM search's bounds (``LLMModel.lower_bound_s`` and the group bounds of
:class:`~dfmodel.inter_chip.llm_space.LLMSpace`) count compute, memory traffic, forced TP
reductions, the bubble and the optimizer step. On slow links the rest of the time is
communication that sits on the critical path whatever the overlap knobs say; each term here is
a floor valid for every mapping of the group it is asked about (a minimum over the placements
and options the group allows), so adding it keeps every bound below the evaluated time.

- **pipeline p2p** (:func:`pp_p2p_floor_s`): plain 1F1B (``v = 1``) is timed by the closed form
  :func:`~dfmodel.inter_chip.pipeline.pipeline_time`, ``m T* + (sum T - T*) + K p2p_s`` with
  ``K`` = :func:`~dfmodel.inter_chip.pipeline.p2p_transfers_on_critical_path` (fill, drain and
  the steady state's ``2 (pp - 1) / pp`` per micro-batch), for any stage times; so
  ``K min_g p2p_s(g)`` over the group's PP placements ``g`` adds to the compute bound
  ``(m + pp - 1) avg`` exactly. Interleaved (``v > 1``): the simulated makespan only grows with
  ``p2p_s`` (a longest path), so 0 there.
"""

from __future__ import annotations

from dfmodel.inter_chip import pipeline as pipe


def pp_p2p_floor_s(model, *, pp: int, micro_batch: int, num_micro_batches: int, interleave: int, cp: int,
                   tp: int, pp_groups, memo: dict | None = None) -> float:
    """Least exposed pipeline point-to-point time of any mapping with these knobs and one of
    the PP groups ``pp_groups`` (placement tuples): ``K p2p_s`` for ``v = 1``, 0 otherwise."""
    if pp <= 1 or interleave != 1 or not pp_groups:
        return 0.0
    memo = {} if memo is None else memo
    key = (micro_batch, cp, tp, tuple(pp_groups))
    if key not in memo:
        memo[key] = min(model.p2p_s(micro_batch, cp, tp, g) for g in pp_groups)
    return pipe.p2p_transfers_on_critical_path(pp, num_micro_batches, 1) * memo[key]


__all__ = ["pp_p2p_floor_s"]
