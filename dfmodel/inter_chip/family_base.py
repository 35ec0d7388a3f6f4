"""What the non-LLM families (DLRM, HPL, FFT, graph) share: the cost-model base class, knob
checks, graph rescaling, the intra-chip pass and its valid floors, breakdown and Result
building, the search call. The families import this module; :mod:`.families` (the entry point
and its documentation) and :mod:`.registry` import the families -- never the other way round.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Phase, Tensor
from dfmodel.inter_chip.memory import MemoryBreakdown
from dfmodel.inter_chip.config import KNOB_NAMES, NEUTRAL, Knobs
from dfmodel.intra_chip import partition
from dfmodel.intra_chip.cost import DEFAULT_TILE_OVERHEAD_S, combine_times
from dfmodel.netmodels import CostTable
from dfmodel.result import BREAKDOWN_KEYS, Parallelism, Result, SolverInfo
from dfmodel.system.cost import system_cost_usd, system_power_w
from dfmodel.system.processor import compute_time_s, memory_time_s
from dfmodel.system.schema import Precision, System

GiB = 2**30

# --------------------------------------------------------------------------------------------
# Memory per chip
# --------------------------------------------------------------------------------------------


class FamilyModel:
    """What every family's cost model starts from: the inputs, the solver options, the
    collective-cost table, and an early check that the chip has a peak at the precision."""

    family = ""

    def __init__(self, workload, system: System, *, solver: str = "auto", time_limit_s: float | None = None):
        self.workload, self.system = workload, system
        self.solver, self.time_limit_s = solver, time_limit_s
        self.costs = CostTable(system)
        self.precision = workload.precision
        peak_flops(system, self.precision, workload)  # InputError early if the chip lacks it
        self.misfits = MisfitTracker()

    @property
    def smallest_misfit(self) -> str | None:
        return self.misfits.message

    def misfit(self, m, label: str, mem: "MemoryBreakdown", shortfall_bytes: float | None = None) -> "FamilyEvaluation":
        """Record candidate ``m`` as not fitting (``label: what``) and return its evaluation;
        the smallest shortfall becomes the error when no candidate fits."""
        self.misfits.add(mem.shortfall_bytes if shortfall_bytes is None else shortfall_bytes, label)
        return FamilyEvaluation(m, math.inf, empty_breakdown(), mem, False, True, reason=label)


#: the families' memory report is the LLM path's (one definition of the memory kinds and checks)
FamilyMemory = MemoryBreakdown


# --------------------------------------------------------------------------------------------
# Knobs, precision
# --------------------------------------------------------------------------------------------

_KNOB_NAMES = KNOB_NAMES
#: the value of each knob that means "not used" (accepted by every family)
_NEUTRAL = NEUTRAL


def reject_knobs(knobs: Knobs, family: str, allowed: tuple[str, ...], why: dict[str, str]) -> None:
    """InputError naming the first knob fixed to a value that means nothing for ``family``.

    Knobs in ``allowed`` are the family's own; the others may only take their neutral value
    (``pp=1``, ``recompute='none'``, ...), or be left to None.
    """
    for name in _KNOB_NAMES:
        v = getattr(knobs, name)
        if v is None or name in allowed:
            continue
        if name in _NEUTRAL and v == _NEUTRAL[name]:
            continue
        reason = why.get(name, f"{family} has no {name.replace('_', ' ')}")
        raise InputError(f"{reason}; leave it unset (got {v!r})", field=name)
    for name in ("tp", "pp", "dp", "micro_batch", "interleave"):
        v = getattr(knobs, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"must be a positive integer, got {v!r}", field=name)


def peak_flops(system: System, precision: Precision | str, workload) -> float:
    """Matrix peak at the workload precision; InputError when the chip has none."""
    try:
        return system.chip.peak(precision)
    except ValueError as e:
        field_name = "training.precision" if hasattr(workload, "training") else "precision"
        raise InputError(f"{e}; pick a precision the chip supports", source=workload.source,
                         field=field_name) from None


# --------------------------------------------------------------------------------------------
# Graph rescaling and the intra-chip pass
# --------------------------------------------------------------------------------------------


def rescale_graph(graph: DataflowGraph, kernels: dict[str, dict], tensors: dict[str, float], *,
                  name: str | None = None, meta: dict | None = None) -> DataflowGraph:
    """Copy of ``graph`` with kernel fields replaced (``kernels[name] = {field: value}``) and
    tensor bytes replaced by name (every edge of that name). Used to turn a builder's whole
    graph into the graph of one chip's share."""
    ks = []
    for k in graph.kernels:
        upd = kernels.get(k.name)
        ks.append(replace(k, **upd) if upd else k)
    ts = []
    for t in graph.tensors:
        b = tensors.get(t.name)
        ts.append(t if b is None else Tensor(t.name, t.producer, t.consumer, max(float(b), 1.0), t.operand, t.shape))
    return DataflowGraph(ks, ts, name=name or graph.name, meta={**graph.meta, **(meta or {})})


@dataclass
class ChipTime:
    """The intra-chip pass on one chip's graph: time, per-partition rows, and its proof status.

    ``parts_s`` books every partition's time under its dominant term (compute, memory or
    network -> ``tp_comm``), as the LLM path does. ``backward_s`` is the time of partitions
    holding backward or weight-gradient kernels (what can hide a DP gradient sync).
    """

    time_s: float
    rows: list[dict]
    parts_s: dict[str, float]
    backward_s: float
    proven_optimal: bool
    gap: float
    solver: str
    method: str
    peak_live_bytes: float
    single_kernel: bool  # one kernel per partition (kernel-by-kernel): per-kernel times are known

    def kernel_time(self, name: str) -> tuple[float, str]:
        """(time, dominant component) of the partition holding only ``name`` (single_kernel)."""
        row = self._by_kernel()[name]
        return row["time_s"], dominant(row)

    def _by_kernel(self) -> dict[str, dict]:
        if not hasattr(self, "_index"):
            self._index = {k: r for r in self.rows for k in r["kernels"]}
        return self._index

    def report(self, per: str) -> dict:
        return {
            "time_s": self.time_s,
            "per": per,
            "num_partitions": len(self.rows),
            "method": self.method,
            "solver": self.solver,
            "proven_optimal": self.proven_optimal,
            "gap": self.gap,
            "partitions": self.rows,
        }


def dominant(row: dict) -> str:
    """Breakdown key of a partition: its largest term (network = model-parallel comm)."""
    terms = {"compute": row["compute_s"], "memory": row["memory_s"], "tp_comm": row["network_s"]}
    return max(terms, key=terms.get)


def chip_time(graph: DataflowGraph, system: System, network_s: dict[str, float], *, solver: str,
              time_limit_s: float | None) -> ChipTime:
    """Run :func:`dfmodel.intra_chip.partition` and summarise it (raises InfeasibleError)."""
    res = partition(graph, system, network_time_s={k: v for k, v in network_s.items() if v > 0},
                    solver=solver, time_limit_s=time_limit_s)
    rows = [p.to_dict() for p in res.partitions]
    parts = dict.fromkeys(("compute", "memory", "tp_comm"), 0.0)
    back = 0.0
    for r in rows:
        parts[dominant(r)] += r["time_s"]
        if any(graph.kernel(k).phase != Phase.forward for k in r["kernels"]):
            back += r["time_s"]
    return ChipTime(
        time_s=float(res.time_s), rows=rows, parts_s=parts, backward_s=back,
        proven_optimal=bool(res.proven_optimal), gap=float(res.gap or 0.0), solver=res.solver,
        method=res.method, peak_live_bytes=float(res.peak_dram_live_bytes),
        single_kernel=all(len(r["kernels"]) == 1 for r in rows),
    )


@dataclass
class FloorTerms:
    """Parts of a valid lower bound on :func:`chip_time`, additive over kernels (see :func:`floor_terms`)."""

    kbk_s: float = 0.0  # kernel-by-kernel: sum of combine(compute, bytes floor, network) + overhead
    compute_s: float = 0.0
    extra_bytes: float = 0.0
    network_s: float = 0.0
    kbk_backward_s: float = 0.0  # the part of kbk_s from backward / weight-gradient kernels
    io_bytes: float = 0.0  # graph inputs, outputs and weights: moved at least once (see io_bytes)

    def __add__(self, other: "FloorTerms") -> "FloorTerms":
        return FloorTerms(self.kbk_s + other.kbk_s, self.compute_s + other.compute_s,
                          self.extra_bytes + other.extra_bytes, self.network_s + other.network_s,
                          self.kbk_backward_s + other.kbk_backward_s, self.io_bytes + other.io_bytes)

    def backward_upper_s(self, system: System) -> float:
        """Upper bound on :attr:`ChipTime.backward_s` when the floor is exact (kernel-by-kernel
        chips with exact input bytes); ``inf`` on dataflow chips (no bound without solving)."""
        return self.kbk_backward_s if system.chip.execution != "dataflow" else math.inf

    def bound_s(self, system: System) -> float:
        """Kernel-by-kernel chips: ``kbk_s``. Dataflow chips: ``combine(sum compute, sum extra
        traffic + graph I/O, sum network) + one partition's overheads`` -- every partition takes
        at least the combine of its own sums, the intra-chip cost adds over partitions, and fusion
        may keep every internal tensor on chip but never the explicit extra traffic, and reads
        each graph input and weight and writes each graph output at least once."""
        chip = system.chip
        if chip.execution != "dataflow":
            return self.kbk_s
        m = memory_time_s(chip, self.extra_bytes + self.io_bytes)
        over = chip.efficiency.kernel_overhead_s + DEFAULT_TILE_OVERHEAD_S  # tile overhead / fraction <= 1
        return float(combine_times(self.compute_s, m, self.network_s, chip.overlap)) + over


def floor_terms(kernels, system: System, precision, network_s: dict[str, float],
                input_bytes: dict[str, float] | None = None) -> FloorTerms:
    """Lower-bound terms of these kernels on one chip, without running the intra-chip pass.

    A kernel run alone (kernel-by-kernel) moves at least its output, weights, extra traffic and
    the ``input_bytes`` given for it; with exact input bytes ``kbk_s`` equals the closed form.
    """
    chip = system.chip
    input_bytes = input_bytes or {}
    out = FloorTerms()
    for k in kernels:
        c = compute_time_s(chip, k, precision)
        n = network_s.get(k.name, 0.0)
        m = memory_time_s(chip, k.output_bytes + k.weight_bytes + k.extra_memory_bytes + input_bytes.get(k.name, 0.0))
        t = float(combine_times(c, m, n, chip.overlap)) + chip.efficiency.kernel_overhead_s
        out.kbk_s += t
        if k.phase != Phase.forward:
            out.kbk_backward_s += t
        out.compute_s += c
        out.extra_bytes += k.extra_memory_bytes
        out.network_s += n
    return out


def io_bytes(kernels, tensors, tensor_bytes: dict[str, float] | None = None) -> float:
    """Bytes any partition plan moves at least once: graph inputs (read), graph outputs
    (written) and weights (read), each counted once as the intra-chip cost model groups them
    (tensors by name and producer, weights by ``Kernel.weight``). ``tensor_bytes`` overrides
    tensor sizes by name."""
    tensor_bytes = tensor_bytes or {}
    seen: dict[tuple, float] = {}
    for t in tensors:
        if t.producer is None or t.consumer is None:
            key = (t.name, t.producer, t.consumer is None)
            seen[key] = max(seen.get(key, 0.0), float(tensor_bytes.get(t.name, t.bytes)))
    weights: dict[str, float] = {}
    for k in kernels:
        if k.weight_bytes > 0:
            key = k.weight or f"<{k.name}>"
            weights[key] = max(weights.get(key, 0.0), float(k.weight_bytes))
    return sum(seen.values()) + sum(weights.values())


def input_bytes_by_kernel(graph: DataflowGraph) -> dict[str, float]:
    """Bytes each kernel reads from its input tensors (one read per tensor name)."""
    out: dict[str, float] = {}
    seen: set[tuple[str, str]] = set()
    for t in graph.tensors:
        if t.consumer is None or (t.name, t.consumer) in seen:
            continue
        seen.add((t.name, t.consumer))
        out[t.consumer] = out.get(t.consumer, 0.0) + t.bytes
    return out


# --------------------------------------------------------------------------------------------
# Breakdown and Result
# --------------------------------------------------------------------------------------------


def empty_breakdown() -> dict[str, float]:
    return dict.fromkeys(BREAKDOWN_KEYS, 0.0)


def close_breakdown(breakdown: dict[str, float], total_s: float) -> dict[str, float]:
    """Put the rounding residue on the largest entry so the values add up to ``total_s``."""
    out = {k: max(0.0, float(breakdown.get(k, 0.0))) for k in BREAKDOWN_KEYS}
    residue = total_s - sum(out.values())
    big = max(out, key=out.get)
    out[big] = max(0.0, out[big] + residue)
    return out


@dataclass
class FamilyEvaluation:
    """One evaluated candidate (the search keeps the best). ``detail`` is family-specific."""

    mapping: object
    iteration_time_s: float
    breakdown_s: dict[str, float]
    memory: FamilyMemory
    fits: bool
    proven_optimal: bool
    chip: ChipTime | None = None
    detail: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    reason: str = ""  # why it does not fit, when it does not


def build_result(*, workload, system: System, ev: FamilyEvaluation, stats, useful_flop: float, samples: float,
                 parallelism: Parallelism, sharding: dict[str, str], intra_per: str, notes: list[str],
                 pipeline: dict | None = None) -> Result:
    """The :class:`~dfmodel.result.Result` of a family's best evaluation (see module doc)."""
    n = system.num_chips
    peak = peak_flops(system, workload.precision, workload)
    t = ev.iteration_time_s
    mfu = useful_flop / (t * n * peak) if t > 0 else 0.0
    chip = ev.chip
    breakdown = close_breakdown(ev.breakdown_s, t)
    proven = stats.proven_optimal
    intra = chip.report(intra_per) if chip is not None else {}
    result = Result(
        workload=workload.name,
        system=system.name,
        num_chips=n,
        iteration_time_s=t,
        samples_per_s=samples / t if t > 0 else 0.0,
        tokens_per_s=samples / t if t > 0 else 0.0,
        model_flops_utilization=mfu,
        hardware_flops_utilization=mfu,
        parallelism=parallelism,
        breakdown_s=breakdown,
        memory_per_chip_bytes=ev.memory.to_dict(),
        sharding=sharding,
        intra_chip=intra,
        solver=SolverInfo(
            backend=chip.solver if chip is not None else "closed_form",
            status="optimal" if proven else "time_limit",
            gap=0.0 if proven or chip is None else chip.gap,
            wall_s=stats.wall_s,
            candidates_evaluated=stats.evaluated,
            candidates_pruned=stats.pruned,
            proven_optimal=proven,
        ),
        cost_usd=system_cost_usd(system),
        power_w=system_power_w(system),
        bottleneck=max(breakdown, key=breakdown.get),
        input_bound=breakdown.get("input", 0.0) > 0,
        notes=list(notes) + list(ev.notes),
        pipeline=pipeline or {},
        io=_io_section(ev, system, t, samples),
    )
    if hasattr(stats, "runners_up"):
        from dfmodel.inter_chip.search import annotate_result

        annotate_result(result, ev, stats)
    return result


def _io_section(ev: FamilyEvaluation, system: System, iteration_time_s: float, samples: float) -> dict:
    """The result's ``io`` section for families whose evaluation carries I/O terms (DLRM)."""
    from dfmodel.inter_chip.io import io_report

    terms = ev.detail.get("io") if isinstance(ev.detail, dict) else None
    return io_report(terms, system, iteration_time_s=iteration_time_s, compute_power_w=system_power_w(system),
                     samples=samples, compute_cost_usd=system_cost_usd(system))


def run_search(model, candidates, *, exhaustive: bool, alternatives: int | None = None):
    """:func:`~dfmodel.inter_chip.search.search` with the family's own infeasibility message."""
    from dfmodel.inter_chip.search import search

    t0 = time.perf_counter()
    try:
        best, stats = search(model, candidates, exhaustive=exhaustive, alternatives=alternatives)
    except InfeasibleError as e:
        misfit = getattr(model, "smallest_misfit", None)
        if misfit is None:
            raise
        raise InfeasibleError(f"{model.family}: no mapping fits: {misfit}") from e
    stats.wall_s = time.perf_counter() - t0
    return best, stats


class MisfitTracker:
    """Remembers the infeasible candidate that came closest to fitting (for the error message)."""

    def __init__(self) -> None:
        self.best: tuple[float, str] | None = None

    def add(self, shortfall: float, message: str) -> None:
        if self.best is None or shortfall < self.best[0]:
            self.best = (shortfall, message)

    @property
    def message(self) -> str | None:
        return None if self.best is None else self.best[1]


__all__ = ["FamilyModel", "FamilyMemory", "FamilyEvaluation", "ChipTime", "chip_time", "floor_terms", "FloorTerms",
           "build_result", "run_search", "reject_knobs", "peak_flops", "rescale_graph", "MisfitTracker",
           "empty_breakdown", "close_breakdown", "dominant", "io_bytes", "input_bytes_by_kernel"]
