"""Best-bound-first search over the outer mapping space, with valid lower bounds and pruning.

Every candidate :class:`Mapping` gets a cheap lower bound (:meth:`LLMModel.lower_bound_s`) and,
before any inner solve, an exact memory check; candidates are visited in increasing bound order
and evaluated until the next bound is no better than the best time found. Each evaluation's inner
solves (sharding MILP, intra-chip partitions) are cached by the knobs they depend on. The best
mapping is optimal over the whole space within the model when every inner solve was proven.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from dfmodel.errors import InfeasibleError, InputError
# the LLM mapping space lives in llm_space; re-exported here for existing imports
from dfmodel.inter_chip.llm_space import degree_triples, llm_candidates, validate_knobs  # noqa: F401


@dataclass
class SearchStats:
    candidates: int = 0
    evaluated: int = 0
    pruned_bound: int = 0
    pruned_memory: int = 0
    wall_s: float = 0.0
    proven_optimal: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def pruned(self) -> int:
        return self.pruned_bound + self.pruned_memory


def search(model, candidates, *, exhaustive: bool = False):
    """Best evaluation over ``candidates`` (an iterable of mappings), with statistics.

    ``exhaustive=True`` evaluates everything (the oracle the tests compare against).
    """
    t0 = time.perf_counter()
    stats = SearchStats()
    heap = []
    capacity = model.system.chip.memory.capacity_bytes
    smallest_floor = None
    for i, m in enumerate(candidates):
        stats.candidates += 1
        floor = model.memory_floor_bytes(m)
        if floor > capacity and not exhaustive:
            stats.pruned_memory += 1
            smallest_floor = floor if smallest_floor is None else min(smallest_floor, floor)
            continue
        heap.append((model.lower_bound_s(m), i, False, m))
    if not heap and stats.candidates == 0:
        from dfmodel.inter_chip.diagnose import no_mapping_message  # names the failed constraint

        raise InfeasibleError(no_mapping_message(model))
    heapq.heapify(heap)
    best = None
    worst_memory = None
    inner_failure = None
    while heap:
        bound, i, refined, m = heapq.heappop(heap)
        if best is not None and bound >= best.iteration_time_s and not exhaustive:
            stats.pruned_bound += 1 + len(heap)
            break
        if not refined and not exhaustive:
            # lazy bound tightening: once this candidate's inner blocks are solved (for another
            # candidate), its exact stage times give a tighter bound; re-queue it with that
            finer = model.refined_bound_s(m)
            if finer is not None and finer > bound:
                heapq.heappush(heap, (finer, i, True, m))
                continue
        try:
            ev = model.evaluate(m)
        except InfeasibleError as exc:  # an inner pass found nothing that fits (e.g. SRAM, DRAM)
            stats.evaluated += 1
            stats.pruned_memory += 1
            inner_failure = str(exc)
            continue
        stats.evaluated += 1
        if not ev.fits:
            stats.pruned_memory += 1
            if worst_memory is None or ev.memory.total_bytes < worst_memory.memory.total_bytes:
                worst_memory = ev
            continue
        stats.proven_optimal &= ev.proven_optimal
        if _better(ev, best):
            best = ev
    stats.wall_s = time.perf_counter() - t0
    if best is None and worst_memory is None:
        if inner_failure is not None:
            raise InfeasibleError(f"no mapping fits: {inner_failure}")
        if smallest_floor is not None:
            raise InfeasibleError(
                f"no mapping fits in memory: even the leanest needs at least {smallest_floor / 2**30:.1f} GiB "
                f"per chip but a chip has {capacity / 2**30:.1f} GiB, short by "
                f"{(smallest_floor - capacity) / 2**30:.1f} GiB"
            )
    if best is None:
        mem = worst_memory.memory
        raise InfeasibleError(
            f"no mapping fits in memory: the smallest needs {mem.total_bytes / 2**30:.1f} GiB per chip "
            f"(weights {mem.weights_bytes / 2**30:.1f}, gradients {mem.gradients_bytes / 2**30:.1f}, "
            f"optimizer {mem.optimizer_bytes / 2**30:.1f}, activations {mem.activations_bytes / 2**30:.1f}) "
            f"but a chip has {mem.capacity_bytes / 2**30:.1f} GiB, short by "
            f"{(mem.total_bytes - mem.capacity_bytes) / 2**30:.1f} GiB"
        )
    return best, stats


__all__ = ["search", "llm_candidates", "degree_triples", "SearchStats", "validate_knobs", "itertools"]


def _better(ev, best) -> bool:
    """Faster iteration wins; ties within rounding (e.g. every mapping waits for the same input
    load) go to the fastest step, then to the smaller mapping (deterministic)."""
    if best is None:
        return True
    a, b = ev.iteration_time_s, best.iteration_time_s
    if abs(a - b) > 1e-12 * max(abs(a), abs(b)):
        return a < b
    return (_step_s(ev), ev.mapping) < (_step_s(best), best.mapping)


def _step_s(ev) -> float:
    """Iteration time without the storage terms (input wait, checkpoint stall)."""
    br = ev.breakdown_s
    return ev.iteration_time_s - br.get("input", 0.0) - br.get("checkpoint", 0.0)
