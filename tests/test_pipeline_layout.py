"""Megatron-Core's custom pipeline layout (training.pipeline_layout): parsing, checks, and the
split the evaluation and the search then run."""

import pytest

from dfmodel import optimize
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.pipeline_layout import parse_pipeline_layout
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm_family import solve_llm_family
from dfmodel.system import load_system


def _workload(layers=8, layout=None, **training):
    t = {"global_batch": 64, **training}
    if layout is not None:
        t["pipeline_layout"] = layout
    return {"kind": "llm", "name": "t", "model": {"hidden": 1024, "num_heads": 8, "num_layers": layers,
                                                  "seq_len": 512}, "training": t}


def test_deepseek_v3_layout_parses_to_megatron_bridges_split():
    lay = parse_pipeline_layout("Et|(tt|)*30mL")
    assert lay.num_stages == 32 and lay.num_decoder_layers == 61 and lay.num_mtp_layers == 1
    assert lay.decoder_counts == (1,) + (2,) * 30 + (0,)
    # one string serves every pp that divides its 32 stages (virtual stage k on rank k % pp)
    assert [lay.interleave(pp) for pp in (1, 2, 3, 8, 32)] == [None, 16, None, 4, 1]


def test_repeats_and_cosmetic_commas():
    assert parse_pipeline_layout("E,t*3|t*4|(t|)*2,tttL").decoder_counts == (3, 4, 1, 1, 3)
    assert parse_pipeline_layout("E(tt|)*2ttL").decoder_counts == (2, 2, 2)


@pytest.mark.parametrize("text, says", [
    ("Et|tx|L", "unknown layer letter 'x'"),
    ("(tt|)*2t", "exactly one E"),
    ("Et|EtL", "exactly one E"),
    ("tE|tL", "must open the first stage"),
    ("Et|Lt", "close the last"),
    ("Et|mt|L", "must follow every transformer layer"),
    ("Et|tm|L", "must sit in the last stage"),
])
def test_bad_layouts_say_what_is_allowed(text, says):
    with pytest.raises(ValueError, match=says):
        parse_pipeline_layout(text)


def test_a_bad_layout_in_a_workload_is_a_one_line_error_naming_the_field():
    with pytest.raises(InputError, match=r"training\.pipeline_layout: unknown layer letter"):
        load_workload(_workload(layout="Et|tq|L"))
    with pytest.raises(InputError, match=r"training\.pipeline_layout: holds 7 transformer layers .* has 8"):
        optimize(_workload(layout="Ettttt|ttL"), "dgx_a100", num_chips=8)


def test_a_layout_equal_to_megatrons_even_chunks_changes_nothing():
    """8 layers at pp 2 x vp 2: the layout of four 2-layer chunks is the equal split evaluate
    takes without one, so the step is the same float."""
    knobs = dict(num_chips=8, tp=1, pp=2, interleave=2, micro_batch=1)
    plain = optimize(_workload(), "dgx_a100", **knobs)
    laid = optimize(_workload(layout="E(tt|)*3ttL"), "dgx_a100", **knobs)
    assert laid.iteration_time_s == plain.iteration_time_s
    assert laid.pipeline["layers_per_stage"] == plain.pipeline["layers_per_stage"] == [4, 4]


def test_an_uneven_layout_runs_as_named_at_the_pace_of_its_heaviest_stage():
    """6 + 2 layers at pp 2 (plain 1F1B, 16 micro-batches): the stage with 6 layers sets the pace,
    and each stage's time is its layers' (the embedding and head of this model are small)."""
    knobs = dict(num_chips=8, tp=1, pp=2, micro_batch=1, interleave=1)
    even = optimize(_workload(), "dgx_a100", **knobs)
    laid = optimize(_workload(layout="Etttttt|ttL"), "dgx_a100", **knobs)
    assert laid.pipeline["layers_per_stage"] == [6, 2] and even.pipeline["layers_per_stage"] == [4, 4]
    f, b = laid.pipeline["stage_forward_s"], laid.pipeline["stage_backward_s"]
    ef, eb = even.pipeline["stage_forward_s"], even.pipeline["stage_backward_s"]
    assert f[0] + b[0] == pytest.approx(1.5 * (ef[0] + eb[0]), rel=0.02)  # 6 layers against 4
    assert laid.iteration_time_s > 1.3 * even.iteration_time_s
    assert any("pipeline_layout" in n for n in laid.notes)


def test_the_search_runs_only_pp_times_vp_equal_to_the_layouts_stages_and_finds_the_exhaustive_optimum():
    w = _workload(layout="E(tt|)*3ttL")
    free = optimize(w, "dgx_a100", num_chips=8, alternatives=20, workers=1)
    brute = solve_llm_family(load_workload(w), load_system("dgx_a100", num_chips=8), Knobs(), exhaustive=True)
    assert free.iteration_time_s == pytest.approx(brute.iteration_time_s, rel=1e-9)
    assert free.parallelism.pp * free.parallelism.interleave == brute.parallelism.pp * brute.parallelism.interleave == 4
    assert free.alternatives and all(a["mapping"]["pp"] * a["mapping"]["interleave"] == 4 for a in free.alternatives)
    # without the layout the search is free to take another pp x vp (here it does: pp 1)
    plain = optimize(_workload(), "dgx_a100", num_chips=8, alternatives=20, workers=1)
    assert plain.parallelism.pp * plain.parallelism.interleave != 4
    assert plain.iteration_time_s <= free.iteration_time_s


def test_a_fixed_pp_that_does_not_divide_the_layout_says_so():
    with pytest.raises(InfeasibleError, match=r"pipeline_layout has 4 virtual stages, so pp x interleave must be 4"):
        optimize(_workload(layout="E(tt|)*3ttL"), "dgx_a100", num_chips=8, pp=4, interleave=2)


def test_the_cli_overrides_a_workloads_layout_and_reports_it(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from dfmodel.cli import app

    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(_workload()))
    res = CliRunner().invoke(app, ["solve", "-w", str(path), "-s", "dgx_a100", "--num-chips", "8",
                                   "--pipeline-layout", "Etttttt|ttL", "--json", "-", "-q"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["parallelism"]["pp"] == 2 and out["pipeline"]["layers_per_stage"] == [6, 2]
    assert any("Etttttt|ttL" in n for n in out["notes"])
    bad = CliRunner().invoke(app, ["solve", "-w", str(path), "-s", "dgx_a100", "--num-chips", "8",
                                   "--pipeline-layout", "Et|tz|L", "-q"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "training.pipeline_layout (--pipeline-layout): unknown layer letter 'z'" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
