"""Storage tiers, the input-time model, checkpoints and I/O energy (issue 8).

Closed forms on tiny cases for each regime (bandwidth, latency, CPU, per-node cap, NIC), hit
ratios, monotonicity (more bandwidth / depth / cores never slower), async never slower than
sync, and "no storage block = exactly today's results"."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InputError
from dfmodel.graph.data_pipeline import Checkpointing, DataPipeline
from dfmodel.inter_chip.checkpoint import CheckpointState, checkpoint_cost, checkpoint_state
from dfmodel.inter_chip.input_pipeline import fetch_time_s, hit_ratio, input_time
from dfmodel.inter_chip.io import io_power_w, io_terms

from tests.test_inter_chip import SMALL_LLM, small_system


def system_with(tiers, nodes=2, chips_per_node=8, **storage):
    spec = {
        "name": "t",
        "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
                 "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
        "network": [{"name": "r", "topology": "ring", "size": nodes * chips_per_node, "link_bandwidth_Bps": 1e9}],
        "storage": {"chips_per_node": chips_per_node, "tiers": tiers, **storage},
    }
    return load_system(spec)


def fs(**kw):
    return {"name": "fs", "kind": "parallel_fs", "capacity_bytes": 1e15, "aggregate_read_Bps": 2e9, **kw}


# -- schema -----------------------------------------------------------------------------------


def test_scope_follows_kind_and_node_figures_scale_with_nodes():
    s = system_with([fs(power_w=1000), {"name": "nvme", "kind": "local_nvme", "capacity_bytes": 1e12,
                                        "node_read_Bps": "25 GB/s", "power_w": 200}], nodes=4)
    fs_t, nvme = s.storage.tiers
    assert (fs_t.scope, nvme.scope) == ("cluster", "node")
    assert nvme.read_Bps_per_node(4) == 25e9 and fs_t.read_Bps_per_node(4) == 0.5e9
    assert io_power_w(s) == 1000 + 4 * 200


@pytest.mark.parametrize("storage,needle", [
    ({"tiers": [{"name": "n", "kind": "local_nvme", "capacity_bytes": 1e12, "node_read_Bps": 1e9}]},
     "first (outermost) tier"),
    ({"tiers": [fs(), {"name": "n", "kind": "local_nvme", "capacity_bytes": 1e12}]}, "needs node_read_Bps"),
    ({"tiers": [{"name": "fs", "kind": "parallel_fs", "capacity_bytes": 1e15}]}, "needs aggregate_read_Bps"),
    ({"tiers": [fs()], "read_bandwidth_Bps": 1e9}, "one-block form"),
    ({"chips_per_node": 8}, "give either tiers"),
    ({"tiers": [fs(), fs()]}, "unique"),
    ({"tiers": [fs(kind="tape")]}, "kind"),
])
def test_bad_storage_is_one_line_error_with_the_field(storage, needle):
    spec = small_system(4, 2)
    spec["storage"] = storage
    with pytest.raises(InputError) as e:
        load_system(spec)
    msg = str(e.value)
    assert "storage" in msg and needle in msg and "\n" not in msg


@pytest.mark.parametrize("training,needle", [
    ({"data": {"dataset_bytes": "1 TB", "dataset_samples": 10}}, "not both"),
    ({"data": {"preprocess_core_s_per_sample": "5 ms"}}, "cpu_cores_per_node"),
    ({"checkpoint": {"mode": "async"}}, "exactly one"),
    ({"checkpoint": {"interval_steps": 10, "interval_s": 60}}, "exactly one"),
    ({"data": {"access": "random"}}, "training.data.access"),
])
def test_bad_data_pipeline_is_one_line_error(training, needle):
    w = copy.deepcopy(SMALL_LLM)
    w["training"].update(training)
    with pytest.raises(InputError) as e:
        load_workload(w)
    assert needle in str(e.value) and "training" in str(e.value)


def test_unknown_checkpoint_tier_names_the_field():
    w = copy.deepcopy(SMALL_LLM)
    w["training"]["checkpoint"] = {"interval_steps": 10, "tier": "tape"}
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "tiers": [fs()]}
    with pytest.raises(InputError, match=r"training.checkpoint.tier: no storage tier 'tape'.*tiers: fs"):
        optimize(w, s)


# -- input time: closed forms ------------------------------------------------------------------


def test_bandwidth_bound_tier_shares_the_aggregate():
    # 2 nodes, 2 GB/s aggregate: 1 GB/s each; 16 samples of 100 MB -> 8 per node, 0.8 GB, 0.8 s
    s = system_with([fs()])
    t = input_time(s, 16, 1e8, None, 0.5)
    assert t.load_s == pytest.approx(0.8) and t.exposed_s == pytest.approx(0.3)
    assert t.binding == "fs" and t.stages[0].bound == "bandwidth"


def test_per_node_bandwidth_caps_the_share():
    s = system_with([fs(aggregate_read_Bps=1e12, node_read_Bps=1e9)])
    assert input_time(s, 16, 1e8, None, 0.0).load_s == pytest.approx(0.8)


def test_latency_bound_tier_and_prefetch_depth():
    # 8000 samples of 1 kB per node, 1 ms per request, 4 in flight: 8000 (1 ms + 1 us) / 4
    s = system_with([fs(latency_s="1 ms", aggregate_read_Bps=2e9)])
    t = input_time(s, 16000, 1e3, DataPipeline(prefetch_depth=4, samples_per_request=1), 0.0)
    assert t.load_s == pytest.approx(8000 * (1e-3 + 1e3 / 1e9) / 4)
    assert t.stages[0].bound == "latency"
    # deep enough prefetching makes it bandwidth-bound again (EMLIO): depth >= latency x bw / size
    deep = input_time(s, 16000, 1e3, DataPipeline(prefetch_depth=10**6, samples_per_request=1), 0.0)
    assert deep.load_s == pytest.approx(8000 * 1e3 / 1e9) and deep.stages[0].bound == "bandwidth"
    # batching samples into requests divides the latency term
    packed = input_time(s, 16000, 1e3, DataPipeline(prefetch_depth=4, samples_per_request=100), 0.0)
    assert packed.load_s == pytest.approx(80 * (1e-3 + 1e5 / 1e9) / 4)


def test_request_size_defaults_to_a_lustre_stripe():
    # small records packed in files are read in 1 MiB requests unless the workload says otherwise
    s = system_with([fs(latency_s="1 ms", aggregate_read_Bps=2e9)])
    per_mib = 2.0**20 / 1e3
    t = input_time(s, 16000, 1e3, None, 0.0)
    assert t.stages[0].requests == pytest.approx(8000 / per_mib)
    assert t.load_s == pytest.approx(max(8e6 / 1e9, 8000 / per_mib * (1e-3 + 2.0**20 / 1e9) / 2))
    r = input_time(s, 16000, 1e3, DataPipeline(request_bytes="4 MB"), 0.0)
    assert r.stages[0].requests == pytest.approx(8000 / 4000)
    assert DataPipeline().samples_per_request_for(4e6) == 1.0  # never below one sample
    with pytest.raises(ValueError, match="not both"):
        DataPipeline(samples_per_request=2, request_bytes=1e6)


def test_cpu_bound_preprocessing():
    s = system_with([fs(aggregate_read_Bps=1e15)])
    data = DataPipeline(preprocess_core_s_per_sample="10 ms", cpu_cores_per_node=4)
    t = input_time(s, 16000, 1e3, data, 1.0)
    assert t.binding == "cpu" and t.load_s == pytest.approx(8000 * 0.01 / 4) and t.exposed_s == pytest.approx(19.0)


def test_storage_nic_limits_remote_bytes_only():
    tiers = [fs(aggregate_read_Bps=1e15),
             {"name": "nvme", "kind": "local_nvme", "capacity_bytes": 1e15, "node_read_Bps": 1e12}]
    s = system_with(tiers, node_network_Bps=1e9)
    cold = input_time(s, 16, 1e8, DataPipeline(dataset_bytes=1e10), 0.0, cold=True)
    assert cold.binding == "network" and cold.load_s == pytest.approx(0.8)
    warm = input_time(s, 16, 1e8, DataPipeline(dataset_bytes=1e10), 0.0)  # all from the local NVMe
    assert warm.load_s == pytest.approx(0.8e9 / 1e12)


# -- caches ---------------------------------------------------------------------------------


def test_hit_ratio_closed_forms():
    assert hit_ratio(1, 4, eviction="pin", access="shuffle") == 0.25
    assert hit_ratio(1, 4, eviction="lru", access="shuffle") == 0.25
    assert hit_ratio(1, 4, eviction="lru", access="sequential") == 0.0
    assert hit_ratio(4, 4, eviction="lru", access="sequential") == 1.0
    assert hit_ratio(4, None, eviction="pin", access="shuffle") == 0.0


@pytest.mark.parametrize("access", ["shuffle", "sequential"])
def test_cache_larger_than_dataset_hits_everything_after_the_first_epoch(access):
    tiers = [fs(), {"name": "jindo", "kind": "distributed_cache", "capacity_bytes": 2e12,
                    "aggregate_read_Bps": 1e12, "eviction": "lru"}]
    s = system_with(tiers)
    data = DataPipeline(dataset_bytes=1e12, access=access)
    warm = input_time(s, 16, 1e8, data, 0.0)
    cache, store = warm.stages[0], warm.stages[1]
    assert (cache.name, cache.hit_ratio, cache.share, store.share) == ("jindo", 1.0, 1.0, 0.0)
    cold = input_time(s, 16, 1e8, data, 0.0, cold=True)
    assert cold.stages[0].share == 0.0 and cold.stages[1].share == 1.0 and cold.binding == "fs"


def test_node_cache_under_sequential_access_holds_its_shard():
    # dataset 4 TB over 4 nodes: each node re-reads its 1 TB shard; a 1 TB node cache holds it
    tiers = [fs(), {"name": "nvme", "kind": "local_nvme", "capacity_bytes": 1e12, "node_read_Bps": 1e10,
                    "eviction": "lru"}]
    s = system_with(tiers, nodes=4)
    seq = input_time(s, 32, 1e8, DataPipeline(dataset_bytes=4e12, access="sequential"), 0.0)
    shuf = input_time(s, 32, 1e8, DataPipeline(dataset_bytes=4e12, access="shuffle"), 0.0)
    assert seq.stages[0].hit_ratio == 1.0 and shuf.stages[0].hit_ratio == pytest.approx(0.25)


def test_two_cache_levels_multiply_their_misses():
    tiers = [fs(), {"name": "dc", "kind": "distributed_cache", "capacity_bytes": 5e11, "aggregate_read_Bps": 1e12},
             {"name": "nvme", "kind": "local_nvme", "capacity_bytes": 5e11, "node_read_Bps": 1e10}]
    t = input_time(system_with(tiers), 16, 1e8, DataPipeline(dataset_bytes=1e12), 0.0)
    shares = {st.name: st.share for st in t.stages}
    assert shares == pytest.approx({"nvme": 0.5, "dc": 0.25, "fs": 0.25, "cpu": 0.0})


# -- monotonicity --------------------------------------------------------------------------


def _random_case(rng):
    tiers = [fs(aggregate_read_Bps=float(rng.uniform(1e9, 1e12)), latency_s=float(rng.uniform(0, 1e-2)),
                node_read_Bps=float(rng.uniform(1e9, 1e11))),
             {"name": "dc", "kind": "distributed_cache", "capacity_bytes": float(rng.uniform(1e11, 2e12)),
              "aggregate_read_Bps": float(rng.uniform(1e9, 1e12)), "latency_s": float(rng.uniform(0, 1e-3))},
             {"name": "nvme", "kind": "local_nvme", "capacity_bytes": float(rng.uniform(1e10, 1e12)),
              "node_read_Bps": float(rng.uniform(1e9, 3e10)), "latency_s": 1e-4}]
    data = DataPipeline(dataset_bytes=float(rng.uniform(1e11, 1e13)), prefetch_depth=int(rng.integers(1, 64)),
                        preprocess_core_s_per_sample=float(rng.uniform(0, 0.02)), cpu_cores_per_node=int(rng.integers(1, 128)),
                        samples_per_request=int(rng.integers(1, 16)), access=str(rng.choice(["shuffle", "sequential"])))
    return tiers, data, int(rng.integers(1, 8)), float(rng.uniform(1e3, 1e7))


@pytest.mark.parametrize("seed", range(20))
def test_more_bandwidth_depth_or_cores_is_never_slower(seed):
    rng = np.random.default_rng(seed)
    tiers, data, nodes, sample = _random_case(rng)
    base = input_time(system_with(tiers, nodes=nodes), 4096, sample, data, 0.0).load_s
    for i, key in ((0, "aggregate_read_Bps"), (0, "node_read_Bps"), (1, "aggregate_read_Bps"), (2, "node_read_Bps")):
        more = copy.deepcopy(tiers)
        more[i][key] *= float(rng.uniform(1.0, 10.0))
        assert input_time(system_with(more, nodes=nodes), 4096, sample, data, 0.0).load_s <= base * (1 + 1e-12)
    for field in ("prefetch_depth", "cpu_cores_per_node"):
        d2 = data.model_copy(update={field: getattr(data, field) * 2})
        assert input_time(system_with(tiers, nodes=nodes), 4096, sample, d2, 0.0).load_s <= base * (1 + 1e-12)
    assert input_time(system_with(tiers, nodes=nodes), 4096, sample, data, 0.0, cold=True).load_s >= 0.0


def test_fetch_time_closed_form_regimes():
    assert fetch_time_s(1e9, 10, 1e9, 0.0, 1) == 1.0
    assert fetch_time_s(1e6, 1000, 1e9, 1e-3, 4) == pytest.approx(1000 * (1e-3 + 1e-6) / 4)
    assert fetch_time_s(0.0, 0.0, 1e9, 1.0, 1) == 0.0


# -- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_bytes_come_from_the_memory_model():
    # mixed-precision Adam: 2 (bf16 weights) + 12 (fp32 master, m, v); gradients (2) on request
    st = checkpoint_state(1e9, num_chips=32, tp=4, pp=2, dp=4, checkpoint=Checkpointing(interval_steps=1))
    assert st.bytes_total == 14e9 and st.writer_chips == 32 and st.restart_bytes_total == 14e9
    st = checkpoint_state(1e9, num_chips=32, tp=4, pp=2, dp=4,
                          checkpoint=Checkpointing(interval_steps=1, fully_parallel=False, include_gradients=True))
    assert st.bytes_total == 16e9 and st.writer_chips == 8 and st.restart_bytes_total == 64e9


def test_sync_checkpoint_closed_form_and_restart_through_the_cache():
    tiers = [fs(aggregate_write_Bps=1e9, node_write_Bps=1e12, latency_s="1 ms"),
             {"name": "dc", "kind": "distributed_cache", "capacity_bytes": 1e12, "aggregate_read_Bps": 1e11}]
    s = system_with(tiers, nodes=2, host_copy_Bps=1e9)
    st = CheckpointState(16e9, 16, 16e9)
    c = checkpoint_cost(s, Checkpointing(interval_steps=100), st, 1.0)
    assert c.copy_s == pytest.approx(1.0)  # 1 GB per chip at 1 GB/s
    assert c.write_s == pytest.approx(16.0 + 1e-3)
    assert c.per_step_s == pytest.approx((1.0 + 16.001) / 100)
    assert c.restart_cold_s == pytest.approx(8e9 / 1e9 + 1e-3)  # 16 GB over 2 nodes at 1 GB/s each
    assert (c.restart_tier, c.restart_s) == ("dc", pytest.approx(8e9 / 5e10))
    # by time: every 50 s with 1 s steps = every 50 steps
    assert checkpoint_cost(s, Checkpointing(interval_s=50), st, 1.0).interval_steps == 50


@pytest.mark.parametrize("seed", range(20))
def test_async_checkpoint_is_never_slower_than_sync(seed):
    rng = np.random.default_rng(seed)
    s = system_with([fs(aggregate_write_Bps=float(rng.uniform(1e8, 1e12)))], nodes=int(rng.integers(1, 16)),
                    host_copy_Bps=float(rng.uniform(1e9, 1e11)))
    st = CheckpointState(float(rng.uniform(1e9, 1e13)), 8, 1e9)
    step, n = float(rng.uniform(1e-3, 10)), int(rng.integers(1, 1000))
    sync = checkpoint_cost(s, Checkpointing(interval_steps=n), st, step).per_step_s
    asyn = checkpoint_cost(s, Checkpointing(interval_steps=n, mode="async"), st, step).per_step_s
    assert 0 <= asyn <= sync


# -- end to end ------------------------------------------------------------------------------

IO_TRAINING = {"input_bytes_per_sample": "100 MB",
               "data": {"dataset_samples": 1000, "prefetch_depth": 8},
               "checkpoint": {"interval_steps": 10, "mode": "sync"}}


def test_no_storage_block_means_exactly_todays_results():
    w = copy.deepcopy(SMALL_LLM)
    w["training"].update(IO_TRAINING)
    plain = optimize(SMALL_LLM, small_system(4, 2)).to_dict()
    with_io = optimize(w, small_system(4, 2)).to_dict()
    for key in ("iteration_time_s", "breakdown_s", "parallelism", "memory_per_chip_bytes", "cost_usd", "power_w"):
        assert with_io[key] == plain[key]
    assert with_io["io"] == {} and with_io["breakdown_s"]["checkpoint"] == 0.0


def test_storage_tiers_add_input_and_checkpoint_terms_end_to_end():
    w = copy.deepcopy(SMALL_LLM)
    w["training"].update(IO_TRAINING)
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "tiers": [fs(aggregate_read_Bps="1 GB/s", aggregate_write_Bps="1 GB/s",
                                                       power_w=1000)]}
    plain = optimize(SMALL_LLM, small_system(4, 2))
    r = optimize(w, s)
    step = r.iteration_time_s - r.breakdown_s["input"] - r.breakdown_s["checkpoint"]
    assert step == pytest.approx(plain.iteration_time_s, rel=1e-9)
    # 16 x 100 MB over 2 nodes sharing 1 GB/s: 1.6 s of loading per step
    assert r.io["steady_state"]["load_s"] == pytest.approx(1.6)
    assert r.breakdown_s["input"] == pytest.approx(1.6 - step)
    params = load_workload(SMALL_LLM)
    from dfmodel.graph.build import build_graphs
    saved = 14 * build_graphs(params, batch=1).params()
    assert r.io["checkpoint"]["bytes_total"] == pytest.approx(saved)
    assert r.breakdown_s["checkpoint"] == pytest.approx(saved / 1e9 / 10)
    assert r.io["binding_tier"] == "fs" and r.input_bound
    e = r.io["energy_j_per_step"]
    assert e["io"] == pytest.approx(1000 * r.iteration_time_s) and e["total"] == pytest.approx(e["io"] + e["compute"])


@pytest.mark.parametrize("workload,chips", [("dlrm", 64), ("gpt3_13b", 64)])
def test_presets_storage_keeps_shipped_workloads_unchanged(workload, chips):
    # the shipped workloads read small records (tokens, DLRM rows): the new storage block of the
    # DGX presets hides their input entirely
    s = load_system("dgx_h100", num_chips=chips)
    a, b = optimize(workload, s), optimize(workload, s.model_copy(update={"storage": None}))
    assert a.iteration_time_s == b.iteration_time_s and a.breakdown_s == b.breakdown_s


def test_presets_storage_keeps_token_workloads_unchanged():
    # the DGX presets gained a storage block; a token-fed LLM hides its 8 kB/sample input
    w = {**SMALL_LLM, "training": {**SMALL_LLM["training"], "input_bytes_per_sample": 8192}}
    s = load_system("dgx_h100", num_chips=16)
    bare = s.model_copy(update={"storage": None})
    a, b = optimize(w, s, tp=8), optimize(w, bare, tp=8)
    assert a.iteration_time_s == b.iteration_time_s and a.breakdown_s == b.breakdown_s
    assert a.io["binding_tier"] == "lustre" and b.io == {}


def test_dlrm_checkpoint_and_tiered_input():
    w = load_workload("dlrm").model_dump()
    w["training"]["global_batch"] = 4096
    w["training"]["precision"] = "bf16"
    w["training"]["checkpoint"] = {"interval_steps": 100}
    w["embedding"]["rows_per_table"] = [10000] * w["embedding"]["num_tables"]
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "tiers": [fs()]}
    r = optimize(w, s)
    assert r.breakdown_s["checkpoint"] > 0 and r.io["checkpoint"]["tier"] == "fs"
    assert r.iteration_time_s == pytest.approx(sum(r.breakdown_s.values()), rel=1e-9)


def test_io_terms_without_checkpoint_support_note():
    w = load_workload({**SMALL_LLM, "training": {**SMALL_LLM["training"], "checkpoint": {"interval_steps": 5}}})
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "read_bandwidth_Bps": 1e9, "preprocess_samples_per_s": 1e3}
    terms = io_terms(load_system(s), w.training, 16, 1.0, CheckpointState(1e9, 8, 1e9))
    assert terms.checkpoint is None and "no tiers" in terms.notes[0]


def test_cli_solve_prints_input_checkpoint_and_binding_tier():
    proc = subprocess.run([sys.executable, "-m", "dfmodel.cli", "solve", "-w", "vit_g14_images", "-s", "dgx_h100",
                           "--num-chips", "64", "--tp", "1", "--pp", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "storage I/O" in out and "binding tier: cpu" in out and "checkpoint" in out and "restart" in out
    assert "first epoch" in out and "energy per step" in out


@pytest.mark.parametrize("fs_read,cache", [("100 MB/s", 0), ("1 GB/s", "2 GB"), ("100 GB/s", "20 GB")])
def test_reprice_io_equals_a_full_solve(fs_read, cache):
    # the notebook prices a storage grid from one solve: exact because the storage terms never
    # favour a slower step (iteration = max(step, load) + checkpoint) and ties go to the fastest step
    from dfmodel.inter_chip.io import reprice_io

    w = copy.deepcopy(SMALL_LLM)
    w["training"].update({"input_bytes_per_sample": "10 MB", "data": {"dataset_bytes": "10 GB", "prefetch_depth": 4},
                          "checkpoint": {"interval_steps": 3, "mode": "async"}})
    w = load_workload(w)
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "host_copy_Bps": "10 GB/s",
                    "tiers": [fs(aggregate_read_Bps="1 GB/s", aggregate_write_Bps="1 GB/s", latency_s="1 ms")]}
    first = optimize(w, s)
    s2 = copy.deepcopy(s)
    s2["storage"]["tiers"][0]["aggregate_read_Bps"] = fs_read
    if cache:
        s2["storage"]["tiers"].append({"name": "dc", "kind": "distributed_cache", "capacity_bytes": cache,
                                       "aggregate_read_Bps": "50 GB/s"})
    full = optimize(w, s2)
    repriced, _ = reprice_io(first, w, load_system(s2))
    assert repriced == pytest.approx(full.iteration_time_s, rel=1e-12)


def test_one_block_storage_names_what_binds_and_module_doctests_pass():
    import doctest

    import dfmodel.graph.data_pipeline as dp
    import dfmodel.inter_chip.checkpoint as ck
    import dfmodel.inter_chip.input_pipeline as ip
    import dfmodel.inter_chip.io as io
    import dfmodel.system.storage as st

    for mod in (dp, ck, ip, io, st):
        assert doctest.testmod(mod).failed == 0, mod.__name__
    w = {**SMALL_LLM, "training": {**SMALL_LLM["training"], "input_bytes_per_sample": "1 GB"}}
    s = small_system(4, 2)
    s["storage"] = {"chips_per_node": 4, "read_bandwidth_Bps": "1 GB/s", "preprocess_samples_per_s": 1000}
    r = optimize(w, s)
    assert r.io["binding_tier"] == "read" and r.io["input_s"] == r.breakdown_s["input"]
    assert r.io["throughput_per_usd"] is None or r.io["throughput_per_usd"] > 0
