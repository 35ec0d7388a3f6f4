"""LLM graphs against closed forms: FLOP, parameters, and the structure of the layer DAG."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.graph.build import build_graph, build_graphs
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.workload import load_workload

FWD, BWD, WG = Phase.forward, Phase.backward, Phase.weight_grad


def llm(h=64, a=4, s=32, layers=2, kv=None, ffn=None, ffn_type="gelu", vocab=0, tie=True, pos="learned",
        batch=2, precision="bf16"):
    model = {"hidden": h, "num_heads": a, "num_layers": layers, "seq_len": s, "vocab_size": vocab,
             "ffn_type": ffn_type, "tie_embeddings": tie, "position_embedding": pos}
    if kv is not None:
        model["num_kv_heads"] = kv
    if ffn is not None:
        model["ffn_hidden"] = ffn
    return load_workload({"kind": "llm", "name": "t", "model": model,
                          "training": {"global_batch": batch, "precision": precision}})


# -- closed forms (written out here, independently of the builder) ------------------------------------


def gpt_forward_matmul_flop(b, s, h):
    """Narayanan et al. SC'21 eq. (2) without the logit layer, per layer."""
    return 24 * b * s * h**2 + 4 * b * s**2 * h


def forward_matmul_flop(b, s, h, a, kv, f, swiglu):
    d = h // a
    f_in = 2 * f if swiglu else f
    return 2 * b * s * h * (a + 2 * kv) * d + 4 * b * s * s * h + 2 * b * s * h * h + 2 * b * s * h * f_in + 2 * b * s * f * h


def layer_params(h, a, kv, f, swiglu):
    """Biases on every linear layer, two layernorms (gain + bias)."""
    d = h // a
    f_in = 2 * f if swiglu else f
    return (h + 1) * (a + 2 * kv) * d + (h + 1) * h + (h + 1) * f_in + (f + 1) * h + 4 * h


def test_gpt_layer_flop_closed_form():
    b, s, h = 3, 128, 256
    g = build_graph(llm(h=h, a=8, s=s), batch=b)
    assert g.matmul_flop(FWD) == gpt_forward_matmul_flop(b, s, h)
    assert g.matmul_flop(BWD) + g.matmul_flop(WG) == 2 * g.matmul_flop(FWD)
    # data gradients: the linears once, attention twice (two products per matmul, no weights);
    # weight gradients: the linears once
    assert g.matmul_flop(BWD) == 24 * b * s * h**2 + 8 * b * s**2 * h
    assert g.matmul_flop(WG) == 24 * b * s * h**2


def test_gpt_layer_params_closed_form():
    h = 256
    g = build_graph(llm(h=h, a=8))
    assert g.params() == 12 * h**2 + 13 * h
    assert g.weight_bytes() == g.params() * 2  # bf16, forward kernels own the weights


@pytest.mark.parametrize("kv,ffn,ffn_type", [(2, None, "gelu"), (1, 96, "swiglu"), (8, 160, "swiglu")])
def test_gqa_swiglu_flop_and_params(kv, ffn, ffn_type):
    h, a, s, b = 128, 8, 16, 2
    f = ffn or 4 * h
    g = build_graph(llm(h=h, a=a, s=s, kv=kv, ffn=ffn, ffn_type=ffn_type), batch=b)
    sw = ffn_type == "swiglu"
    assert g.matmul_flop(FWD) == forward_matmul_flop(b, s, h, a, kv, f, sw)
    assert g.matmul_flop(BWD) + g.matmul_flop(WG) == 2 * g.matmul_flop(FWD)
    assert g.params() == layer_params(h, a, kv, f, sw)
    assert g.kernel("fwd.qkv").dims["n"] == (a + 2 * kv) * (h // a)
    assert g.kernel("fwd.fc1").dims["n"] == (2 * f if sw else f)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 8), s=st.integers(1, 256), a=st.integers(1, 16), d=st.integers(1, 64))
def test_flop_identity_property(b, s, a, d):
    h = a * d
    g = build_graph(llm(h=h, a=a, s=s), batch=b)
    assert g.matmul_flop(FWD) == gpt_forward_matmul_flop(b, s, h)
    assert g.matmul_flop(BWD) + g.matmul_flop(WG) == 2 * g.matmul_flop(FWD)
    assert g.params() == 12 * h**2 + 13 * h


def test_embedding_and_head_params():
    h, s, V = 64, 32, 1000
    tied = build_graphs(llm(h=h, s=s, vocab=V), batch=1)
    assert tied.embedding.params() == V * h + s * h  # token + learned positions
    assert tied.head.params() == 2 * h  # final layernorm; LM head tied to the embedding
    untied = build_graphs(llm(h=h, s=s, vocab=V, tie=False, pos="rotary"), batch=1)
    assert untied.embedding.params() == V * h
    assert untied.head.params() == 2 * h + V * h
    # tied or not, the head reads the table and computes its gradient
    assert tied.head.kernel("fwd.lm_head").weight_bytes == V * h * 2
    # accumulated into the fp32 main gradient (Megatron-LM bf16 default)
    assert tied.head.kernel("wgrad.lm_head").output_bytes == V * h * 4
    assert tied.head.matmul_flop(FWD) == 2 * s * V * h  # 2 T V h, T = s tokens (batch 1)
    # the embedding table is not streamed: only gathered rows (token + position) are read
    emb = tied.embedding.kernel("fwd.embed")
    assert emb.weight_bytes == 0 and emb.extra_memory_bytes == 2 * s * h * 2
    none = build_graphs(llm(vocab=0))
    assert none.embedding is None and none.head is None


def test_gpt3_175b_total_params():
    gs = build_graphs("gpt3_175b", batch=1)
    h, L, V, s = 12288, 96, 51200, 2048
    closed = L * (12 * h**2 + 13 * h) + V * h + s * h + 2 * h
    assert gs.params() == closed
    assert gs.params() == pytest.approx(174.6e9, rel=0.005)


def test_llama3_70b_total_params():
    gs = build_graphs("llama3_70b", batch=1)
    h, a, kv, f, L, V = 8192, 64, 8, 28672, 80, 128256
    closed = L * layer_params(h, a, kv, f, True) + 2 * V * h + 2 * h  # untied, rotary
    assert gs.params() == closed
    assert gs.params() == pytest.approx(70.6e9, rel=0.01)


def test_iteration_flop_sums_layers_embedding_head():
    gs = build_graphs("gpt3_13b", batch=4)
    assert gs.total_flop() == pytest.approx(
        40 * gs.layer.total_flop() + gs.embedding.total_flop() + gs.head.total_flop(), rel=1e-12)
    # the familiar 6 x params x tokens rule holds to within the attention and vector terms
    tokens = 4 * 2048
    assert gs.matmul_flop() == pytest.approx(6 * gs.params() * tokens, rel=0.15)


# -- structure ----------------------------------------------------------------------------------------


def test_layer_inputs_outputs_and_names():
    g = build_graph(llm())
    assert {t.name for t in g.inputs()} == {"x", "dy"}
    outs = {t.name for t in g.outputs()}
    assert {"y", "dx", "dW.qkv", "dW.out_proj", "dW.fc1", "dW.fc2", "dW.ln1", "dW.ln2"} == outs
    names = [k.name for k in g.kernels]
    assert len(names) == len(set(names)) == 30
    for k in g.kernels:
        prefix = {FWD: "fwd.", BWD: "bwd.", WG: "wgrad."}[k.phase]
        assert k.name.startswith(prefix)
        assert k.group in ("attention", "mlp", "norm")
        if k.kind == KernelKind.matmul:
            assert k.flop == 2 * k.dims.get("b", 1) * k.dims["m"] * k.dims["n"] * k.dims["k"]
        assert k.params == 0 or k.phase == FWD


def test_weight_gradient_outputs_total_weight_bytes():
    g = build_graph(llm(kv=2, ffn_type="swiglu"))
    dw = sum(t.bytes for t in g.outputs() if t.name.startswith("dW."))
    # bf16 training keeps fp32 main gradients (Megatron-LM accumulate_allreduce_grads_in_fp32)
    assert dw == g.params() * 4
    for name in ("qkv", "out_proj", "fc1", "fc2"):
        fwd, bwd, wg = g.kernel(f"fwd.{name}"), g.kernel(f"bwd.{name}"), g.kernel(f"wgrad.{name}")
        assert fwd.weight_bytes == bwd.weight_bytes == fwd.params * 2
        assert wg.weight_bytes == wg.output_bytes == fwd.params * 4
        assert bwd.flop == wg.flop == fwd.flop


def test_backward_reads_saved_activations():
    g = build_graph(llm())
    edges = {(t.producer, t.consumer) for t in g.internal_tensors()}
    saved = [("fwd.ln1", "wgrad.qkv"), ("fwd.qkv", "bwd.attn_score.dq"), ("fwd.qkv", "bwd.attn_score.dk"),
             ("fwd.qkv", "bwd.attn_v.dp"), ("fwd.softmax", "bwd.softmax"), ("fwd.softmax", "bwd.attn_v.dv"),
             ("fwd.attn_v", "wgrad.out_proj"), ("fwd.residual1", "bwd.ln2"), ("fwd.ln2", "wgrad.fc1"),
             ("fwd.fc1", "bwd.act"), ("fwd.act", "wgrad.fc2")]
    for e in saved:
        assert e in edges, e
    # gradients flow backwards through the whole layer: dy reaches dx
    assert nx.has_path(g.nx, "bwd.residual2", "bwd.ln1")
    # every weight-gradient kernel reads an activation (forward) and a gradient (backward)
    for k in g.kernels:
        if k.phase == WG:
            preds = [g.kernel(u).phase for u in g.nx.predecessors(k.name)]
            assert FWD in preds and BWD in preds, k.name
    # the backward of each forward kernel exists (attention matmuls have two)
    for k in g.kernels:
        if k.phase == FWD:
            base = k.name.removeprefix("fwd.")
            assert any(x.name in (f"bwd.{base}", f"bwd.{base}.dq", f"bwd.{base}.dp") for x in g.kernels), base


def test_tensor_bytes_are_elements_times_precision():
    b, s, h, a = 2, 16, 64, 4
    # FP8 training (Transformer Engine) stores and exchanges activations in 16 bit
    for prec, p in (("fp32", 4), ("bf16", 2), ("fp8", 2)):
        g = build_graph(llm(h=h, a=a, s=s, precision=prec), batch=b)
        x = next(t for t in g.inputs() if t.name == "x")
        assert x.bytes == b * s * h * p and x.shape == (b, s, h)
        scores = next(t for t in g.tensors if t.name == "scores")
        assert scores.bytes == b * a * s * s * p
        assert g.kernel("fwd.attn_score").dims == {"b": b * a, "m": s, "n": s, "k": h // a}


def test_batch_defaults_to_global_batch_and_meta():
    w = llm(batch=6)
    g = build_graph(w)
    assert g.meta["batch"] == 6 and g.meta["family"] == "llm" and g.meta["tokens"] == 6 * 32
    assert build_graph(w, batch=1).total_flop() * 6 == pytest.approx(g.total_flop(), rel=1e-12)
