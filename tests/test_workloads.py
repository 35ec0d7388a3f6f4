"""Workload loading: shipped presets, one-line errors with the user's field path, JSON export."""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import yaml

from dfmodel.errors import InputError
from dfmodel.graph.build import build_graph, build_graphs, summary
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.workload import (
    DLRMWorkload,
    FFTWorkload,
    GraphWorkload,
    HPLWorkload,
    LLMWorkload,
    load_workload,
)
from dfmodel.presets import list_presets, preset_dir

PRESETS = [p.stem for p in list_presets("workloads")]
EXPECTED = {"gpt3_175b", "gpt3_1t", "gpt3_13b", "llama3_70b", "dlrm", "hpl", "fft", "tiny_mlp"}


def test_expected_presets_ship():
    assert EXPECTED <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_builds(name):
    w = load_workload(name)
    assert w.name and w.description
    first = (preset_dir("workloads") / f"{name}.yaml").read_text().splitlines()[0]
    assert first.startswith("#")  # a comment names the source of the hyper-parameters
    small = {"llm": 1, "dlrm": 64}.get(w.kind)  # small batch: same structure, quick
    gs = build_graphs(w, batch=small) if small else build_graphs(w)
    for g, _ in gs.parts():
        assert nx.is_directed_acyclic_graph(g.nx)
        assert all(k.output_bytes > 0 for k in g.kernels)
        assert all(t.bytes > 0 for t in g.tensors)
        assert len({k.name for k in g.kernels}) == len(g.kernels)
        assert g.meta["family"] in ("llm", "dlrm", "hpl", "fft", "graph")
    assert gs.total_flop() > 0


@pytest.mark.parametrize("name", PRESETS)
def test_json_round_trip(name):
    w = load_workload(name)
    g = build_graph(w, batch=1) if w.kind in ("llm", "dlrm") else build_graph(w)
    back = DataflowGraph.from_dict(yaml.safe_load(g.to_json()))
    assert back.to_dict() == g.to_dict()
    assert back.kernels == g.kernels and back.tensors == g.tensors


def test_families_and_load_forms(tmp_path):
    types = {"gpt3_175b": LLMWorkload, "dlrm": DLRMWorkload, "hpl": HPLWorkload, "fft": FFTWorkload,
             "tiny_mlp": GraphWorkload}
    for name, cls in types.items():
        w = load_workload(name)
        assert isinstance(w, cls) and w.source.endswith(f"{name}.yaml")
        assert load_workload(w).model_dump() == w.model_dump()  # a model passes through (copied)
    data = yaml.safe_load((preset_dir("workloads") / "gpt3_175b.yaml").read_text())
    assert load_workload(data).model_dump() == load_workload("gpt3_175b").model_dump()
    assert load_workload(data).source == "<dict>"
    assert load_workload("gpt3_175b.yaml").source == str(preset_dir("workloads") / "gpt3_175b.yaml")
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(data))
    assert load_workload(str(p)).model.hidden == 12288


def test_llm_defaults_and_training_fields():
    w = load_workload({"kind": "llm", "name": "t", "model": {"hidden": 64, "num_heads": 8, "num_layers": 1,
                                                              "seq_len": 8},
                       "training": {"global_batch": 4, "micro_batch": 2, "input_bytes_per_sample": "4 KiB"}})
    m, t = w.model, w.training
    assert (m.ffn_hidden, m.num_kv_heads, m.vocab_size, m.ffn_type) == (256, 8, 0, "gelu")
    assert (t.precision.value, t.optimizer, t.micro_batch, t.input_bytes_per_sample) == ("bf16", "adam", 2, 4096)
    assert w.description == "" and w.default_batch == 4


def test_hpl_dat_spelling():
    w = load_workload({"kind": "hpl", "name": "h", "N": 1000, "NB": 100, "P": 2, "Q": 4})
    assert (w.n, w.nb, w.p, w.q, w.precision.value) == (1000, 100, 2, 4, "fp64")


# -- errors: one line, file + user's field path + what is allowed --------------------------------------

GPT = yaml.safe_load((preset_dir("workloads") / "gpt3_13b.yaml").read_text())
MLP = yaml.safe_load((preset_dir("workloads") / "tiny_mlp.yaml").read_text())


def edit(base, fn):
    d = copy.deepcopy(base)
    fn(d)
    return d


BAD = [
    ("unknown field", edit(GPT, lambda d: d["model"].update(hiden=1)), "model.hiden", "unknown field"),
    ("missing field", edit(GPT, lambda d: d["model"].pop("hidden")), "model.hidden", "missing"),
    ("wrong type", edit(GPT, lambda d: d["model"].update(hidden="big")), "model.hidden", "integer"),
    ("zero size", edit(GPT, lambda d: d["model"].update(num_layers=0)), "model.num_layers", "greater than 0"),
    ("negative size", edit(GPT, lambda d: d["training"].update(global_batch=-8)), "training.global_batch",
     "greater than 0"),
    ("heads do not divide", edit(GPT, lambda d: d["model"].update(num_heads=30)), "model.num_heads",
     "must divide model.hidden"),
    ("kv heads do not divide", edit(GPT, lambda d: d["model"].update(num_kv_heads=7)), "model.num_kv_heads",
     "must divide model.num_heads"),
    ("unknown kind", edit(GPT, lambda d: d.update(kind="cnn")), "kind", "allowed: llm, dlrm, hpl, fft, graph"),
    ("missing kind", edit(GPT, lambda d: d.pop("kind")), "kind", "allowed: llm"),
    ("bad precision", edit(GPT, lambda d: d["training"].update(precision="int3")), "training.precision", "'bf16'"),
    ("fp64 training", edit(GPT, lambda d: d["training"].update(precision="fp64")), "training.precision", "fp32"),
    ("bad ffn type", edit(GPT, lambda d: d["model"].update(ffn_type="relu")), "model.ffn_type", "'swiglu'"),
    ("micro batch", edit(GPT, lambda d: d["training"].update(micro_batch=3)), "training.micro_batch", "divide"),
    ("top-level extra", edit(GPT, lambda d: d.update(layers=3)), "layers", "unknown field"),
    ("cycle", edit(MLP, lambda d: d["tensors"].append({"name": "z", "producer": "wgrad.fc1",
                                                       "consumer": "fwd.fc1", "bytes": 4})), "tensors", "acyclic"),
    ("unknown kernel", edit(MLP, lambda d: d["tensors"][2].update(consumer="fwd.fc9")), "tensors.2.consumer",
     "unknown kernel 'fwd.fc9'"),
    ("zero tensor bytes", edit(MLP, lambda d: d["tensors"][2].update(bytes=0)), "tensors.2.bytes", "> 0"),
    ("bad kernel kind", edit(MLP, lambda d: d["kernels"][1].update(kind="conv")), "kernels.1.kind", "'matmul'"),
    ("comm without collective", edit(MLP, lambda d: d["kernels"][0].update(kind="comm")), "kernels.0.collective",
     "all_to_all"),
    ("duplicate kernel", edit(MLP, lambda d: d["kernels"][1].update(name="fwd.fc1")), "kernels.1.name", "duplicate"),
]


@pytest.mark.parametrize("label,data,field,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line(tmp_path, label, data, field, text):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as exc:
        load_workload(str(path))
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {field}: "), msg
    assert text in msg, msg
    assert exc.value.field == field


OTHER_BAD = [
    ({"kind": "hpl", "name": "h", "n": 10, "nb": 20}, "nb", "<= n"),
    ({"kind": "hpl", "name": "h", "n": 0, "nb": 1}, "n", "greater than 0"),
    ({"kind": "fft", "name": "f", "dims": [8, 0]}, "dims.1", "greater than or equal to 2"),
    ({"kind": "fft", "name": "f", "dims": [8], "decomposition": "slab"}, "decomposition", "3-D"),
    ({"kind": "fft", "name": "f", "dims": [8, 8, 8, 8]}, "dims", "at most 3"),
    ({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2, "rows_per_table": [1], "dim": 4},
      "dense_features": 3, "bottom_mlp": [4], "top_mlp": [1], "training": {"global_batch": 2}},
     "embedding.rows_per_table", "num_tables (2)"),
    ({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2, "rows_per_table": 5, "dim": 4},
      "dense_features": 3, "bottom_mlp": [8], "top_mlp": [1], "training": {"global_batch": 2}},
     "bottom_mlp", "embedding.dim"),
    ({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2, "rows_per_table": -5, "dim": 4},
      "dense_features": 3, "bottom_mlp": [4], "top_mlp": [1], "training": {"global_batch": 2}},
     "embedding.rows_per_table", "must be > 0"),
    ({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2, "rows_per_table": [5, 0], "dim": 4},
      "dense_features": 3, "bottom_mlp": [4], "top_mlp": [1], "training": {"global_batch": 2}},
     "embedding.rows_per_table.1", "greater than 0"),
]


@pytest.mark.parametrize("data,field,text", OTHER_BAD)
def test_bad_input_other_families(data, field, text):
    with pytest.raises(InputError) as exc:
        load_workload(data)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"<dict>: {field}: ") and text in msg, msg


def test_malformed_yaml_and_missing_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("kind: llm\nname: [unclosed\n")
    with pytest.raises(InputError) as exc:
        load_workload(p)
    assert str(exc.value).startswith(f"{p}: line ") and "malformed YAML" in str(exc.value)
    assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="presets: .*gpt3_175b"):
        load_workload("no_such_workload")


def test_bad_batch():
    for bad in (0, -1, 2.5):
        with pytest.raises(InputError, match="batch"):
            build_graph("gpt3_13b", batch=bad)


# -- summary ------------------------------------------------------------------------------------------


def test_summary_llm():
    s = summary("gpt3_175b", batch=1)
    gs = build_graphs("gpt3_175b", batch=1)
    assert s["family"] == "llm" and s["kernels"] == 30 and s["num_layers"] == 96
    assert s["flop_per_iteration"] == pytest.approx(s["flop_forward"] + s["flop_backward"] + s["flop_weight_grad"])
    assert s["flop_per_iteration"] == gs.total_flop()
    assert s["params"] == gs.params() and s["weight_bytes"] == 2 * gs.params()
    assert s["flop_per_layer"] == gs.layer.total_flop()
    assert s["batch"] == 1


@pytest.mark.parametrize("name", ["dlrm", "hpl", "fft", "tiny_mlp"])
def test_summary_other(name):
    s = summary(name)
    assert s["num_layers"] == 1 and s["flop_per_layer"] == s["flop_per_iteration"] > 0
    assert set(s) >= {"family", "kernels", "tensors", "flop_per_layer", "flop_per_iteration", "flop_forward",
                      "flop_backward", "flop_weight_grad", "params", "weight_bytes"}
