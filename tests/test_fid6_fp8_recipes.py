"""Issue 11 session 6: the FP8 recipe is a field of the workload's precision (TE's recipes).

The oracle below writes each recipe's operand preparation as the sequence of kernels Transformer
Engine launches (csrc/quantizer.cpp, csrc/extensions/normalization.cpp @ d0067d0), element by
element, independently of the cost table in dfmodel.graph.fp8; the model must agree with it.
"""

from __future__ import annotations

import copy

import pytest

from dfmodel.errors import InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.llm import LLMModel, _fp8_prep_s
from dfmodel.inter_chip.memory import StateBytesPerParam, fp8_linear_input_bytes
from dfmodel.system.loader import load_system
from dfmodel.system.processor import fp8_operand_prep_s
from dfmodel.validate import Case, evaluate_case, unknown_workload_knobs, workload_variants, workload_of

from test_inter_chip import SMALL_LLM, small_system

# (name, bytes read, bytes written, is a kernel of its own) per element of the rank's shard
AMAX = ("amax", 2, 0, True)                      # nvte_compute_amax over the 16-bit tensor
SCALE = ("scale", 0, 0, True)                    # nvte_compute_scale_from_amax (one float)
CAST = ("cast", 2, 1, True)                      # nvte_quantize: 16 bit in, one FP8 copy out
NORM_WIDER = ("norm writes 16 bit", 0, 1, False)  # the norm's own kernel writes 2 bytes, not 1


def both_copies(scale):  # row- and column-wise copies, each with its scales, from the 16-bit input
    return ("cast both", 2, 2 * (1 + scale), True)


ORACLE = {  # recipe -> (kernels for a 16-bit operand, kernels for a LayerNormLinear input)
    "delayed": ([CAST], []),
    "current": ([AMAX, SCALE, CAST], [NORM_WIDER, SCALE, CAST]),
    "mxfp8": ([both_copies(1 / 32)], [NORM_WIDER, both_copies(1 / 32)]),
    "blockwise": ([both_copies(4 / 128)], [NORM_WIDER, both_copies(4 / 128)]),
}
PER_TENSOR = ("delayed", "current")  # the recipes that transpose their FP8 copy on a TN-only chip


def _system(any_layout=False, bw="2 TB/s", overhead="4 us"):
    s = small_system(4, 1)
    s["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    s["chip"]["memory"]["bandwidth_Bps"] = bw
    s["chip"]["efficiency"]["kernel_overhead_s"] = overhead
    s["chip"]["fp8_gemm_any_layout"] = any_layout
    return load_system(s)


def _oracle_s(chip, recipe, gathered, shard, from_norm):
    ops = ORACLE[recipe][1 if from_norm else 0]
    num_bytes = sum((r + w) * shard for _, r, w, _ in ops)
    kernels = sum(k for *_, k in ops)
    if recipe in PER_TENSOR and not chip.fp8_gemm_any_layout:
        num_bytes += 2 * gathered  # read 1, write 1 over the gathered operand
        kernels = kernels or 1     # fused into the cast when there is one (cast_transpose)
    if num_bytes == 0:
        return 0.0
    return num_bytes / (chip.memory.bandwidth_Bps * chip.efficiency.memory) + kernels * chip.efficiency.kernel_overhead_s


@pytest.mark.parametrize("recipe", list(ORACLE))
@pytest.mark.parametrize("any_layout", [False, True])
@pytest.mark.parametrize("from_norm", [False, True])
def test_operand_prep_matches_te_kernel_sequence(recipe, any_layout, from_norm):
    chip = _system(any_layout).chip
    got = fp8_operand_prep_s(chip, 4e6, 1e6, from_norm=from_norm, recipe=recipe)
    assert got == pytest.approx(_oracle_s(chip, recipe, 4e6, 1e6, from_norm))


def _model(recipe=None, system=None, **fp8):
    w = copy.deepcopy(SMALL_LLM)
    w["training"]["precision"] = "fp8"
    w["training"]["fp8"] = {**({"recipe": recipe} if recipe else {}), **fp8}
    return LLMModel(load_workload(w), system or _system())


def test_default_is_delayed_and_current_scaling_costs_more_per_layer():
    system = _system()
    default, delayed, current = _model(), _model("delayed"), _model("current")
    assert default.training.fp8.recipe == "delayed"
    layer = default.block("layer", 1, 2, (("nvlink", 2),), True)
    d, c = _fp8_prep_s(layer, system.chip, "delayed"), _fp8_prep_s(layer, system.chip, "current")
    assert c[0] > d[0] and c[1] > d[1]
    # the same layer's sum under each recipe is the oracle's over its FP8 GEMMs
    for recipe in ("delayed", "current", "blockwise"):  # mxfp8 runs on Blackwell only
        want = [0.0, 0.0]
        for k in layer.sharded.graph.kernels:
            if k.precision != "fp8" or k.phase.value == "weight_grad":
                continue
            gathered, shard = k.dims["m"] * k.dims["k"], k.extra_memory_bytes / 2
            want[k.phase.value != "forward"] += _oracle_s(system.chip, recipe, gathered, shard,
                                                         k.name in ("fwd.qkv", "fwd.fc1"))
        assert _fp8_prep_s(layer, system.chip, recipe) == pytest.approx(tuple(want))
    from dfmodel.inter_chip.config import Mapping

    m = Mapping(tp=2, pp=1, dp=2, micro_batch=1, num_micro_batches=8, recompute="none",
                sequence_parallel=True, tp_comm_overlap=False)
    assert current.evaluate(m).iteration_time_s > delayed.evaluate(m).iteration_time_s


def test_mxfp8_needs_blackwell_and_stores_its_scales():
    with pytest.raises(InputError, match=r"training\.fp8\.recipe: mxfp8"):
        _model("mxfp8", _system(any_layout=False))
    _model("mxfp8", _system(any_layout=True))  # accepted on a Blackwell-class chip
    delayed = StateBytesPerParam.of(precision="fp8", grad_bytes=4)
    mx = StateBytesPerParam.of(precision="fp8", grad_bytes=4, fp8_recipe="mxfp8")
    assert mx.weights - delayed.weights == pytest.approx(2 / 32)  # two copies, one E8M0 per 32
    w = copy.deepcopy(SMALL_LLM)
    w["training"].update(precision="fp8", fp8={"recipe": "blockwise"})
    assert fp8_linear_input_bytes(load_workload(w).training) == pytest.approx(1 + 4 / 128)


def _case(**training):
    return Case.model_validate({
        "id": "x", "model": {"hidden": 1024, "num_heads": 16, "num_layers": 4, "seq_len": 512, "ffn_type": "swiglu",
                             "vocab_size": 8192},
        # CUDA graphs: no eager host floor, which would hide the casts of a model this small
        "training": {"global_batch": 16, "micro_batch": 1, "precision": "fp8", "cuda_graphs": True, **training},
        "system": {"num_chips": 8, "chip": "H100-SXM5-80GB"},
        "parallelism": {"tp": 2, "pp": 1, "dp": 4, "activation_recompute": "none", "sequence_parallel": True,
                        "distributed_optimizer": True, "tp_comm_overlap": False},
        "measured": {"iteration_time_s": 1.0}})


def test_case_recipe_reaches_the_workload_and_unknown_recipe_is_a_knob():
    named = _case(fp8_recipe="current")
    assert workload_of(named)["training"]["fp8"] == {"recipe": "current"}
    assert unknown_workload_knobs(named) == {} and len(workload_variants(named, workload_of(named))) == 1
    unknown = _case()
    assert unknown_workload_knobs(unknown) == {"fp8_recipe": "delayed"}
    row = evaluate_case(unknown)
    assert row.chosen["fp8_recipe"] == "delayed"
    lo, hi = row.range_s  # printed without --range: the recipe is an unknown of the run
    cur = evaluate_case(named)
    assert lo <= row.predicted_s <= hi and lo < hi and hi >= cur.predicted_s - 1e-12


# FP8 dispatch (DeepSeek-V3 sec. 3.3.3 / 3.5.1): the sender casts one row-wise copy of its tokens;
# the receiver reads the FP8 rows out and writes the other copy (read + write one copy each)
def _oracle_dispatched_s(chip, recipe, gathered, shard):
    plain = ORACLE[recipe][0]
    if recipe in PER_TENSOR:
        sender = plain
        receiver = [] if chip.fp8_gemm_any_layout else [("requant", 1, 1, True)]
    else:
        _, r, w, k = plain[-1]
        copy = w / 2  # one copy with its scales
        sender = [("cast one copy", r, copy, k)]
        receiver = [("requant", copy, copy, True)]
    num_bytes = sum((r + w) * shard for _, r, w, _ in sender) + sum((r + w) * gathered for _, r, w, _ in receiver)
    kernels = sum(k for *_, k in sender + receiver)
    return num_bytes / (chip.memory.bandwidth_Bps * chip.efficiency.memory) + kernels * chip.efficiency.kernel_overhead_s


@pytest.mark.parametrize("recipe", list(ORACLE))
@pytest.mark.parametrize("any_layout", [False, True])
def test_dispatched_operand_matches_deepseek_sequence(recipe, any_layout):
    chip = _system(any_layout).chip
    got = fp8_operand_prep_s(chip, 8e6, 1e6, from_norm=False, recipe=recipe, dispatched=True)
    assert got == pytest.approx(_oracle_dispatched_s(chip, recipe, 8e6, 1e6))


def test_fp8_dispatch_casts_each_token_once_not_each_routed_copy():
    """With top-k 4 the expert GEMMs compute on 4 rows per token; an FP8 dispatch casts the token
    once at the sender, so the expert inputs' cast elements drop 4x and the layer's preparation
    moves fewer bytes (blockwise, as DeepSeek-V3 runs it; launches left out: at this toy size the
    receiver's extra kernel would outweigh the bytes)."""
    from dfmodel.graph.build import build_graphs

    def model(dispatch_fp8):
        w = copy.deepcopy(SMALL_LLM)
        w["model"]["moe"] = {"num_experts": 8, "top_k": 4, "expert_ffn_hidden": 256, "dispatch_fp8": dispatch_fp8}
        w["training"].update(precision="fp8", fp8={"recipe": "blockwise"})
        return load_workload(w)

    def cast_elements(w):
        g = build_graphs(w, batch=1).layer
        return {k.name: k.extra_memory_bytes / 2 for k in g.kernels if k.name in ("fwd.fc1", "bwd.fc2")}

    plain, fp8 = cast_elements(model(False)), cast_elements(model(True))
    tokens_h = 512 * 1024
    assert plain == {"fwd.fc1": 4 * tokens_h, "bwd.fc2": 4 * tokens_h}
    assert fp8 == {"fwd.fc1": tokens_h, "bwd.fc2": tokens_h}
    system = _system(overhead="0 us")
    prep = [sum(_fp8_prep_s(LLMModel(model(d), system).block("layer", 1, 1, (), True), system.chip, "blockwise", d))
            for d in (False, True)]
    assert prep[1] < prep[0]
