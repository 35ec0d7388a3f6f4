"""Issue 11 round 4: Transformer Engine's FP8 operand cast / transpose kernels run on their own
before each FP8 GEMM (memory-bound, nothing hides them), so they add to the layer's time; a
bf16 layer has none. Closed form on one GEMM and monotonicity in DRAM bandwidth."""

from __future__ import annotations

import copy

import pytest

from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.llm import LLMModel, _fp8_prep_s
from dfmodel.system.loader import load_system
from dfmodel.system.processor import FP8_CAST_BYTES, FP8_TRANSPOSE_BYTES, fp8_operand_prep_s

from test_inter_chip import SMALL_LLM, small_system


def _system(bw="2 TB/s", execution=None):
    s = small_system(4, 1)
    s["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    s["chip"]["memory"]["bandwidth_Bps"] = bw
    if execution:
        s["chip"]["execution"] = execution
    return load_system(s)


def _layer(precision, system, tp=2):
    w = copy.deepcopy(SMALL_LLM)
    w["training"]["precision"] = precision
    model = LLMModel(load_workload(w), system)
    return model.block("layer", 1, tp, (("nvlink", tp),), True)


def test_closed_form_one_operand():
    chip = _system().chip
    rate = chip.memory.bandwidth_Bps * chip.efficiency.memory
    t = fp8_operand_prep_s(chip, 4e6, 1e6, from_norm=False)
    assert t == pytest.approx((FP8_TRANSPOSE_BYTES * 4e6 + FP8_CAST_BYTES * 1e6) / rate + chip.efficiency.kernel_overhead_s)
    assert fp8_operand_prep_s(chip, 4e6, 1e6, from_norm=True) < t  # a layer norm that writes FP8 saves the cast


def test_layer_sum_matches_its_fp8_gemms():
    """Forward: qkv and fc1 (after TE's LayerNormLinear) are only transposed; out_proj and fc2
    (Megatron-Core's 16-bit activation kernel before it) are cast and transposed. Backward: every data-gradient GEMM's incoming gradient is
    cast and transposed; weight-gradient GEMMs need nothing more."""
    system = _system()
    layer = _layer("fp8", system)
    chip = system.chip
    fwd = bwd = 0.0
    for k in layer.sharded.graph.kernels:
        if k.precision != "fp8" or k.phase.value == "weight_grad":
            continue
        gathered = k.dims["m"] * k.dims["k"]
        shard = k.extra_memory_bytes / 2
        t = fp8_operand_prep_s(chip, gathered, shard, from_norm=k.name in ("fwd.qkv", "fwd.fc1"))
        if k.phase.value == "forward":
            fwd += t
        else:
            bwd += t
    assert _fp8_prep_s(layer, chip) == pytest.approx((fwd, bwd))
    assert fwd > 0 and bwd > fwd  # four forward operands, four gradients (two of them cast from wider tensors)


def test_bf16_and_dataflow_have_none():
    assert _fp8_prep_s(_layer("bf16", _system()), _system().chip) == (0.0, 0.0)
    df = _system(execution="dataflow")
    assert _fp8_prep_s(_layer("fp8", df), df.chip) == (0.0, 0.0)


def test_more_bandwidth_never_slower_and_adds_to_the_step():
    slow, fast = _system("1 TB/s"), _system("4 TB/s")
    f_slow, b_slow = _fp8_prep_s(_layer("fp8", slow), slow.chip)
    f_fast, b_fast = _fp8_prep_s(_layer("fp8", fast), fast.chip)
    assert f_fast < f_slow and b_fast < b_slow
    # the layer's phase times carry the prep kernels on top of the partitioned kernels
    from dfmodel.inter_chip.config import Mapping
    from dfmodel.inter_chip.llm import _layer_times_s

    w = copy.deepcopy(SMALL_LLM)
    w["training"]["precision"] = "fp8"
    model = LLMModel(load_workload(w), slow)
    layer = model.block("layer", 1, 2, (("nvlink", 2),), True)
    for recompute, redo in (("none", 0.0), ("full", f_slow)):
        m = Mapping(tp=2, pp=1, dp=2, micro_batch=1, num_micro_batches=8, recompute=recompute,
                    sequence_parallel=True, tp_comm_overlap=False)
        base_f, base_b = _layer_times_s(layer, m)
        t_f, t_b = model._layer_phases_s(m, layer, {})
        assert t_f - base_f == pytest.approx(f_slow) and t_b - base_b == pytest.approx(b_slow + redo)


def test_fp8_layernorm_outputs_are_gathered_in_fp8_by_default():
    """TE's LayerNormLinear writes the layer norm's output in FP8 and all-gathers that (TE v1.11);
    a framework that gathers 16 bit and casts after sets ``fp8_allgather: false``."""
    from dfmodel.graph.build import build_graphs

    def ln1_bytes(**fp8):
        w = copy.deepcopy(SMALL_LLM)
        w["training"]["precision"] = "fp8"
        if fp8:
            w["training"]["fp8"] = fp8
        g = build_graphs(load_workload(w), batch=1).layer
        return next(t for t in g.tensors if t.name == "ln1_out").bytes

    tok = 512 * 1024
    assert ln1_bytes() == tok * 1
    assert ln1_bytes(fp8_allgather=False) == tok * 2


def test_fp8_incoming_gradients_are_gathered_in_fp8():
    """TE v1.11 ``grad_output_preprocess`` ("FP8 case with gather") casts a row-parallel layer's
    incoming gradient on the rank's shard and all-gathers the FP8 copy: FC2's ``d_y`` and the
    projection's ``d_r1`` move 1 byte per element under sequence parallelism, half the bf16
    bytes, and the 16-bit kernels that also read them (residual and norm backward) still read
    2 bytes per element. ``fp8_allgather: false`` (a framework that gathers 16 bit) keeps 2."""
    def comm_bytes(precision, **fp8):
        w = copy.deepcopy(SMALL_LLM)
        w["training"]["precision"] = precision
        if fp8:
            w["training"]["fp8"] = fp8
        model = LLMModel(load_workload(w), _system())
        g = model.block("layer", 1, 2, (("nvlink", 2),), True).sharded.graph
        moved = {k.name.split(".", 2)[2]: k.comm_bytes for k in g.kernels if k.kind.value == "comm"}
        reads = {k.name: k.extra_memory_bytes for k in g.kernels if k.name in ("bwd.residual1", "bwd.ln1")}
        return moved, reads

    bf16, bf16_reads = comm_bytes("bf16")
    fp8, fp8_reads = comm_bytes("fp8")
    wide, wide_reads = comm_bytes("fp8", fp8_allgather=False)
    for name in ("d_y", "d_r1"):
        assert bf16[name] > 0 and fp8[name] == pytest.approx(bf16[name] / 2) and wide[name] == bf16[name]
    tok_shard = 512 * 1024 / 2  # tokens x hidden of SMALL_LLM on one of the 2 sequence-parallel ranks
    assert bf16_reads == wide_reads == {"bwd.residual1": 0.0, "bwd.ln1": 0.0}
    assert fp8_reads == {"bwd.residual1": pytest.approx(tok_shard), "bwd.ln1": pytest.approx(tok_shard)}
