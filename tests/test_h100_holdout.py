"""Held-out H100 runs (calibration/h100_holdout.yaml) and the run's own userbuffers SMs (issue 11,
session 9): the data set loads by name and a few of its cases validate; a run's
``ub_tp_comm_overlap_cfg`` (or TE's defaults without one) sets the SMs each exchange holds."""

from __future__ import annotations

import re

import pytest

from dfmodel.graph.workload import Training
from dfmodel.netmodels import nccl
from dfmodel.validate import evaluate_case, load_cases, resolve_cases

from test_fid2_tp_overlap import _phase, _row


def _holdout():
    return load_cases(resolve_cases("h100_holdout"))


def test_holdout_loads_by_name_with_a_commit_per_source():
    cases = _holdout()
    assert len(cases) == 33
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        # each source names the repository file at a commit (hex) or a tag
        assert re.search(r"git show [0-9a-f]{7,40}:", c.source), c.id
        tokens = c.training.global_batch * c.model.seq_len
        assert c.parallelism.tp * c.parallelism.pp * c.parallelism.cp * c.parallelism.dp == c.system.num_chips
        assert tokens > 0 and c.measured.iteration_time_s > 0


def test_holdout_nemo_step_times_follow_from_the_published_throughput():
    """The NeMo table gives tokens/s/GPU; the case's step time is GBS x seq / (that x GPUs)."""
    for c in _holdout():
        if not c.id.startswith("nemo2407-"):
            continue
        note = re.search(r"Step time derived: (\d+) x (\d+) / \((\d+) x (\d+)\)", c.notes)
        gbs, seq, tok, n = map(int, note.groups())
        assert (gbs, seq, n) == (c.training.global_batch, c.model.seq_len, c.system.num_chips)
        assert c.measured.iteration_time_s == pytest.approx(gbs * seq / (tok * n), abs=1e-3)


@pytest.mark.parametrize("case_id", ["dgxc-nemotron4-15b-bf16-16", "dgxc-gpt3-175b-fp8-128",
                                     "nemo2407-llama2-7b-fp8-8"])
def test_holdout_cases_validate(case_id):
    case = next(c for c in _holdout() if c.id == case_id)
    row = evaluate_case(case)
    assert row.predicted_s is not None, row.message
    assert abs(row.error) < 0.25  # held out: no factor was fitted on them; a gross miss fails


def test_userbuffers_sms_of_the_run_config():
    """TE initialize_ub: an exchange the config leaves out holds 16 SMs; ring exchanges hold none;
    a config given replaces NeMo's tuned table (by hand: GPT-3 175B's num_sm values)."""
    gpt3 = {"proj_fprop": 24, "fc2_fprop": 20, "qkv_dgrad": 4, "qkv_wgrad": 8, "fc1_dgrad": 2, "fc1_wgrad": 4}
    assert nccl.userbuffers_sms("fc2", "fprop", 4, gpt3) == 20
    assert nccl.userbuffers_sms("qkv", "wgrad", 4, gpt3) == 8
    assert nccl.userbuffers_sms("qkv", "wgrad", 4) == 24  # NeMo's TP-4 table
    assert nccl.userbuffers_sms("fc2", "fprop", 8, {}) == 16 == nccl.TE_DEFAULT_UB_SMS
    assert nccl.userbuffers_sms("fc1", "dgrad", 8, {"fc2_fprop": 4}) == 16
    for ring in (("qkv", "fprop"), ("fc1", "fprop"), ("out_proj", "dgrad"), ("fc2", "dgrad")):
        assert nccl.userbuffers_sms(*ring, 8, {}) == 0
    assert Training(global_batch=8, userbuffers_sms="te_default").userbuffers_config() == ()
    assert Training(global_batch=8, userbuffers_sms={"qkv_wgrad": 8}).userbuffers_config() == (("qkv_wgrad", 8),)
    assert Training(global_batch=8).userbuffers_config() is None
    with pytest.raises(ValueError):
        Training(global_batch=8, userbuffers_sms={"qkv_fprop": 8})  # a ring exchange holds no SMs


def test_te_default_userbuffers_slow_the_tp8_phase_by_hand():
    """At TP 8 NeMo's tuned config holds 8 SMs beside fc2 fprop; TE's default 16: fc2 slows by
    132/116 instead of 132/124 (fc1 fprop, a ring exchange, keeps every SM)."""
    from dfmodel.inter_chip.llm import _userbuffers_s

    rows = [_row("comm1.all_gather.ln2_out", network_s=0.3), _row("fwd.fc1", 2.0),
            _row("fwd.fc2", 1.0), _row("comm2.reduce_scatter.mlp_out", network_s=0.3)]
    phase = _phase(rows, 0.6)
    # each 0.3 s exchange hides under its own GEMM's chunks: the phase is fc1 plus fc2 slowed
    for config, fc2_sms in ((None, 8), ((), 16), ((("fc2_fprop", 40),), 40)):
        assert _userbuffers_s(phase, 8, 132, config) == pytest.approx(2.0 + 132 / (132 - fc2_sms), rel=1e-12)
    assert _userbuffers_s(phase, 8, 132, ()) > _userbuffers_s(phase, 8, 132)


def test_te_default_userbuffers_move_the_340b_prediction_up():
    """Nemotron-4 340B ran tp_comm_overlap without a ub config (TE defaults): predicted slower
    than with NeMo's tuned TP-8 table, and still faster than without the overlap."""
    from dfmodel.validate import knobs_of, optimize_as_megatron, system_of, workload_of

    case = next(c for c in _holdout() if c.id == "dgxc-nemotron4-340b-fp8-128")
    assert case.training.userbuffers_sms == "te_default"
    w, system, n = workload_of(case), system_of(case.system.chip), case.system.num_chips
    tuned = {**w, "training": {k: v for k, v in w["training"].items() if k != "userbuffers_sms"}}
    t_default = optimize_as_megatron(w, system, n, knobs_of(case)).iteration_time_s
    t_tuned = optimize_as_megatron(tuned, system, n, knobs_of(case)).iteration_time_s
    t_off = optimize_as_megatron(w, system, n, {**knobs_of(case), "tp_comm_overlap": False}).iteration_time_s
    assert t_tuned < t_default < t_off


def _fp8_small(recipe="delayed", cuda_graphs=False):
    from test_inter_chip import SMALL_LLM, small_system

    w = {**SMALL_LLM, "training": {**SMALL_LLM["training"], "precision": "fp8", "fp8": {"recipe": recipe},
                                    "cuda_graphs": cuda_graphs}}
    s = small_system(4, 2)
    s["chip"] = {**s["chip"], "peak_flops": {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}}
    return w, s


def _step_s(w, s, **knobs):
    from dfmodel import optimize

    fixed = dict(tp=2, pp=1, dp=4, micro_batch=1, recompute="none", sequence_parallel=False,
                 tp_comm_overlap=False, distributed_optimizer=False)
    return optimize(w, s, **{**fixed, **knobs}).iteration_time_s


def test_delayed_scaling_amax_allreduce_per_chunk_by_hand(monkeypatch):
    """TE's delayed scaling all-reduces the amaxes of a model chunk's FP8 tensors at the exit of
    its fp8_autocast (forward: input, weight, output per GEMM) and in its backward (two gradients
    per GEMM), over every tp x dp rank. SMALL_LLM: 8 layers of 4 weight GEMMs (qkv, out_proj,
    fc1, fc2), one chunk (pp 1): 4 B x 3 x 4 x 8 = 384 B forward, 256 B backward, over all 8
    ranks (4 per node x 2 nodes), once per micro-batch (16 / dp 4 = 4 of them)."""
    from dfmodel import load_system, load_workload
    from dfmodel.inter_chip.llm import LLMModel

    w, s = _fp8_small()
    model = LLMModel(load_workload(w), load_system(s))
    group = (("nvlink", 4), ("ib", 2))
    per_mb = model.costs.time_s("all_reduce", 384, group) + model.costs.time_s("all_reduce", 256, group)
    assert per_mb > 0
    with_term = _step_s(w, s)
    monkeypatch.setattr(LLMModel, "_amax_reduce_s", lambda self, m, layer: (0.0, 0.0))
    without = _step_s(w, s)
    assert with_term - without == pytest.approx(4 * per_mb, rel=1e-6)


@pytest.mark.parametrize("recipe,graphs", [("current", False), ("delayed", True)])
def test_no_amax_allreduce_without_delayed_scaling_or_with_cuda_graphs(monkeypatch, recipe, graphs):
    from dfmodel.inter_chip.llm import LLMModel

    w, s = _fp8_small(recipe, graphs)
    before = _step_s(w, s)
    monkeypatch.setattr(LLMModel, "_amax_reduce_s", lambda self, m, layer: (1.0, 1.0))  # would add seconds
    patched = _step_s(w, s)
    assert patched > before  # the hook is on the step's path ...
    monkeypatch.undo()
    from dfmodel import load_system, load_workload
    from dfmodel.inter_chip.config import Mapping

    model = LLMModel(load_workload(w), load_system(s))
    m = Mapping(2, 1, 4, 1, 4, placement=(("tp", (("nvlink", 2),)), ("pp", ()), ("dp", (("nvlink", 2), ("ib", 2))),
                                          ("cp", ()), ("ep", ())))
    layer = model.block("layer", 1, 2, m.group("tp"), False, 1, 1, whole_experts=False)
    assert model._amax_reduce_s(m, layer) == (0.0, 0.0)  # ... and 0 for these runs


def test_a_bad_userbuffers_exchange_names_the_key_and_the_allowed_ones(tmp_path):
    """The union 'te_default' | {exchange: SMs} sits inside the workload's kind union: the error
    reports the dict branch's bad key, not "should be 'te_default'"."""
    from dfmodel.errors import InputError
    from dfmodel.graph.workload import load_workload

    path = tmp_path / "bad.yaml"
    path.write_text("kind: llm\nname: bad\nmodel: {hidden: 1024, num_heads: 16, num_layers: 4, seq_len: 1024, "
                    "vocab_size: 32000}\ntraining:\n  global_batch: 8\n  precision: bf16\n"
                    "  userbuffers_sms: {fc3_fprop: 4}\n")
    with pytest.raises(InputError) as err:
        load_workload(path)
    text = str(err.value)
    assert "training.userbuffers_sms.fc3_fprop" in text and "'fc1_wgrad'" in text
    assert "te_default" not in text and "\n" not in text
