"""A published run's ZeRO stage (``parallelism.zero_stage``): the performance tables' FSDP runs
(Megatron FSDP: parameters, gradients and optimizer state sharded, stage 3) are validated with
that stage, not with the optimizer's pick, and a stage that contradicts the case's
``distributed_optimizer`` is an error naming the field."""

from __future__ import annotations

import pathlib

import pytest

from dfmodel.errors import InputError
from dfmodel.validate import evaluate_case, knobs_of, load_cases

CASE = """- id: fsdp
  source: test (Megatron Bridge)
  model: {hidden: 2048, num_heads: 16, num_layers: 8, seq_len: 2048, vocab_size: 32000, ffn_type: swiglu}
  training: {global_batch: 64, micro_batch: 1, precision: bf16}
  system: {chip: H100-SXM5-80GB, num_chips: 8}
  parallelism: {tp: 1, pp: 1, dp: 8, %s}
  measured: {iteration_time_s: 1.0}
"""


def _case(tmp_path: pathlib.Path, fields: str):
    path = tmp_path / "c.yaml"
    path.write_text(CASE % fields)
    return load_cases(path)[0]


def test_zero_stage_is_the_runs_not_a_pick(tmp_path):
    for stage, sharded in ((3, True), (1, True), (0, False)):
        knobs = knobs_of(_case(tmp_path, f"zero_stage: {stage}"))
        assert knobs["zero_stage"] == stage and knobs["distributed_optimizer"] is sharded
    assert "zero_stage" not in knobs_of(_case(tmp_path, "distributed_optimizer: true"))


def test_fsdp_case_runs_at_stage_3_and_pays_its_gathers(tmp_path):
    fsdp = evaluate_case(_case(tmp_path, "zero_stage: 3"))
    zero1 = evaluate_case(_case(tmp_path, "zero_stage: 1"))
    assert fsdp.mapping and zero1.mapping
    assert fsdp.mapping.endswith(" ZeRO3") and "ZeRO" not in zero1.mapping
    assert fsdp.predicted_s > zero1.predicted_s  # its per-layer parameter gathers and gradient scatters
    assert "distributed_optimizer" not in fsdp.chosen


def test_a_stage_that_contradicts_the_distributed_optimizer_is_an_error(tmp_path):
    with pytest.raises(InputError, match="distributed_optimizer False contradicts zero_stage 3"):
        knobs_of(_case(tmp_path, "zero_stage: 3, distributed_optimizer: false"))


def test_validation_never_offloads_what_a_run_kept_on_the_gpu(tmp_path):
    """A case whose model state does not fit is reported as not fitting, not rescued by an offload
    the published run never did (the Qwen3-30B-A3B micro-batch-2 row picked activation offload
    silently before)."""
    knobs = knobs_of(_case(tmp_path, "zero_stage: 1"))
    assert (knobs["offload_optimizer"], knobs["offload_activations"], knobs["offload_weights"]) == ("none", False, False)
    big = (CASE.replace("num_layers: 8, seq_len: 2048", "num_layers: 80, seq_len: 8192")
           .replace("hidden: 2048", "hidden: 8192").replace("num_heads: 16", "num_heads: 64"))
    path = tmp_path / "big.yaml"
    path.write_text(big % "zero_stage: 1")
    row = evaluate_case(load_cases(path)[0])
    assert row.predicted_s is None and "no mapping fits in memory" in row.message
