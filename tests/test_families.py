"""Non-LLM families (DLRM, HPL, FFT): search = exhaustive enumeration, valid bounds, monotonicity in
network bandwidth, infeasibility, FLOP identities, breakdown sums, knobs, shipped presets."""

from __future__ import annotations

import copy
import math

import pytest

from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.families import solve_family
from dfmodel.result import BREAKDOWN_KEYS
from dfmodel.system import load_system

# -- tiny systems -------------------------------------------------------------------------------


def chip(execution="kernel_by_kernel"):
    c = {
        "name": "c",
        "peak_flops": {"fp64": 10e12, "fp32": 20e12, "bf16": 100e12},
        "vector_flops": 10e12,
        "sram_bytes": "4 MiB",
        "compute_tiles": 64,
        "memory": {"kind": "HBM", "capacity_bytes": "4 GiB", "bandwidth_Bps": "1 TB/s"},
        "execution": execution,
        "efficiency": {"matmul": 0.8, "vector": 0.6, "memory": 0.9, "kernel_overhead_s": 2e-6},
    }
    return c


def system(dims, execution="kernel_by_kernel", scale_bw=1.0, overlap=1.0, storage=None):
    net = []
    for name, topo, size, bw, lat in dims:
        net.append({"name": name, "topology": topo, "size": size, "link_bandwidth_Bps": bw * scale_bw,
                    "latency_s": lat})
    spec = {"name": "tiny", "chip": chip(execution), "network": net, "dp_overlap": overlap}
    if storage:
        spec["storage"] = storage
    return load_system(spec)


SYSTEMS = {
    "switch4x2": [("nv", "switch", 4, 200e9, 1e-6), ("ib", "switch", 2, 25e9, 5e-6)],
    "switch2x8": [("nv", "switch", 2, 200e9, 1e-6), ("ib", "switch", 8, 25e9, 5e-6)],
    "ring2": [("r", "ring", 2, 50e9, 2e-6)],
    "torus4x4": [("x", "ring", 4, 50e9, 2e-6), ("y", "ring", 4, 50e9, 2e-6)],
}

# -- tiny workloads -----------------------------------------------------------------------------

DLRM = {
    "kind": "dlrm", "name": "tiny_dlrm",
    "embedding": {"num_tables": 5, "rows_per_table": [200000, 30000, 5000, 100, 10], "dim": 16,
                  "lookups_per_table": [4, 1, 8, 2, 1]},
    "dense_features": 8, "bottom_mlp": [32, 16], "top_mlp": [32, 1],
    "training": {"global_batch": 256, "precision": "fp32", "optimizer": "adagrad"},
}
HPL = {"kind": "hpl", "name": "tiny_hpl", "n": 4096, "nb": 128, "p": 2, "q": 4, "max_steps": 8}
FFT = {"kind": "fft", "name": "tiny_fft", "dims": [64, 64, 32], "batch": 4, "precision": "fp32"}
FFT2D = {"kind": "fft", "name": "tiny_fft2", "dims": [256, 128], "batch": 2, "precision": "fp64"}
FFT1D = {"kind": "fft", "name": "tiny_fft1", "dims": [4096], "batch": 1, "precision": "fp32"}

WORKLOADS = {"dlrm": DLRM, "hpl": HPL, "fft": FFT, "fft2d": FFT2D, "fft1d": FFT1D}


def solve(workload, sys_, knobs=None, **kw):
    return solve_family(load_workload(workload), sys_, knobs or Knobs(), **kw)


def useful_flop(w: dict, num_chips: int) -> float:
    wl = load_workload(w)
    if wl.kind == "dlrm":
        return build_graphs(wl, batch=1).layer.total_flop() * wl.training.global_batch
    if wl.kind == "hpl":
        return 2 / 3 * wl.n**3 + 1.5 * wl.n**2
    points = math.prod(wl.dims)
    return 5 * points * math.log2(points) * wl.batch


# -- search = exhaustive ------------------------------------------------------------------------


@pytest.mark.parametrize("wname", list(WORKLOADS))
@pytest.mark.parametrize("sname", ["switch4x2", "ring2", "torus4x4"])
def test_search_equals_exhaustive(wname, sname):
    s = system(SYSTEMS[sname])
    w = WORKLOADS[wname]
    r = solve(w, s)
    ex = solve(w, s, exhaustive=True)
    assert r.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-12)
    assert ex.solver.candidates_evaluated >= r.solver.candidates_evaluated
    assert r.solver.proven_optimal and r.solver.status == "optimal"


def _model_and_candidates(wname, s):
    w = load_workload(WORKLOADS[wname])
    if w.kind == "dlrm":
        from dfmodel.inter_chip import dlrm as mod

        model = mod.DLRMModel(w, s)
    elif w.kind == "hpl":
        from dfmodel.inter_chip import hpl as mod

        model = mod.HPLModel(w, s)
    else:
        from dfmodel.inter_chip import fft as mod

        model = mod.FFTModel(w, s)
    return model, list(mod.candidates(model, Knobs()))


@pytest.mark.parametrize("wname", ["dlrm", "hpl", "fft"])
@pytest.mark.parametrize("execution", ["kernel_by_kernel", "dataflow"])
def test_bounds_are_valid_and_brute_force_agrees(wname, execution):
    """Every candidate's lower bound <= its evaluation (and the memory floor <= its memory), and the
    brute-force minimum over the same cost model is what the search returns."""
    s = system(SYSTEMS["switch4x2"], execution=execution)
    model, cands = _model_and_candidates(wname, s)
    assert cands
    best = math.inf
    for m in cands:
        ev = model.evaluate(m)
        if not ev.fits:
            continue
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-9)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-9)
        assert sum(ev.breakdown_s.values()) == pytest.approx(ev.iteration_time_s, rel=1e-9)
        best = min(best, ev.iteration_time_s)
    r = solve(WORKLOADS[wname], s)
    assert r.iteration_time_s == pytest.approx(best, rel=1e-12)


def test_kernel_by_kernel_bound_is_exact_for_dlrm():
    """On kernel-by-kernel chips the DLRM bound is the evaluation itself (so the search prunes hard)."""
    s = system(SYSTEMS["switch2x8"])
    model, cands = _model_and_candidates("dlrm", s)
    for m in cands[::7]:
        ev = model.evaluate(m)
        if ev.fits:
            assert model.lower_bound_s(m) == pytest.approx(ev.iteration_time_s, rel=1e-9)


# -- monotone in network bandwidth --------------------------------------------------------------


@pytest.mark.parametrize("wname", list(WORKLOADS))
@pytest.mark.parametrize("sname", ["switch4x2", "switch2x8"])
def test_doubling_bandwidth_never_slows(wname, sname):
    slow = solve(WORKLOADS[wname], system(SYSTEMS[sname])).iteration_time_s
    fast = solve(WORKLOADS[wname], system(SYSTEMS[sname], scale_bw=2.0)).iteration_time_s
    assert fast <= slow * (1 + 1e-12)


# -- identities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wname", list(WORKLOADS))
def test_mfu_flop_identity_and_breakdown(wname):
    s = system(SYSTEMS["switch4x2"])
    w = WORKLOADS[wname]
    r = solve(w, s)
    wl = load_workload(w)
    peak = s.chip.peak(wl.precision)
    flop = useful_flop(w, s.num_chips)
    assert r.model_flops_utilization * r.iteration_time_s * s.num_chips * peak == pytest.approx(flop, rel=1e-9)
    assert 0 < r.model_flops_utilization < 1
    assert set(r.breakdown_s) == set(BREAKDOWN_KEYS)
    assert sum(r.breakdown_s.values()) == pytest.approx(r.iteration_time_s, rel=1e-12)
    assert all(v >= 0 for v in r.breakdown_s.values())
    mem = r.memory_per_chip_bytes
    assert set(mem) == {"weights", "gradients", "optimizer", "activations", "total", "capacity", "reserve"}
    assert mem["total"] == pytest.approx(mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"])
    assert mem["total"] <= mem["capacity"]
    assert r.bottleneck in BREAKDOWN_KEYS and r.breakdown_s[r.bottleneck] == max(r.breakdown_s.values())
    assert r.tokens_per_s == r.samples_per_s > 0
    assert r.parallelism.tp * r.parallelism.pp * r.parallelism.dp == s.num_chips
    assert r.intra_chip["partitions"] and r.sharding and r.notes
    assert r.cost_usd >= 0 and r.power_w >= 0
    r.to_json()  # serialises


def test_dlrm_samples_and_hpl_runs_per_second():
    s = system(SYSTEMS["switch4x2"])
    d = solve(DLRM, s)
    assert d.samples_per_s == pytest.approx(DLRM["training"]["global_batch"] / d.iteration_time_s)
    h = solve(HPL, s)
    assert h.samples_per_s == pytest.approx(1 / h.iteration_time_s)
    assert h.parallelism.dims.keys() == {"P", "Q"}
    assert any("Gflop/s" in n for n in h.notes)


def test_dlrm_exposed_sync_and_input_pipeline():
    """dp_overlap 0 exposes the whole gradient sync; a slow input pipeline shows up as ``input``."""
    w = copy.deepcopy(DLRM)
    w["training"]["input_bytes_per_sample"] = 1000
    hidden = solve(w, system(SYSTEMS["switch4x2"]))
    exposed = solve(w, system(SYSTEMS["switch4x2"], overlap=0))
    assert exposed.breakdown_s["dp_comm"] > 0
    assert exposed.iteration_time_s >= hidden.iteration_time_s
    slow = solve(w, system(SYSTEMS["switch4x2"], storage={"chips_per_node": 4, "read_bandwidth_Bps": "10 MB/s",
                                                          "preprocess_samples_per_s": 1e9}))
    # 256 samples over 2 nodes x 1000 bytes at 10 MB/s: 12.8 ms of loading, the step is shorter
    assert slow.input_bound and slow.iteration_time_s == pytest.approx(128 * 1000 / 10e6)
    assert sum(slow.breakdown_s.values()) == pytest.approx(slow.iteration_time_s, rel=1e-12)


# -- family specifics -------------------------------------------------------------------------------


def test_dlrm_tables_fit_only_when_sharded():
    """Tables too big for one chip: replicated plans are out, a sharded one is chosen; its shard
    memory is what the chip holds."""
    w = copy.deepcopy(DLRM)
    w["embedding"]["rows_per_table"] = [60_000_000, 10_000_000, 5000, 100, 10]  # 4.5 GB of fp32 rows
    s = system(SYSTEMS["switch4x2"])
    r = solve(w, s)
    assert r.parallelism.tp > 1
    assert any(v.startswith(("row-wise", "table-wise", "column-wise")) for k, v in r.sharding.items()
               if k.startswith("table"))
    with pytest.raises(InfeasibleError, match=r"short by"):
        solve(w, s, Knobs(tp=1))  # every chip would hold every table


def test_dlrm_dp_knob_and_exchange_volume():
    """dp fixes the number of table replicas; with tp = N a table-wise plan's all-to-all message
    is the chip's pooled embeddings for the samples of its group."""
    s = system(SYSTEMS["switch4x2"])
    r = solve(DLRM, s, Knobs(dp=2))
    assert (r.parallelism.tp, r.parallelism.dp) == (4, 2)
    assert r.parallelism.dims["dense_dp"] == ["nv:4", "ib:2"]
    from dfmodel.inter_chip.dlrm import DLRMMapping, DLRMModel

    model = DLRMModel(load_workload(DLRM), s)
    m = DLRMMapping(8, 1, 32, 1, "hybrid:0,0", (("tp", (("nv", 4), ("ib", 2))), ("dp", ())))
    _, _, _, vol = model.per_chip(m)
    # 5 tables of dim 16 table-wise on 8 chips: a chip owns at most one table; it sends the pooled
    # rows of its table for the group's 8 x 32 samples (= what it receives: 32 x 5 x 16 is smaller)
    assert vol["a2a_msg"] == max(8 * 32 * 16, 32 * 5 * 16) * 4


def test_hpl_grid_and_lookahead():
    s = system(SYSTEMS["switch4x2"])
    from dfmodel.inter_chip.hpl import HPLMapping, HPLModel

    model = HPLModel(load_workload(HPL), s)
    m = HPLMapping(2, 4, (("P", (("nv", 2),)), ("Q", (("nv", 2), ("ib", 2)))))
    ev = model.evaluate(m)
    assert ev.iteration_time_s <= ev.chip.time_s * (1 + 1e-12)  # look-ahead only hides work
    assert ev.memory.weights_bytes == 2048 * 1024 * 8  # 4096 / 2 rows x 4096 / 4 columns, fp64
    r = solve(HPL, s)
    assert r.parallelism.dims["P"] or r.parallelism.dims["Q"]


def test_fft_searches_both_decompositions():
    s = system(SYSTEMS["switch2x8"])
    r = solve(FFT, s, exhaustive=True)
    assert r.pipeline["decomposition"] in ("pencil", "slab")
    from dfmodel.inter_chip.fft import FFTModel, candidates

    model = FFTModel(load_workload(FFT), s)
    decs = {m.decomposition for m in candidates(model, Knobs())}
    assert decs == {"pencil", "slab"}
    r4 = solve(FFT, s, Knobs(dp=4))
    assert r4.parallelism.dp == 4 and r4.parallelism.tp == 4


# -- infeasible and bad knobs --------------------------------------------------------------------


@pytest.mark.parametrize("w", [
    {**HPL, "n": 200_000, "nb": 256},
    {**FFT, "dims": [2048, 2048, 1024], "batch": 1},
])
def test_too_big_raises_infeasible(w):
    with pytest.raises(InfeasibleError, match=r"short by \d"):
        solve(w, system(SYSTEMS["switch4x2"]))


def test_dlrm_too_big_raises_infeasible():
    w = copy.deepcopy(DLRM)
    w["embedding"]["rows_per_table"] = [400_000_000] * 5
    with pytest.raises(InfeasibleError, match=r"short by"):
        solve(w, system(SYSTEMS["switch4x2"]))


@pytest.mark.parametrize("wname,knobs,field", [
    ("hpl", Knobs(tp=2), "tp"),
    ("hpl", Knobs(dp=2), "dp"),
    ("hpl", Knobs(micro_batch=1), "micro_batch"),
    ("dlrm", Knobs(pp=2), "pp"),
    ("dlrm", Knobs(recompute="full"), "recompute"),
    ("dlrm", Knobs(tp=4, dp=4), "tp/dp"),
    ("dlrm", Knobs(micro_batch=7), "micro_batch"),
    ("fft", Knobs(sequence_parallel=True), "sequence_parallel"),
    ("fft", Knobs(distributed_optimizer=True), "distributed_optimizer"),
    ("fft", Knobs(dp=8), "dp"),
])
def test_meaningless_knobs_raise_input_error(wname, knobs, field):
    with pytest.raises(InputError) as e:
        solve(WORKLOADS[wname], system(SYSTEMS["switch4x2"]), knobs)
    assert e.value.field == field


def test_neutral_knobs_are_accepted():
    s = system(SYSTEMS["switch4x2"])
    a = solve(HPL, s, Knobs(pp=1, recompute="none", interleave=1))
    assert a.iteration_time_s == solve(HPL, s).iteration_time_s


def test_precision_missing_on_chip_is_input_error():
    s = load_system("tpu_v4", num_chips=256)
    with pytest.raises(InputError, match="fp64"):
        solve(HPL, s)


# -- shipped presets -----------------------------------------------------------------------------


@pytest.mark.parametrize("workload,num_chips", [("dlrm", 64), ("fft", 64), ("hpl", 1024)])
def test_shipped_workloads_solve_to_proven_optimum(workload, num_chips):
    # (how fast is benchmarks' business -- bench_optimize.py -- not a wall-clock assertion here)
    s = load_system("dgx_a100", num_chips=num_chips)
    r = solve_family(load_workload(workload), s, Knobs())
    assert r.iteration_time_s > 0 and 0 < r.model_flops_utilization < 1
    assert r.solver.proven_optimal
    assert sum(r.breakdown_s.values()) == pytest.approx(r.iteration_time_s, rel=1e-12)


def test_optimize_dispatches_families():
    from dfmodel import optimize

    r = optimize(FFT, {"name": "t", "chip": chip(), "network": [
        {"name": "nv", "topology": "switch", "size": 4, "link_bandwidth_Bps": 1e11}]})
    assert r.workload == "tiny_fft" and r.num_chips == 4
