"""Issue 11 round 5: an eager framework's host (CPU) time per linear module is a floor of a layer's
forward + backward (the timings of Transformer Engine issue #445's test on an H100 host, 0.57 ms in
16 bit, 2.07 ms in FP8, applied per module forward + backward: an upper reading, see
systems/dgx_h100.yaml). Closed form on a small layer whose GPU work is far below the
floor, no effect when the floor does not bind or the layers run as CUDA graphs, monotonicity, a
clear error for a bad table, and the dgxc Llama 3.1 FP8 speed-ups over bf16 the floor explains."""

from __future__ import annotations

import copy

import pytest

from dfmodel.errors import InputError
from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.config import Mapping
from dfmodel.inter_chip.llm import LLMModel, _host_floor_s
from dfmodel.system.loader import load_system

from test_inter_chip import SMALL_LLM, small_system


def _system(host=None):
    s = small_system(4, 1)
    s["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    if host is not None:
        s["chip"]["efficiency"]["host_linear_s"] = host
    return load_system(s)


def _model(precision, system, **training):
    w = copy.deepcopy(SMALL_LLM)
    w["training"]["precision"] = precision
    w["training"].update(training)
    return LLMModel(load_workload(w), system)


def _mapping(recompute="none"):
    return Mapping(tp=2, pp=1, dp=2, micro_batch=1, num_micro_batches=8, recompute=recompute,
                   sequence_parallel=True, tp_comm_overlap=False)


def _layer(model):
    return model.block("layer", 1, 2, (("nvlink", 2),), True)


HOST = {"bf16": "0.57 ms", "fp8": "2.07 ms"}


@pytest.mark.parametrize("precision,per_linear_s", [("bf16", 0.57e-3), ("fp8", 2.07e-3)])
def test_floor_is_the_sum_over_the_four_linear_modules(precision, per_linear_s):
    system = _system(HOST)
    model = _model(precision, system)
    layer = _layer(model)
    # QKV, projection, FC1, FC2: the forward matmuls with weights (attention's BMMs carry none)
    assert _host_floor_s(layer, system.chip, precision) == pytest.approx(4 * per_linear_s)
    # the small layer's GPU work (hidden 1024, 512 tokens on TP 2) is far below: the floor binds
    free = _model(precision, _system())
    f0, b0 = free._layer_phases_s(_mapping(), _layer(free), {})
    assert f0 + b0 < 4 * per_linear_s
    f, b = model._layer_phases_s(_mapping(), layer, {})
    assert f == pytest.approx(f0)  # the forward is queued first; the GPU's wait shows in the backward
    assert f + b == pytest.approx(4 * per_linear_s)


def test_no_table_no_floor_and_cuda_graphs_lift_it():
    assert _host_floor_s(_layer(_model("fp8", _system())), _system().chip, "fp8") == 0.0
    system = _system(HOST)
    eager, graphed = _model("fp8", system), _model("fp8", system, cuda_graphs=True)
    m = _mapping()
    assert sum(graphed._layer_phases_s(m, _layer(graphed), {})) < sum(eager._layer_phases_s(m, _layer(eager), {}))
    free = _model("fp8", _system())
    assert sum(graphed._layer_phases_s(m, _layer(graphed), {})) == pytest.approx(
        sum(free._layer_phases_s(m, _layer(free), {})))


def test_a_floor_below_the_gpu_time_changes_nothing():
    tiny = _system({"bf16": "1 us", "fp8": "1 us"})
    model, free = _model("fp8", tiny), _model("fp8", _system())
    m = _mapping()
    assert model._layer_phases_s(m, _layer(model), {}) == pytest.approx(free._layer_phases_s(m, _layer(free), {}))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_more_host_time_never_faster_and_the_breakdown_names_it(precision):
    m = _mapping()
    times = []
    for ms in (0.0, 0.1, 0.5, 2.0, 5.0):
        model = _model(precision, _system({precision: f"{ms} ms"}))
        ev = model.evaluate(m)
        times.append(ev.iteration_time_s)
        if ms == 5.0:
            assert ev.breakdown_s.get("host", 0.0) > 0.0
            assert sum(ev.breakdown_s.values()) == pytest.approx(ev.iteration_time_s, rel=1e-6)
        if ms == 0.0:
            assert "host" not in ev.breakdown_s
    assert times == sorted(times)
    assert times[-1] > times[0]


def test_bad_table_is_a_clear_error():
    s = small_system(4, 1)
    s["chip"]["efficiency"]["host_linear_s"] = {"fp7": "1 ms"}
    with pytest.raises(InputError, match="host_linear_s"):
        load_system(s)


def test_dgxc_fp8_speedup_over_bf16_without_a_binding_host_floor():
    """Measured (NVIDIA dgxc-benchmarking v24.11.1, DGX H100): Llama 3.1 70B TP4 runs 1.34x faster in
    FP8 than bf16 (14.72 / 11.01 s), 405B TP8 1.53x (17.2 / 11.24 s). With the honest FP8 host figure
    (0.67 ms per module, session 12) the floor binds in neither: the 405B's gain is met, the 70B's is
    over-predicted (1.44x): what costs the 70B's FP8 layers time is not in the model (an open item;
    the misread 2.07 ms per module made the floor bind there and hid it)."""
    from dfmodel.validate import evaluate_case, load_cases, resolve_cases

    cases = {c.id: c for c in load_cases(resolve_cases("h100_training"))}
    pred = {k: evaluate_case(cases[k]).predicted_s for k in (
        "dgxc-llama31-70b-bf16-64", "dgxc-llama31-70b-fp8-64", "dgxc-llama31-405b-bf16-576", "dgxc-llama31-405b-fp8-576")}
    s70 = pred["dgxc-llama31-70b-bf16-64"] / pred["dgxc-llama31-70b-fp8-64"]
    s405 = pred["dgxc-llama31-405b-bf16-576"] / pred["dgxc-llama31-405b-fp8-576"]
    assert s405 == pytest.approx(17.2 / 11.24, rel=0.05)
    assert 14.72 / 11.01 < s70 < s405  # the known miss: the 70B gains more in the model than measured
