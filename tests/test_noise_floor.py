"""benchmarks/noise_floor.py: published runs of one configuration, grouped across datasets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("noise_floor", Path(__file__).parents[1] / "benchmarks" / "noise_floor.py")
noise_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(noise_floor)


def _ids(groups):
    return [sorted(c.id for _, c in g) for g in groups]


def test_the_same_llama3_8b_config_from_two_nemo_releases_is_one_group_10_percent_apart():
    groups = noise_floor.same_config_groups(["h100_training", "h100_holdout"])
    pair = sorted(["dgxc-llama31-8b-fp8-8", "nemo2407-llama3-8b-fp8-8"])
    assert pair in _ids(groups)
    g = next(g for g in groups if sorted(c.id for _, c in g) == pair)
    assert abs(noise_floor.spread(g) - (10.68 / 9.67 - 1)) < 1e-9
    # the vocabulary padded to 128 x tp (128512) still matches the tokenizer's 128256
    assert sorted(["dgxc-llama31-70b-fp8-64", "nemo2407-llama3-70b-fp8-64"]) in _ids(groups)


def test_runs_that_name_different_recompute_are_not_one_configuration():
    groups = noise_floor.same_config_groups(["megatron_a100"])
    # Korthikanti et al. publish each model with full and with selective recompute: other configs
    assert groups == []
    cases = [c for c in noise_floor.load_cases(noise_floor.resolve_cases("megatron_a100")) if "kor22-22B" in c.id]
    assert len(cases) == 2 and noise_floor.config_key(cases[0]) == noise_floor.config_key(cases[1])
    assert not noise_floor.agree(cases[0], cases[1])
