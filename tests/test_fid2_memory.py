"""Issue 11 round 2: what the real Megatron/TE runs hold in memory (FP8 saved GEMM inputs,
bf16 gradient reduction as NeMo's distributed_fused_adam ran it)."""

from dfmodel.inter_chip.memory import activation_bytes_per_layer
from dfmodel.validate import Case, workload_of
from dfmodel.graph.workload import Training


def _layer(**kw):
    base = dict(seq_len=4096, micro_batch=1, hidden=16384, num_heads=128, num_kv_heads=8, ffn_hidden=53248,
                tp=8, sequence_parallel=True, recompute="none", attention="flash", dropout=False, gated_mlp=True)
    return activation_bytes_per_layer(**{**base, **kw})


def test_fp8_saved_linear_inputs_closed_form():
    # The four linear-GEMM inputs (QKV, FC1 inputs /t with SP; projection, FC2 inputs /t) drop
    # from 2 to 1 byte: 2 sbh/t + sbh/t + sbf/t fewer bytes; everything else unchanged.
    s, h, f, t = 4096, 16384, 53248, 8
    saved = _layer() - _layer(linear_input_bytes=1)
    assert saved == 2 * s * h / t + s * h / t + s * f / t


def test_fp8_saving_never_grows_memory_and_full_recompute_unchanged():
    assert _layer(linear_input_bytes=1) < _layer()
    assert _layer(recompute="full", linear_input_bytes=1) == _layer(recompute="full")


def test_bf16_grad_reduce_halves_gradient_bytes():
    assert Training(global_batch=8, precision="bf16").grad_bytes == 4
    assert Training(global_batch=8, precision="bf16", grad_reduce="bf16").grad_bytes == 2


def test_case_carries_grad_reduce_and_fp8_weights():
    case = Case.model_validate({
        "id": "x", "model": {"hidden": 1024, "num_heads": 8, "num_layers": 2, "seq_len": 128, "ffn_type": "swiglu"},
        "training": {"global_batch": 8, "precision": "fp8", "grad_reduce": "bf16", "fp8_weights": True},
        "system": {"num_chips": 8}, "parallelism": {"tp": 8, "pp": 1, "dp": 1},
        "measured": {"iteration_time_s": 1.0}})
    t = workload_of(case)["training"]
    # the recipe the case leaves out is its framework's default, written out (no source: TE's delayed)
    assert t["grad_reduce"] == "bf16" and t["fp8"] == {"fp8_weights": True, "recipe": "delayed"}


def test_param_remainders_save_two_bytes_of_master_per_param():
    from dfmodel.inter_chip.memory import StateBytesPerParam, model_state_bytes
    full = StateBytesPerParam.of(precision="bf16", grad_bytes=2)
    rem = StateBytesPerParam.of(precision="bf16", grad_bytes=2, param_remainders=True)
    assert full.optimizer - rem.optimizer == 2
    # sharded over dp with the distributed optimizer: 2 + 2 + 10/d
    s = model_state_bytes(1e9, dp=4, distributed_optimizer=True, bytes_per_param_weights=rem.weights,
                          bytes_per_param_grads=rem.gradients, bytes_per_param_optimizer=rem.optimizer)
    assert s.total_bytes == 1e9 * (2 + 2 + 10 / 4)
