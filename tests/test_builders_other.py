"""DLRM, HPL, FFT and explicit graphs against closed forms."""

from __future__ import annotations

import math

import networkx as nx
import pytest

from dfmodel.errors import InputError
from dfmodel.graph.build import build_graph, build_graphs
from dfmodel.graph.builders.formulas import lu_flop, lu_panel_flop
from dfmodel.graph.builders.hpl import hpl_groups, hpl_steps
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.workload import load_workload

# -- HPL ----------------------------------------------------------------------------------------------


def hpl(n, nb, max_steps=64, precision="fp64"):
    return load_workload({"kind": "hpl", "name": "h", "n": n, "nb": nb, "p": 2, "q": 3, "max_steps": max_steps,
                          "precision": precision})


def test_lu_panel_matches_unblocked_loop():
    for r in range(1, 25):
        for w in range(1, r + 1):
            assert lu_panel_flop(r, w) == sum((r - i - 1) * (1 + 2 * (w - i - 1)) for i in range(w))


@pytest.mark.parametrize("n,nb,max_steps", [(1, 1, 64), (7, 3, 64), (100, 7, 64), (100, 7, 4), (257, 16, 1),
                                            (1000, 100, 3), (999, 1, 64)])
def test_hpl_exact_blocked_sum(n, nb, max_steps):
    g = build_graph(hpl(n, nb, max_steps))
    exact = lu_flop(n) + 2 * n * n - n  # LU + forward/back substitution
    assert g.meta["lu_flop_exact"] == lu_flop(n)
    assert g.total_flop() == exact  # small sizes: float sums are exact
    assert sum(1 for k in g.kernels if k.kind == KernelKind.lu_panel) == min(math.ceil(n / nb), max_steps)


def test_hpl_preset_close_to_two_thirds_n_cubed():
    w = load_workload("hpl")
    g = build_graph(w)
    n = w.n
    assert g.meta["lu_flop_exact"] == (4 * n**3 - 3 * n**2 - n) // 6
    assert g.total_flop() == pytest.approx(2 / 3 * n**3, rel=0.01)
    assert g.total_flop() == pytest.approx(lu_flop(n) + 2 * n * n - n, rel=1e-12)
    assert len(g) == 4 * 64 + 1  # 64 groups of panel/bcast/swap/update, then the solve


def test_hpl_huge_n_is_fast_and_exact():
    g = build_graph(hpl(10_000_000, 64, max_steps=16))  # 156250 steps grouped into 16
    assert len([k for k in g.kernels if k.kind == KernelKind.lu_panel]) == 16
    assert g.meta["lu_flop_exact"] == lu_flop(10_000_000)
    assert g.total_flop() == pytest.approx(2 / 3 * 1e21, rel=1e-6)


def test_hpl_structure_and_comm():
    g = build_graph(hpl(1000, 50, max_steps=5))
    assert hpl_groups(20, 5) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4)]
    order = [n for n in g.topological_names() if n.endswith(".panel")]
    assert order == [f"g{i}.panel" for i in range(5)]
    for i in range(4):  # chained: group i's update feeds group i+1's panel
        assert g.nx.has_edge(f"g{i}.update", f"g{i + 1}.panel")
        assert nx.has_path(g.nx, f"g{i}.panel", f"g{i + 1}.panel")
    b, s = g.kernel("g0.bcast"), g.kernel("g0.swap")
    assert (b.collective, b.comm_group, s.collective, s.comm_group) == ("broadcast", "row", "all_to_all", "col")
    # bytes are the exact sums over the group's steps
    steps = hpl_steps(1000, 50)[:4]
    assert b.comm_bytes == sum(r * w * 8 for r, w in steps)
    assert s.comm_bytes == sum(w * (r - w) * 8 for r, w in steps)
    assert g.meta["comm_groups"] == {"row": 3, "col": 2}
    assert build_graph(hpl(1000, 50, precision="fp32")).kernel("g00.bcast").comm_bytes * 2 == build_graph(
        hpl(1000, 50)).kernel("g00.bcast").comm_bytes


def test_hpl_has_no_batch():
    with pytest.raises(InputError, match="batch"):
        build_graph(hpl(100, 10), batch=4)


# -- FFT ----------------------------------------------------------------------------------------------


def fft(dims, batch=1, decomposition="pencil", precision="fp32"):
    return load_workload({"kind": "fft", "name": "f", "dims": dims, "batch": batch,
                          "decomposition": decomposition, "precision": precision})


@pytest.mark.parametrize("dims,decomposition,stages,transposes", [
    ([1 << 20], "pencil", 2, 1), ([256, 512], "pencil", 2, 1), ([64, 128, 256], "pencil", 3, 2),
    ([64, 128, 256], "slab", 2, 1), ([4096, 4096, 4096], "pencil", 3, 2),
])
def test_fft_flop_exact(dims, decomposition, stages, transposes):
    for batch in (1, 3):
        g = build_graph(fft(dims, batch, decomposition))
        N = math.prod(dims)
        assert g.total_flop() == 5 * N * math.log2(N) * batch
        kinds = [g.kernel(n).kind for n in g.topological_names()]
        assert kinds.count(KernelKind.fft) == stages and kinds.count(KernelKind.comm) == transposes
        assert kinds[0] == kinds[-1] == KernelKind.fft  # starts and ends with local FFTs
        for k in g.kernels:
            assert k.output_bytes == N * batch * 8  # complex64
            if k.kind == KernelKind.comm:
                assert k.collective == "all_to_all" and k.comm_bytes == N * batch * 8


def test_fft_pencil_groups_and_non_power_of_two():
    g = build_graph(fft([8, 8, 8]))
    assert [g.kernel(n).comm_group for n in ("transpose0", "transpose1")] == ["row", "col"]
    assert g.topological_names() == ["fft.x", "transpose0", "fft.y", "transpose1", "fft.z"]
    g = build_graph(fft([12, 10, 6], precision="fp64"))
    N = 720
    assert g.total_flop() == pytest.approx(5 * N * math.log2(N), rel=1e-12)
    assert g.kernel("fft.x").output_bytes == N * 16
    assert build_graph(fft([13])).topological_names() == ["fft.n"]  # prime: one local stage


def test_fft_batch_override():
    w = fft([64, 64, 64], batch=2)
    assert build_graph(w).meta["batch"] == 2
    assert build_graph(w, batch=5).total_flop() == 5 * 64**3 * 18 * 5


# -- DLRM ---------------------------------------------------------------------------------------------


def dlrm_spec(**kw):
    spec = {"kind": "dlrm", "name": "d",
            "embedding": {"num_tables": 3, "rows_per_table": [100, 2000, 30], "dim": 16, "lookups_per_table": [1, 4, 2]},
            "dense_features": 13, "bottom_mlp": [64, 16], "top_mlp": [32, 8, 1],
            "training": {"global_batch": 128, "precision": "fp32"}}
    spec.update(kw)
    return spec


def mlp_params(widths):
    return sum(k * n + n for k, n in zip(widths[:-1], widths[1:]))


def test_dlrm_params_closed_form():
    g = build_graph(load_workload(dlrm_spec()))
    F = 4
    top_in = 16 + F * (F - 1) // 2
    assert g.params() == (100 + 2000 + 30) * 16 + mlp_params([13, 64, 16]) + mlp_params([top_in, 32, 8, 1])


def test_dlrm_preset_params():
    w = load_workload("dlrm")
    g = build_graph(w, batch=256)
    rows = sum(w.embedding.rows())
    assert rows == 204_184_588
    F = 27
    closed = rows * 128 + mlp_params([13, 512, 256, 128]) + mlp_params([128 + F * (F - 1) // 2, 1024, 1024, 512, 256, 1])
    assert g.params() == closed


def test_dlrm_embedding_and_all_to_all():
    B, p = 128, 4
    g = build_graph(load_workload(dlrm_spec()))
    emb = g.kernel("fwd.emb")
    assert emb.kind == KernelKind.embedding and emb.weight_bytes == 0
    assert emb.extra_memory_bytes == B * (1 + 4 + 2) * 16 * p
    assert emb.params == (100 + 2000 + 30) * 16
    a2a = [k for k in g.kernels if k.kind == KernelKind.comm]
    assert [k.name for k in a2a] == ["fwd.emb_a2a", "bwd.emb_a2a"]
    assert all(k.collective == "all_to_all" and k.comm_group == "embedding" and k.comm_bytes == B * 3 * 16 * p
               for k in a2a)
    assert g.nx.has_edge("fwd.emb", "fwd.emb_a2a") and g.nx.has_edge("fwd.emb_a2a", "fwd.interact")
    assert g.nx.has_edge("bwd.interact", "bwd.emb_a2a") and g.nx.has_edge("bwd.emb_a2a", "wgrad.emb")
    scatter = g.kernel("wgrad.emb")
    assert scatter.phase == Phase.weight_grad and scatter.kind == KernelKind.embedding
    assert g.kernel("fwd.interact").flop == 2 * B * 4 * 4 * 16


def test_dlrm_matmul_gradients():
    g = build_graph(load_workload(dlrm_spec()))
    B = 128
    layers = [(13, 64), (64, 16), (22, 32), (32, 8), (8, 1)]
    mlp_fwd = sum(2 * B * k * n for k, n in layers)
    wgrad = g.matmul_flop(Phase.weight_grad)
    assert wgrad == mlp_fwd
    # data gradients: every layer but the first bottom one, plus the interaction
    assert g.matmul_flop(Phase.backward) == mlp_fwd - 2 * B * 13 * 64 + 2 * B * 4 * 4 * 16
    assert {t.name for t in g.inputs()} == {"indices", "dense", "labels"}


def test_dlrm_batch_scales():
    w = load_workload(dlrm_spec())
    assert build_graph(w, batch=256).total_flop() == pytest.approx(2 * build_graph(w).total_flop(), rel=1e-12)


# -- explicit -----------------------------------------------------------------------------------------


def test_tiny_mlp():
    gs = build_graphs("tiny_mlp")
    g = gs.layer
    assert len(g) == 6 and gs.num_layers == 1
    assert g.params() == 2 * 1024 * 4096
    assert g.matmul_flop() == 5 * 2 * 1024 * 4096 * 1024
    assert g.matmul_flop(Phase.backward) + g.matmul_flop(Phase.weight_grad) == 3 * 2 * 1024 * 4096 * 1024
    with pytest.raises(InputError, match="batch"):
        build_graph("tiny_mlp", batch=7)
    assert build_graph("tiny_mlp", batch=1024).total_flop() == g.total_flop()


def test_subgraph_keeps_same_named_cut_tensors_apart():
    from dfmodel.graph.graph import DataflowGraph
    from dfmodel.graph.kernel import Kernel, KernelKind, Tensor

    k = lambda n: Kernel(n, KernelKind.elementwise, {"m": 4}, flop=4, output_bytes=8)  # noqa: E731
    g = DataflowGraph([k("a"), k("conv"), k("b")],
                      [Tensor("t", "a", "conv", 8), Tensor("t", "conv", "b", 8), Tensor("t", "a", "b", 8)])
    sub = g.subgraph(["b"])
    assert sorted(t.name for t in sub.inputs()) == ["t@a", "t@conv"]
    assert sorted(t.name for t in g.subgraph(["conv", "b"]).inputs()) == ["t", "t"]  # one producer: kept
