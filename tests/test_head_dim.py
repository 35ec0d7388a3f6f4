"""A head width of the model's own (``model.head_dim``, Megatron-Core ``kv_channels``): Qwen3's
128-wide heads at hidden 2048 / 32 heads, GPT-OSS's 64 at hidden 2880 / 64 heads. Q and the
attention output are ``a d`` wide, K and V ``kv d``; the QKV and output projections, the attention
FLOP and the saved activations follow."""

from __future__ import annotations

import pytest

from dfmodel import load_workload, optimize
from dfmodel.errors import InputError
from dfmodel.graph.builders.llm import build_llm_layer
from dfmodel.graph.kernel import Phase
from dfmodel.inter_chip.memory import activation_bytes_per_layer


def _w(head_dim=None, *, h=2048, a=32, kv=4, s=1024, mla=None):
    model = {"hidden": h, "num_heads": a, "num_kv_heads": kv, "num_layers": 4, "seq_len": s,
             "vocab_size": 4096, "ffn_type": "swiglu", "ffn_hidden": 4096, "attention": "flash"}
    if head_dim is not None:
        model["head_dim"] = head_dim
    if mla is not None:
        model["mla"] = mla
    return load_workload({"kind": "llm", "name": "t", "model": model, "training": {"global_batch": 8}})


def _kernel(g, name):
    return next(k for k in g.kernels if k.name == name)


def test_head_dim_of_hidden_over_heads_changes_nothing():
    a, b = build_llm_layer(_w(), 2), build_llm_layer(_w(64), 2)
    assert a.params() == b.params()
    assert a.matmul_flop(Phase.forward) == b.matmul_flop(Phase.forward)
    assert sum(t.bytes for t in a.tensors) == sum(t.bytes for t in b.tensors)


def test_wider_heads_size_the_projections_and_the_attention():
    h, a, kv, s, d = 2048, 32, 4, 1024, 128  # Qwen3-30B-A3B's attention: a d = 4096 = 2h
    base, wide = build_llm_layer(_w(), 1), build_llm_layer(_w(d), 1)
    # QKV: h x (a + 2 kv) d and its bias; out_proj: a d x h; one layer's params grow by exactly those
    grow = (h + 1) * (a + 2 * kv) * (d - h // a) + a * (d - h // a) * h
    assert wide.params() - base.params() == grow
    assert _kernel(wide, "fwd.qkv").dims["n"] == (a + 2 * kv) * d
    assert _kernel(wide, "fwd.out_proj").dims["k"] == a * d
    # attention's FLOP (QK^T and PV) are linear in the head width: twice the default's
    fa_w, fa_b = _kernel(wide, "fwd.flash_attn").flop, _kernel(base, "fwd.flash_attn").flop
    assert fa_w == pytest.approx(2 * fa_b)
    q = next(t for t in wide.tensors if t.name == "q")
    assert q.bytes == s * a * d * 2


def test_saved_activations_follow_the_head_width():
    s, b, h, a, kv, t, e = 1024, 2, 2048, 32, 4, 4, 2
    kw = dict(seq_len=s, micro_batch=b, hidden=h, num_heads=a, tp=t, sequence_parallel=True,
              recompute="none", num_kv_heads=kv, ffn_hidden=4096, gated_mlp=True, attention="flash", dropout=False)
    base = activation_bytes_per_layer(**kw)
    assert activation_bytes_per_layer(head_dim=h / a, **kw) == base
    d = 128
    # Q and the attention output grow from s b h to s b a d (per chip / t); K and V from kv h/a to kv d
    extra = (2 * e * s * b * (a * d - h) + 2 * e * s * b * (d - h / a) * kv) / t
    assert activation_bytes_per_layer(head_dim=d, **kw) - base == pytest.approx(extra)


def test_heads_need_not_divide_hidden_with_a_head_dim():
    w = _w(64, h=2000, a=64, kv=8)  # 64 heads of 64 over a hidden size they do not divide
    assert w.model.head_width == 64 and w.model.attention_dim == 4096
    assert build_llm_layer(w, 1).params() > 0
    with pytest.raises(InputError, match="model.num_heads: must divide model.hidden .2000. unless model.head_dim"):
        _w(None, h=2000, a=64, kv=8)
    with pytest.raises(InputError, match="MLA sets its own head widths"):
        _w(128, a=32, kv=32, mla={})


def test_a_wider_headed_model_searches_and_runs_slower():
    narrow = optimize(_w(), "dgx_h100", num_chips=8)
    wide = optimize(_w(128), "dgx_h100", num_chips=8)
    assert wide.solver.status == narrow.solver.status == "optimal"
    assert wide.iteration_time_s > narrow.iteration_time_s


def _qwen3_like(qk_norm: bool):
    model = {"hidden": 2048, "head_dim": 128, "num_heads": 32, "num_kv_heads": 4, "num_layers": 4, "seq_len": 4096,
             "vocab_size": 4096, "ffn_type": "swiglu", "ffn_hidden": 6144, "qk_norm": qk_norm, "dropout": False}
    return load_workload({"kind": "llm", "name": "q", "model": model, "training": {"global_batch": 16}})


def test_qk_norm_costs_its_passes_over_q_and_k_on_gpus():
    from dfmodel.inter_chip.llm import QK_NORM_KERNELS
    from dfmodel.system.loader import load_system
    from dfmodel.system.processor import memory_time_s

    system = load_system("dgx_h100", num_chips=8)
    knobs = dict(tp=1, pp=1, dp=8, micro_batch=1, recompute="none", sequence_parallel=False, interleave=1)
    off = optimize(_qwen3_like(False), "dgx_h100", num_chips=8, **knobs)
    on = optimize(_qwen3_like(True), "dgx_h100", num_chips=8, **knobs)
    # per layer and micro-batch: forward 2 passes, backward 3 over the rank's Q and K (4096 tokens x
    # (32 + 4) heads x 128), bf16, plus 2 x (1 + 2) launches; 4 layers, 2 micro-batches a rank
    elements = 4096 * (32 + 4) * 128
    chip = system.chip
    per_layer = memory_time_s(chip, 5 * elements * 2) + 2 * sum(QK_NORM_KERNELS) * chip.efficiency.kernel_overhead_s
    assert on.iteration_time_s - off.iteration_time_s == pytest.approx(4 * 2 * per_layer, rel=0.02)
    # the un-normed Q and K are saved for the norms' backward
    grow = on.memory_per_chip_bytes["activations"] - off.memory_per_chip_bytes["activations"]
    assert grow == pytest.approx(4 * elements * 2, rel=0.01)
    # a dataflow chip's compiler fuses the norms into their neighbours: no kernels of their own
    from dfmodel.inter_chip.llm import _qk_norm_s
    assert _qk_norm_s(None, load_system("sn30").chip, 2.0) == (0.0, 0.0)
