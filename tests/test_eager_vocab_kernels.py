"""Megatron-Core's eager vocabulary, loss and activation kernels on GPUs (issue 11, session 12 F7):
the unfused VocabParallelCrossEntropy's fp32 passes, squared ReLU as relu + pow, and the dense
embedding gradient of every micro-batch. Byte counts are written out by hand from the source
lines each docstring in dfmodel/graph/builders/llm.py cites."""

from __future__ import annotations

import pytest

from dfmodel import load_workload
from dfmodel.graph.builders.llm import build_llm_embedding, build_llm_head, build_llm_layer
from dfmodel.graph.workload import resolve_fusion
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.system.processor import memory_time_s

from tests.test_fidelity import gpu


def _w(*, ffn_type="gelu", precision="bf16", ce=None, act=None, emb=None, h=256, s=512, vocab=1024):
    training = {"global_batch": 8, "precision": precision, "cross_entropy": ce,
                "activation_fusion": act, "embedding_dense_grad": emb}
    model = {"hidden": h, "num_heads": 8, "num_layers": 4, "seq_len": s, "vocab_size": vocab, "ffn_type": ffn_type}
    return load_workload({"kind": "llm", "name": "t", "model": model, "training": training})


def _extra(g, name):
    return next(k.extra_memory_bytes for k in g.kernels if k.name == name)


@pytest.mark.parametrize("eager,ffn,expect", [
    (True, "gelu", ("unfused", True, True)),
    (True, "swiglu", ("unfused", True, True)),
    (True, "squared_relu", ("unfused", False, True)),
    (False, "squared_relu", ("single_pass", True, False)),
])
def test_resolve_fusion_follows_megatron_defaults_on_gpus_and_fuses_on_dataflow(eager, ffn, expect):
    t = resolve_fusion(_w(ffn_type=ffn), eager).training
    assert (t.cross_entropy, t.activation_fusion, t.embedding_dense_grad) == expect


def test_resolve_fusion_keeps_explicit_values():
    t = resolve_fusion(_w(ffn_type="squared_relu", ce="megatron_fused", act=True, emb=False),
                       True).training
    assert (t.cross_entropy, t.activation_fusion, t.embedding_dense_grad) == ("megatron_fused", True, False)


def test_unfused_cross_entropy_bytes_per_logit_bf16():
    # forward: cast 2+4, max 4, sub 4+4, exp 4+4, sum 4, div 4+4 = 38 B per logit; the edge reads 2
    # backward: mul_ 4+4, cast back 4+2 = 14 B; the edges read 2 and write 2
    T, V = 2 * 512, 1024
    fused = build_llm_head(_w(ce="single_pass"), 2)
    eager = build_llm_head(_w(ce="unfused"), 2)
    assert _extra(fused, "fwd.loss") == 0 and _extra(fused, "bwd.loss") == 0
    assert _extra(eager, "fwd.loss") == 36 * T * V
    assert _extra(eager, "bwd.loss") == 10 * T * V


def test_megatron_fused_cross_entropy_bytes_per_logit_bf16():
    # cross_entropy_loss_fusion: four compiled passes. Forward: read 2 + write 4 (fp32 copy, max),
    # 4 + 4 (sub, exp, sum in place), 4 + 4 (divide) = 22 B (the edge reads 2); backward: read 4,
    # write back 4, write the bf16 gradient 2 = 10 B (the edges 4)
    T, V = 2 * 512, 1024
    g = build_llm_head(_w(ce="megatron_fused"), 2)
    assert _extra(g, "fwd.loss") == 20 * T * V and _extra(g, "bwd.loss") == 6 * T * V


def test_te_fused_cross_entropy_bytes_per_logit_bf16():
    # cross_entropy_fusion_impl te (TE's Triton kernels): forward online softmax reads 2, the loss
    # kernel reads 2 and writes the gradient in place 2 = 6 B (the edge reads 2); backward the
    # element-wise scale reads and writes it, 2 + 2 = 4 B (the edges 4): below Megatron's own fused
    # form, above one pass each way
    T, V = 2 * 512, 1024
    g = build_llm_head(_w(ce="te"), 2)
    assert _extra(g, "fwd.loss") == 4 * T * V and _extra(g, "bwd.loss") == 0
    nat, one = build_llm_head(_w(ce="megatron_fused"), 2), build_llm_head(_w(ce="single_pass"), 2)
    assert _extra(one, "fwd.loss") < _extra(g, "fwd.loss") < _extra(nat, "fwd.loss")


def test_case_names_the_te_cross_entropy_only_with_the_fusion_on():
    from dfmodel.errors import InputError
    from dfmodel.validate import load_cases, workload_of

    case = """- id: ce
  source: test
  model: {hidden: 1024, num_heads: 8, num_layers: 2, seq_len: 1024, vocab_size: 32000}
  training: {global_batch: 8, %s}
  system: {chip: H100-SXM5-80GB, num_chips: 8}
  parallelism: {tp: 1, pp: 1, dp: 8}
  measured: {iteration_time_s: 1.0}
"""
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "c.yaml"
        for fields, want in (("cross_entropy_loss_fusion: true, cross_entropy_fusion_impl: te", "te"),
                             ("cross_entropy_loss_fusion: true, cross_entropy_fusion_impl: native", "megatron_fused"),
                             ("cross_entropy_loss_fusion: true", "megatron_fused"),
                             ("cross_entropy_loss_fusion: false", "unfused")):
            path.write_text(case % fields)
            assert workload_of(load_cases(path)[0])["training"]["cross_entropy"] == want, fields
        path.write_text(case % "cross_entropy_fusion_impl: te")
        with pytest.raises(InputError, match="cross_entropy_fusion_impl is read only with cross_entropy_loss_fusion"):
            load_cases(path)


def test_unfused_cross_entropy_under_fp8_training_reads_bf16_logits():
    # the output layer is not a TE layer: its logits are bf16 under FP8 training, same 36 / 10
    eager = build_llm_head(_w(ce="unfused", precision="fp8"), 1)
    assert _extra(eager, "fwd.loss") == 36 * 512 * 1024 and _extra(eager, "bwd.loss") == 10 * 512 * 1024


def test_squared_relu_unfused_bytes_per_element():
    # f = 4h = 1024 elements per token. Forward relu 2+2, pow 2+2 = 8 B (fused 4: +4);
    # backward pow(1) copy 2+2, 2x 2+2, grad* 4+2, threshold_backward 4+2 = 20 B (fused 6: +14)
    T, f = 2 * 512, 4 * 256
    g = build_llm_layer(_w(ffn_type="squared_relu", act=False), 2)
    assert _extra(g, "fwd.act") == 4 * T * f
    assert _extra(g, "bwd.act") == 14 * T * f
    fused = build_llm_layer(_w(ffn_type="squared_relu", act=True), 2)
    assert _extra(fused, "fwd.act") == 0 and _extra(fused, "bwd.act") == 0


@pytest.mark.parametrize("ffn", ["gelu", "swiglu"])
def test_fused_activations_add_nothing_even_when_unfused_is_asked(ffn):
    g = build_llm_layer(_w(ffn_type=ffn, act=False), 1)
    assert _extra(g, "fwd.act") == 0 and _extra(g, "bwd.act") == 0


def test_dense_embedding_gradient_bytes_per_micro_batch():
    # zero-fill 2 B + read 2 B + fp32 main-gradient read and write 8 B = 12 B per table element
    V, h = 1024, 256
    for mb in (1, 3):  # table-shaped: the same at any micro-batch
        on, off = build_llm_embedding(_w(emb=True), mb), build_llm_embedding(_w(emb=False), mb)
        wb = {g: {k.name: k.weight_bytes for k in g.kernels} for g in (on, off)}
        assert wb[on]["wgrad.embed"] == 12 * V * h and wb[off]["wgrad.embed"] == 0
        assert wb[on]["fwd.embed"] == wb[off]["fwd.embed"] == 0
        assert _extra(on, "wgrad.embed") == _extra(off, "wgrad.embed")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpu_head_time_grows_by_the_memory_time_of_the_eager_passes(tp):
    """On a GPU the loss kernels are memory-bound: the head's forward grows by exactly the DRAM time
    of 36 B per logit of the chip's vocab/tp slice, the backward by that of 10 B."""
    system = gpu()
    T, V = 1 * 512, 4096
    blocks = {}
    for ce in ("single_pass", "unfused"):
        model = LLMModel(_w(ce=ce, emb=False, vocab=V), system)
        blocks[ce] = model.block("head", 1, tp, (("nvlink", tp),), False) if tp > 1 else model.block("head", 1, 1, (), False)
    fused, eager = blocks["single_pass"], blocks["unfused"]
    chip = system.chip
    assert eager.fwd.time_s - fused.fwd.time_s == pytest.approx(memory_time_s(chip, 36 * T * V / tp), rel=1e-6)
    assert eager.bwd.time_s - fused.bwd.time_s == pytest.approx(memory_time_s(chip, 10 * T * V / tp), rel=1e-6)


def test_dataflow_default_keeps_the_fused_loss():
    w = resolve_fusion(load_workload("gpt3_175b"), False)
    g = build_llm_head(w, 1)
    assert _extra(g, "fwd.loss") == 0 and _extra(g, "bwd.loss") == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpu_embedding_backward_grows_by_the_dense_gradient_of_the_vocab_slice(tp):
    """12 B per element of the chip's vocab/tp x hidden slice, once per micro-batch."""
    system = gpu()
    V, h = 4096, 256
    blocks = {}
    for emb in (True, False):
        model = LLMModel(_w(ce="single_pass", emb=emb, vocab=V, h=h), system)
        blocks[emb] = model.block("embedding", 1, tp, (("nvlink", tp),) if tp > 1 else (), False)
    assert blocks[True].fwd.time_s == pytest.approx(blocks[False].fwd.time_s, rel=1e-12)
    assert blocks[True].bwd.time_s - blocks[False].bwd.time_s == pytest.approx(
        memory_time_s(system.chip, 12 * V * h / tp), rel=1e-6)


@pytest.mark.parametrize("preset,eager", [("dgx_h100", True), ("mi300x", True), ("tpu_v4", False), ("wse2", False)])
def test_compiled_and_dataflow_chips_keep_the_fused_forms(preset, eager):
    """XLA on TPU fuses the loss and activation chains like a dataflow compiler: only eager
    frameworks' chips get Megatron-Core's separate kernels."""
    from dfmodel.presets import resolve
    from dfmodel.system.loader import load_system
    from dfmodel.yamlio import read_yaml

    chip = load_system(read_yaml(resolve(preset, "systems"))).chip
    assert chip.eager is eager
    model = LLMModel(load_workload("gpt3_175b"), load_system(read_yaml(resolve(preset, "systems"))))
    t = model.workload.training
    assert (t.cross_entropy == "unfused", t.embedding_dense_grad) == (eager, eager)
