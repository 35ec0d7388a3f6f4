"""Issue 11 round 5: what carries the Hopper fit to Blackwell, and what the MLPerf B200 runs ran.

- CUDA graphs (the full-iteration graph of NVIDIA's MLPerf LLM submissions) replace each
  kernel's eager launch by the in-graph gap (``graph_kernel_overhead_s``), as for DLRM;
- Blackwell's FP8 GEMMs take any operand layout, so Transformer Engine keeps no FP8 transpose;
- benchmarks/calibrate.py carries the fitted matmul factors to another preset by the ratio of
  published large-GEMM fractions of peak (no factor fitted on B200 runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dfmodel.inter_chip.config import Mapping
from dfmodel.inter_chip.llm import _fp8_prep_s
from dfmodel.system.loader import load_system
from dfmodel.system.processor import FP8_CAST_BYTES, fp8_operand_prep_s

from test_calibrate_factors import _calibrate
from test_fid4_host_floor import _model
from test_inter_chip import small_system

ROOT = Path(__file__).resolve().parents[1]


def _system(*, graph_us=None, any_layout=False):
    s = small_system(4, 1)
    s["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    s["chip"]["efficiency"]["kernel_overhead_s"] = "4 us"
    if graph_us is not None:
        s["chip"]["efficiency"]["graph_kernel_overhead_s"] = f"{graph_us} us"
    s["chip"]["fp8_gemm_any_layout"] = any_layout
    return load_system(s)


def _layer(model):
    return model.block("layer", 1, 2, (("nvlink", 2),), True)


MAPPING = Mapping(tp=2, pp=1, dp=2, micro_batch=1, num_micro_batches=8, recompute="none",
                  sequence_parallel=True, tp_comm_overlap=False)


def test_cuda_graphs_cost_the_in_graph_gap_per_kernel():
    system = _system(graph_us=0.5)
    eager, graphed = _model("bf16", system), _model("bf16", system, cuda_graphs=True)
    assert eager.system.chip.efficiency.kernel_overhead_s == pytest.approx(4e-6)
    assert graphed.system.chip.efficiency.kernel_overhead_s == pytest.approx(0.5e-6)
    t_eager = sum(eager._layer_phases_s(MAPPING, _layer(eager), {}))
    t_graph = sum(graphed._layer_phases_s(MAPPING, _layer(graphed), {}))
    kernels = len(_layer(eager).sharded.graph.kernels)
    # faster, and by no more than the 3.5 us saved on every kernel of the layer
    assert t_graph < t_eager <= t_graph + 3.5e-6 * kernels + 1e-12


def test_cuda_graphs_without_an_in_graph_figure_change_nothing_but_the_host_floor():
    system = _system()  # no graph_kernel_overhead_s, no host table
    eager, graphed = _model("bf16", system), _model("bf16", system, cuda_graphs=True)
    assert sum(graphed._layer_phases_s(MAPPING, _layer(graphed), {})) == pytest.approx(
        sum(eager._layer_phases_s(MAPPING, _layer(eager), {})))


def test_blackwell_fp8_operands_are_cast_never_transposed():
    """On a chip whose FP8 GEMMs take any layout the layer's FP8 preparation is exactly the casts
    of the operands whose producers do not write FP8 (closed form), and less than with transposes."""
    hopper, blackwell = _system(), _system(any_layout=True)
    layer_h, layer_b = _layer(_model("fp8", hopper)), _layer(_model("fp8", blackwell))
    chip = blackwell.chip
    rate = chip.memory.bandwidth_Bps * chip.efficiency.memory
    expect = 0.0
    for k in layer_b.sharded.graph.kernels:
        if k.precision != "fp8" or k.phase.value == "weight_grad":
            continue
        if k.name not in ("fwd.qkv", "fwd.fc1"):  # out_proj, fc2 and every data-gradient GEMM
            expect += FP8_CAST_BYTES * (k.extra_memory_bytes / 2) / rate + chip.efficiency.kernel_overhead_s
    assert sum(_fp8_prep_s(layer_b, chip)) == pytest.approx(expect)
    assert sum(_fp8_prep_s(layer_b, chip)) < sum(_fp8_prep_s(layer_h, hopper.chip))
    assert fp8_operand_prep_s(chip, 1e9, 0.0, from_norm=True) == 0.0  # nothing to do: no kernel at all


def test_b200_matmul_factors_are_the_hopper_fit_times_the_published_gemm_ratio():
    cal = _calibrate()
    assert cal.tensor_core_scale("dgx_h100") == 1.0 and cal.tensor_core_scale("dgx_h200") == 1.0
    ratio = (1.42e15 / 2.25e15) / (797.51 / 989.0)  # pytorch/ao #2427 (B200) over H100, both 8192^3 bf16
    assert cal.tensor_core_scale("dgx_b200") == pytest.approx(ratio)
    factors = {"matmul.bf16": 0.625, "matmul.fp8": 0.55, "attention": 0.4}
    b200 = cal.system_with("dgx_b200", factors)["chip"]["efficiency"]
    h100 = cal.system_with("dgx_h100", factors)["chip"]["efficiency"]
    assert h100["matmul"]["fp8"] == 0.55 and h100["matmul"]["bf16"] == 0.625
    assert b200["matmul"]["fp8"] == pytest.approx(0.55 * ratio) and b200["matmul"]["bf16"] == pytest.approx(0.625 * ratio)
    assert b200["attention"] == 0.4  # fused attention: no published B200 ratio used, shared as before


def test_shipped_b200_preset_is_the_shipped_hopper_fit_carried_over():
    """systems/dgx_b200.yaml holds what calibrate.py derives from systems/dgx_h100.yaml (to the
    three decimals written there), so the preset cannot drift from its stated source."""
    cal = _calibrate()
    h100 = load_system(ROOT / "systems" / "dgx_h100.yaml").chip.efficiency
    b200 = load_system(ROOT / "systems" / "dgx_b200.yaml").chip.efficiency
    for p in ("bf16", "fp16", "fp8"):
        assert b200.matmul_at(p) == pytest.approx(h100.matmul_at(p) * cal.tensor_core_scale("dgx_b200"), abs=5e-4)
