"""Exact checks before the costly solves of a dataflow search (issue 12):

- ``LLMModel.memory_before_solves``: a mapping none of whose possible layer splits fits the chip
  is pruned before its blocks are solved (memory reads the blocks' sharded graphs, never their
  solved times, which only pick the split). Oracle: the full evaluation of every sampled mapping
  of a small MoE space on a dataflow chip whose memory holds only some of them;
- ``presolve_bound_s(m, cutoff_s)`` leaves out the blocks' floors once the own-group bound
  reaches the cutoff: the search still equals exhaustive enumeration;
- ``ideals._first_tight_edge``: the walk back of the shortest plan takes the same edges as a
  scan of every edge per step (ties to the first edge)."""

from __future__ import annotations

import numpy as np
import pytest

from dfmodel import load_system, load_workload
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel, MemoryFloorMiss
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.intra_chip.ideals import _first_tight_edge
from test_inter_chip import small_system
from test_moe_physics import moe_workload

STEP = 7  # (a sample of the ~11k mappings: every pp, interleave, tp, ep and placement appear)


def _tight_dataflow_moe(capacity: str):
    """The small MoE model (1 dense + 7 MoE layers) on 8 four-tile dataflow chips whose memory
    holds its leanest mappings only (they need ~0.1-1.2 GiB)."""
    s = small_system(4, 2, capacity=capacity)
    s["chip"].update(execution="dataflow", overlap=True, sram_bytes="24 MiB", compute_tiles=4)
    return load_workload(moe_workload(first_dense_layers=1)), load_system(s)


def test_split_memory_screen_never_prunes_a_mapping_that_fits():
    w, s = _tight_dataflow_moe("400 MiB")
    screen, exact = LLMModel(w, s), LLMModel(w, s)  # (screen: no block ever solved on it)
    pruned = {1: 0, 2: 0, "interleaved": 0}
    fits = 0
    for m in list(llm_candidates(screen, Knobs()))[::STEP]:
        floor = screen.memory_before_solves(m)
        ev = exact.evaluate(m)
        fits += ev.fits
        if floor is None:
            continue
        assert not ev.fits and ev.memory.total_bytes >= floor.total_bytes * (1 - 1e-12), (m, floor, ev.memory)
        if m.pp == 1 or m.interleave > 1:  # one split only: the screen's memory is the evaluation's
            assert floor.total_bytes == pytest.approx(ev.memory.total_bytes, rel=1e-12)
        pruned["interleaved" if m.interleave > 1 else m.pp] += 1
    assert fits > 20 and all(n > 5 for n in pruned.values()), (fits, pruned)


def test_evaluate_with_a_cutoff_returns_the_screened_miss_before_any_solve():
    w, s = _tight_dataflow_moe("400 MiB")
    model = LLMModel(w, s)
    m = next(m for m in llm_candidates(model, Knobs()) if m.pp == 2 and model.memory_before_solves(m) is not None)
    got = model.evaluate(m, cutoff_s=1e9)
    assert isinstance(got, MemoryFloorMiss) and not model._blocks  # nothing solved


# (600 MiB and 1 GiB: many two-stage splits move for memory, test_split_bound)
@pytest.mark.parametrize("capacity", ["400 MiB", "600 MiB", "1 GiB", "80 GiB"])
def test_search_with_the_screens_equals_exhaustive(capacity):
    w, s = _tight_dataflow_moe(capacity)
    fast = solve_llm(w, s, Knobs(recompute="full"))
    full = solve_llm(w, s, Knobs(recompute="full"), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_first_tight_edge_is_the_first_edge_a_scan_finds():
    rng = np.random.default_rng(7)
    n = 40
    for _ in range(50):
        e = 600
        src = rng.integers(0, n - 1, e)
        dst = src + rng.integers(1, 5, e)
        dst = np.minimum(dst, n - 1)
        cost = rng.integers(0, 3, e).astype(float)  # (integer costs: many ties)
        dist = np.full(n, np.inf)
        dist[0] = 0.0
        for v in range(1, n):
            into = dst == v
            if into.any():
                dist[v] = np.min(dist[src[into]] + cost[into])
        got = _first_tight_edge(src, dst, cost, dist, n)
        for v in range(1, n):
            if not np.isfinite(dist[v]):
                continue
            hit = np.flatnonzero((dst == v) & (dist[src] + cost == dist[v]))
            assert got[v] == hit[0]


def test_block_params_without_a_sharding_equal_the_sharded_graphs():
    """``LLMModel._block_params`` counts a block's parameters per chip without solving its sharding
    where every plan gives the same (Megatron's layouts, :func:`sharding.plan_free_params`):
    exactly the sharded graph's, for every block of a sample of mappings (TP degrees, placements,
    SP, expert TP 1, ep) of the small MoE space."""
    from dfmodel.graph.builders.moe import expert_params

    w, s = _tight_dataflow_moe("400 MiB")
    model = LLMModel(w, s)
    checked = 0
    for m in list(llm_candidates(model, Knobs()))[::STEP]:
        for which in ("layer", "embedding", "head", "dense_layer"):
            got = model._block_params(which, m)
            layer = which == "layer"
            graph = getattr(model.graphs(m.micro_batch, m.cp, m.ep_outside_tp if layer else 1), which)
            g = model._shard_block(graph, m.tp, m.group("tp"), m.sequence_parallel,
                                   m.whole_experts and layer and m.tp > 1).graph
            assert got == (g.params(), expert_params(g)), (m, which)
            checked += m.tp > 1
    assert checked > 100
