"""Public entry point of the intra-chip pass: :func:`partition`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import numpy as np

from dfmodel.errors import InfeasibleError, SolverError
from dfmodel.graph.graph import DataflowGraph
from dfmodel.intra_chip import ideals as _dp
from dfmodel.intra_chip.bounded_dp import floor_s, solve_bounded
from dfmodel.solvers.deadline import check as check_deadline
from dfmodel.solvers.deadline import interruptible
from dfmodel.intra_chip.cost import CostModel
from dfmodel.intra_chip.milp import solve_milp
from dfmodel.intra_chip.result import PartitionReport, PartitionResult
from dfmodel.system.schema import Chip, System

#: Time limit of a MILP solve when the caller gives none (every solve has one, DESIGN.md s. 6).
DEFAULT_TIME_LIMIT_S = 60.0
METHODS = ("auto", "milp", "dp", "closed_form")


def partition(
    graph: DataflowGraph,
    system: System | Chip,
    *,
    method: str = "auto",
    max_partitions: int | None = None,
    solver: str = "auto",
    time_limit_s: float | None = None,
    network_time_s: Mapping[str, float] | None = None,
    mip_gap: float = 1e-6,
    tile_fractions: Iterable[float] | None = None,
    tile_overhead_s: float | None = None,
    max_ideals: int = _dp.DEFAULT_MAX_IDEALS,
    max_pairs: int = _dp.DEFAULT_MAX_PAIRS,
    warm_start: bool = True,
    weight_streaming: bool = True,
    stream_buffer_fraction: float | None = None,
) -> PartitionResult:
    """Sequence of partitions of ``graph``'s kernels minimising the chip's time per micro-batch.

    ``graph`` holds the kernels one chip runs (per-chip sizes after sharding); ``network_time_s``
    the per-kernel network seconds from the inter-chip pass (zero when run alone).

    ``method``:
      - ``auto``: kernel-by-kernel chips take the closed form (one kernel per partition in
        topological order, no search); dataflow chips take the exact DP when the ideal lattice
        is within ``max_ideals``/``max_pairs``, else the MILP warm-started by the best plan
        of the DP restricted to one topological order;
      - ``dp``: the exact DP (SolverError when over the guards);
      - ``milp``: the MILP on ``solver`` (``auto``/``highs``/``gurobi``), warm-started by the DP
        plan when it is cheap (``warm_start=False`` for a cold start);
      - ``closed_form``: kernel-by-kernel chips only.

    Dataflow partitions choose, with their row tile, whether their weights stay resident in
    SRAM or are streamed from DRAM (re-read per row tile; see :mod:`dfmodel.intra_chip.cost`);
    ``weight_streaming=False`` allows resident weights only, ``stream_buffer_fraction`` sets the
    SRAM a streamed weight keeps (default :data:`~dfmodel.intra_chip.cost.STREAM_BUFFER_FRACTION`).

    ``max_partitions`` limits the partitions of a dataflow chip (kernel-by-kernel chips always
    use one per kernel). ``time_limit_s`` bounds the MILP (default 60 s); the result says
    whether it is proven optimal and with what gap. Raises InfeasibleError (one line, naming
    the kernel and the bytes against the capacity) when no plan fits.

    >>> from dfmodel.graph.kernel import Kernel, KernelKind, Tensor
    >>> from dfmodel.system.schema import Chip
    >>> chip = Chip(name="rdu", peak_flops=1e12, sram_bytes=2**20, compute_tiles=8,
    ...             memory={"kind": "DDR", "capacity_bytes": 2**30, "bandwidth_Bps": 1e9},
    ...             execution="dataflow")
    >>> mm = lambda n: Kernel(n, KernelKind.matmul, {"m": 64, "n": 64, "k": 64}, flop=2 * 64**3,
    ...                       output_bytes=8192, weight_bytes=8192)
    >>> g = DataflowGraph([mm("a"), mm("b")], [Tensor("x", None, "a", 8192),
    ...     Tensor("y", "a", "b", 8192), Tensor("z", "b", None, 8192)])
    >>> r = partition(g, chip)
    >>> r.plan, r.proven_optimal, r.method
    ([['a', 'b']], True, 'dp')
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if max_partitions is not None and max_partitions < 1:
        raise ValueError(f"max_partitions must be >= 1, got {max_partitions}")
    check_deadline()  # a whole-call deadline (optimize's time limit) has passed: abandon this pass
    t0 = time.perf_counter()
    cm = CostModel(graph, system, network_time_s, tile_fractions_=tile_fractions, tile_overhead_s=tile_overhead_s,
                   weight_streaming=weight_streaming, stream_buffer_fraction=stream_buffer_fraction)
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if cm.n == 0:
        return PartitionResult(0.0, [], True, 0.0, "closed_form", "closed_form", "optimal", 0.0, max_partitions)
    _precheck(cm)

    if method == "closed_form" or (method == "auto" and not cm.dataflow):
        if cm.dataflow:
            raise ValueError("method 'closed_form' is for kernel_by_kernel chips; use auto, dp or milp")
        plan = [[k] for k in cm.names]
        if np.isfinite(cm.plan_time_s(plan)):
            return _result(cm, plan, t0, method="closed_form", solver="closed_form", max_partitions=max_partitions)
        # the topological order parks too much in DRAM: search the orders
        method = "auto"

    if method in ("auto", "dp"):
        try:
            with interruptible():  # (checks the deadline as it goes: check_deadline)
                found = _exact_dp(cm, max_partitions, max_ideals, max_pairs)
        except _dp.TooLarge as e:
            if method == "dp":
                raise SolverError(f"graph too large for the exact DP ({e}); use method='milp'") from e
        else:
            if found is None:
                raise InfeasibleError(cm.infeasibility_reason(max_partitions))
            return _result(cm, found[0], t0, method="dp", solver="dp", max_partitions=max_partitions)

    # MILP, warm-started by the best plan known cheaply
    start = None
    if warm_start:
        start = _best_start(cm, max_partitions, max_ideals, max_pairs, exact=(method == "milp"))
    out = solve_milp(cm, max_partitions, start=start, solver=solver, time_limit_s=limit, mip_gap=mip_gap)
    if out.status == "infeasible":
        raise InfeasibleError(out.message)
    if out.plan is None:
        raise SolverError(f"MILP found no plan ({out.status}: {out.message})")
    res = _result(cm, out.plan, t0, method="milp", solver=out.backend, max_partitions=max_partitions,
                  status=out.status, gap=out.gap, bound_s=out.bound_s, message=out.message)
    res.stats.update(out.stats, milp_objective_s=out.objective_s, solve_wall_s=out.wall_s, warm_start=start is not None)
    return res


#: Lattices above this many ideals whose (ideal, superset) pairs within the tile count are
#: estimated above half the DP's pair guard take the floor-pruned DP (:mod:`.bounded_dp`) first:
#: DeepSeek-V3's MoE backward at TP 8 has 21,592 ideals and, on chips with more tiles than
#: kernels (sn30, wse2), over 32 M pairs: sent to the MILP after ~10 CPU s of pair enumeration.
#: On dragonfly (few tiles) the same lattice has few pairs and the full DP, whose pair
#: structure is shared by every graph of the shape, stays faster.
BOUNDED_MIN_IDEALS = 4096
#: The floor-pruned DP gives up past this many times the full DP's pair guard (it holds only
#: one ideal size's pairs at a time, ~1 CPU s per million): DeepSeek-V3's MoE backward at TP 8
#: on sn30 at a small micro-batch (floor 0.591 s, optimum 0.633 s, 7 % above it) keeps 16.5 M
#: pairs over its passes and is proven in ~24 CPU s, where the MILP stopped at its time limit
#: without improving its warm start.
BOUNDED_PAIR_FACTOR = 3


def floor_time_s(graph: DataflowGraph, system: System | Chip, *,
                 network_time_s: Mapping[str, float] | None = None) -> float:
    """A true lower bound of ``partition(graph, system, network_time_s=...).time_s`` (its
    defaults: streaming on, the graph's tile fractions) without solving it: the floor-pruned
    DP's floor of the whole graph (:func:`~dfmodel.intra_chip.bounded_dp.floor_s`: below every
    plan, so below any plan a solver returns), with the plain heavy-group table (the expanded
    one, ``expand_heavy_table``, costs 15x more and raised one of twelve DeepSeek-V3 sn30 phases,
    by 3 %). 0 off dataflow chips, for an empty graph, or when the floor finds no option that
    fits (the solve then raises; 0 is still a floor). DeepSeek-V3's MoE backward at TP 8 on
    sn30's slow inter-node links: 7 CPU ms against 5-22 s for the solve."""
    chip = system.chip if isinstance(system, System) else system
    if len(graph) == 0 or chip.execution != "dataflow":
        return 0.0
    cm = CostModel(graph, chip, network_time_s)
    out = float(floor_s(cm, np.ones((1, cm.n), dtype=bool))[0])
    return out if np.isfinite(out) else 0.0


def _exact_dp(cm: CostModel, max_partitions, max_ideals, max_pairs):
    """Optimal plan by the ideal-lattice DP (None: nothing fits); TooLarge past the guards.
    Large lattices of dataflow chips without a partition limit go through the floor-pruned
    DP, seeded with the best plan along one topological order; it gives up (to the MILP) past
    :data:`BOUNDED_PAIR_FACTOR` times the full DP's own pair guard (~1 CPU s per million pairs: where the floors are within ~1 %
    of the optimum the pairs within reach stay at a few million -- DeepSeek-V3's MoE backward at
    TP 8 on sn30, floor 42.67 s, optimum 42.86 s, keeps 7.5 M, proven in ~7 CPU s, where the
    MILP returned its warm start with a 99 % gap after ~50 s)."""
    unlimited = max_partitions is None or max_partitions >= cm.n
    if cm.dataflow and unlimited:
        lat = _dp.enumerate_ideals(cm, max_ideals)
        if lat.size > BOUNDED_MIN_IDEALS and _dp.estimate_pairs(lat, cm.tiles) > max_pairs // 2:
            seed = _dp.solve_dp(cm, None, lattice=_dp.chain_lattice(cm))
            return solve_bounded(cm, lat, seed, max_pairs=BOUNDED_PAIR_FACTOR * max_pairs)
    return _dp.solve_dp(cm, max_partitions, max_ideals=max_ideals, max_pairs=max_pairs)


def _precheck(cm: CostModel) -> None:
    """Cheap certain infeasibility: weights beyond DRAM, a kernel's weights (or, when streaming,
    their double buffer) beyond SRAM."""
    mib = 2**20
    if cm.all_weight_bytes > cm.dram_bytes:
        raise InfeasibleError(cm.infeasibility_reason())
    if cm.dataflow:
        c = cm.phi if cm.streaming else 1.0
        for w in cm.weights:
            if c * w.bytes > cm.sram_bytes:
                k = cm.names[w.kernels[0]]
                what = (f"the streaming buffer ({c:g} of weights {w.bytes / mib:.1f} MiB) exceeds" if cm.streaming
                        else f"resident weights {w.bytes / mib:.1f} MiB exceed")
                raise InfeasibleError(f"kernel {k!r}: {what} the chip's SRAM {cm.sram_bytes / mib:.1f} MiB at every tile")


def _best_start(cm: CostModel, max_partitions, max_ideals, max_pairs, *, exact: bool) -> list[list[str]] | None:
    """Exact DP plan when affordable (``exact``), else the DP along one topological order."""
    if exact:
        try:
            found = _dp.solve_dp(cm, max_partitions, max_ideals=max_ideals, max_pairs=max_pairs)
            if found is not None:
                return found[0]
        except _dp.TooLarge:
            pass
    found = _dp.solve_dp(cm, max_partitions, lattice=_dp.chain_lattice(cm))
    return found[0] if found is not None else None


def _result(cm: CostModel, plan, t0, *, method, solver, max_partitions, status="optimal", gap=0.0,
            bound_s=None, message="") -> PartitionResult:
    rows = cm.report_sets(plan)
    reports = [PartitionReport.from_row(r) for r in rows]
    total = float(sum(r.time_s for r in reports))
    proven = status == "optimal"
    return PartitionResult(
        time_s=total,
        partitions=reports,
        proven_optimal=proven,
        gap=gap if gap is not None else None,
        solver=solver,
        method=method,
        status=status,
        wall_s=time.perf_counter() - t0,
        max_partitions=max_partitions,
        bound_s=bound_s if bound_s is not None else (total if proven else None),
        peak_dram_live_bytes=max((r.dram_live_bytes for r in reports), default=0.0),
        message=message,
    )
