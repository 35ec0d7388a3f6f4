"""First use (issue 9): every message a new user meets is one line that says what to fix, the
output reads in full off a terminal, each family shows its own figures, and the compute part of
the breakdown never grows with memory bandwidth."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InputError
from dfmodel.inter_chip.llm import PhaseTime

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, cwd=None, env=None):
    """Run ``dfmodel`` as a user would (stdout a pipe, so not a terminal)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    e.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "dfmodel.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=e, timeout=600)


def one_error_line(proc, code):
    assert proc.returncode == code, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# -- no valid mapping: the failed constraint, its numbers, the nearest valid values -------------------

def test_no_mapping_names_heads_and_nearest_tp():
    line = one_error_line(cli("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "64", "--tp", "16"), 3)
    assert "tp 16 does not divide the 40 attention heads" in line and "--tp 8" in line


def test_no_mapping_names_micro_batch():
    line = one_error_line(cli("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "64", "--micro-batch", "7"), 3)
    assert "micro-batch 7 does not divide the per-replica batch" in line and "--micro-batch 4 or 8" in line


def test_no_mapping_names_dp_and_batch():
    line = one_error_line(cli("solve", "-w", "gpt3_175b", "-s", "dgx_a100", "--tp", "1", "--pp", "1"), 3)
    assert "dp 1024" in line and "does not divide the global batch 1536" in line and "--pp 2" in line


# -- output paths are checked before any work --------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "64", "--json", "/nonexistent/dir/x.json"),
    ("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "64", "--plot", "/nonexistent/dir/x.png"),
    ("graph", "-w", "gpt3_13b", "--png", "/nonexistent/dir/g.png"),
    ("plot", "results.jsonl", "--out", "/nonexistent/dir/p.png"),
])
def test_output_path_is_checked_first(args):
    proc = cli(*args)
    line = one_error_line(proc, 2)
    assert "/nonexistent/dir" in line and "does not exist" in line
    assert proc.stdout == ""  # nothing was solved or printed before the check


def test_output_path_that_is_a_directory(tmp_path):
    line = one_error_line(cli("solve", "-w", "tiny_mlp", "-s", "dgx_a100", "--json", str(tmp_path)), 2)
    assert "is a directory" in line


# -- markup: install hints keep their brackets --------------------------------------------------------

def test_install_hint_keeps_its_extra():
    try:
        import gurobipy  # noqa: F401
        pytest.skip("gurobipy installed: the hint is not shown")
    except ImportError:
        pass
    line = one_error_line(cli("solve", "-w", "tiny_mlp", "-s", "dgx_a100", "--solver", "gurobi"), 4)
    assert "pip install 'dfmodel[gurobi]'" in line


def test_markup_in_any_message_is_printed_verbatim(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text("kind: llm\nname: '[bold]x[/bold]'\nmodel: {hidden: 64}\ntraining: {global_batch: 1}\n")
    line = one_error_line(cli("check", str(p)), 2)
    assert "model.num_heads" in line


# -- did you mean ------------------------------------------------------------------------------------

def test_misspelled_required_field_suggests_the_name(tmp_path):
    p = tmp_path / "typo.yaml"
    p.write_text("kind: llm\nname: t\nmodel: {hidden: 512, num_heads: 8, num_layer: 4, seq_len: 128}\n"
                 "training: {global_batch: 8}\n")
    line = one_error_line(cli("check", str(p)), 2)
    assert "model.num_layer: unknown field; did you mean 'num_layers'?" in line


def test_misspelled_optional_field_suggests_the_name(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text((ROOT / "systems" / "dgx_a100.yaml").read_text().replace("  bandwidth_Bps:", "  bandwith_Bps:", 1))
    line = one_error_line(cli("check", str(p)), 2)
    assert "chip.memory.bandwith_Bps: unknown field; did you mean 'bandwidth_Bps'?" in line


@pytest.mark.parametrize("args,suggested", [
    (("solve", "-w", "gpt3_13b", "-s", "dgx_a10"), "did you mean 'dgx_a100'?"),
    (("solve", "-w", "gpt3_13", "-s", "dgx_a100"), "did you mean 'gpt3_13b'?"),
    (("validate", "megatron_a10"), "did you mean 'megatron_a100'?"),
])
def test_misspelled_preset_suggests_the_name(args, suggested):
    assert suggested in one_error_line(cli(*args), 2)


def test_misspelled_sweep_override_suggests_the_name(tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text("workloads: [tiny_mlp]\nsystems: [dgx_a100]\noverrides:\n"
                    "  system.chip.memory.bandwith_Bps: [1.0e12]\n")
    line = one_error_line(cli("sweep", str(spec), "--out", str(tmp_path / "r.jsonl")), 2)
    assert "did you mean 'bandwidth_Bps'?" in line


# -- binary / non-UTF-8 files ------------------------------------------------------------------------

@pytest.mark.parametrize("content,needle", [(b"kind: llm\nname: caf\xe9\n", "not UTF-8 text"),
                                            (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary file")])
def test_binary_or_latin1_file_is_one_line(tmp_path, content, needle):
    p = tmp_path / "bad.yaml"
    p.write_bytes(content)
    line = one_error_line(cli("check", str(p)), 2)
    assert str(p) in line and needle in line
    with pytest.raises(InputError, match=needle):
        load_workload(p)


# -- full width off a terminal, help for every option ------------------------------------------------

def test_help_shows_whole_option_names_and_every_option_has_help():
    proc = cli("solve", "--help")
    assert proc.returncode == 0
    assert "…" not in proc.stdout
    for name in ("--sequence-parallel", "--no-sequence-parallel", "--distributed-optimizer",
                 "--no-distributed-optimizer", "--precision"):
        assert name in proc.stdout
    from typer.main import get_command

    from dfmodel.cli import app

    for cmd_name, cmd in get_command(app).commands.items():
        for param in cmd.params:
            assert getattr(param, "help", None) or param.param_type_name == "argument" and param.help, (cmd_name, param.name)


def test_graph_rows_are_not_cut():
    proc = cli("graph", "-w", "gpt3_175b", "--batch", "1")
    assert proc.returncode == 0
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("│")]
    assert rows and all("…" not in ln for ln in rows)
    from dfmodel.graph.build import build_graphs

    for k in build_graphs(load_workload("gpt3_175b"), batch=1).layer.kernels:
        assert k.name in proc.stdout


# -- units ---------------------------------------------------------------------------------------------

def test_collective_title_and_bytes_are_binary():
    proc = cli("collective", "-s", "dgx_a100", "--size", "1 GiB", "--group", "nvlink=8,ib=4")
    assert proc.returncode == 0
    assert "1 GiB over nvlink=8 x ib=4" in proc.stdout and "[(" not in proc.stdout and "1.07 GB" not in proc.stdout


# -- one table per family ------------------------------------------------------------------------------

def test_hpl_table_reads_like_top500():
    proc = cli("solve", "-w", "hpl", "-s", "dgx_h100")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # the grid is the optimizer's pick (16 x 64 since the panel's arithmetic shares the GPU with
    # the update; the workload's 32 x 32 is within 3 %): check the TOP500 wording, not the pick
    assert re.search(r"P x Q = (\d+) x (\d+)", out) and "NB 384" in out and "Pflop/s" in out
    p, q = map(int, re.search(r"P x Q = (\d+) x (\d+)", out).groups())
    assert p * q == 1024 and p <= q  # HPL's advice (P <= Q) comes out of the model
    assert "samples/s" not in out and "sequence parallel" not in out and "TP 1024" not in out


def test_fft_table_shows_decomposition_and_time_per_transform():
    proc = cli("solve", "-w", "fft", "-s", "dgx_h100")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "decomposition" in out and "time per transform" in out and "fraction of peak" in out
    assert "MFU" not in out and "sequence parallel" not in out


def test_dlrm_table_shows_plan_and_samples():
    proc = cli("solve", "-w", "dlrm", "-s", "dgx_a100", "--num-chips", "64")
    assert proc.returncode == 0, proc.stderr
    assert "sharding plan" in proc.stdout and "samples/s" in proc.stdout and "sequence parallel" not in proc.stdout


def test_hpl_rmax_is_the_fraction_of_rpeak():
    from dfmodel.report import head_rows

    w, s = load_workload("hpl"), load_system("dgx_h100")
    r = optimize(w, s)
    rows = dict(head_rows(r, system=s, workload=w))
    rpeak = r.num_chips * s.chip.peak(w.precision)
    assert f"{r.model_flops_utilization * rpeak / 1e15:.4g} Pflop/s" in rows["Rmax"]
    assert f"Rpeak {rpeak / 1e15:.4g} Pflop/s" in rows["Rmax"]


# -- --precision ---------------------------------------------------------------------------------------

def test_precision_override_changes_the_answer_and_is_validated():
    fp32 = optimize("tiny_mlp", "dgx_a100", num_chips=8, precision="fp32")
    bf16 = optimize("tiny_mlp", "dgx_a100", num_chips=8)
    assert fp32.iteration_time_s > bf16.iteration_time_s  # A100: 19.5 fp32 vs 312 bf16 TFLOPS
    line = one_error_line(cli("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--precision", "fp64"), 2)
    assert "training.precision (--precision)" in line


def test_fp32_workload_on_tpu_runs_with_a_precision_override():
    """The issue's case: DLRM is fp32, TPU v4 has bf16 only; no YAML edit needed."""
    line = one_error_line(cli("solve", "-w", "dlrm", "-s", "tpu_v4"), 2)
    assert "has no peak_flops for fp32" in line
    proc = cli("solve", "-w", "dlrm", "-s", "tpu_v4", "--precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "dlrm on tpu_v4" in proc.stdout


# -- binning: compute never rises with memory bandwidth ----------------------------------------------

def test_split_adds_up_and_compute_ignores_memory_time():
    rng = random.Random(1)
    for _ in range(2000):
        c, m, n = (rng.uniform(0, 2) for _ in range(3))
        overlap = rng.random() < 0.5
        busy = max(c, m, n) if overlap else c + m + n
        t = busy + rng.uniform(0, 0.3)
        parts = PhaseTime.split(c, m, n, t, overlap)
        assert sum(parts.values()) == pytest.approx(t) and min(parts.values()) >= 0
        faster = PhaseTime.split(c, m / 1.5, n, (max(c, m / 1.5, n) if overlap else c + m / 1.5 + n) + t - busy, overlap)
        assert faster["compute"] == pytest.approx(parts["compute"])
        assert faster["memory"] <= parts["memory"] + 1e-12


def test_a100_compute_does_not_rise_from_2_to_3_TBps():
    """The issue's case: gpt3_13b on 64 A100s, memory bandwidth 2 -> 3 TB/s. The full search's
    optimum never gets slower; at the mapping it picks at 2 TB/s, compute never rises and memory
    falls (the search itself may trade a little compute for less memory and DP time at 3 TB/s:
    a smaller micro-batch pays the per-micro-batch dense embedding gradient more often)."""
    compute, memory, total = [], [], []
    fixed = {}
    for bw in (2e12, 3e12):
        s = load_system("dgx_a100", num_chips=64)
        s.chip.memory.bandwidth_Bps = bw
        total.append(optimize("gpt3_13b", s).iteration_time_s)
        r = optimize("gpt3_13b", s, **fixed)
        if not fixed:
            p = r.parallelism
            fixed = dict(tp=p.tp, pp=p.pp, dp=p.dp, micro_batch=p.micro_batch, recompute=p.recompute,
                         sequence_parallel=p.sequence_parallel, interleave=p.interleave, zero=p.zero_stage)
        compute.append(r.breakdown_s["compute"])
        memory.append(r.breakdown_s["memory"])
    assert total[1] <= total[0]
    assert compute[1] <= compute[0] * (1 + 1e-9), compute
    assert memory[1] < memory[0]


# -- the packaged data ---------------------------------------------------------------------------------

def test_presets_resolve_from_any_directory(tmp_path):
    proc = cli("check", "gpt3_13b", cwd=tmp_path)
    assert proc.returncode == 0 and "ok:" in proc.stdout
    proc = cli("systems", cwd=tmp_path)
    assert "dgx_a100" in proc.stdout and "tpu_v4" in proc.stdout


def test_shipped_files_cite_no_local_paths():
    for folder in ("systems", "workloads", "calibration"):
        for f in (ROOT / folder).glob("*.yaml"):
            text = f.read_text()
            assert "/work/" not in text and "../shared" not in text, f


def test_example_sweep_file_is_valid():
    from dfmodel.sweeps import load_spec

    spec = ROOT / "examples" / "sweep.yaml"
    assert spec.exists()
    load_spec(spec)


def test_json_result_roundtrip_unchanged(tmp_path):
    out = tmp_path / "r.json"
    proc = cli("solve", "-w", "tiny_mlp", "-s", "dgx_a100", "--num-chips", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["num_chips"] == 8
