"""Held-out Megatron-Core H100 runs (calibration/megatron_core_h100.yaml, issue 11, session 16): the
Megatron-LM README's weak-scaling table, 1.7B to 462B on 48 to 6144 H100s. The data set loads by
name, its step times follow from the table's per-GPU TFLOP/s and Megatron's own FLOP count, its
architecture from the table's model sizes, and it runs with Megatron-LM's defaults, not NeMo's."""

from __future__ import annotations

import re

import pytest

from dfmodel.validate import (evaluate_case, framework_defaults, framework_of, load_cases, read_case_items,
                              resolve_cases, workload_of)

H100_BF16_PEAK_FLOPS = 989e12  # dense bf16, the denominator of the table's MFU column


def _cases():
    return load_cases(resolve_cases("megatron_core_h100"))


def _also(case, label: str) -> float:
    """A figure of the case's ``measured.also`` list (the table's other columns), by its label."""
    items = read_case_items(resolve_cases("megatron_core_h100"))[1]
    also = next(item for item in items if item["id"] == case.id)["measured"]["also"]
    text = next(a for a in also if a.startswith(label))
    return float(re.search(r"([\d.]+)", text.split(":")[1]).group(1))


def test_loads_by_name_with_the_readme_commit():
    cases = _cases()
    assert len(cases) == 9
    assert len({c.id for c in cases}) == 9
    for c in cases:
        assert "f2e5db402c" in c.source, c.id
        p = c.parallelism
        assert p.tp * p.pp * p.dp == c.system.num_chips
        assert p.dp == 48 and c.training.global_batch == 4 * p.pp * p.dp  # the table's batches


def test_step_time_is_megatrons_flop_count_over_the_published_rate():
    """megatron/training/training.py num_floating_point_operations (core_r0.8.0), 4h GELU MLP, no
    GQA: 12 B s L h^2 (2 + s/h + 4 + V / (2 L h)); the step is that over TFLOP/s per GPU x GPUs, and
    the rate over the bf16 peak rounds to the table's MFU."""
    for c in _cases():
        m, b = c.model, c.training.global_batch
        flop = 12 * b * m.seq_len * m.num_layers * m.hidden ** 2 * (
            2 + m.seq_len / m.hidden + m.ffn_hidden / m.hidden + m.vocab_size / (2 * m.num_layers * m.hidden))
        rate = _also(c, "per-GPU teraFLOP/s") * 1e12
        assert c.measured.iteration_time_s == pytest.approx(flop / (rate * c.system.num_chips), rel=1e-3), c.id
        assert round(100 * rate / H100_BF16_PEAK_FLOPS) == pytest.approx(_also(c, "MFU"), abs=1), c.id


def test_architecture_gives_the_tables_model_sizes():
    """12 L h^2 + 2 V h: a 4h GELU MLP and untied input / output embeddings (tied, the 1.7B would
    count 1.48e9); the table rounds to two significant figures."""
    for c in _cases():
        m = c.model
        assert m.ffn_type == "gelu" and m.ffn_hidden == 4 * m.hidden and m.tie_embeddings is False
        params = 12 * m.num_layers * m.hidden ** 2 + 2 * m.vocab_size * m.hidden
        assert params == pytest.approx(_also(c, "model size") * 1e9, rel=0.06), c.id


def test_runs_with_megatron_lm_defaults_and_the_readme_overlaps():
    """Megatron-LM's own script: fp32 gradient reduction (no NeMo bf16 default), TE's default
    userbuffers, and the README's overlaps (tp-comm-overlap needs SP; param-gather overlap the
    distributed optimizer)."""
    for c in _cases():
        assert framework_of(c) == "megatron_lm" and framework_defaults(c) == {}
        assert "grad_reduce" not in workload_of(c)["training"]
        p = c.parallelism
        assert p.distributed_optimizer and p.overlap_grad_reduce
        if p.tp > 1:
            assert p.sequence_parallel and p.tp_comm_overlap and c.training.userbuffers_sms == "te_default"


@pytest.mark.parametrize("case_id", ["mcore08-gpt-7.1b-96", "mcore08-gpt-314b-3072"])
def test_cases_validate(case_id):
    case = next(c for c in _cases() if c.id == case_id)
    row = evaluate_case(case)
    assert row.predicted_s is not None, row.message
    assert abs(row.error) < 0.25  # held out: no factor was fitted on them; a gross miss fails
