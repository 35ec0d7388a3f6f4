"""The optimizer state's dtype (``training.optimizer_dtype``; NeMo 1.x ``optim.dtype`` of Apex
DistributedFusedAdam): in bf16, Adam's two moments take 2 bytes each and bf16 weights need no fp32
master copy (NeMo's ``store_params = False``), so a parameter's optimizer state is 4 bytes, not 12."""

from __future__ import annotations

import pytest

from dfmodel import load_workload, optimize
from dfmodel.inter_chip.memory import StateBytesPerParam


def _w(**training):
    model = {"hidden": 1024, "num_heads": 8, "num_layers": 4, "seq_len": 1024, "vocab_size": 4096}
    return load_workload({"kind": "llm", "name": "t", "model": model,
                          "training": {"global_batch": 16, **training}})


@pytest.mark.parametrize("precision,fp8_weights,want", [("bf16", False, 4.0), ("fp8", False, 4.0), ("fp8", True, 6.0)])
def test_bf16_state_bytes(precision, fp8_weights, want):
    s = StateBytesPerParam.of(precision=precision, grad_bytes=2, optimizer_dtype="bf16", fp8_weights=fp8_weights)
    assert s.optimizer == want  # + a bf16 master where the weights are FP8 only
    assert StateBytesPerParam.of(precision=precision, grad_bytes=2, fp8_weights=fp8_weights).optimizer == 12


def test_a_bf16_optimizer_holds_a_third_of_the_state_per_chip():
    knobs = dict(tp=1, pp=1, dp=8, micro_batch=1, recompute="none", sequence_parallel=False, interleave=1,
                 distributed_optimizer=True)
    fp32 = optimize(_w(), "dgx_h100", num_chips=8, **knobs).memory_per_chip_bytes
    bf16 = optimize(_w(optimizer_dtype="bf16"), "dgx_h100", num_chips=8, **knobs).memory_per_chip_bytes
    assert bf16["optimizer"] == pytest.approx(fp32["optimizer"] * 4 / 12)
    assert bf16["weights"] == fp32["weights"] and bf16["gradients"] == fp32["gradients"]


def test_optimizer_dtype_is_checked():
    from dfmodel.errors import InputError
    with pytest.raises(InputError, match="optimizer_dtype"):
        _w(optimizer_dtype="fp16")
