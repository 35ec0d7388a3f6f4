"""Sliding-window attention (model.sliding_window, model.full_attention_every): the fused kernel's
tiles against a brute-force count, the graph's FLOP, and what the search may do with it."""

import pytest

from dfmodel import optimize
from dfmodel.errors import InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.llm import FLASH_BLOCK, attention_tile_fraction, causal_fraction, window_fraction
from dfmodel.graph.workload import load_workload


def _tiles_brute(s: int, window: int, block: int) -> float:
    """Tiles (query tile, key tile) holding at least one pair a causal window keeps: key c of
    query r with r - window < c <= r."""
    n = -(-s // block)
    kept = set()
    for r in range(s):
        for c in range(max(0, r - window + 1), r + 1):
            kept.add((r // block, c // block))
    return len(kept) / (n * n)


@pytest.mark.parametrize("s, window, block", [(512, 1, 128), (512, 100, 128), (512, 128, 128), (512, 129, 128),
                                              (512, 300, 128), (512, 512, 128), (520, 64, 64), (384, 1000, 128)])
def test_window_tiles_match_a_brute_force_count(s, window, block):
    assert window_fraction(s, window, block) == pytest.approx(_tiles_brute(s, window, block), abs=1e-12)


def test_a_whole_sequence_window_is_plain_causal_attention():
    for s in (128, 4096, 8192, 10000):
        assert window_fraction(s, s) == causal_fraction(s)


def _model(**over):
    base = {"hidden": 1024, "num_heads": 8, "num_layers": 12, "seq_len": 8192, "ffn_type": "swiglu",
            "ffn_hidden": 2816, "position_embedding": "rotary", "dropout": False, "tie_embeddings": False,
            "vocab_size": 32000}
    return {"kind": "llm", "name": "swa", "model": {**base, **over}, "training": {"global_batch": 32}}


def test_the_layer_carries_the_mean_over_sliding_and_full_layers():
    """12 layers, every 3rd full: 4 full at the causal fraction, 8 sliding at the window's."""
    w = load_workload(_model(sliding_window=1024, full_attention_every=3))
    expected = (4 * causal_fraction(8192) + 8 * window_fraction(8192, 1024)) / 12
    assert attention_tile_fraction(w.model) == pytest.approx(expected)


def test_only_the_fused_attention_kernels_shrink_and_by_the_tile_fraction():
    full, swa = (build_graphs(load_workload(_model(**kw)), batch=1).layer
                 for kw in ({}, {"sliding_window": 1024}))
    f_full = {k.name: k.flop for k in full.kernels}
    f_swa = {k.name: k.flop for k in swa.kernels}
    ratio = window_fraction(8192, 1024) / causal_fraction(8192)
    for name in f_full:
        if name.endswith("flash_attn"):
            assert f_swa[name] == pytest.approx(ratio * f_full[name])
        else:
            assert f_swa[name] == f_full[name], name


def test_a_window_shortens_the_step_with_fused_attention_and_not_with_the_unfused_one():
    knobs = dict(num_chips=8, tp=1, pp=1, micro_batch=1, cp=1, recompute="none")
    full = optimize(_model(), "dgx_h100", **knobs).iteration_time_s
    swa = optimize(_model(sliding_window=1024), "dgx_h100", **knobs).iteration_time_s
    assert swa < 0.9 * full
    # the eager (unfused) path computes and masks the whole s x s matrix: nothing saved
    unfused = dict(attention="unfused")
    assert (optimize(_model(sliding_window=1024, **unfused), "dgx_h100", **knobs).iteration_time_s
            == optimize(_model(**unfused), "dgx_h100", **knobs).iteration_time_s)


def test_bad_windows_and_context_parallelism_are_one_line_errors():
    with pytest.raises(InputError, match=r"model\.full_attention_every: .*give model\.sliding_window"):
        load_workload(_model(full_attention_every=2))
    with pytest.raises(InputError, match=r"model\.sliding_window: .*greater than 0"):
        load_workload(_model(sliding_window=0))
    with pytest.raises(InputError, match=r"cp: context parallelism with sliding-window attention .* not modelled"):
        optimize(_model(sliding_window=1024), "dgx_h100", num_chips=8, cp=2)
    # the free search stays at cp 1 (its cp rank graph assumes full attention)
    assert optimize(_model(seq_len=32768, sliding_window=4096), "dgx_h100", num_chips=8).parallelism.cp == 1


def test_flash_block_is_the_tile_the_fraction_counts():
    assert window_fraction(4 * FLASH_BLOCK, FLASH_BLOCK) == pytest.approx((1 + 2 * 3) / 16)


def test_a_case_may_name_its_window(tmp_path):
    import yaml

    from dfmodel.validate import evaluate_case, load_cases

    def case_model(**over):  # (a case's model block: the workload's minus what cases derive)
        return {k: v for k, v in _model(**over)["model"].items() if k != "position_embedding"}

    case = {"id": "swa-8", "model": case_model(sliding_window=1024),
            "training": {"global_batch": 32, "precision": "bf16"},
            "system": {"chip": "H100-SXM5-80GB", "num_chips": 8},
            "parallelism": {"tp": 1, "pp": 1, "dp": 8, "virtual_pipeline": 1, "activation_recompute": "none"},
            "measured": {"iteration_time_s": 1.0}}
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump([case]))
    row = evaluate_case(load_cases(path)[0])
    full = {**case, "model": case_model()}
    path.write_text(yaml.safe_dump([full]))
    assert row.predicted_s < evaluate_case(load_cases(path)[0]).predicted_s
