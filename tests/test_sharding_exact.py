"""Exact sharding by variable elimination (issue 12) against its oracles: the MILP on every
shipped LLM graph, brute force over every assignment on random graphs, and
:func:`dfmodel.solvers.pairwise.minimise` against enumeration on random pairwise problems."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.algorithms import TooLarge
from dfmodel.graph.build import build_graphs
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup, solve_sharding
from dfmodel.netmodels import CostTable
from dfmodel.solvers import gurobi_licence
from dfmodel.solvers.pairwise import minimise
from dfmodel.system.loader import load_system
from test_sharding import brute_force  # the exhaustive oracle (pytest puts tests/ on sys.path)

LLMS = ["gpt3_13b", "gpt3_175b", "gpt3_1t", "llama3_70b", "llama3_405b", "llama3_405b_128k", "mixtral_8x7b",
        "deepseek_v3"]


@lru_cache(maxsize=None)
def graphs(workload: str, batch: int):
    return build_graphs(load_workload(workload), batch=batch)


@lru_cache(maxsize=None)
def system(name: str):
    return load_system(name)


def problem(graph, sys_name, tp, sp, megatron=True, whole_experts=False, inner=None):
    s = system(sys_name)
    dims = [(d.name, d.size) for d in s.network]
    # TP on the innermost dimension, or spread over two (a slower group: other costs, other plans)
    placement = ((dims[0][0], tp),) if inner is None else ((dims[0][0], inner), (dims[1][0], tp // inner))
    return ShardingProblem(graph, s, TPGroup(tp, placement), CostTable(s), tokens_split=sp,
                           megatron_layouts=megatron, whole_experts=whole_experts)


def assert_same(p: ShardingProblem, solver="highs"):
    exact = solve_sharding(p, method="exact")
    milp = solve_sharding(p, method="milp", solver=solver)
    assert milp.status == "optimal"
    assert exact.objective_s == milp.objective_s  # to the last digit
    assert exact.strategy == milp.strategy and exact.boundary_layout == milp.boundary_layout
    assert exact.backend == "exact"


@pytest.mark.parametrize("workload", LLMS)
@pytest.mark.parametrize("which", ["layer", "embedding", "head"])
def test_exact_equals_milp_on_shipped_llm_graphs(workload, which):
    for batch, tp, sp, inner in ((1, 8, True, None), (1, 2, False, None), (2, 4, True, None), (1, 16, True, 8),
                                 (4, 8, False, None)):
        g = getattr(graphs(workload, batch), which)
        moe = which == "layer" and any(k.expert for k in g.kernels)
        for whole in ((False, True) if moe else (False,)):
            assert_same(problem(g, "dgx_h100", tp, sp, whole_experts=whole, inner=inner))


@pytest.mark.parametrize("workload", ["gpt3_13b", "llama3_70b", "mixtral_8x7b"])
def test_exact_equals_milp_without_megatron_restriction(workload):
    """Every valid strategy per kernel (not only Megatron's): larger domains, same optimum."""
    for tp, sp in ((8, True), (4, False)):
        for which in ("layer", "head"):
            p = problem(getattr(graphs(workload, 1), which), "dgx_a100", tp, sp, megatron=False)
            try:
                assert_same(p)
            except TooLarge:  # the elimination refused; auto then takes the MILP
                assert solve_sharding(p).backend != "exact"


def test_gurobi_agrees_when_licensed():
    if gurobi_licence()[0] == "none":
        pytest.skip("no Gurobi licence")
    assert_same(problem(graphs("gpt3_13b", 1).layer, "dgx_h100", 8, True), solver="gurobi")


def random_graph(rng: random.Random) -> DataflowGraph:
    """A random layer-like DAG: matmuls (some sharing weights across phases), element-wise
    kernels and norms, with skip connections, graph inputs and outputs, random sizes."""
    n = rng.randint(2, 7)
    kinds = []
    kernels = []
    for i in range(n):
        kind = rng.choice(["mm", "mm", "ew", "norm", "attn"])
        phase = rng.choice([Phase.forward, Phase.forward, Phase.backward, Phase.weight_grad]) if kind == "mm" \
            else Phase.forward
        m, k_, n_ = (rng.choice([256, 1024, 4096]) for _ in range(3))
        if kind == "mm":
            kernels.append(Kernel(f"k{i}", KernelKind.matmul, {"m": m, "n": n_, "k": k_}, flop=2.0 * m * n_ * k_,
                                  output_bytes=2.0 * m * n_, weight_bytes=2.0 * n_ * k_, phase=phase,
                                  weight=f"w{rng.randint(0, 2)}", group="mlp"))
        elif kind == "attn":
            kernels.append(Kernel(f"k{i}", KernelKind.matmul, {"b": 16, "m": m, "n": m, "k": 128},
                                  flop=2.0 * 16 * m * m * 128, output_bytes=2.0 * 16 * m * m, group="attention"))
        elif kind == "ew":
            kernels.append(Kernel(f"k{i}", KernelKind.elementwise, {"m": m, "n": n_}, flop=8.0 * m * n_,
                                  output_bytes=2.0 * m * n_, group="mlp"))
        else:
            kernels.append(Kernel(f"k{i}", KernelKind.reduction, {"m": m, "n": n_}, flop=7.0 * m * n_,
                                  output_bytes=2.0 * m * n_, group="norm"))
        kinds.append(kind)
    tensors = [Tensor("in", None, "k0", rng.choice([1e6, 8e6, 6e7]), operand=rng.choice(["x", "g"]))]
    for j in range(1, n):
        for i in rng.sample(range(j), k=min(j, rng.randint(1, 2))):
            tensors.append(Tensor(f"t{i}", f"k{i}", f"k{j}", kernels[i].output_bytes))
        if rng.random() < 0.3:
            tensors.append(Tensor(f"in{j}", None, f"k{j}", rng.choice([1e6, 8e6]), operand=rng.choice(["x", "g"])))
    for i in range(n):
        if rng.random() < 0.4 or i == n - 1:
            name = f"dW{i}" if kernels[i].phase == Phase.weight_grad else f"out{i}"
            tensors.append(Tensor(name, f"k{i}", None, kernels[i].output_bytes))
    return DataflowGraph(kernels, tensors, name="random", meta={"precision": "bf16"})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), tp=st.sampled_from([2, 4, 8]), sp=st.booleans(), megatron=st.booleans())
def test_exact_equals_brute_force_and_milp_on_random_graphs(seed, tp, sp, megatron):
    g = random_graph(random.Random(seed))
    p = problem(g, "dgx_a100", tp, sp, megatron=megatron)
    best = brute_force(p)
    if best is None:
        from dfmodel.errors import InfeasibleError

        with pytest.raises(InfeasibleError):
            solve_sharding(p, method="exact")
        return
    exact = solve_sharding(p, method="exact")
    assert exact.objective_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    milp = solve_sharding(p, method="milp", solver="highs")
    assert exact.objective_s == pytest.approx(milp.objective_s, rel=1e-9, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_minimise_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    domains = [int(rng.integers(1, 4)) for _ in range(n)]
    unary = [rng.random(d) for d in domains]
    pairs = {}
    for i, j in itertools.combinations(range(n), 2):
        if rng.random() < 0.6:
            t = rng.random((domains[i], domains[j]))
            t[rng.random(t.shape) < 0.2] = np.inf  # forbidden pairs
            pairs[(i, j)] = t
    x, value = minimise(domains, unary, pairs)
    best = min(sum(unary[i][a[i]] for i in range(n)) + sum(t[a[i], a[j]] for (i, j), t in pairs.items())
               for a in itertools.product(*(range(d) for d in domains)))
    assert value == pytest.approx(best, rel=1e-12) if np.isfinite(best) else value == np.inf
    if np.isfinite(best):
        got = sum(unary[i][x[i]] for i in range(n)) + sum(t[x[i], x[j]] for (i, j), t in pairs.items())
        assert got == pytest.approx(best, rel=1e-12)


def test_minimise_refuses_big_tables():
    # a clique of 6 variables with 8 values: eliminating any one needs an 8**6 table
    n, d = 6, 8
    pairs = {(i, j): np.zeros((d, d)) for i, j in itertools.combinations(range(n), 2)}
    with pytest.raises(TooLarge):
        minimise([d] * n, [np.zeros(d)] * n, pairs, max_table=1000)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_topological_order_is_networkx_lexicographic(seed):
    """DataflowGraph's own Kahn order (no networkx on the hot path) == networkx's
    lexicographical topological sort keyed by insertion index, on random DAGs with parallel edges."""
    import networkx as nx

    g = random_graph(random.Random(seed))
    rng = random.Random(seed + 1)
    kernels = list(g.kernels)
    rng.shuffle(kernels)  # insertion order differs from any topological order
    g2 = DataflowGraph(kernels, g.tensors + [t for t in g.tensors if t.producer and t.consumer][:2])
    index = {k.name: i for i, k in enumerate(g2.kernels)}
    assert g2.topological_names() == list(nx.lexicographical_topological_sort(g2.nx, key=index.__getitem__))


def test_cycle_is_still_reported():
    from dfmodel.errors import InputError

    a = Kernel("a", KernelKind.elementwise, {"m": 4}, flop=1, output_bytes=4)
    b = Kernel("b", KernelKind.elementwise, {"m": 4}, flop=1, output_bytes=4)
    with pytest.raises(InputError, match="acyclic"):
        DataflowGraph([a, b], [Tensor("x", "a", "b", 4), Tensor("y", "b", "a", 4)])


def test_chunked_unique_equals_numpy_unique(monkeypatch):
    """The deadline-checked unique of the DP's ideal-pair sets gives np.unique's exact output."""
    from dfmodel.intra_chip import ideals
    from dfmodel.solvers.deadline import deadline_scope

    rng = np.random.default_rng(1)
    keys = rng.integers(0, 5000, size=100_000).astype(np.uint64) * np.uint64(2**40 + 7)
    monkeypatch.setattr(ideals, "_UNIQUE_CHUNK", 4096)
    want_u, want_i = np.unique(keys, return_inverse=True)
    with deadline_scope(1e6):
        got_u, got_i = ideals._unique_chunked(keys)
    assert np.array_equal(got_u, want_u) and np.array_equal(got_i, want_i.ravel())


def test_dp_honours_an_expired_deadline(monkeypatch):
    """The intra-chip DP stops between chunks once the call's deadline has passed."""
    from dfmodel.intra_chip import ideals
    from dfmodel.intra_chip.cost import CostModel
    from dfmodel.solvers.deadline import DeadlineExpired, deadline_scope

    monkeypatch.setattr(ideals, "_UNIQUE_CHUNK", 64)
    g = graphs("gpt3_13b", 1).layer
    bwd = g.subgraph([k.name for k in g.kernels if k.phase != Phase.forward])
    cm = CostModel(bwd, system("sn30"))
    ideals._STRUCTURES.clear()
    with deadline_scope(1e-9), pytest.raises(DeadlineExpired):
        ideals.solve_dp(cm)



def test_memoised_block_solves_equal_fresh_ones():
    """One model solving a layer on several placements (memoised: per-plan graphs, kernel
    times, intra-chip phases) gives exactly what a fresh model gives for each alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_inter_chip import SMALL_LLM, small_system

    from dfmodel.inter_chip.llm import LLMModel

    s = load_system(small_system(4, 2))
    nv, ib = s.network[0].name, s.network[1].name
    cases = [(2, ((nv, 2),), True), (2, ((ib, 2),), True), (4, ((nv, 4),), False), (4, ((nv, 2), (ib, 2)), False),
             (2, ((nv, 2),), False)]
    shared = LLMModel(load_workload(SMALL_LLM), s)

    def fingerprint(b):
        return (b.sharded.plan.strategy, b.sharded.plan.objective_s, b.sharded.network_time_s,
                [(p.time_s, p.parts_s, p.partitions) for p in (b.fwd, b.bwd, b.attention_core)])

    for mb in (1, 2):
        for tp, placement, sp in cases:
            fresh = LLMModel(load_workload(SMALL_LLM), s)
            assert fingerprint(shared.block("layer", mb, tp, placement, sp)) == \
                fingerprint(fresh.block("layer", mb, tp, placement, sp))
