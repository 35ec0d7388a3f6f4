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
- **ZeRO-3 / FSDP gathers** (:func:`fsdp_layer_floor_s`): every layer and micro-batch gathers
  its parameters in the forward and again in the backward and reduce-scatters its gradients
  (``LLMModel._fsdp_exposed``: prefetched, a phase takes at least its collectives,
  ``max(fwd, ag)`` and ``max(bwd, ag + rs)``; without prefetch more). So a layer's pass is at
  least ``2 ag + rs`` of the fewest parameters a chip holds (``1 / tp`` of the layer's: TP splits
  a weight at most ``tp`` ways) over the cheapest dp x cp group. Not under tp_comm_overlap (its
  layer times are below the solved phases the max is taken against) nor for MoE layers (their
  experts sync over the expert data-parallel group), nor on dataflow chips (a layer keeping its
  stash on chip runs below the solved phase the max is taken against): 0 there.
- **TP collectives on dataflow chips** (:func:`forced_phase_comm_s`): a fused partition takes
  ``max(compute, memory, network)``, so a phase is at least its forced TP reductions (the
  partial sums no Megatron layout avoids: :mod:`.block_floor`), which
  :func:`.dataflow_floor.pass_floor_s` now counts per phase on the cheapest TP group.
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


def fsdp_layer_floor_s(model, *, tp: int, zero_stage: int, dp_cp: int, tp_comm_overlap: bool, dp_groups,
                       memo: dict | None = None) -> float:
    """Least ZeRO-3 collective time of one layer and micro-batch, forward + backward, over the
    dp x cp groups ``dp_groups``: ``2 all_gather(P e) + reduce_scatter(P g)`` with ``P`` the
    layer's parameters over ``tp``, ``e`` / ``g`` the 16-bit parameter and gradient bytes
    (as ``LLMModel._fsdp_exposed`` sends them). 0 where the floor does not hold (module doc)."""
    if (zero_stage != 3 or dp_cp == 1 or (tp_comm_overlap and tp > 1) or model.num_experts > 1 or not dp_groups
            or model.system.chip.execution == "dataflow"):
        return 0.0
    memo = {} if memo is None else memo
    key = (tp, tuple(dp_groups))
    if key not in memo:
        params = model.graphs(1).layer.params() / tp
        t, costs = model.training, model.costs
        memo[key] = min(2 * costs.time_s("all_gather", params * t.activation_bytes, g)
                        + costs.time_s("reduce_scatter", params * t.grad_bytes, g) for g in dp_groups)
    return memo[key]


def forced_phase_comm_s(floor, k: int, costs, group, memo: dict | None = None) -> list[tuple[float, float]]:
    """The (forward, backward) network seconds of the TP reductions no layout avoids in a block
    at micro-batch ``k`` on ``group``, as the Pareto-least pairs over every choice of options:
    per weight group of the :class:`~dfmodel.inter_chip.block_floor.BlockFloor`, each option
    leaves partial sums to reduce in one phase or the other (row-parallel: forward,
    column-parallel: backward), each the cheaper of an all-reduce and a reduce-scatter of the
    logical bytes (as :func:`~dfmodel.inter_chip.block_floor.forced_comm_s`). Any sharding's
    pair is at least one of the returned pairs in both coordinates; a floor nondecreasing in
    both takes its least over them. No launches: on a dataflow chip the collective is a
    partition's network term."""
    memo = {} if memo is None else memo

    def reduce_s(b: float) -> float:
        key = (b, group)
        if key not in memo:
            memo[key] = min(costs.time_s("all_reduce", b, group), costs.time_s("reduce_scatter", b, group))
        return memo[key]

    pairs = [(0.0, 0.0)]
    for per_option in floor.forced:
        options = [(sum(reduce_s(b * k if grows else b) for b, f, grows in items if f),
                    sum(reduce_s(b * k if grows else b) for b, f, grows in items if not f)) for items in per_option]
        pairs = _pareto([(a + c, b + d) for a, b in pairs for c, d in options])
    return pairs


def _pareto(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The pairs no other pair is below in both coordinates (sorted by the first)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(set(pairs)):
        if not out or b < out[-1][1]:
            out.append((a, b))
    return out


__all__ = ["pp_p2p_floor_s", "fsdp_layer_floor_s", "forced_phase_comm_s"]
