"""The sharding's pair tables from placement-free conversion slots (issue 12: DeepSeek-V3 on
8192 dragonfly chips shards its layer 1122 times, 460 contents on ~2.4 placements each): the
tables, the optimum and its objective are exactly the cell-by-cell ones, and a content's
conversions are derived once however many placements ask."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from dfmodel.graph.build import build_graphs
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip import sharding
from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup, pairwise_model, solve_sharding
from dfmodel.netmodels import CostTable
from dfmodel.system.loader import load_system

PLACEMENTS = [((("local", 8),), 8), ((("local", 2), ("global", 4)), 8), ((("global", 8),), 8),
              ((("local", 4),), 4), ((("local", 8), ("global", 4)), 32)]


@lru_cache(maxsize=None)
def _system():
    return load_system("dragonfly", num_chips=512)


@lru_cache(maxsize=None)
def _layer(workload: str):
    return build_graphs(load_workload(workload), batch=1).layer


def _problem(graph, placement, size, memo, sp=True):
    s = _system()
    return ShardingProblem(graph, s, TPGroup(size, placement), CostTable(s), tokens_split=sp,
                           megatron_layouts=True, memo=memo)


def _cell_by_cell(problem: ShardingProblem):
    """The pair tables as built before the slots: every cell's layouts and conversion asked of
    the problem, added edge by edge."""
    groups, domains, terms = sharding._layout_terms(problem)
    unary = list(sharding._strategy_times(problem, groups, domains))
    pairs: dict = {}

    def cost_s(hw, nbytes):
        c = problem.conversion_s(hw[0], hw[1], nbytes)
        return np.inf if c is None else c * sharding.US

    for ei, i, j, cells in terms:
        nbytes = problem.graph.tensors[ei].bytes
        if i == j:
            unary[i] = unary[i] + np.array([cost_s(c, nbytes) for c in cells])
            continue
        table = np.array([[cost_s(c, nbytes) for c in row] for row in cells])
        if i > j:
            i, j, table = j, i, table.T
        pairs[(i, j)] = pairs[(i, j)] + table if (i, j) in pairs else table
    return unary, pairs


@pytest.mark.parametrize("workload", ["deepseek_v3", "llama3_70b"])
@pytest.mark.parametrize("sp", [True, False])
def test_slot_tables_equal_cell_by_cell(workload, sp):
    memo: dict = {}
    for placement, size in PLACEMENTS:
        p = _problem(_layer(workload), placement, size, memo, sp)
        _, _, unary, pairs = pairwise_model(p)
        ref_unary, ref_pairs = _cell_by_cell(p)
        assert len(unary) == len(ref_unary) and all(np.array_equal(a, b) for a, b in zip(unary, ref_unary))
        assert list(pairs) == list(ref_pairs)
        assert all(np.array_equal(pairs[k], ref_pairs[k]) for k in pairs)


@pytest.mark.parametrize("workload", ["deepseek_v3", "llama3_70b"])
def test_exact_objective_is_the_evaluation(workload):
    """The objective read from the tables is ``evaluate``'s, to the bit, and the plan the MILP's."""
    memo: dict = {}
    for placement, size in PLACEMENTS:
        p = _problem(_layer(workload), placement, size, memo)
        plan = solve_sharding(p)
        choice = {g: plan.strategy[ks[0].name] for g, ks in p.groups.items()}
        assert plan.backend == "exact"
        assert plan.objective_s == p.evaluate(choice, plan.boundary_layout)
        milp = solve_sharding(_problem(_layer(workload), placement, size, None), method="milp", solver="highs")
        assert (plan.strategy, plan.boundary_layout, plan.objective_s) == \
            (milp.strategy, milp.boundary_layout, milp.objective_s)


def test_conversions_derived_once_per_content(monkeypatch):
    """A content sharded on several placements of one size with one memo derives its cells'
    conversions once; each placement only times the distinct collectives."""
    built = []
    real = sharding._build_conversion_slots
    monkeypatch.setattr(sharding, "_build_conversion_slots", lambda p: built.append(p) or real(p))
    memo: dict = {}
    for placement, size in PLACEMENTS:
        if size == 8:
            sharding.shard(_layer("deepseek_v3"), _system(), TPGroup(size, placement), CostTable(_system()),
                           megatron_layouts=True, memo=memo)
    assert len(built) == 1


def test_compute_time_once_per_kernel(monkeypatch):
    """A kernel's compute seconds are asked once per problem, whatever its strategies (they only
    divide it by the group size)."""
    asked = []
    real = sharding.compute_time_s
    monkeypatch.setattr(sharding, "compute_time_s", lambda chip, k, p: asked.append(k.name) or real(chip, k, p))
    p = _problem(_layer("deepseek_v3"), (("local", 8),), 8, {})
    plan = solve_sharding(p)
    assert len(asked) == len(set(asked)) == len(p.graph.kernels)
    assert plan.objective_s == p.evaluate({g: plan.strategy[ks[0].name] for g, ks in p.groups.items()},
                                          plan.boundary_layout)
