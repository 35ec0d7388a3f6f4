"""Explicit graphs (kind: graph): exact min-max stage partition vs brute force, search vs exhaustive
enumeration, valid bounds, knobs, memory infeasibility, steady-state identities and the CLI."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dfmodel import optimize
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip import graph_family as gf
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.families import solve_family
from dfmodel.result import BREAKDOWN_KEYS
from dfmodel.system import load_system

ROOT = Path(__file__).resolve().parents[1]
TINY_MLP = str(ROOT / "workloads" / "tiny_mlp.yaml")

# -- systems ------------------------------------------------------------------------------------


def system(dims, execution="kernel_by_kernel", capacity="4 GiB", overlap=1.0):
    chip = {
        "name": "c", "peak_flops": {"fp32": 20e12, "bf16": 100e12}, "vector_flops": 10e12,
        "sram_bytes": "8 MiB", "compute_tiles": 64,
        "memory": {"kind": "HBM", "capacity_bytes": capacity, "bandwidth_Bps": "1 TB/s"},
        "execution": execution,
        "efficiency": {"matmul": 0.8, "vector": 0.6, "memory": 0.9, "kernel_overhead_s": 2e-6},
    }
    net = [{"name": n, "topology": t, "size": s, "link_bandwidth_Bps": bw, "latency_s": lat}
           for n, t, s, bw, lat in dims]
    return load_system({"name": "tiny", "chip": chip, "network": net, "dp_overlap": overlap})


SYSTEMS = {
    "one": [("nv", "switch", 1, 100e9, 1e-6)],
    "ring2": [("r", "ring", 2, 50e9, 2e-6)],
    "switch4": [("nv", "switch", 4, 200e9, 1e-6)],
    "switch4x2": [("nv", "switch", 4, 200e9, 1e-6), ("ib", "switch", 2, 25e9, 5e-6)],
}


# -- workloads ----------------------------------------------------------------------------------


def random_graph(seed: int, n: int = 5) -> dict:
    """A small random training DAG: matmuls and element-wise kernels in topological order, each
    reading one or two earlier tensors (or the graph input); some weight-gradient kernels."""
    rng = random.Random(seed)
    kernels, tensors = [], []
    for i in range(n):
        name = f"k{i}"
        if rng.random() < 0.6:
            m, nn, k = (rng.choice([128, 256, 512]) for _ in range(3))
            phase = "weight_grad" if i >= n // 2 and rng.random() < 0.5 else ("forward" if i < n // 2 else "backward")
            kernels.append({"name": name, "kind": "matmul", "dims": {"m": m, "n": nn, "k": k}, "flop": 2.0 * m * nn * k,
                            "output_bytes": 2 * m * nn, "weight_bytes": 2 * nn * k,
                            "params": nn * k if phase == "forward" else 0, "phase": phase})
        else:
            m, nn = rng.choice([256, 512]), rng.choice([256, 1024])
            kernels.append({"name": name, "kind": "elementwise", "dims": {"m": m, "n": nn}, "flop": 4.0 * m * nn,
                            "output_bytes": 2 * m * nn, "phase": "forward" if i < n // 2 else "backward"})
        preds = rng.sample(range(i), k=min(i, rng.choice([1, 1, 2]))) if i else []
        if not preds:
            tensors.append({"name": f"in{i}", "producer": None, "consumer": name, "bytes": 2**18})
        for j in preds:
            tensors.append({"name": f"t{j}", "producer": f"k{j}", "consumer": name, "bytes": kernels[j]["output_bytes"]})
    consumed = {t["producer"] for t in tensors if t["producer"]}
    for kd in kernels:
        if kd["phase"] == "weight_grad":
            tensors.append({"name": f"dW.{kd['name']}", "producer": kd["name"], "consumer": None,
                            "bytes": kd["output_bytes"]})
        elif kd["name"] not in consumed:
            tensors.append({"name": f"out.{kd['name']}", "producer": kd["name"], "consumer": None,
                            "bytes": kd["output_bytes"]})
    return {"kind": "graph", "name": f"rand{seed}", "precision": "bf16", "batch": 8, "kernels": kernels,
            "tensors": tensors}


def solve(w, s, knobs=None, **kw):
    return solve_family(load_workload(w), s, knobs or Knobs(), **kw)


# -- the exact min-max chain ----------------------------------------------------------------------


def brute_force_chain(n, preds, pp, cost):
    """Min over every ordered partition into <= pp non-empty stages, each the difference of two
    nested down-sets, of the slowest stage (plain recursion over the ideals)."""
    ideals = gf.enumerate_ideals(n, preds)
    full = (1 << n) - 1
    best = math.inf

    def rec(I, k, worst):
        nonlocal best
        if I == full:
            best = min(best, worst)
            return
        if k == pp:
            return
        for J in ideals:
            if J != I and (I & ~J) == 0:
                rec(J, k + 1, max(worst, cost(J & ~I)))

    rec(0, 0, 0.0)
    return best


def is_down_set(mask, preds):
    return all(not (mask >> k) & 1 or (preds[k] & ~mask) == 0 for k in range(len(preds)))


def random_dag(rng, n):
    preds = [0] * n
    for v in range(1, n):
        for u in range(v):
            if rng.random() < 0.35:
                preds[v] |= 1 << u
    return preds


@pytest.mark.parametrize("seed", range(40))
def test_min_max_chain_equals_brute_force_on_random_costs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    preds = random_dag(rng, n)
    lower = [rng.random() for _ in range(n)] if seed % 2 else None
    extra = {}

    def cost(mask):  # any set function >= the additive bound, some sets infeasible
        if mask not in extra:
            r = random.Random(mask * 7919 + seed)
            extra[mask] = math.inf if r.random() < 0.1 else r.random() * 3
        return extra[mask] + (sum(lower[k] for k in range(n) if (mask >> k) & 1) if lower else 0.0)

    for pp in (1, 2, 3, 5):
        want = brute_force_chain(n, preds, pp, cost)
        got = gf.min_max_chain(n, preds, pp, cost, lower)
        if math.isinf(want):
            assert got is None
            continue
        assert got.value == pytest.approx(want, rel=1e-12)
        # a chain of non-empty down-set differences covering every kernel once, <= pp stages
        assert 1 <= len(got.stages) <= pp
        acc = 0
        for s in got.stages:
            assert s and not (acc & s)
            acc |= s
            assert is_down_set(acc, preds)
        assert acc == (1 << n) - 1
        assert max(cost(s) for s in got.stages) == pytest.approx(got.value, rel=1e-12)


def test_min_max_chain_costs_lazily():
    n, preds = 8, [0] + [1 << (k - 1) for k in range(1, 8)]  # a chain: 9 ideals, 36 stage sets
    calls = []

    def cost(mask):
        calls.append(mask)
        return float(mask.bit_count())

    got = gf.min_max_chain(n, preds, 4, cost, [1.0] * n)
    assert got.value == 2.0 and len(got.stages) == 4
    assert len(set(calls)) == len(calls) < 36  # each set at most once, and not all of them


def test_ideals_guard():
    with pytest.raises(gf.TooLarge):
        gf.enumerate_ideals(20, [0] * 20, max_ideals=1000)


# -- the stage partition of the model equals brute force ---------------------------------------------


@pytest.mark.parametrize("wname", ["tiny_mlp", "rand1", "rand2", "rand5"])
@pytest.mark.parametrize("execution", ["kernel_by_kernel", "dataflow"])
def test_stage_partition_equals_brute_force(wname, execution):
    w = load_workload(TINY_MLP if wname == "tiny_mlp" else random_graph(int(wname[4:])))
    s = system(SYSTEMS["switch4x2"], execution)
    model = gf.GraphModel(w, s)
    checked = 0
    for m in gf.candidates(model, Knobs()):
        if m.pp == 1 or m.sequence_parallel or m.distributed_optimizer:
            continue
        p = model.prepared(m)
        pp_group = m.group("pp")
        chain = model.chain(p, m)

        def cost(mask):
            st = model.stage(p, mask, pp_group, 1)
            return st.time_s if st.fits else math.inf

        want = brute_force_chain(len(p.names), p.preds, m.pp, cost)
        assert chain.value == pytest.approx(want, rel=1e-12)
        checked += 1
    assert checked


# -- the search ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("wname", ["tiny_mlp", "rand3", "rand7"])
@pytest.mark.parametrize("sname", ["one", "ring2", "switch4", "switch4x2"])
def test_search_equals_exhaustive(wname, sname):
    w = TINY_MLP if wname == "tiny_mlp" else random_graph(int(wname[4:]))
    s = system(SYSTEMS[sname])
    r = solve(w, s)
    ex = solve(w, s, exhaustive=True)
    assert r.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-12)
    assert ex.solver.candidates_evaluated >= r.solver.candidates_evaluated
    assert r.solver.proven_optimal


@pytest.mark.parametrize("execution", ["kernel_by_kernel", "dataflow"])
def test_bounds_are_valid(execution):
    s = system(SYSTEMS["switch4x2"], execution)
    for w in (TINY_MLP, random_graph(4)):
        model = gf.GraphModel(load_workload(w), s)
        for m in gf.candidates(model, Knobs()):
            ev = model.evaluate(m)
            assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-9)
            assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-9)
            assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-9)


def test_fixing_a_knob_never_helps():
    s = system(SYSTEMS["switch4x2"])
    free = solve(TINY_MLP, s).iteration_time_s
    fixed = [Knobs(tp=t) for t in (1, 2, 4, 8)] + [Knobs(pp=p) for p in (1, 2, 4)] + \
        [Knobs(dp=d) for d in (1, 2, 8)] + [Knobs(sequence_parallel=b) for b in (False, True)] + \
        [Knobs(distributed_optimizer=b) for b in (False, True)] + [Knobs(tp=2, pp=2, dp=2)]
    for k in fixed:
        r = solve(TINY_MLP, s, k)
        assert r.iteration_time_s >= free * (1 - 1e-12), k
        for name in ("tp", "pp", "dp", "sequence_parallel", "distributed_optimizer"):
            if getattr(k, name) is not None:
                assert getattr(r.parallelism, name) == getattr(k, name)


def test_result_identities():
    s = system(SYSTEMS["switch4x2"])
    w = load_workload(TINY_MLP)
    for k in (Knobs(), Knobs(tp=2, pp=2, dp=2), Knobs(tp=1, pp=1, dp=8)):
        r = solve_family(w, s, k)
        par = r.parallelism
        assert par.tp * par.pp * par.dp == 8
        assert sum(r.breakdown_s.values()) == pytest.approx(r.iteration_time_s, rel=1e-9)
        assert set(r.breakdown_s) == set(BREAKDOWN_KEYS) and r.breakdown_s["bubble"] == 0
        assert r.samples_per_s == pytest.approx(par.dp * w.batch / r.iteration_time_s)
        stages = r.pipeline["stages"]
        slowest = max(st["time_s"] for st in stages)
        assert r.pipeline["latency_s"] == pytest.approx(sum(st["time_s"] for st in stages))
        extra = max(st["dp_exposed_s"] + st["optimizer_s"] for st in stages)
        assert r.iteration_time_s == pytest.approx(slowest + extra)
        assert any("latency" in n for n in r.notes)
        # every kernel of the sharded graph sits in exactly one stage
        names = [k for st in stages for k in st["kernels"]]
        assert len(names) == len(set(names)) == len(r.sharding)
        flop = sum(kd.flop for kd in w.kernels) * par.dp
        assert r.model_flops_utilization == pytest.approx(flop / (r.iteration_time_s * 8 * 100e12))
    r = solve_family(w, s, Knobs(tp=1, pp=1, dp=8))
    assert r.breakdown_s["dp_comm"] >= 0 and r.pipeline["stages"][0]["dp_sync_s"] > 0


def test_exposed_sync_without_overlap():
    s = system(SYSTEMS["switch4x2"], overlap=0)
    r = solve(TINY_MLP, s, Knobs(tp=1, pp=1, dp=8))
    st = r.pipeline["stages"][0]
    assert st["dp_exposed_s"] == pytest.approx(st["dp_sync_s"]) and r.breakdown_s["dp_comm"] == pytest.approx(st["dp_sync_s"])


def test_inference_graph_has_no_optimizer():
    g = random_graph(2)
    for kd in g["kernels"]:
        if kd["phase"] == "weight_grad":
            kd["phase"] = "backward"
    s = system(SYSTEMS["switch4"])
    r = solve(g, s)
    assert r.breakdown_s["optimizer"] == 0 and r.memory_per_chip_bytes["optimizer"] == 0
    assert r.memory_per_chip_bytes["gradients"] == 0
    with pytest.raises(InputError) as e:
        solve(g, s, Knobs(distributed_optimizer=True))
    assert e.value.field == "distributed_optimizer"


@pytest.mark.parametrize("knobs, field", [
    (Knobs(micro_batch=2), "micro_batch"),
    (Knobs(recompute="full"), "recompute"),
    (Knobs(interleave=2), "interleave"),
    (Knobs(tp=3), "tp"),
    (Knobs(tp=2, pp=2, dp=4), "tp/pp/dp"),
    (Knobs(pp=0), "pp"),
])
def test_bad_knobs_raise_input_error(knobs, field):
    with pytest.raises(InputError) as e:
        solve(TINY_MLP, system(SYSTEMS["switch4x2"]), knobs)
    assert e.value.field == field


def test_neutral_knobs_are_accepted():
    r = solve(TINY_MLP, system(SYSTEMS["switch4"]), Knobs(recompute="none", interleave=1))
    assert r.iteration_time_s > 0


def test_too_big_raises_infeasible_naming_the_shortfall():
    s = system(SYSTEMS["ring2"], capacity="70 MiB")  # above the state floors, below what fits
    with pytest.raises(InfeasibleError) as e:
        solve(TINY_MLP, s)
    assert "short by" in str(e.value) and str(e.value).startswith("graph: no mapping fits")


def test_memory_steers_the_stage_partition():
    # the fastest 2-stage split puts both forward matmuls (all parameters) on stage 0; with less
    # memory than that stage needs, a slower split that spreads the parameters is chosen
    k = Knobs(tp=1, pp=2, dp=1)
    free = solve(TINY_MLP, system(SYSTEMS["ring2"]), k)
    need = free.memory_per_chip_bytes["total"]
    s = system(SYSTEMS["ring2"], capacity=f"{int(0.75 * need)} B")
    r = solve(TINY_MLP, s, k)
    assert r.memory_per_chip_bytes["total"] <= r.memory_per_chip_bytes["capacity"] < need
    assert r.iteration_time_s > free.iteration_time_s
    params = [st["params_per_chip"] for st in r.pipeline["stages"]]
    assert len(params) == 2 and min(params) > 0


def test_wide_graph_pp_guard():
    wide = {"kind": "graph", "name": "wide", "batch": 1,
            "kernels": [{"name": f"e{i}", "kind": "elementwise", "dims": {"m": 64, "n": 64}, "flop": 4096,
                         "output_bytes": 8192} for i in range(16)],
            "tensors": [{"name": f"x{i}", "producer": None, "consumer": f"e{i}", "bytes": 8192} for i in range(16)]
            + [{"name": f"y{i}", "producer": f"e{i}", "consumer": None, "bytes": 8192} for i in range(16)]}
    s = system(SYSTEMS["ring2"])
    with pytest.raises(InputError) as e:
        solve(wide, s, Knobs(pp=2))
    assert e.value.field == "pp" and "pp=1" in str(e.value)
    r = solve(wide, s)
    assert r.parallelism.pp == 1 and any("down-sets" in n for n in r.notes)


def test_optimize_and_cli_on_tiny_mlp(tmp_path):
    r = optimize(TINY_MLP, "dgx_a100", num_chips=8)
    assert r.num_chips == 8 and r.solver.proven_optimal and r.iteration_time_s > 0
    script = Path(sys.executable).parent / "dfmodel"  # the console script, as a user runs it
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "dfmodel.cli"]
    out = subprocess.run(cmd + ["solve", "--workload", TINY_MLP, "--system", "dgx_a100", "--num-chips", "8",
                                "--json", "-"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["iteration_time_s"] == pytest.approx(r.iteration_time_s, rel=1e-9)
    assert d["parallelism"]["tp"] * d["parallelism"]["pp"] * d["parallelism"]["dp"] == 8


@pytest.mark.parametrize("wname", ["tiny_mlp", "rand1", "rand6", "rand9"])
@pytest.mark.parametrize("execution", ["kernel_by_kernel", "dataflow"])
def test_stage_bounds_and_fast_path_against_the_intra_chip_pass(wname, execution):
    # on every down-set difference of the sharded graphs: the per-kernel bounds never exceed the
    # intra-chip pass; on kernel-by-kernel chips whose tensors have one size per name, a stage's
    # time is exactly the sum of its kernels' closed-form times (the fast path)
    w = load_workload(TINY_MLP if wname == "tiny_mlp" else random_graph(int(wname[4:]), 6))
    model = gf.GraphModel(w, system(SYSTEMS["switch4x2"], execution))
    seen = set()
    for m in gf.candidates(model, Knobs(pp=2)):
        p = model.prepared(m)
        if p.key in seen:
            continue
        seen.add(p.key)
        if execution == "dataflow":
            assert p.fast is None
        elif wname == "tiny_mlp":
            assert p.fast is not None
        ideals = gf.enumerate_ideals(len(p.names), p.preds)
        for I in ideals:
            for J in ideals:
                if J != I and (I & ~J) == 0:
                    S = J & ~I
                    exact = model.stage(p, S, (), 1, exact=True)
                    bound = max(sum(p.lower[k, c] for k in range(len(p.names)) if (S >> k) & 1)
                                for c in range(p.lower.shape[1]))
                    assert bound <= exact.chip_s * (1 + 1e-9)
                    if p.fast is not None:
                        fast = model.stage(p, S, (), 1)
                        assert fast.chip_s == pytest.approx(exact.chip_s, rel=1e-12)
                        assert fast.memory.total_bytes >= exact.memory.total_bytes
    assert seen


def test_graphs_own_comm_kernel_costs_its_group():
    g = random_graph(3, 4)
    last = g["kernels"][-1]["name"]
    g["kernels"].append({"name": "sync", "kind": "comm", "collective": "all_reduce", "comm_bytes": "1 MiB",
                         "comm_group": "dp", "output_bytes": "1 MiB", "phase": "backward"})
    g["tensors"].append({"name": "s_in", "producer": last, "consumer": "sync", "bytes": "1 MiB"})
    g["tensors"].append({"name": "s_out", "producer": "sync", "consumer": None, "bytes": "1 MiB"})
    s = system(SYSTEMS["switch4"])
    one = solve(g, s, Knobs(tp=1, pp=1, dp=4))
    assert one.pipeline["graph_comm_s"]["sync"] > 0 and "over dp" in one.sharding["sync"]
    none = solve(g, s, Knobs(tp=4, pp=1, dp=1))
    assert none.pipeline["graph_comm_s"]["sync"] == 0
    assert solve(g, s).iteration_time_s == pytest.approx(solve(g, s, exhaustive=True).iteration_time_s, rel=1e-12)
