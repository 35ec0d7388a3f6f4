"""The LLM family behind the common family interface: a thin adapter over
:class:`~dfmodel.inter_chip.llm.LLMModel`, :func:`~dfmodel.inter_chip.search.llm_candidates`
and :func:`~dfmodel.inter_chip.llm_result.to_result` (it adds nothing to the physics)."""

from __future__ import annotations

import dataclasses

from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.family_api import ModelFamily
from dfmodel.inter_chip.llm_space import LLMSpace, canonical_placement, symmetric_dims  # noqa: F401 (re-exported)
from dfmodel.inter_chip.search import annotate_result, llm_candidates, search, validate_knobs


def solve_llm_family(workload, system, knobs: Knobs, *, solver: str = "auto", time_limit_s: float | None = None,
                     exhaustive: bool = False):
    """Fastest mapping of an LLM workload, with the search's status, bound, gap and runners-up."""
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.inter_chip.llm_result import to_result

    validate_knobs(knobs, system.num_chips)
    model = LLMModel(workload, system, solver=solver, time_limit_s=time_limit_s)
    model.knobs = knobs  # read by inter_chip.diagnose when no mapping exists
    # the free search walks the space as groups (lazy branch and bound); exhaustive (the test
    # oracle) enumerates every mapping
    cands = llm_candidates(model, knobs) if exhaustive else LLMSpace(model, knobs)
    best, stats = search(PlacementFreeBounds(model), cands, exhaustive=exhaustive)
    return annotate_result(to_result(model, best, stats), best, stats)


#: the LLM path's entry point (its historical name)
solve_llm = solve_llm_family


def distinct_up_to_symmetry(candidates, system):
    """Candidates with one representative per class of placements equivalent under relabelling
    identical network dimensions (same time, same memory: evaluating twins is wasted work)."""
    classes = symmetric_dims(system)
    if not classes:
        yield from candidates
        return
    canon: dict[tuple, tuple] = {}
    seen: set = set()
    for m in candidates:
        p = m.placement
        if p not in canon:
            canon[p] = canonical_placement(p, classes)
        key = dataclasses.replace(m, placement=canon[p])
        if key not in seen:
            seen.add(key)
            yield m


class PlacementFreeBounds:
    """The model, with its two per-candidate screens memoised on the mapping minus its placement.

    ``LLMModel.lower_bound_s`` (compute floor / (tp pp), 1F1B fill, optimizer step) and
    ``memory_floor_bytes`` (weights, state and activations per chip) read degrees and schedule
    knobs only, never where a group sits on the network; the 2-6 placements of each degree
    tuple share them, so the search pays for each once (test_search.py checks the equality on
    every candidate of a small case, so a future bound that reads placement fails loudly).
    """

    def __init__(self, model):
        self._model = model
        self._floor: dict = {}
        self._bound: dict = {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    @staticmethod
    def _key(m):
        # every field but the placement (a tuple: dataclasses.replace costs ~25x more)
        return (type(m),) + tuple(v for k, v in vars(m).items() if k != "placement")

    def memory_floor_bytes(self, m) -> float:
        k = self._key(m)
        if k not in self._floor:
            self._floor[k] = self._model.memory_floor_bytes(m)
        return self._floor[k]

    def leanness(self, m) -> tuple:
        """Sort key: the candidate likeliest to fit in memory first -- full recompute, the
        smallest micro-batch, a sharded optimizer and sequence parallelism (what the memory
        floor assumes but the candidate may not have), then the smallest floor."""
        rank = {"full": 0, "selective": 1, "none": 2}.get(getattr(m, "recompute", "none"), 3)
        return (rank, getattr(m, "micro_batch", 1), not getattr(m, "distributed_optimizer", False),
                not getattr(m, "sequence_parallel", False), self.memory_floor_bytes(m))

    def global_lower_bound_s(self) -> float:
        """A bound valid for every mapping (what a time-limited search reports for candidates it
        never enumerated): the iteration's compute at achieved peak spread over all chips.
        ``lower_bound_s`` is at least ``M floor(mb) / (tp pp)`` with ``M mb = batch / dp`` and
        the compute floor linear in the micro-batch (every kernel's FLOP is; test_search.py
        checks it), hence at least ``batch floor(1) / N``."""
        m = self._model
        return m.training.global_batch * m.compute_floor_s(1, "none") / m.system.num_chips

    def lower_bound_s(self, m) -> float:
        k = self._key(m)
        if k not in self._bound:
            self._bound[k] = self._model.lower_bound_s(m)
        return self._bound[k]


class LLMFamily(ModelFamily):
    """``kind: llm`` behind the common family interface (:mod:`dfmodel.inter_chip.family_api`)."""

    kind = "llm"

    def model(self, workload, system, *, solver="auto", time_limit_s=None, knobs=None):
        from dfmodel.inter_chip.llm import LLMModel

        return LLMModel(workload, system, solver=solver, time_limit_s=time_limit_s)

    def candidates(self, model, knobs):
        return llm_candidates(model, knobs)

    def result(self, model, best, stats):
        from dfmodel.inter_chip.llm_result import to_result

        return annotate_result(to_result(model, best, stats), best, stats)

    def solve(self, workload, system, knobs, *, solver="auto", time_limit_s=None, exhaustive=False):
        return solve_llm_family(workload, system, knobs, solver=solver, time_limit_s=time_limit_s,
                                exhaustive=exhaustive)
