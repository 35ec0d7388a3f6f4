"""Sharding MILP against brute force over every strategy assignment, on both back-ends."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup, apply_sharding, solve_sharding
from dfmodel.inter_chip.strategies import conversion
from dfmodel.netmodels import CostTable
from dfmodel.solvers import gurobi_licence
from dfmodel.system import load_system

B = 2


def mlp_graph(T=4096, h=1024, f=4096, with_ln=True) -> DataflowGraph:
    """A Megatron MLP block: (layernorm) -> fc1 -> gelu -> fc2, with backward and wgrad."""

    def mm(name, m, n, k, w, phase):
        return Kernel(name, KernelKind.matmul, {"m": m, "n": n, "k": k}, flop=2 * m * n * k,
                      output_bytes=m * n * B, weight_bytes=n * k * B if phase != Phase.weight_grad else m * n * B,
                      weight=w, phase=phase, group="mlp")

    ew = lambda name, phase: Kernel(name, KernelKind.elementwise, {"m": T, "n": f}, flop=8 * T * f,  # noqa: E731
                                    output_bytes=T * f * B, phase=phase, group="mlp")
    ks = [mm("fwd.fc1", T, f, h, "w1", Phase.forward), ew("fwd.act", Phase.forward),
          mm("fwd.fc2", T, h, f, "w2", Phase.forward), mm("bwd.fc2", T, f, h, "w2", Phase.backward),
          ew("bwd.act", Phase.backward), mm("bwd.fc1", T, h, f, "w1", Phase.backward),
          mm("wgrad.fc2", f, h, T, "w2", Phase.weight_grad), mm("wgrad.fc1", h, f, T, "w1", Phase.weight_grad)]
    x = "fwd.ln" if with_ln else None
    if with_ln:
        ks.insert(0, Kernel("fwd.ln", KernelKind.reduction, {"m": T, "n": h}, flop=7 * T * h,
                            output_bytes=T * h * B, group="norm"))
    ts = [Tensor("x", x, "fwd.fc1", T * h * B), Tensor("x", x, "wgrad.fc1", T * h * B),
          Tensor("h1", "fwd.fc1", "fwd.act", T * f * B), Tensor("h1", "fwd.fc1", "bwd.act", T * f * B),
          Tensor("a", "fwd.act", "fwd.fc2", T * f * B), Tensor("a", "fwd.act", "wgrad.fc2", T * f * B),
          Tensor("y", "fwd.fc2", None, T * h * B),
          Tensor("dy", None, "bwd.fc2", T * h * B, operand="g"), Tensor("dy", None, "wgrad.fc2", T * h * B, operand="g"),
          Tensor("da", "bwd.fc2", "bwd.act", T * f * B), Tensor("dh1", "bwd.act", "bwd.fc1", T * f * B),
          Tensor("dh1", "bwd.act", "wgrad.fc1", T * f * B), Tensor("dx", "bwd.fc1", None, T * h * B),
          Tensor("dw2", "wgrad.fc2", None, f * h * B), Tensor("dw1", "wgrad.fc1", None, h * f * B)]
    if with_ln:
        ts.insert(0, Tensor("x0", None, "fwd.ln", T * h * B))
    return DataflowGraph(ks, ts, name="mlp", meta={"precision": "bf16"})


def system(bw=300e9, lat=2e-6, size=8):
    return load_system({"name": "t", "chip": {"name": "c", "peak_flops": 312e12, "sram_bytes": 40e6,
                        "memory": {"kind": "HBM", "capacity_bytes": 80e9, "bandwidth_Bps": 2e12}},
                        "network": [{"name": "nv", "topology": "switch", "size": size,
                                     "link_bandwidth_Bps": bw, "latency_s": lat}]})


def brute_force(problem: ShardingProblem) -> float:
    groups = list(problem.options)
    best = None
    for combo in itertools.product(*(problem.options[g] for g in groups)):
        for boundary in problem.boundaries:
            v = problem.evaluate(dict(zip(groups, combo)), boundary)
            if v is not None and (best is None or v < best):
                best = v
    return best


def test_megatron_mlp_is_column_then_row():
    s = system()
    p = ShardingProblem(mlp_graph(with_ln=False), s, TPGroup(8, (("nv", 8),)), CostTable(s), tokens_split=False)
    plan = solve_sharding(p, solver="highs")
    assert plan.strategy["fwd.fc1"] == "col" and plan.strategy["fwd.fc2"] == "row"
    sharded = apply_sharding(p, plan)
    collectives = sorted(c for _, c, _, _ in sharded.comm)
    assert collectives == ["all_reduce", "all_reduce"]  # Megatron: one in forward, one in backward
    assert sharded.graph.params() == pytest.approx(0.0)  # synthetic graph carries no params
    fc1 = sharded.graph.kernel("fwd.fc1")
    assert fc1.flop == pytest.approx(mlp_graph().kernel("fwd.fc1").flop / 8)


@settings(max_examples=25, deadline=None)
@given(bw=st.floats(1e9, 1e12), lat=st.floats(0, 2e-5), sp=st.booleans(), size=st.sampled_from([2, 4, 8]))
def test_milp_equals_brute_force_on_highs(bw, lat, sp, size):
    s = system(bw, lat, size)
    p = ShardingProblem(mlp_graph(T=512 * size, h=256, f=1024), s, TPGroup(size, (("nv", size),)), CostTable(s), tokens_split=sp)
    plan = solve_sharding(p, solver="highs")
    assert plan.objective_s == pytest.approx(brute_force(p), rel=1e-6)


def test_both_backends_agree():
    if gurobi_licence()[0] == "none":
        pytest.skip("no Gurobi licence")
    s = system(50e9, 5e-6)
    p = ShardingProblem(mlp_graph(), s, TPGroup(8, (("nv", 8),)), CostTable(s), tokens_split=True)
    a = solve_sharding(p, solver="highs")
    b = solve_sharding(p, solver="gurobi")
    assert a.objective_s == pytest.approx(b.objective_s, rel=1e-7)
    assert a.strategy == b.strategy


def test_conversions():
    assert conversion("R", "F", 100, 4).collective is None
    assert conversion("F", "R", 100, 4).collective == "all_gather"
    assert conversion("P", "T", 100, 4).collective == "reduce_scatter"
    assert conversion("R", "P", 100, 4) is None



def test_saved_input_is_gathered_once_forward_and_again_backward():
    """Issue 11: the sequence-sharded input of a column-parallel linear is all-gathered once in
    the forward (not once per reader) and again in the backward for the weight gradient
    (Megatron SP saves the sharded input)."""
    from dfmodel.inter_chip.sharding import shard

    s = system()
    sharded = shard(mlp_graph(), s, TPGroup(8, (("nv", 8),)), CostTable(s), sequence_parallel=True,
                    solver="highs", megatron_layouts=True)
    gathers = [k for k in sharded.graph.kernels if k.kind == KernelKind.comm and k.name.endswith("all_gather.x")]
    assert sorted(k.phase == Phase.forward for k in gathers) == [False, True]
    readers = {k.name: [t.consumer for t in sharded.graph.tensors if t.producer == k.name] for k in gathers}
    assert sorted(r for rs in readers.values() for r in rs) == ["fwd.fc1", "wgrad.fc1"]


def test_megatron_sp_layer_runs_4_collectives_forward_6_backward():
    """A Megatron SP decoder layer: forward AG + RS per block (4); backward per block an AG of
    the output gradient (shared by dgrad and wgrad), an AG of the saved input for the wgrad and
    an RS of the input gradient (6), Korthikanti et al. 2022 sec. 4.2.2. (The layernorm weight
    gradients' tiny all-reduces are not counted.) Without SP: one all-reduce per block each way."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_inter_chip import SMALL_LLM, small_system

    from dfmodel import load_workload
    from dfmodel.graph.build import build_graphs
    from dfmodel.inter_chip.sharding import shard

    layer = build_graphs(load_workload(SMALL_LLM), batch=1).layer
    s = load_system(small_system(4, 1))
    group = TPGroup(4, ((s.network[0].name, 4),))
    for sp, fwd_n, bwd_n in ((True, 4, 6), (False, 2, 2)):
        g = shard(layer, s, group, CostTable(s), sequence_parallel=sp, solver="highs", megatron_layouts=True).graph
        comm = [k for k in g.kernels if k.kind == KernelKind.comm and ".dW." not in k.name]
        assert sum(k.phase == Phase.forward for k in comm) == fwd_n, (sp, [k.name for k in comm])
        assert sum(k.phase != Phase.forward for k in comm) == bwd_n, (sp, [k.name for k in comm])
