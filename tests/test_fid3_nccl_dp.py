"""Issue 11 round 4: NCCL's algorithm set on a switch (no recursive halving / doubling or
halving-doubling: reduce-scatter and all-gather run as rings, n - 1 latency steps), the DP
gradient sync as one collective per bucket, and FP8 parameters all-gathered in 1 byte."""

from __future__ import annotations

import copy

import pytest

from dfmodel.graph.workload import load_workload
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.netmodels import formulas as f
from dfmodel.netmodels.topologies import NCCL_MISSING, dim_candidates
from dfmodel.system.loader import load_system

from test_inter_chip import SMALL_LLM, small_system


def _ib(nccl: bool):
    s = small_system(4, 64)
    s["network"][1]["nccl_protocols"] = nccl
    return load_system(s).network[1]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_reduce"])
def test_nccl_switch_has_only_nccl_algorithms(collective):
    with_nccl = dim_candidates(_ib(True), collective, 64, 1e6)
    plain = dim_candidates(_ib(False), collective, 64, 1e6)
    assert not any(name.startswith(NCCL_MISSING) for name, _ in with_nccl)
    assert any(name.startswith(NCCL_MISSING) for name, _ in plain)
    # fewer choices are never faster
    assert min(t for _, t in with_nccl) >= min(t for _, t in plain) * (1 - 1e-12)


def test_nccl_ring_latency_grows_with_ranks():
    """A small reduce-scatter (latency-bound) over n ranks: the NCCL ring pays n - 1 steps,
    the closed form of the ring with Simple's full latency or LL's share of it."""
    ib = _ib(True)
    small = 1e3
    times = [min(t for _, t in dim_candidates(ib, "reduce_scatter", n, small)) for n in (2, 8, 32, 64)]
    assert times == sorted(times)
    simple = f.ring_reduce_scatter_s(64, small, ib.effective_bandwidth_Bps, ib.latency_s)
    assert times[-1] <= simple + 1e-15
    assert times[-1] > 63 * ib.latency_s * 0.1  # still n - 1 steps of (LL's) latency, not log2 n


def _model(precision="bf16", fp8_weights=False):
    w = copy.deepcopy(SMALL_LLM)
    w["training"]["precision"] = precision
    if fp8_weights:
        w["training"]["fp8"] = {"fp8_weights": True}
    s = small_system(4, 64)
    s["chip"]["peak_flops"] = {"bf16": "312 TFLOPS", "fp8": "624 TFLOPS"}
    return LLMModel(load_workload(w), load_system(s))


def test_fp8_parameters_gather_in_one_byte():
    assert _model()._param_gather_bytes == 2
    assert _model("fp8")._param_gather_bytes == 2  # a 16-bit master copy cast per step: gathered 16-bit
    assert _model("fp8", fp8_weights=True)._param_gather_bytes == 1


def test_dp_sync_is_one_collective_per_bucket():
    """Without overlap the exposed sync is k buckets x one bucket's reduce-scatter + all-gather;
    splitting the same bytes into more buckets only adds latency (never faster)."""
    from dfmodel.inter_chip import pipeline as pipe
    from dfmodel.inter_chip.config import Mapping

    model = _model()
    dp = 64
    group = (("ib", dp),)
    m = Mapping(tp=1, pp=1, dp=dp, micro_batch=1, num_micro_batches=1, zero_stage=1,
                overlap_grad_reduce=False, overlap_param_gather=False)
    bucket = pipe.megatron_bucket_elements(dp)
    params = 3.5 * bucket  # 4 buckets
    got = model._dp_sync_s(m, params, 0.0, 1.0, group)
    t = model.training
    one = (model.costs.time_s("reduce_scatter", params / 4 * t.grad_bytes, group)
           + model.costs.time_s("all_gather", params / 4 * t.activation_bytes, group))
    assert got == pytest.approx(4 * one)
    whole = (model.costs.time_s("reduce_scatter", params * t.grad_bytes, group)
             + model.costs.time_s("all_gather", params * t.activation_bytes, group))
    assert got >= whole


def test_case_overlap_grad_reduce_is_passed_and_never_faster_off():
    """A case's ``overlap_grad_reduce: false`` (Megatron-LM before Megatron-Core) reaches the
    optimizer, and reducing after the backward is never faster than under it."""
    from pathlib import Path

    from dfmodel.validate import evaluate_case, knobs_of, load_cases

    root = Path(__file__).resolve().parents[1]
    case = next(c for c in load_cases(root / "calibration" / "megatron_a100.yaml") if c.id == "meg21-gpt-1.7B")
    assert knobs_of(case)["overlap_grad_reduce"] is False and knobs_of(case)["distributed_optimizer"] is False
    on = case.model_copy(deep=True)
    on.parallelism.overlap_grad_reduce = True
    assert "overlap_grad_reduce" in knobs_of(on)
    off_row, on_row = evaluate_case(case, workload_overrides={"attention": "unfused"}), evaluate_case(
        on, workload_overrides={"attention": "unfused"})
    assert off_row.predicted_s > on_row.predicted_s


def test_an_overlapped_dp_sync_takes_its_channels_sms_from_the_compute():
    """Hidden under a long backward, the sync still costs the compute the SMs of NCCL's 16 ring
    channels for as long as it runs: exposed = tail + 16 / sms x (sync - tail), by hand. Never
    more than the sync exposed whole; nothing on a chip whose collectives are not kernels beside
    the compute (a dataflow chip)."""
    from dfmodel.inter_chip import pipeline as pipe
    from dfmodel.inter_chip.config import Mapping
    from dfmodel.netmodels import nccl

    model = _model()
    dp, group = 64, (("ib", 64),)
    bucket = pipe.megatron_bucket_elements(dp)
    params = 3.5 * bucket
    t = model.training
    sync_s = 4 * (model.costs.time_s("reduce_scatter", params / 4 * t.grad_bytes, group)
                  + model.costs.time_s("all_gather", params / 4 * t.activation_bytes, group))
    hidden = Mapping(tp=1, pp=1, dp=dp, micro_batch=1, num_micro_batches=1, zero_stage=1)
    exposed = Mapping(tp=1, pp=1, dp=dp, micro_batch=1, num_micro_batches=1, zero_stage=1,
                      overlap_grad_reduce=False, overlap_param_gather=False)
    tail_s = pipe.dp_sync_exposed_s(sync_s=sync_s, grad_elements=params, chunk_backward_s=1e3, interleave=1,
                                    pp=1, overlap_fraction=model.system.dp_overlap, bucket_elements=bucket)
    sms = model.system.chip.compute_tiles
    assert model.system.chip.eager and sms > nccl.NCCL_RING_CHANNELS
    got = model._dp_sync_s(hidden, params, 1e3, 1e3, group)
    assert got == pytest.approx(tail_s + nccl.NCCL_RING_CHANNELS / sms * (sync_s - tail_s), rel=1e-12)
    assert tail_s < got < model._dp_sync_s(exposed, params, 1e3, 1e3, group) == pytest.approx(sync_s)

    w = copy.deepcopy(SMALL_LLM)
    s = small_system(4, 64)
    s["chip"]["execution"] = "dataflow"
    dataflow = LLMModel(load_workload(w), load_system(s))
    assert not dataflow.system.chip.eager
    assert dataflow._collective_sm_fraction == 0.0 and model._collective_sm_fraction == 16 / sms


def test_the_last_bucket_holds_the_whole_word_embedding():
    """Megatron-Core never splits a parameter across gradient buckets, so the bucket the backward
    ends with holds the whole vocabulary-parallel word embedding (V h / tp elements) however
    small the bucket size: with a long backward hiding everything else, that bucket's
    reduce-scatter + all-gather is exposed (the default 64M-element bucket would expose under
    1/4 of it here). Fails when the sync's tail is the bucket size alone."""
    from dfmodel.inter_chip import pipeline as pipe
    from dfmodel.inter_chip.config import Mapping

    w = copy.deepcopy(SMALL_LLM)
    w["model"]["vocab_size"] = 4 * 65536  # 256 Mi elements of embedding at hidden 1024, tp 1
    model = LLMModel(load_workload(w), load_system(small_system(4, 64)))
    dp, group = 64, (("ib", 64),)
    emb = model.model.vocab_size * model.model.hidden
    bucket = pipe.megatron_bucket_elements(dp)
    assert emb > 4 * bucket
    params = 2 * emb
    t = model.training
    m = Mapping(tp=1, pp=1, dp=dp, micro_batch=1, num_micro_batches=1, zero_stage=1)
    got = model._dp_sync_s(m, params, 1e3, 1e3, group)
    frac = model._collective_sm_fraction
    # the sync runs in k buckets (k latency sets); the tail is the embedding's share of it
    k = -(-params // bucket)
    bucketed_s = k * (model.costs.time_s("reduce_scatter", params / k * t.grad_bytes, group)
                      + model.costs.time_s("all_gather", params / k * t.activation_bytes, group))
    tail_s = bucketed_s * emb / params
    assert got == pytest.approx(tail_s + frac * (bucketed_s - tail_s), rel=1e-9)
    assert tail_s > 3.9 * bucketed_s * bucket / params


def test_the_parameter_all_gather_hides_under_the_next_forward_not_the_backward():
    """With the distributed optimizer the gradients' reduce-scatter drains under the last
    backward, while the updated parameters' all-gather runs under the next step's forward
    (Megatron-Core's forward pre-hooks, core_r0.8.0 distrib_optimizer.py): a long backward
    with no forward to hide behind leaves the all-gather exposed whole, and a long forward with
    no backward the reduce-scatter. Fails when both share the backward's window."""
    from dfmodel.inter_chip import pipeline as pipe
    from dfmodel.inter_chip.config import Mapping

    model = _model()
    dp, group = 64, (("ib", 64),)
    bucket = pipe.megatron_bucket_elements(dp)
    params = 3.5 * bucket
    t = model.training
    rs = 4 * model.costs.time_s("reduce_scatter", params / 4 * t.grad_bytes, group)
    ag = 4 * model.costs.time_s("all_gather", params / 4 * t.activation_bytes, group)
    m = Mapping(tp=1, pp=1, dp=dp, micro_batch=1, num_micro_batches=1, zero_stage=1)
    f = model._collective_sm_fraction
    tail = bucket / params  # the last (first) bucket's share, exposed after (before) its pass
    no_forward = model._dp_sync_s(m, params, 0.0, 1e3, group)
    assert no_forward == pytest.approx(ag + rs * tail + f * rs * (1 - tail), rel=1e-9)
    no_backward = model._dp_sync_s(m, params, 1e3, 0.0, group)
    assert no_backward == pytest.approx(rs + ag * tail + f * ag * (1 - tail), rel=1e-9)
