"""Design-space sweeps: grid expansion, dotted overrides, recorded failures, resume, CLI, results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

import dfmodel
from dfmodel.errors import InputError
from dfmodel.sweeps import expand, load_results, read_records, sweep

TINY_LLM = {
    "kind": "llm",
    "name": "tiny",
    "model": {"hidden": 256, "num_heads": 4, "num_layers": 2, "seq_len": 128, "vocab_size": 1024},
    "training": {"global_batch": 8, "precision": "bf16"},
}


def mini_system(chips_per_node=4, nodes=2):
    return {
        "name": "mini",
        "chip": {"name": "gpu", "peak_flops": {"bf16": "312 TFLOPS"}, "vector_flops": "39 TFLOPS",
                 "sram_bytes": "40 MiB", "compute_tiles": 108,
                 "memory": {"kind": "HBM", "capacity_bytes": "80 GiB", "bandwidth_Bps": "2 TB/s"},
                 "efficiency": {"matmul": 0.8, "vector": 0.7, "memory": 0.85, "kernel_overhead_s": "4 us"}},
        "network": [
            {"name": "nvlink", "topology": "switch", "size": chips_per_node, "link_bandwidth_Bps": "300 GB/s"},
            {"name": "ib", "topology": "switch", "size": nodes, "link_bandwidth_Bps": "25 GB/s"},
        ],
    }


BW = "system.chip.memory.bandwidth_Bps"
CAP = "system.chip.memory.capacity_bytes"
FAST = {"tp": 1, "pp": 1}  # fixed knobs: one candidate per point keeps each solve ~20 ms


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One small sweep shared by several tests: 4 bandwidths (one invalid) x 2 capacities (one too small)."""
    out = tmp_path_factory.mktemp("sweep") / "results.jsonl"
    spec = {"workloads": [TINY_LLM], "systems": [mini_system()],
            "overrides": {BW: [1e11, 3e11, 2e12, -1], CAP: ["80 GiB", "1 MiB"]}, "fixed": FAST}
    records = sweep(spec, out=out, workers=2, progress=False)
    return spec, out, records


def test_grid_expansion_count_order_and_stable_ids():
    spec = {"workloads": [TINY_LLM], "systems": [mini_system(), {**mini_system(), "name": "mini2"}],
            "num_chips": [8, 16],
            "overrides": {BW: [1e11, 3e11, 2e12], "system.network.1.link_bandwidth_Bps": ["25 GB/s"], "tp": [1]},
            "zip": [{"workload.training.global_batch": [8, 16], "system.network.-1.latency_s": ["1 us", "2 us"]}],
            "fixed": {"recompute": "none"}}
    points = expand(spec)
    assert len(points) == 1 * 2 * 2 * 3 * 1 * 1 * 2
    # the last axis (the zip group) varies fastest; its keys move together
    assert points[0].inputs["overrides"]["workload.training.global_batch"] == 8
    assert points[1].inputs["overrides"]["workload.training.global_batch"] == 16
    assert points[1].inputs["overrides"]["system.network.-1.latency_s"] == "2 us"
    assert points[2].inputs["overrides"][BW] == 3e11
    assert [p.inputs["system"] for p in points[:12]] == ["mini"] * 12
    assert points[0].inputs["fixed"] == {"recompute": "none"}
    ids = [p.id for p in points]
    assert len(set(ids)) == len(ids) and ids == [p.id for p in expand(spec)]


def test_dotted_override_applied_time_falls_with_memory_bandwidth(swept):
    _, _, records = swept
    ok = [r for r in records if r["error"] is None]
    assert [r["inputs"]["overrides"][BW] for r in ok] == [1e11, 3e11, 2e12]
    times = [r["result"]["iteration_time_s"] for r in ok]
    assert times[0] > times[1] > times[2]  # memory-bound tiny model: more bandwidth, faster
    assert all(r["result"]["memory_per_chip_bytes"]["capacity"] == 80 * 2**30 for r in ok)


def test_failing_points_are_recorded_and_the_sweep_goes_on(swept):
    _, out, records = swept
    assert [r["index"] for r in records] == list(range(8))
    by = {(r["inputs"]["overrides"][BW], r["inputs"]["overrides"][CAP]): r for r in records}
    assert by[(3e11, "1 MiB")]["error"]["type"] == "InfeasibleError"
    bad = by[(-1, "80 GiB")]["error"]
    assert bad["type"] == "InputError" and f"{BW}: must be > 0" in bad["message"] and "\n" not in bad["message"]
    assert sum(r["error"] is None for r in records) == 3
    assert sorted(r["id"] for r in read_records(out)) == sorted(r["id"] for r in records)


def test_kill_and_resume_runs_only_missing_points(tmp_path, monkeypatch):
    spec = {"workloads": [TINY_LLM], "systems": [mini_system()], "overrides": {BW: [1e11, 3e11, 2e12, 4e12]},
            "fixed": FAST}
    points = expand(spec)
    out = tmp_path / "r.jsonl"
    # what a kill leaves: two finished points, then half a line (the third was being written)
    done = [{"id": p.id, "index": p.index, "inputs": p.inputs, "result": {"marker": p.index}, "error": None}
            for p in points[:2]]
    text = "".join(json.dumps(r) + "\n" for r in done)
    out.write_text(text + json.dumps({"id": points[2].id, "index": 2, "result": {"iteration_time_s": 1.0}})[:40])
    with pytest.raises(InputError, match="already exists"):
        sweep(spec, out=out, workers=1, progress=False)

    ran = []
    import dfmodel.sweeps as sweeps

    real = sweeps.run_point
    monkeypatch.setattr(sweeps, "run_point", lambda p: ran.append(p.index) or real(p))
    records = sweep(spec, out=out, workers=1, resume=True, progress=False)
    assert sorted(ran) == [2, 3]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[0]["result"] == {"marker": 0}  # taken from the file, not re-run
    lines = out.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn line is gone
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(p.id for p in points)

    ran.clear()  # resuming a finished sweep runs nothing and changes nothing
    assert sweep(spec, out=out, workers=1, resume=True, progress=False) == records
    assert ran == [] and out.read_text().splitlines() == lines


@pytest.mark.parametrize("change,field,words", [
    ({"overide": {}}, "overide", "unknown field"),
    ({"overrides": {"system.chip.memory.bandwith_Bps": [1]}}, "overrides.system.chip.memory.bandwith_Bps",
     "unknown field 'bandwith_Bps'"),
    ({"overrides": {"system.network.2.size": [1]}}, "overrides.system.network.2.size", "index out of range"),
    ({"overrides": {"workload.model.depth": [1]}}, "overrides.workload.model.depth", "unknown field"),
    ({"overrides": {"chip.sram_bytes": [1]}}, "overrides.chip.sram_bytes", "expected system."),
    ({"overrides": {BW: 1e11}}, f"overrides.{BW}", "list"),
    ({"overrides": {"tp": [0]}}, "overrides.tp.0", "greater than 0"),
    ({"zip": [{BW: [1, 2], CAP: [1]}]}, "zip.0", "one length"),
    ({"fixed": {"tpp": 2}}, "fixed.tpp", "unknown field"),
    ({"fixed": {"tp": 2}, "overrides": {"tp": [1, 2]}}, "overrides.tp", "varied twice"),
    ({"systems": ["no_such_system"]}, "systems.0", "no such file or preset"),
])
def test_bad_spec_is_an_input_error_naming_the_field(tmp_path, change, field, words):
    spec = {"workloads": [TINY_LLM], "systems": [mini_system()], **change}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(InputError) as info:
        sweep(path, progress=False)
    assert info.value.field == field and str(path) in str(info.value)
    assert words in str(info.value)


def test_cli_sweep_end_to_end(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_LLM))
    (tmp_path / "mini.yaml").write_text(yaml.safe_dump(mini_system()))
    # 1e11 without a dot: a number, not a string, in a sweep file; relative paths: next to the spec
    (tmp_path / "sweep.yaml").write_text(
        "workloads: [tiny.yaml]\nsystems: [mini.yaml]\n"
        f"overrides:\n  {BW}: [1e11, 2e12]\nfixed: {{tp: 1, pp: 1}}\n"
    )
    out = tmp_path / "out" / "results.jsonl"
    cmd = [sys.executable, "-m", "dfmodel.cli", "sweep", str(tmp_path / "sweep.yaml"), "--out", str(out)]
    run = subprocess.run(cmd + ["--workers", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "2 points: 2 ok, 0 failed" in run.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["inputs"]["overrides"][BW] for r in recs) == [1e11, 2e12]
    assert all(r["result"]["parallelism"]["tp"] == 1 for r in recs)

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0 and len(out.read_text().splitlines()) == 2


def test_load_results_flattens(swept):
    _, out, records = swept
    df = load_results(out)
    assert len(df) == len(records) and list(df["index"]) == list(range(8))
    for col in ("workload", "system", BW, CAP, "error", "error_type", "iteration_time_s", "parallelism.tp",
                "breakdown_s.compute", "throughput.samples_per_s", "throughput_per_usd", "solver.status"):
        assert col in df.columns, col
    ok = df[df["error"].isna()]
    assert len(ok) == 3 and set(ok["workload"]) == {"tiny"}
    assert (ok["throughput.samples_per_s"] > 0).all()
    assert ok["iteration_time_s"].tolist() == [r["result"]["iteration_time_s"] for r in records if not r["error"]]
    assert df["error"].str.startswith("InfeasibleError: ").sum() == 3


def test_sweep_is_exported_as_a_function():
    import dfmodel.sweeps  # noqa: F401 -- importing the module must not shadow the function

    assert callable(dfmodel.sweep) and callable(dfmodel.load_results)


def test_ray_executor_matches_process_results(tmp_path, swept):
    pytest.importorskip("ray")
    spec, _, records = swept
    spec = {**spec, "overrides": {BW: [1e11, 2e12], CAP: ["80 GiB"]}}
    out = tmp_path / "ray.jsonl"
    got = sweep(spec, out=out, workers=2, executor="ray", progress=False)
    want = {r["id"]: r["result"]["iteration_time_s"] for r in records if r["error"] is None}
    assert [r["result"]["iteration_time_s"] for r in got] == [want[r["id"]] for r in got]
    assert len(read_records(out)) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="relies on fork copying the patched function into workers")
def test_a_dead_worker_stops_the_sweep_with_a_resume_hint(tmp_path, monkeypatch):
    import os

    import dfmodel.sweeps as sweeps

    real = sweeps._solve  # forked workers inherit the patch; the worker running point 1 dies
    monkeypatch.setattr(sweeps, "_solve", lambda p: os._exit(1) if p.index == 1 else real(p))
    spec = {"workloads": [TINY_LLM], "systems": [mini_system()], "overrides": {BW: [1e11, 3e11]}, "fixed": FAST}
    out = tmp_path / "r.jsonl"
    with pytest.raises(dfmodel.DFModelError, match="--resume"):
        sweep(spec, out=out, workers=2, progress=False)
    monkeypatch.setattr(sweeps, "_solve", real)
    records = sweep(spec, out=out, workers=2, resume=True, progress=False)
    assert [r["error"] for r in records] == [None, None]
    assert len(read_records(out)) == 2
