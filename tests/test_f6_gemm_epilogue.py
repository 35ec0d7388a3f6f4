"""Issue 11 (session 11, F6): on Hopper a GEMM tile's epilogue (store D; a weight-gradient GEMM
first reads the main gradient it accumulates into) runs after its mainloop, so it adds to the
GEMM's roofline instead of hiding under it (``chip.gemm_epilogue: serial``). Hand numbers for
one GEMM, the layer's sum against its kernels, the phases that carry it, the presets that set it,
and the search's bound and optimum on a serial chip."""

from __future__ import annotations

import copy

import pytest

from dfmodel.graph.kernel import Kernel, KernelKind, Phase
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.config import Knobs, Mapping
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.presets import resolve
from dfmodel.system.loader import load_system
from dfmodel.system.processor import (compute_time_s, gemm_epilogue_bytes, gemm_epilogue_exposed_s, mainloop_time_s,
                                      memory_time_s)
from dfmodel.system.schema import Chip
from dfmodel.yamlio import read_yaml

from test_inter_chip import SMALL_LLM, small_system


def _h100_like(epilogue="serial") -> Chip:
    """H100 SXM figures written out: 989 TFLOPS bf16 at 0.625, 3.35 TB/s at 0.85."""
    return Chip.model_validate({"name": "h", "peak_flops": {"bf16": "989 TFLOPS"}, "sram_bytes": "50 MiB",
                                "memory": {"kind": "HBM3", "capacity_bytes": "80 GiB", "bandwidth_Bps": "3.35 TB/s"},
                                "efficiency": {"matmul": 0.625, "memory": 0.85}, "gemm_epilogue": epilogue})


def _system(epilogue="serial", execution="kernel_by_kernel"):
    s = small_system(4, 1)
    s["chip"]["gemm_epilogue"] = epilogue
    s["chip"]["execution"] = execution
    return load_system(s)


def test_gpt3_fc1_wgrad_by_hand():
    """GPT-3 175B's fc1 weight gradient on one TP-4 rank at micro-batch 1 x 2048 tokens: a
    12288 x 12288 output over K = 2048 (618.5 GFLOP, 1.0006 ms at 618.1 TFLOPS), accumulated
    into bf16 main gradients: 150,994,944 elements x (2 read + 2 written) = 603,979,776 bytes,
    at 3.35e12 x 0.85 = 2.8475e12 B/s: 0.21211 ms after the mainloop."""
    k = Kernel("wgrad.fc1", KernelKind.matmul, {"m": 12288, "n": 12288, "k": 2048}, flop=2 * 12288 * 12288 * 2048,
               output_bytes=12288 * 12288 * 2, weight_bytes=12288 * 12288 * 2, phase=Phase.weight_grad)
    assert gemm_epilogue_bytes(k) == 603_979_776
    assert mainloop_time_s(_h100_like(), k, "bf16") == pytest.approx(1.00058e-3, rel=1e-4)
    assert compute_time_s(_h100_like(), k, "bf16") == pytest.approx(1.00058e-3 + 2.12109e-4, rel=1e-4)
    assert compute_time_s(_h100_like("overlapped"), k, "bf16") == pytest.approx(1.00058e-3, rel=1e-4)
    assert gemm_epilogue_exposed_s(_h100_like(), k, "bf16") == pytest.approx(2.12109e-4, rel=1e-4)
    assert gemm_epilogue_exposed_s(_h100_like("overlapped"), k, "bf16") == 0.0


def test_forward_gemm_counts_its_output_only_and_never_more_than_its_math():
    """A forward GEMM's weight bytes are an operand (read in the mainloop), not the epilogue's;
    a short-K GEMM whose output outweighs its math adds at most its math (min(compute, epilogue))."""
    fwd = Kernel("fwd.fc1", KernelKind.matmul, {}, flop=2e9, output_bytes=1e6, weight_bytes=5e8)
    assert gemm_epilogue_bytes(fwd) == 1e6
    chip = _h100_like()
    assert gemm_epilogue_exposed_s(chip, fwd, "bf16") == pytest.approx(1e6 / 2.8475e12)
    short = Kernel("bmm", KernelKind.matmul, {}, flop=1e6, output_bytes=1e9)
    assert gemm_epilogue_exposed_s(chip, short, "bf16") == pytest.approx(1e6 / (989e12 * 0.625))
    flash = Kernel("fwd.flash_attn", KernelKind.matmul, {}, flop=1e9, output_bytes=1e6, efficiency="attention")
    ln = Kernel("fwd.ln1", KernelKind.reduction, {}, flop=1e6, output_bytes=1e6)
    assert gemm_epilogue_exposed_s(chip, flash, "bf16") == 0.0 and gemm_epilogue_exposed_s(chip, ln, "bf16") == 0.0


def _layer(system, tp=2):
    model = LLMModel(load_workload(copy.deepcopy(SMALL_LLM)), system)
    return model, model.block("layer", 1, tp, (("nvlink", tp),), True)


def _epilogues_s(layer, chip) -> tuple[float, float]:
    """(forward, backward) sums of the layer's GEMM epilogues, worked out kernel by kernel."""
    fwd = bwd = 0.0
    for k in layer.sharded.graph.kernels:
        if k.kind != KernelKind.matmul or k.efficiency == "attention":
            continue
        ep = k.output_bytes + (k.weight_bytes if k.phase == Phase.weight_grad else 0.0)
        t = min(mainloop_time_s(chip, k, "bf16"), memory_time_s(chip, ep))
        if k.phase == Phase.forward:
            fwd += t
        else:
            bwd += t
    return fwd, bwd


def test_every_gemm_kernel_carries_its_epilogue():
    """Forward: qkv, out_proj, fc1, fc2 stores; backward: their data-gradient stores and the four
    weight-gradient GEMMs' main-gradient read + write (the fused attention kernels carry none).
    The epilogue is in the kernel's own compute time, so every pass that times the kernel pays it."""
    system, over = _system(), _system("overlapped")
    _, layer = _layer(system)
    names = set()
    for k in layer.sharded.graph.kernels:
        extra_s = compute_time_s(system.chip, k, "bf16") - compute_time_s(over.chip, k, "bf16")
        if k.kind != KernelKind.matmul or k.efficiency == "attention":
            assert extra_s == 0.0
            continue
        names.add(k.name)
        assert extra_s == pytest.approx(gemm_epilogue_exposed_s(system.chip, k, "bf16")) and extra_s > 0
    assert {"fwd.qkv", "fwd.out_proj", "fwd.fc1", "fwd.fc2", "wgrad.fc1", "wgrad.qkv"} <= names
    fwd, bwd = _epilogues_s(layer, system.chip)
    assert fwd > 0 and bwd > 2 * fwd  # backward: two stores per forward one, plus the main-gradient reads


def test_overlapped_and_dataflow_chips_and_fp64_have_none():
    k = Kernel("wgrad.fc1", KernelKind.matmul, {}, flop=4e9, output_bytes=4e6, weight_bytes=4e6, phase=Phase.weight_grad)
    for system in (_system("overlapped"), _system("serial", execution="dataflow")):
        assert gemm_epilogue_exposed_s(system.chip, k, "bf16") == 0.0
    chip = _h100_like().model_copy(update={"peak_flops": {"bf16": 989e12, "fp64": 67e12}})
    assert gemm_epilogue_exposed_s(chip, k, "fp64") == 0.0  # DMMA, not wgmma: HPL's DGEMM
    assert compute_time_s(chip, k, "fp64") == mainloop_time_s(chip, k, "fp64")
    assert gemm_epilogue_exposed_s(chip, k, "bf16") > 0


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_layer_phases_carry_it(recompute):
    """The phase times on a serial chip exceed the overlapped chip's by the epilogues of the
    compute-bound GEMMs, never by more (full recompute re-runs the forward GEMMs in the
    backward, so their stores too)."""
    m = Mapping(tp=2, pp=1, dp=2, micro_batch=1, num_micro_batches=8, recompute=recompute,
                sequence_parallel=True, tp_comm_overlap=False)
    serial_model, serial_layer = _layer(_system())
    over_model, over_layer = _layer(_system("overlapped"))
    e_f, e_b = _epilogues_s(serial_layer, serial_model.system.chip)
    s_f, s_b = serial_model._layer_phases_s(m, serial_layer, {})
    o_f, o_b = over_model._layer_phases_s(m, over_layer, {})
    redo = e_f if recompute == "full" else 0.0
    assert 0.5 * e_f < s_f - o_f <= e_f * (1 + 1e-9)
    assert 0.5 * (e_b + redo) < s_b - o_b <= (e_b + redo) * (1 + 1e-9)


@pytest.mark.parametrize("preset,expected", [("dgx_h100", "serial"), ("dgx_h200", "serial"), ("dgx_h800", "serial"),
                                             ("dgx_b200", "overlapped"), ("gb200_nvl72", "overlapped"),
                                             ("dgx_a100", "overlapped")])
def test_presets(preset, expected):
    assert load_system(read_yaml(resolve(preset, "systems"))).chip.gemm_epilogue == expected


def test_search_bound_and_optimum_on_a_serial_chip():
    """The term is in the evaluation only: every candidate's lower bound stays below its time,
    and the pruned search finds the exhaustive optimum."""
    from dfmodel.inter_chip.search import llm_candidates

    w, s = load_workload(SMALL_LLM), _system()
    model = LLMModel(w, s)
    for m in list(llm_candidates(model, Knobs()))[::5]:
        assert model.lower_bound_s(m) <= model.evaluate(m).iteration_time_s * (1 + 1e-12)
    fast, full = solve_llm(w, s, Knobs()), solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.iteration_time_s > solve_llm(w, _system("overlapped"), Knobs()).iteration_time_s
