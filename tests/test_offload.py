"""Offload to host memory (issue 10 item 6): schema, closed forms, identity, monotonicity, search."""

from __future__ import annotations

import dataclasses

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.search import llm_candidates
from dfmodel.system.host import CPU_ADAM_BYTES_PER_PARAM, CPU_ADAM_DRAM_EFFICIENCY, Host
from tests.test_inter_chip import SMALL_LLM, small_system


def host_block(**kw) -> dict:
    block = {"kind": "DDR5", "capacity_bytes": "1 TB", "chips_per_host": 4, "memory_bandwidth_Bps": "400 GB/s",
             "link_bandwidth_Bps": "25 GB/s"}
    block.update(kw)
    return block


def with_host(system: dict, **kw) -> dict:
    return {**system, "host": host_block(**kw)}


def first(model: LLMModel, **fixed):
    """The first candidate with these knob values (offload options may be set on top)."""
    offload = {k: fixed.pop(k) for k in list(fixed) if k in off.OFFLOAD_OPTIONS}
    for m in llm_candidates(model, Knobs(**fixed)):
        return dataclasses.replace(m, **offload)
    raise AssertionError("no candidate")


# -- schema ---------------------------------------------------------------------------------------


def test_host_block_is_optional_and_validated():
    s = load_system(with_host(small_system(4, 2)))
    assert s.host.capacity_bytes == 1e12 and s.host.sharing(8) == 4
    assert load_system(small_system(4, 2)).host is None
    with pytest.raises(InputError, match="host.link_bandwidth_Bps"):
        load_system(with_host(small_system(4, 2), link_bandwidth_Bps="-3 GB/s"))
    bad = with_host(small_system(4, 2))
    del bad["host"]["chips_per_host"]
    with pytest.raises(InputError, match="host.chips_per_host"):
        load_system(bad)


def test_link_share_closed_form():
    h = Host(capacity_bytes=1e12, chips_per_host=8, memory_bandwidth_Bps=400e9, link_bandwidth_Bps=50e9,
             chips_per_link=2)
    assert h.link_Bps(8, 1) == 25e9  # two chips behind one 50 GB/s link
    assert h.link_Bps(8, 2) == 25e9  # DRAM: 400 / (8 x 2) = 25
    assert h.link_Bps(16, 2) == 25e9  # only the host's own chips share its DRAM
    assert h.link_Bps(2, 2) == 25e9 and Host(**{**h.model_dump(), "chips_per_link": 1}).link_Bps(8, 2) == 25e9
    assert Host(**{**h.model_dump(), "memory_bandwidth_Bps": 200e9}).link_Bps(8, 2) == 12.5e9
    # CPU-Adam derived from DRAM: ZeRO-Offload's DGX-2 host (256 GB/s) gives back its 10B / 2.57 s
    dgx2 = Host(capacity_bytes=1.5e12, chips_per_host=16, memory_bandwidth_Bps=2 * 6 * 2666e6 * 8,
                link_bandwidth_Bps=12e9)
    assert dgx2.adam_params_per_s == pytest.approx(10e9 / 2.57)
    assert 0 < CPU_ADAM_DRAM_EFFICIENCY < 1 and CPU_ADAM_BYTES_PER_PARAM == 30


def test_every_shipped_preset_with_a_host_loads():
    for name in ("dgx_a100", "dgx_h100", "dgx_h200", "dgx_h800", "dgx_b200", "gb200_nvl72", "mi300x"):
        s = load_system(name)
        assert s.host is not None and s.host.usable_bytes > 0
    gb = load_system("gb200_nvl72").host
    assert gb.chips_per_host == 2 and gb.link_Bps(72, 1) == 225e9  # C2C: 450 GB/s per direction for 2 GPUs


# -- closed forms on a tiny case ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    w = load_workload(SMALL_LLM)
    s = load_system(with_host(small_system(2, 1), cpu_adam_params_per_s=1e9))
    return LLMModel(w, s)


def test_optimizer_offload_moves_exactly_the_optimizer_state_and_gradients(tiny):
    m = first(tiny, tp=1, pp=1, dp=2, micro_batch=1, recompute="none", zero_stage=2)
    base, moved = tiny.evaluate(m), tiny.evaluate(dataclasses.replace(m, offload_optimizer="host"))
    b, o = base.memory, moved.memory
    assert o.optimizer_bytes == 0 and o.gradients_bytes == 0
    assert b.total_bytes - o.total_bytes == pytest.approx(b.optimizer_bytes + b.gradients_bytes, rel=1e-12)
    assert (o.weights_bytes, o.activations_bytes) == (b.weights_bytes, b.activations_bytes)
    # the host holds the state and the fp32 gradients of the same shard (12 bytes/param of state)
    params = b.optimizer_bytes / 12
    assert b.gradients_bytes == pytest.approx(4 * params, rel=1e-12)  # ZeRO-2: the same shard
    assert o.host_bytes == pytest.approx(b.optimizer_bytes + 4 * params, rel=1e-12)
    assert o.host_capacity_bytes == pytest.approx((1e12 - 0) / 2)
    # every micro-batch's 16-bit gradient shard goes down under its backward; then CPU-Adam over
    # the shard for both chips of the host, the weights coming back under it
    cpu = params * 2 / 1e9
    h2d = d2h = 2 * params / tiny.system.host.link_Bps(2, 1)
    backward = max(moved.stage_bwd_s)
    expected = m.num_micro_batches * max(0.0, d2h - backward) + max(cpu, h2d)
    assert moved.breakdown_s["offload"] == pytest.approx(expected, rel=1e-9)
    assert moved.breakdown_s["optimizer"] == 0.0
    assert moved.iteration_time_s - base.iteration_time_s == pytest.approx(
        moved.breakdown_s["offload"] - base.breakdown_s["optimizer"], rel=1e-9)
    assert sum(moved.breakdown_s.values()) == pytest.approx(moved.iteration_time_s, rel=1e-9)


def test_delayed_update_hides_the_step_behind_the_next_iteration(tiny):
    m = first(tiny, tp=1, pp=1, dp=2, micro_batch=1, recompute="none", zero_stage=2)
    base = tiny.evaluate(m)
    delayed = tiny.evaluate(dataclasses.replace(m, offload_optimizer="delayed"))
    assert delayed.memory.total_bytes == tiny.evaluate(dataclasses.replace(m, offload_optimizer="host")).memory.total_bytes
    params = base.memory.optimizer_bytes / 12
    plan = tiny.offload_plan(delayed.mapping)
    move = plan.transfer_s(2 * params, 1)
    grads = m.num_micro_batches * max(0.0, move - max(delayed.stage_bwd_s))  # as without the delay
    br = delayed.breakdown_s
    pipeline = delayed.iteration_time_s - br["offload"] - br["dp_comm"] - br["input"] - br["checkpoint"]
    assert br["offload"] == pytest.approx(grads + max(0.0, plan.cpu_step_s(params) + move - pipeline), abs=1e-12)


def test_activation_offload_moves_all_but_two_layers(tiny):
    m = first(tiny, tp=1, pp=1, dp=2, micro_batch=2, recompute="none", zero_stage=0)
    base = tiny.evaluate(m)
    moved = tiny.evaluate(dataclasses.replace(m, offload_activations=True))
    from dfmodel.inter_chip.memory import llm_layer_activation_bytes

    layer = llm_layer_activation_bytes(model=tiny.model, training=tiny.training, attention=tiny.model.attention or "unfused",
                                       tp=1, cp=1, micro_batch=2, sequence_parallel=False, recompute="none")
    offloaded = layer * (tiny.num_layers - off.RESIDENT_ACTIVATION_LAYERS)  # pp 1: one micro-batch in flight
    assert base.memory.activations_bytes - moved.memory.activations_bytes == pytest.approx(offloaded, rel=1e-12)
    assert moved.memory.host_bytes == pytest.approx(offloaded, rel=1e-12)
    # per layer: max(0, transfer - the pass it hides behind), forward (down) and backward (up)
    link = tiny.system.host.link_Bps(2, 2)
    t_f, t_b = base.layer.fwd.time_s, base.layer.backward_s("none")
    exposed = (max(0, layer / link - t_f) + max(0, layer / link - t_b)) * tiny.num_layers * m.num_micro_batches
    assert moved.breakdown_s["offload"] == pytest.approx(exposed, rel=1e-9)


def test_weight_offload_keeps_a_three_layer_buffer(tiny):
    m = first(tiny, tp=2, pp=1, dp=1, micro_batch=1, recompute="none")
    base = tiny.evaluate(m)
    moved = tiny.evaluate(dataclasses.replace(m, offload_optimizer="host", offload_weights=True))
    p_layer = base.layer.params_per_chip
    layer_weights = tiny.num_layers * p_layer * 2  # bf16
    drop = base.memory.total_bytes - moved.memory.total_bytes
    assert drop == pytest.approx(base.memory.optimizer_bytes + base.memory.gradients_bytes + layer_weights
                                 - 3 * p_layer * 2, rel=1e-9)
    # streamed per layer and micro-batch: weights up in forward, up again in backward, gradients down
    link = tiny.system.host.link_Bps(2, 2)
    w = p_layer * 2
    per_mb = max(0, w / link - base.layer.fwd.time_s) + max(0, w / link - base.layer.backward_s("none"))
    layer_part = per_mb * tiny.num_layers * m.num_micro_batches
    # the step: only the CPU's (gradients and weights already moved per layer)
    step = tiny.offload_plan(moved.mapping).cpu_step_s(base.memory.optimizer_bytes / 12)
    assert moved.breakdown_s["offload"] == pytest.approx(layer_part + step, rel=1e-9)


def test_transfer_time_is_bytes_over_link_bandwidth():
    h = Host(capacity_bytes=1e12, chips_per_host=1, memory_bandwidth_Bps=1e12, link_bandwidth_Bps=10e9)
    plan = off.OffloadPlan(h, 1, "host", True, False, 2.0, 2.0, 12.0)
    assert plan.transfer_s(5e9, 1) == 0.5
    assert plan.layer_transfer_s(act_bytes=1e9, weight_bytes=123.0) == (0.1, 0.1)  # weights not offloaded
    assert off.exposed_s(0.3, 0.1) == pytest.approx(0.2) and off.exposed_s(0.1, 0.3) == 0.0


# -- identity, monotonicity -----------------------------------------------------------------------


def test_a_host_block_changes_nothing_where_everything_fits():
    w = load_workload(SMALL_LLM)
    a = optimize(w, small_system(4, 2), alternatives=3)
    b = optimize(w, with_host(small_system(4, 2)), alternatives=3)
    assert a.iteration_time_s == b.iteration_time_s
    assert a.parallelism == b.parallelism and "offload" not in a.breakdown_s  # no host: today's keys
    assert b.breakdown_s == {**a.breakdown_s, "offload": 0.0}
    assert a.memory_per_chip_bytes == b.memory_per_chip_bytes and "host" not in b.memory_per_chip_bytes
    assert [x["iteration_time_s"] for x in a.alternatives] == [x["iteration_time_s"] for x in b.alternatives]


@pytest.mark.parametrize("kind", ["optimizer", "activations", "weights"])
def test_more_link_bandwidth_is_never_slower(kind):
    w = load_workload(SMALL_LLM)
    fixed = {"optimizer": {"offload_optimizer": "host"}, "activations": {"offload_activations": True},
             "weights": {"offload_optimizer": "host", "offload_weights": True, "dp": 1}}[kind]
    times = []
    for gbps in (1, 4, 16, 64, 256):
        r = optimize(w, with_host(small_system(2, 1), link_bandwidth_Bps=f"{gbps} GB/s", memory_bandwidth_Bps="10 TB/s"),
                     alternatives=0, **fixed)
        times.append(r.iteration_time_s)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:]))
    assert times[-1] < times[0]


# -- the search -----------------------------------------------------------------------------------


def _every_offload_variant(model):
    """The oracle: every candidate with every valid offload combination (no restriction)."""
    for m in llm_candidates(model, Knobs()):
        for o, a, wt in [(o, a, wt) for o in ("none", "host") for a in (False, True) for wt in (False, True)]:
            v = dataclasses.replace(m, offload_optimizer=o, offload_activations=a, offload_weights=wt)
            if off.valid(v):  # (delayed is only used when the user fixes it)
                yield v


@pytest.mark.parametrize("capacity", ["0.2 GiB", "0.5 GiB", "2 GiB"])
def test_search_equals_exhaustive_with_offload_in_the_space(capacity):
    w = load_workload(SMALL_LLM)
    s = load_system(with_host(small_system(2, 2, capacity=capacity), link_bandwidth_Bps="8 GB/s",
                              capacity_bytes="64 GB"))
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"
    # the restriction (offload only for mappings that do not fit without it) loses nothing
    model = LLMModel(w, s)
    evs = [model.evaluate(v) for v in _every_offload_variant(model)]
    best = min(e.iteration_time_s for e in evs if e.fits)
    assert fast.iteration_time_s == pytest.approx(best, rel=1e-12)


def test_a_model_that_does_not_fit_fits_with_offload():
    w = load_workload(SMALL_LLM)
    tight = small_system(2, 1, capacity="0.5 GiB")  # leanest without offload: 0.94 GiB
    with pytest.raises(InfeasibleError):
        optimize(w, tight)
    r = optimize(w, with_host(tight), alternatives=0)
    p = r.parallelism
    assert p.offload_optimizer != "none" or p.offload_activations or p.offload_weights
    assert r.breakdown_s["offload"] > 0 and r.memory_per_chip_bytes["host"] > 0
    assert r.memory_per_chip_bytes["total"] <= r.memory_per_chip_bytes["capacity"]


def test_host_capacity_exceeded_is_a_clear_error():
    w = load_workload(SMALL_LLM)
    with pytest.raises(InfeasibleError, match="host memory per chip"):
        optimize(w, with_host(small_system(2, 1), capacity_bytes="100 MB"), offload_optimizer="host")
    # offload asked of a system without a host block: one line naming the option
    with pytest.raises(InputError, match="no host block") as exc:
        optimize(w, small_system(2, 1), offload_activations=True)
    assert exc.value.field == "offload_activations"
    with pytest.raises(InputError, match="offload_optimizer must be host or delayed"):
        optimize(w, with_host(small_system(2, 1)), offload_weights=True, offload_optimizer="none")
    with pytest.raises(InputError, match="offload_optimizer"):
        optimize(w, with_host(small_system(2, 1)), offload_optimizer="nvme")


def test_cli_options_and_json_record():
    import json

    from typer.testing import CliRunner

    from dfmodel.cli import app

    r = optimize(load_workload(SMALL_LLM), with_host(small_system(2, 1)), offload_optimizer="delayed",
                 offload_activations=True, alternatives=0)
    d = json.loads(r.to_json())
    assert d["parallelism"]["offload_optimizer"] == "delayed" and d["parallelism"]["offload_activations"] is True
    assert "offload" in d["breakdown_s"] and "host" in d["memory_per_chip_bytes"]
    res = CliRunner().invoke(app, ["solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "8", "--tp", "8",
                                   "--pp", "1", "--micro-batch", "1", "--recompute", "full", "--no-sequence-parallel",
                                   "--zero", "0", "--offload-optimizer", "host", "--no-offload-activations",
                                   "--no-offload-weights", "--no-tp-comm-overlap", "--json", "-", "-q"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["parallelism"]["offload_optimizer"] == "host" and out["breakdown_s"]["offload"] > 0


def test_a_host_faster_than_the_chip_is_searched_up_front():
    """On a (hypothetical) host whose CPU step beats the chip's own, offload may win even where
    everything fits: then every variant is enumerated, and the search still equals the oracle."""
    w = load_workload(SMALL_LLM)
    s = load_system(with_host(small_system(2, 1), cpu_adam_params_per_s=1e14, link_bandwidth_Bps="100 TB/s",
                              memory_bandwidth_Bps="1000 TB/s"))
    assert off.host_step_can_win(s) and not off.host_step_can_win(load_system(with_host(small_system(2, 1))))
    r = optimize(w, s, alternatives=0)
    assert r.parallelism.offload_optimizer == "host"
    model = LLMModel(w, s)
    best = min(e.iteration_time_s for e in map(model.evaluate, _every_offload_variant(model)) if e.fits)
    assert r.iteration_time_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("opts", [{"offload_optimizer": "host"}, {"offload_activations": True},
                                  {"offload_optimizer": "host", "offload_activations": True, "offload_weights": True}])
def test_memory_floors_stay_below_the_evaluated_memory_with_offload(opts):
    """Both pre-solve screens (chip and host) are lower bounds of what evaluate() finds."""
    w = load_workload(SMALL_LLM)
    s = load_system(with_host(small_system(2, 2), capacity_bytes="64 GB"))
    model = LLMModel(w, s)
    seen = 0
    for m in list(llm_candidates(model, Knobs()))[::5]:
        v = dataclasses.replace(m, **opts)
        if not off.valid(v):
            continue
        ev = model.evaluate(v)
        assert model.memory_floor_bytes(v) <= ev.memory.total_bytes * (1 + 1e-12)
        floor = LLMModel(w, s).memory_before_blocks(v)
        assert floor.total_bytes <= ev.memory.total_bytes * (1 + 1e-12)
        assert floor.host_bytes <= ev.memory.host_bytes * (1 + 1e-12)
        assert model.lower_bound_s(v) <= ev.iteration_time_s * (1 + 1e-12)
        seen += 1
    assert seen >= 5


def test_refined_bound_is_valid_with_tp_comm_overlap():
    """The lazily refined bound runs a layer as evaluate() does: with tp_comm_overlap the
    userbuffers phases can be shorter than the plain ones (found through an offload case that
    the search missed: its refined bound was above its time)."""
    w = load_workload(SMALL_LLM)
    model = LLMModel(w, load_system(with_host(small_system(4, 2))))
    checked = 0
    for m in llm_candidates(model, Knobs(tp=4)):
        if not m.tp_comm_overlap:
            continue
        for v in [m] + [dataclasses.replace(m, offload_optimizer="host")] * (m.zero_stage >= 2):
            ev = model.evaluate(v)
            assert model.refined_bound_s(v) <= ev.iteration_time_s * (1 + 1e-12)
            checked += 1
    assert checked >= 10
