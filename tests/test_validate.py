"""Fidelity check plumbing: case loading, fixed mappings honoured, error maths, CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dfmodel.errors import InputError
from dfmodel.validate import evaluate_case, load_cases, summary, validate_cases

from dfmodel.presets import preset_dir

CASES = preset_dir("calibration") / "megatron_a100.yaml"  # shipped with the package

SMALL_CASE = {
    "id": "small",
    "model": {"hidden": 1024, "num_heads": 16, "num_layers": 8, "seq_len": 512, "vocab_size": 8192},
    "training": {"global_batch": 16, "micro_batch": 2, "precision": "bf16/fp16 mixed"},
    "system": {"chip": "A100-SXM4-80GB", "num_chips": 16, "chips_per_node": 8},
    "parallelism": {"tp": 2, "pp": 2, "dp": 4, "activation_recompute": "selective", "sequence_parallel": True},
    "measured": {"iteration_time_s": 1.0},
}


def write(tmp_path, cases) -> Path:
    p = tmp_path / "cases.yaml"
    p.write_text(yaml.safe_dump(cases))
    return p


def test_published_mapping_is_honoured(tmp_path):
    row = validate_cases(write(tmp_path, [SMALL_CASE]))[0]
    assert row.mapping.startswith("TP2 PP2 DP4 mb2") and "selective SP" in row.mapping
    assert row.error == pytest.approx(row.predicted_s / 1.0 - 1)


def test_free_search_is_never_slower_than_published(tmp_path):
    case = load_cases(write(tmp_path, [SMALL_CASE]))[0]
    row = evaluate_case(case, free=True)
    assert row.free_predicted_s <= row.predicted_s * (1 + 1e-12)


def test_summary():
    from dfmodel.validate import Row

    rows = [Row("a", 8, "", 1, 1.1, 1.0, 0.1), Row("b", 8, "", 1, 0.8, 1.0, -0.2), Row("c", 8, "", 1, None, 1.0, None)]
    s = summary(rows)
    assert s["evaluated"] == 2 and s["mean_abs_error"] == pytest.approx(0.15) and s["max_abs_error"] == pytest.approx(0.2)


def test_bad_case_names_file_and_field(tmp_path):
    bad = dict(SMALL_CASE, parallelism={"tp": 0, "pp": 1, "dp": 1})
    with pytest.raises(InputError, match=r"cases.yaml: 0\.parallelism\.tp"):
        load_cases(write(tmp_path, [bad]))


def test_shipped_calibration_cases_load():
    cases = load_cases(CASES)
    assert len(cases) == 18 and all(c.measured.iteration_time_s > 0 for c in cases)
    assert [c.id for c in load_cases("megatron_a100")] == [c.id for c in cases]  # by data-set name


def test_unknown_data_set_suggests_the_nearest_name():
    with pytest.raises(InputError, match=r"megatron_a10: no such file or calibration data set preset "
                                         r"\(did you mean 'megatron_a100'\?\)"):
        load_cases("megatron_a10")


@pytest.mark.parametrize("name,reason", [("other_families", "validate evaluates LLM training cases only")])
def test_other_data_sets_list_their_cases_with_a_reason(name, reason):
    """Cases the model cannot evaluate yet are rows with a one-line reason, not a crash."""
    rows = validate_cases(name)
    assert rows and all(r.predicted_s is None and r.message for r in rows if r.error is None)
    assert any(r.message.startswith(reason) or reason in r.message for r in rows)
    assert summary(rows)["cases"] == len(rows)


def test_cli_validate(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dfmodel.cli", "validate", str(write(tmp_path, [SMALL_CASE]))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "small" in proc.stdout and "mean absolute error" in proc.stdout


def test_validate_help_names_every_shipped_data_set():
    """`dfmodel validate --help` is how a user finds the data sets: it must name each one shipped."""
    from typer.testing import CliRunner

    from dfmodel.cli import app
    from dfmodel.presets import list_presets

    help_text = " ".join(CliRunner().invoke(app, ["validate", "--help"], env={"COLUMNS": "400"}).output.split())
    shipped = [p.stem for p in list_presets("calibration") if p.stem != "hardware_specs"]
    assert len(shipped) >= 4
    assert [s for s in shipped if s not in help_text] == []


@pytest.mark.parametrize("source,given,expected", [
    ("NVIDIA/dgxc-benchmarking 'Expected Performance' tables (NeMo 24.09)", None, "bf16"),
    ("MLPerf Training v5.1 results", None, "bf16"),
    ("MLPerf Training v5.1 results", "fp32", "fp32"),  # what the case says wins
    ("Narayanan et al. 2021 (Megatron-LM)", None, None),  # the workload default: fp32 main grads
])
def test_a_nemo_run_reduces_gradients_in_bf16_unless_the_case_says_otherwise(tmp_path, source, given, expected):
    """Published runs of NeMo recipes (dgxc-benchmarking, MLPerf) reduce gradients in bf16
    (NeMo grad_reduce_in_fp32 = False); a case in the shared format does not say so. The default
    follows the framework its source names, is shown as picked, and changes the prediction."""
    from dfmodel.validate import workload_of

    case = {**SMALL_CASE, "source": source, "training": {**SMALL_CASE["training"], "precision": "bf16"}}
    if given:
        case["training"]["grad_reduce"] = given
    c = load_cases(write(tmp_path, [case]))[0]
    assert workload_of(c)["training"].get("grad_reduce") == expected
    row = evaluate_case(c)
    assert ("grad_reduce" in row.chosen) == (given is None and expected is not None)
    if expected == "bf16":
        fp32 = evaluate_case(load_cases(write(tmp_path, [{**case, "training": {**case["training"], "grad_reduce": "fp32"}}]))[0])
        assert row.predicted_s < fp32.predicted_s  # half the bytes in the DP gradient sync


@pytest.mark.parametrize("source,precision,recipe,grad", [
    ("NVIDIA Megatron Bridge Performance Summary (H100)", "FP8-CS", "current", "bf16"),
    ("NVIDIA Megatron Bridge Performance Summary (H100)", "fp8", "current", "bf16"),  # the Bridge default
    ("NVIDIA/dgxc-benchmarking (NeMo 24.09)", "fp8", "delayed", "bf16"),  # NeMo's default
    ("NVIDIA/dgxc-benchmarking (NeMo 24.09)", "FP8-DS", "delayed", "bf16"),
    ("Megatron-LM README, H100 weak scaling", "fp8", "delayed", None),  # Megatron-LM: fp32 main grads
    ("Megatron Bridge performance summary", "BF16", None, "bf16"),
])
def test_published_precision_spellings_and_framework_defaults(tmp_path, source, precision, recipe, grad):
    """Published tables write the FP8 recipe into the precision ("FP8-CS", "FP8-DS"); a case
    says what it ran, and where it is silent its framework's performance recipes decide
    (Megatron Bridge: FP8 current scaling, bf16 gradient reduction; NeMo: delayed scaling)."""
    from dfmodel.validate import workload_of

    case = {**SMALL_CASE, "source": source, "training": {**SMALL_CASE["training"], "precision": precision}}
    t = workload_of(load_cases(write(tmp_path, [case]))[0])["training"]
    assert t["precision"] == ("fp8" if "fp8" in precision.lower() else "bf16")
    assert t.get("fp8", {}).get("recipe") == recipe
    assert t.get("grad_reduce") == grad


def test_describe_names_every_degree_that_multiplies_the_chips():
    """A validation row's mapping shows CP and EP: TP x PP x CP x DP must be the case's chip count."""
    from types import SimpleNamespace

    from dfmodel.validate import describe
    p = SimpleNamespace(tp=4, pp=1, cp=2, dp=8, ep=8, etp=0, micro_batch=1, interleave=1, recompute="none",
                        sequence_parallel=True, overlap_moe_expert_parallel_comm=False)
    assert describe(p) == "TP4 PP1 CP2 DP8 mb1 v1 none SP EP8"
    assert "CP" not in describe(SimpleNamespace(**{**vars(p), "cp": 1}))
