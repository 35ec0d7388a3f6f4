"""Kernel sets as 64-bit masks (dfmodel.intra_chip.packed): the chunk-table terms equal the
tensor-by-tensor ones to the bit on shipped layer graphs, the floor-pruned DP on masks returns
the very plan and time of the boolean-row path (and brute force's time), and its rough floor
decides exactly as the exact one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dfmodel.graph.build import build_graphs
from dfmodel.graph.graph import DataflowGraph
from dfmodel.intra_chip import CostModel
from dfmodel.intra_chip.cost import PACKED_MIN_ROWS
from dfmodel.intra_chip import bounded_dp
from dfmodel.intra_chip import ideals as dpmod
from dfmodel.intra_chip.packed import ChunkSum, any_bits, pack_rows, unpack_fortran
from dfmodel.system import load_system
from test_intra_chip_support import chips, dags, streaming

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _sets(n: int, seed: int, m: int = 3000) -> np.ndarray:
    """Column-major kernel sets: random ones of several densities, runs of the topological
    order (what partitions mostly are), singletons, the empty and the full set."""
    rng = np.random.default_rng(seed)
    rows = [rng.random((m, n)) < p for p in (0.05, 0.3, 0.7)]
    lo = rng.integers(0, n, m)
    hi = np.minimum(n, lo + rng.integers(1, 12, m))
    rows.append((np.arange(n) >= lo[:, None]) & (np.arange(n) < hi[:, None]))
    rows += [np.eye(n, dtype=bool), np.zeros((1, n), bool), np.ones((1, n), bool)]
    return np.asfortranarray(np.vstack(rows))


@pytest.mark.parametrize("system", ["sn30", "wse2"])
@pytest.mark.parametrize("workload", ["deepseek_v3", "mixtral_8x7b", "gpt3_13b"])
def test_chunk_terms_equal_tensor_by_tensor_on_shipped_layers(workload, system):
    cm = CostModel(build_graphs(workload).layer, load_system(system))
    assert cm.packed_terms is not None  # integer bytes, <= 64 kernels: the chunk tables apply
    S = _sets(cm.n, seed=len(workload))
    want = cm.terms_by_tensor(S)
    for got in (cm.terms_of(S), cm.terms_of_codes(pack_rows(S), S)):
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    light = bounded_dp.light_bytes(cm, S)  # many rows: by the chunk tables
    few = np.concatenate([bounded_dp.light_bytes(cm, S[a:a + 500]) for a in range(0, S.shape[0], 500)])
    assert S.shape[0] >= PACKED_MIN_ROWS > 500 and np.array_equal(light, few)


def test_unpack_inverts_pack_with_asfortranarray_strides():
    rng = np.random.default_rng(0)
    for m, n in ((0, 5), (1, 47), (2, 47), (1000, 64), (7, 1)):
        S = rng.random((m, n)) < 0.5
        back = unpack_fortran(pack_rows(S), n)
        ref = np.asfortranarray(S)
        assert back.shape == ref.shape and np.array_equal(back, ref)
        if m and n > 1:  # (a dimension of length 1 has no stride that matters)
            assert back.strides == ref.strides  # einsum's order of addition follows the strides


def test_chunk_sum_with_items_cut_by_narrow_chunks_equals_the_items():
    """Width 3: most items span chunks, go to tables of their own kernels, or (more kernels
    than the width) are evaluated directly; the sum is the items' sum either way."""
    rng = np.random.default_rng(1)
    n = 20
    masks = [int(m) for m in rng.integers(1, 1 << n, 30) & rng.integers(1, 1 << n, 30)] + [1 << k for k in range(n)]
    values = rng.integers(1, 1000, len(masks)).astype(float)

    def evaluate(codes, which):
        out = np.zeros((codes.size, 2))
        for i in which:  # any and all of the item's kernels: two different functions of its bits
            out[:, 0] += values[i] * any_bits(codes, masks[i])
            out[:, 1] += values[i] * ((codes & np.uint64(masks[i])) == np.uint64(masks[i]))
        return out

    cs = ChunkSum(n, masks, evaluate, width=3)
    assert cs.direct and len(cs.tables) > -(-n // 3)
    codes = rng.integers(0, 1 << n, 5000).astype(np.uint64)
    assert np.array_equal(cs(codes), evaluate(codes, list(range(len(masks)))).T)


def _integer_bytes(graph: DataflowGraph) -> DataflowGraph:
    """The graph with every byte count rounded to an integer (the chunk tables' exactness
    condition; shipped graphs count whole bytes)."""
    ks = [dataclasses.replace(k, output_bytes=round(k.output_bytes), weight_bytes=round(k.weight_bytes),
                              extra_memory_bytes=round(k.extra_memory_bytes)) for k in graph.kernels]
    ts = [dataclasses.replace(t, bytes=round(t.bytes)) for t in graph.tensors]
    return DataflowGraph(ks, ts, name=graph.name, meta=graph.meta)


@SETTINGS
@given(dags(), chips(execution="dataflow"), streaming())
def test_bounded_dp_on_masks_returns_the_boolean_paths_plan(g_net, c, stream):
    graph, net = g_net
    graph = _integer_bytes(graph)
    runs = []
    for packed in (True, False):
        cm = CostModel(graph, c, net, **(stream or {}))
        if not packed:
            cm.__dict__["_packed_terms"] = None  # the tensor-by-tensor path, as before the masks
        assert (cm.packed_terms is not None) == packed
        lat = dpmod.enumerate_ideals(cm)
        seed = dpmod.solve_dp(cm, None, lattice=dpmod.chain_lattice(cm))
        runs.append([bounded_dp.solve_bounded(cm, lat, s, max_pairs=10**7) for s in (None, seed)])
    assert runs[0] == runs[1]  # the same plans and the same float times
    brute = dpmod.brute_force(CostModel(graph, c, net, **(stream or {})))
    for got in runs[0]:
        assert (got is None) == (brute is None)
        if got is not None:
            assert got[1] == pytest.approx(brute[1], rel=1e-9)


@pytest.mark.parametrize("system", ["sn30", "wse2"])
def test_rough_floor_decides_as_the_exact_floor(system):
    """At limits set to each set's own exact ``dist + floor + h`` (every decision on the edge),
    and 1e-13 below them, :meth:`_State._within` answers as the exact floor does."""
    cm = CostModel(build_graphs("deepseek_v3").layer, load_system(system))
    lat = dpmod.chain_lattice(cm)
    st = bounded_dp._State(cm, lat, 10**7)
    assert st.masks is not None
    masks = pack_rows(_sets(cm.n, seed=3))
    masks = masks[masks != 0]
    heavy_code = bounded_dp._heavy_codes(unpack_fortran(masks, cm.n), bounded_dp._heavy_table(cm)[0])
    exact = st._floor(masks, heavy_code)[0]
    assert np.array_equal(exact, bounded_dp.floor_s(cm, unpack_fortran(masks, cm.n)))
    rough = st._rough_floor(masks, heavy_code)
    finite = np.isfinite(exact)  # (inf: no option fits the set's relaxed terms)
    assert np.array_equal(np.isfinite(rough), finite) and finite.sum() > 1000
    assert np.all(np.abs(rough[finite] - exact[finite]) <= 1e-13 * (exact[finite] + st._seconds_total))
    dist, h = np.linspace(0, 1, masks.size), np.full(masks.size, 0.25)
    for i in np.flatnonzero(finite)[::97]:
        for scale in (1.0, 1 - 1e-13, 1 + 1e-13):
            limit = float(dist[i] + exact[i] + h[i]) * scale
            assert np.array_equal(st._within(masks, heavy_code, dist, h, limit), dist + exact + h <= limit)


def test_cost_model_pickles_with_its_chunk_tables_built():
    """The tables hold closures: a cost model pickles without them and rebuilds them."""
    import pickle

    cm = CostModel(build_graphs("deepseek_v3").layer, load_system("sn30"))
    S = _sets(cm.n, seed=5)
    want = cm.terms_of(S)
    bounded_dp._floor_chunks(cm), bounded_dp._light_chunks(cm)
    back = pickle.loads(pickle.dumps(cm))
    got = back.terms_of(S)
    assert all(np.array_equal(got[k], want[k]) for k in want)
