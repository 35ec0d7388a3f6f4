"""Memory per chip: Korthikanti et al. 2022 Table 2 exactly, its generalisation, model state, bounds."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.inter_chip.memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    embedding_activation_bytes,
    head_activation_bytes,
    in_flight_micro_batches,
    memory_lower_bound_bytes,
    memory_per_chip,
    model_state_bytes,
)
from dfmodel.inter_chip.pipeline import peak_in_flight, simulate_1f1b

# ------------------------------------------------------------------ Table 2, exactly

SHAPES = [  # (s, b, h, a): GPT-3 175B, a 22B-like, and a small odd one
    (2048, 1, 12288, 96),
    (2048, 4, 6144, 64),
    (1024, 2, 1536, 16),
]


def table2(s, b, h, a, t, sp, recompute):
    """Korthikanti et al. 2022, Table 2 (bytes per layer per chip), typed in verbatim."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if not sp and recompute == "none":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if not sp and recompute == "selective":
        return s * b * h * (10 + 24 / t)
    if sp and recompute == "none":
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * 34 / t  # sp, selective


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_reproduces_korthikanti_table2(shape, t, sp, recompute):
    s, b, h, a = shape
    got = activation_bytes_per_layer(
        seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t, sequence_parallel=sp, recompute=recompute
    )
    assert got == pytest.approx(table2(s, b, h, a, t, sp, recompute), rel=1e-12)


def test_explicit_gpt_defaults_are_the_defaults():
    kw = dict(seq_len=2048, micro_batch=1, hidden=4096, num_heads=32, tp=4, sequence_parallel=False,
              recompute="none")
    assert activation_bytes_per_layer(**kw) == activation_bytes_per_layer(
        **kw, ffn_hidden=4 * 4096, num_kv_heads=32, bytes_per_element=2, dropout=True, gated_mlp=False
    )


def test_design_md_no_tp_formula():
    # DESIGN.md: s*b*h*(34 + 5*a*s/h) without recompute (t = 1)
    s, b, h, a = 2048, 1, 12288, 96
    got = activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=1,
                                      sequence_parallel=False, recompute="none")
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h))


# ------------------------------------------------------------------ generalisation, term by term


def test_llama_like_gqa_swiglu_no_dropout_by_hand():
    s, b, h, a, kv, f, t, e = 4096, 1, 4096, 32, 8, 11008, 4, 2
    d = h // a
    sbh = s * b * h
    replicated = 4 * e * sbh / t  # LN1 in, QKV in, LN2 in, FC1 in (SP), no masks
    q = e * sbh / t
    kvb = 2 * e * s * b * d * (kv // t)
    out = e * sbh / t
    act_in = 2 * e * s * b * f / t  # gate and up
    fc2_in = e * s * b * f / t
    sel = replicated + q + kvb + out + act_in + fc2_in
    kw = dict(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t, sequence_parallel=True,
              ffn_hidden=f, num_kv_heads=kv, dropout=False, gated_mlp=True)
    assert activation_bytes_per_layer(**kw, recompute="selective") == pytest.approx(sel)
    # without dropout only the softmax output (e bytes per score) is kept
    assert activation_bytes_per_layer(**kw, recompute="none") == pytest.approx(sel + e * a * s * s * b / t)


def test_gqa_shrinks_k_and_v_only():
    s, b, h, a, t = 1024, 1, 2048, 16, 2
    base = dict(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t, sequence_parallel=True,
                recompute="selective")
    mha = activation_bytes_per_layer(**base)
    gqa = activation_bytes_per_layer(**base, num_kv_heads=4)
    # K and V go from 2 * 2sbh/t to 2 * 2 s b (h/a) (4/t)
    assert mha - gqa == pytest.approx(2 * 2 * s * b * (h / a) * (a - 4) / t)


def test_mqa_keeps_one_kv_head_per_chip():
    kw = dict(seq_len=1024, micro_batch=1, hidden=2048, num_heads=16, sequence_parallel=True,
              recompute="selective", num_kv_heads=1)
    # with kv < t each chip keeps one KV head: the K/V term does not shrink past t = kv
    k8 = activation_bytes_per_layer(**kw, tp=8)
    k16 = activation_bytes_per_layer(**kw, tp=16)
    kv_term = 2 * 2 * 1024 * 1 * (2048 / 16)
    assert k8 - kv_term == pytest.approx(2 * (k16 - kv_term))


def test_ffn_hidden_and_element_size_scale_their_terms():
    s, b, h, a, t = 512, 2, 1024, 8, 2
    kw = dict(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t, sequence_parallel=False,
              recompute="selective")
    f4 = activation_bytes_per_layer(**kw)
    f8 = activation_bytes_per_layer(**kw, ffn_hidden=8 * h)
    assert f8 - f4 == pytest.approx(2 * 2 * s * b * 4 * h / t)  # two f-sized tensors, 2 bytes
    # fp8 activations: every non-mask term halves, the 1-byte masks (2 sbh) stay
    e1 = activation_bytes_per_layer(**kw, bytes_per_element=1)
    assert e1 == pytest.approx((f4 - 2 * s * b * h) / 2 + 2 * s * b * h)


@given(
    s=st.sampled_from([128, 1024, 4096]), b=st.integers(1, 8), h=st.sampled_from([512, 4096, 8192]),
    a=st.sampled_from([8, 32, 64]), t=st.sampled_from([1, 2, 4, 8]), dropout=st.booleans(),
    gated=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_recompute_and_sp_only_reduce_memory(s, b, h, a, t, dropout, gated):
    def m(sp, rc):
        return activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t,
                                          sequence_parallel=sp, recompute=rc, dropout=dropout,
                                          gated_mlp=gated)

    for sp in (False, True):
        assert m(sp, "none") >= m(sp, "selective") >= m(sp, "full") > 0
    for rc in ("none", "selective", "full"):
        assert m(True, rc) <= m(False, rc)
        if t == 1:
            assert m(True, rc) == m(False, rc)


def test_bad_recompute_rejected():
    with pytest.raises(ValueError):
        activation_bytes_per_layer(seq_len=1, micro_batch=1, hidden=1, num_heads=1, tp=1,
                                   sequence_parallel=False, recompute="some")


def test_embedding_and_head_sec_4_3():
    s, b, h, v, t = 2048, 1, 12288, 51200, 8
    assert embedding_activation_bytes(seq_len=s, micro_batch=b, hidden=h, tp=t,
                                      sequence_parallel=True) == s * b * h / t
    assert embedding_activation_bytes(seq_len=s, micro_batch=b, hidden=h, tp=t,
                                      sequence_parallel=False) == s * b * h
    assert embedding_activation_bytes(seq_len=s, micro_batch=b, hidden=h, tp=t, sequence_parallel=True,
                                      dropout=False) == 0
    assert head_activation_bytes(seq_len=s, micro_batch=b, hidden=h, vocab=v, tp=t,
                                 sequence_parallel=True) == pytest.approx(4 * s * b * h / t * (1 + v / h))
    assert head_activation_bytes(seq_len=s, micro_batch=b, hidden=h, vocab=v, tp=t,
                                 sequence_parallel=False) == pytest.approx(4 * s * b * h + 4 * s * b * v / t)


# ------------------------------------------------------------------ micro-batches in flight


def test_in_flight_plain_1f1b():
    assert [in_flight_micro_batches(4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight_micro_batches(4, i, 2) for i in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_in_flight_first_stage_is_korthikanti_factor(pp, v):
    m = 4 * pp * v  # enough micro-batches to reach the steady state
    assert in_flight_micro_batches(pp, 0, m, v) == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_in_flight_matches_simulated_peak_and_interleaving_never_lowers_it(pp, v, mult):
    if v > 1 and pp < 2:
        return
    for m in ({pp * mult, pp * mult + 1, max(1, pp - 1)} if v == 1 else {pp * mult}):
        ev = simulate_1f1b([1.0] * pp, [2.0] * pp, m, v)
        for i in range(pp):
            assert in_flight_micro_batches(pp, i, m, v) == pytest.approx(peak_in_flight(ev, i, v))
            assert in_flight_micro_batches(pp, i, m, v) >= in_flight_micro_batches(pp, i, m, 1)


def test_in_flight_bad_stage():
    with pytest.raises(ValueError):
        in_flight_micro_batches(4, 4, 8)


# ------------------------------------------------------------------ model state and breakdown


def test_sixteen_bytes_per_param_and_distributed_optimizer():
    ms = model_state_bytes(1e9, dp=64, distributed_optimizer=False)
    assert (ms.weights_bytes, ms.gradients_bytes, ms.optimizer_bytes) == (2e9, 2e9, 12e9)
    assert ms.total_bytes == 16e9
    ds = model_state_bytes(1e9, dp=64, distributed_optimizer=True)
    assert ds.total_bytes == pytest.approx((4 + 12 / 64) * 1e9)
    # dp = 1: sharding is a no-op
    assert model_state_bytes(1e9, dp=1, distributed_optimizer=True) == model_state_bytes(
        1e9, dp=1, distributed_optimizer=False)


def test_zero_paper_figure1_example():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B params, N_d = 64: baseline 120 GB, P_os 31.4 GB
    assert model_state_bytes(7.5e9, dp=64, distributed_optimizer=False).total_bytes / 1e9 == 120
    assert model_state_bytes(7.5e9, dp=64, distributed_optimizer=True).total_bytes / 1e9 == pytest.approx(
        31.4, abs=0.01)


def test_megatron_bf16_fp32_grads_18_bytes():
    assert model_state_bytes(1.0, dp=8, distributed_optimizer=False, bytes_per_param_grads=4).total_bytes == 18
    assert model_state_bytes(1.0, dp=8, distributed_optimizer=True,
                             bytes_per_param_grads=4).total_bytes == pytest.approx(6 + 12 / 8)


def test_breakdown_dict_keys_and_fit():
    m = MemoryBreakdown(1.0, 2.0, 3.0, 4.0, capacity_bytes=10.0)
    d = m.to_dict()
    assert list(d) == ["weights", "gradients", "optimizer", "activations", "total", "capacity", "reserve"]
    assert d["total"] == 10.0 and m.fits and m.shortfall_bytes == 0
    json.dumps(d)
    tight = MemoryBreakdown(1.0, 2.0, 3.0, 4.5, capacity_bytes=10.0)
    assert not tight.fits and tight.shortfall_bytes == pytest.approx(0.5)
    assert "short" in tight.summary() and "short" not in m.summary()


def test_memory_per_chip_assembles_terms():
    act = activation_bytes_per_layer(seq_len=2048, micro_batch=1, hidden=12288, num_heads=96, tp=8,
                                     sequence_parallel=True, recompute="selective")
    emb = embedding_activation_bytes(seq_len=2048, micro_batch=1, hidden=12288, tp=8, sequence_parallel=True)
    m = memory_per_chip(params_per_chip=2e9, dp=8, distributed_optimizer=True, activation_bytes_per_layer=act,
                        layers_on_chip=12, in_flight_micro_batches=8, capacity_bytes=80 * 2**30,
                        extra_params=1e8, extra_activation_bytes_per_micro_batch=emb,
                        working_activation_bytes=123.0)
    assert m.weights_bytes == 2 * 2.1e9
    assert m.gradients_bytes == 2 * 2.1e9
    assert m.optimizer_bytes == pytest.approx(12 * 2.1e9 / 8)
    assert m.activations_bytes == pytest.approx((act * 12 + emb) * 8 + 123.0)
    assert m.total_bytes == pytest.approx(sum(m.to_dict()[k] for k in
                                              ("weights", "gradients", "optimizer", "activations")))


def test_gpt3_175b_first_stage_korthikanti_setting():
    # GPT-3 175B, t=8, p=8 (Korthikanti Table 3 setting: 96 layers, 12 per stage, b=1), SP + selective:
    # first stage holds p micro-batches of 12 layers: 34 sbh/t * 12 * 8 bytes ~ 9.6 GiB
    s, b, h, a, t, p = 2048, 1, 12288, 96, 8, 8
    act = activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t,
                                     sequence_parallel=True, recompute="selective")
    total = act * 12 * in_flight_micro_batches(p, 0, 64)
    assert total == pytest.approx(34 * s * b * h / t * 12 * 8)
    assert 9.5 * 2**30 < total < 9.6 * 2**30


# ------------------------------------------------------------------ lower bound for pruning


@given(
    L=st.integers(1, 24), pp=st.integers(1, 6), tp=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([1, 2, 8]),
    m=st.integers(1, 16), b=st.integers(1, 4), v=st.sampled_from([1, 2]), data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_lower_bound_below_every_mapping(L, pp, tp, dp, m, b, v, data):
    pp = min(pp, L)
    if v > 1 and (pp < 2 or m % pp):
        v = 1
    s, h, a = 256, 512, 8
    params_per_layer = 12 * h * h
    # any split of layers into pp stages (each >= 1)
    cuts = sorted(data.draw(st.lists(st.integers(1, L - 1), min_size=pp - 1, max_size=pp - 1, unique=True))) \
        if pp > 1 else []
    bounds = [0, *cuts, L]
    layers = [bounds[i + 1] - bounds[i] for i in range(pp)]
    sp = data.draw(st.booleans())
    rc = data.draw(st.sampled_from(["none", "selective", "full"]))
    dist = data.draw(st.booleans())
    act = activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=tp,
                                     sequence_parallel=sp, recompute=rc)
    worst = max(
        memory_per_chip(params_per_chip=layers[i] * params_per_layer / tp, dp=dp, distributed_optimizer=dist,
                        activation_bytes_per_layer=act, layers_on_chip=layers[i],
                        in_flight_micro_batches=in_flight_micro_batches(pp, i, m, v),
                        capacity_bytes=1.0).total_bytes
        for i in range(pp)
    )
    lb = memory_lower_bound_bytes(num_layers=L, params_per_layer=params_per_layer, seq_len=s, micro_batch=b,
                                  hidden=h, tp=tp, pp=pp, dp=dp, num_micro_batches=m)
    assert lb <= worst * (1 + 1e-12)


def test_lower_bound_is_attained_by_one_stage_full_recompute():
    L, s, b, h, tp, dp = 4, 512, 2, 1024, 2, 4
    ppl = 12 * h * h
    lb = memory_lower_bound_bytes(num_layers=L, params_per_layer=ppl, seq_len=s, micro_batch=b, hidden=h, tp=tp,
                                  pp=1, dp=dp, num_micro_batches=8)
    act = activation_bytes_per_layer(seq_len=s, micro_batch=b, hidden=h, num_heads=8, tp=tp,
                                     sequence_parallel=True, recompute="full")
    m = memory_per_chip(params_per_chip=L * ppl / tp, dp=dp, distributed_optimizer=True,
                        activation_bytes_per_layer=act, layers_on_chip=L, in_flight_micro_batches=1,
                        capacity_bytes=0.0)
    assert lb == pytest.approx(m.total_bytes)
    assert math.isfinite(lb)
