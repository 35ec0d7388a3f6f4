"""benchmarks/calibrate.py: a factor of one preset (``<preset>/<key>``) touches only that preset's
cases, and None keeps the shared value (issue 11: one set of global factors per preset); the
shared matmul factors reach another preset through tests/test_fid5_blackwell.py's GEMM ratio."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _calibrate():
    spec = importlib.util.spec_from_file_location("calibrate_script", ROOT / "benchmarks" / "calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, ["calibrate.py"]
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.argv = argv
    return mod


def test_preset_factor_applies_to_its_preset_only():
    cal = _calibrate()
    factors = {"matmul.fp8": 0.55, "dgx_b200/matmul.fp8": 0.45}
    assert cal.system_with("dgx_b200", factors)["chip"]["efficiency"]["matmul"]["fp8"] == 0.45
    assert cal.system_with("dgx_h100", factors)["chip"]["efficiency"]["matmul"]["fp8"] == 0.55
    keep = cal.system_with("dgx_b200", {"matmul.fp8": 0.55, "dgx_b200/matmul.fp8": None})
    # None keeps the shared value, carried to the preset by its published GEMM ratio
    assert keep["chip"]["efficiency"]["matmul"]["fp8"] == 0.55 * cal.tensor_core_scale("dgx_b200")


def test_preset_factor_is_relevant_to_its_cases_only():
    cal = _calibrate()
    cases = {c.id: c for c in cal.load_cases(ROOT / "calibration" / "h100_training.yaml")}
    b200 = next(c for c in cases.values() if "B200" in c.system.chip)
    h100_fp8 = cases["dgxc-llama31-405b-fp8-576"]
    assert cal.relevant("dgx_b200/matmul.fp8", b200)
    assert not cal.relevant("dgx_b200/matmul.fp8", h100_fp8)
    assert cal.relevant("matmul.fp8", h100_fp8) and not cal.relevant("matmul.fp8", cases["dgxc-llama31-405b-bf16-576"])


def test_unidentified_factor_is_one_no_training_case_moves_with():
    """A fold's factor is unidentified when, with the others as fitted, no training case's
    prediction moves by more than IDENTIFIED_REL over the factor's grid (e.g. the FP8 GEMM
    efficiency when every FP8 training run sits on the host floor)."""
    from types import SimpleNamespace as Row

    cal = _calibrate()

    def point(a, b):  # case "x" sees factor a only; case "y" sees nothing
        return ({"a": a, "b": b}, {"x": Row(error=0.0, predicted_s=10.0 * a, measured_s=10.0),
                                   "y": Row(error=0.0, predicted_s=5.0, measured_s=5.0)})

    points = [point(a, b) for a in (0.5, 0.6) for b in (1, 2)]
    assert cal.unidentified(points, {"a": 0.5, "b": 1}, ["x", "y"]) == ["b"]
    assert cal.unidentified(points, {"a": 0.5, "b": 1}, ["y"]) == ["a", "b"]
