"""The end-to-end optimizer against exhaustive enumeration, monotonicity and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm_family import solve_llm

SMALL_LLM = {
    "kind": "llm",
    "name": "small",
    "model": {"hidden": 1024, "num_heads": 16, "num_layers": 8, "seq_len": 512, "vocab_size": 8192},
    "training": {"global_batch": 16, "precision": "bf16"},
}


def small_system(chips_per_node=4, nodes=2, nv_bw="300 GB/s", ib_bw="25 GB/s", capacity="80 GiB"):
    return {
        "name": "mini",
        "chip": {"name": "gpu", "peak_flops": {"bf16": "312 TFLOPS"}, "vector_flops": "39 TFLOPS",
                 "sram_bytes": "40 MiB", "compute_tiles": 108,
                 "memory": {"kind": "HBM", "capacity_bytes": capacity, "bandwidth_Bps": "2 TB/s"},
                 "efficiency": {"matmul": 0.8, "vector": 0.7, "memory": 0.85, "kernel_overhead_s": "4 us"}},
        "network": [
            {"name": "nvlink", "topology": "switch", "size": chips_per_node, "link_bandwidth_Bps": nv_bw, "latency_s": "3 us",
             "comm_gemm_overlap": True},
            {"name": "ib", "topology": "switch", "size": nodes, "link_bandwidth_Bps": ib_bw, "latency_s": "6 us"},
        ],
    }


@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 2), (2, 4), (4, 4)])
def test_search_equals_exhaustive_enumeration(nodes, per_node):
    w, s = load_workload(SMALL_LLM), load_system(small_system(per_node, nodes))
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.candidates_evaluated <= full.solver.candidates_evaluated
    assert fast.solver.status == "optimal"


def test_lower_bound_is_valid_for_every_candidate():
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.inter_chip.search import llm_candidates

    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    for m in list(llm_candidates(model, Knobs()))[::7]:
        ev = model.evaluate(m)
        assert model.lower_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        assert model.memory_floor_bytes(m) <= ev.memory.total_bytes * (1 + 1e-12)


@pytest.mark.parametrize("knob", [{"tp": 2}, {"pp": 2}, {"micro_batch": 1}, {"recompute": "full"},
                                  {"sequence_parallel": False}, {"dp": 2}])
def test_fixing_a_knob_never_helps(knob):
    w, s = SMALL_LLM, small_system(4, 2)
    free = optimize(w, s)
    fixed = optimize(w, s, **knob)
    assert fixed.iteration_time_s >= free.iteration_time_s * (1 - 1e-12)
    for k, v in knob.items():
        assert getattr(fixed.parallelism, k) == v


def test_more_bandwidth_never_slower():
    base = optimize(SMALL_LLM, small_system(4, 2))
    fast = optimize(SMALL_LLM, small_system(4, 2, nv_bw="600 GB/s", ib_bw="50 GB/s"))
    assert fast.iteration_time_s <= base.iteration_time_s * (1 + 1e-12)


def test_breakdown_adds_up_and_keys_are_stable():
    r = optimize(SMALL_LLM, small_system(4, 2)).to_dict()
    assert sum(r["breakdown_s"].values()) == pytest.approx(r["iteration_time_s"], rel=1e-9)
    for key in ("workload", "system", "num_chips", "iteration_time_s", "throughput", "model_flops_utilization",
                "parallelism", "breakdown_s", "memory_per_chip_bytes", "sharding", "intra_chip", "solver",
                "cost_usd", "power_w"):
        assert key in r
    # today's keys stay; the record adds one <dim>_comm per new parallel dimension
    assert set(r["breakdown_s"]) == {"compute", "memory", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "input",
                                     "checkpoint", "cp_comm", "ep_comm"}
    assert set(r["memory_per_chip_bytes"]) >= {"weights", "gradients", "optimizer", "activations", "total", "capacity", "reserve"}
    p = r["parallelism"]
    assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == r["num_chips"]
    assert p["micro_batch"] * p["num_micro_batches"] * p["dp"] == 16


def test_model_too_big_is_infeasible():
    # the shortfall in binary-prefixed bytes (cli_format.fmt_bytes): MiB here, never "0.0 GiB"
    with pytest.raises(InfeasibleError, match=r"needs .* per chip .* short by \d+(\.\d+)? [KMG]iB"):
        optimize(SMALL_LLM, small_system(2, 1, capacity="64 MiB"))


def test_bad_knobs_are_input_errors():
    with pytest.raises(InputError, match="tp"):
        optimize(SMALL_LLM, small_system(4, 2), tp=3)
    with pytest.raises(InputError, match="recompute"):
        optimize(SMALL_LLM, small_system(4, 2), recompute="sometimes")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dfmodel.cli", *args], capture_output=True, text=True)


def test_cli_json_agrees_with_optimize(tmp_path):
    import yaml

    wf, sf = tmp_path / "w.yaml", tmp_path / "s.yaml"
    wf.write_text(yaml.safe_dump(SMALL_LLM))
    sf.write_text(yaml.safe_dump(small_system(4, 2)))
    proc = run_cli("solve", "--workload", str(wf), "--system", str(sf), "--json", "-")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = optimize(str(wf), str(sf)).to_dict()
    assert got["iteration_time_s"] == pytest.approx(want["iteration_time_s"], rel=1e-12)
    assert got["parallelism"] == want["parallelism"]


def test_cli_exit_codes(tmp_path):
    import yaml

    wf, sf = tmp_path / "w.yaml", tmp_path / "s.yaml"
    wf.write_text(yaml.safe_dump(SMALL_LLM))
    sf.write_text(yaml.safe_dump(small_system(2, 1, capacity="64 MiB")))
    proc = run_cli("solve", "--workload", str(wf), "--system", str(sf))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: llm\nname: x\nmodel: {hidden: -4}\n")
    proc = run_cli("solve", "--workload", str(bad), "--system", str(sf))
    assert proc.returncode == 2 and "model.hidden" in proc.stderr and "Traceback" not in proc.stderr


def test_slow_storage_makes_the_step_input_bound():
    w = {**SMALL_LLM, "training": {**SMALL_LLM["training"], "input_bytes_per_sample": "1 GB"}}
    fast = optimize(SMALL_LLM, small_system(4, 2))
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "read_bandwidth_Bps": "1 GB/s", "preprocess_samples_per_s": 1000}
    r = optimize(w, s)
    assert r.input_bound and r.breakdown_s["input"] > 0
    # 16 samples over 2 nodes at 1 GB/s: loading takes 8 s, and the step hides part of it
    assert r.iteration_time_s == pytest.approx(8.0, rel=1e-9)
    assert fast.iteration_time_s < 8.0
