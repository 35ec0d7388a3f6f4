"""System presets load and are sane; bad specs fail with one-line errors naming file and field."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from dfmodel.errors import InputError
from dfmodel.netmodels import collective_time
from dfmodel.presets import list_presets, preset_dir
from dfmodel.system import load_system
from dfmodel.system.units import parse_quantity

PRESETS = [p.stem for p in list_presets("systems")]

EXPECTED_CHIPS = {
    "dgx_a100": 1024,
    "dgx_h100": 1024,
    "dgx_b200": 1024,
    "tpu_v4": 4096,
    "sn30": 64,
    "wse2": 16,
    "pcie_ddr": 32,
    "dragonfly": 264,
}


def test_required_presets_are_shipped():
    assert set(EXPECTED_CHIPS) <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_is_plausible(name):
    s = load_system(name)
    assert s.num_chips == math.prod(d.size for d in s.network)
    if name in EXPECTED_CHIPS:
        assert s.num_chips == EXPECTED_CHIPS[name]
    chip = s.chip
    assert isinstance(chip.peak_flops, dict) and chip.peak_flops
    matmul = chip.efficiency.matmul  # one number, or one per precision (issue 11)
    matmul = list(matmul.values()) if isinstance(matmul, dict) else [matmul]
    for eff in (*matmul, chip.efficiency.vector, chip.efficiency.memory):
        assert 0 < eff <= 1
    assert all(0 < d.efficiency <= 1 for d in s.network)
    assert chip.price_usd > 0 and chip.power_w > 0
    assert chip.sram_bytes > 0 and chip.memory.capacity_bytes > chip.sram_bytes or chip.memory.kind == "external"
    # every dimension's whole-group collectives are defined and finite
    for d in s.network:
        c = collective_time(s, "all_reduce", 2**20, ((d.name, d.size),))
        assert 0 < c.time_s < 1 and d.name in c.algorithm


def test_preset_files_cite_sources():
    for path in list_presets("systems"):
        text = path.read_text()
        assert text.lstrip().startswith("#"), f"{path.name} has no header comment"
        assert "estimate" in text or "UNVERIFIED" in text or "source" in text.lower()


def test_dgx_a100_figures():
    s = load_system("dgx_a100")
    chip = s.chip
    assert chip.peak("bf16") == 312e12
    assert chip.peak("fp32") == 19.5e12
    assert chip.peak("fp64") == 19.5e12
    assert chip.memory.capacity_bytes == 80 * 2**30
    assert chip.memory.bandwidth_Bps == 2039e9
    nv, ib = s.network
    assert (nv.name, nv.topology, nv.size, nv.link_bandwidth_Bps) == ("nvlink", "switch", 8, 300e9)
    assert (ib.name, ib.topology, ib.size, ib.link_bandwidth_Bps) == ("ib", "switch", 128, 25e9)


def test_dgx_a100_collective_sanity():
    s = load_system("dgx_a100")
    gib = 2.0**30
    node = collective_time(s, "all_reduce", gib, (("nvlink", 8),))
    busbw = 2 * 7 / 8 * gib / node.time_s
    assert 200e9 < busbw < 300e9  # nccl-tests report ~230 GB/s on DGX A100
    full = collective_time(s, "all_reduce", gib, (("nvlink", 8), ("ib", 128)))
    assert node.time_s < full.time_s < 0.05
    assert "nvlink" in full.algorithm and "ib" in full.algorithm


def test_tpu_v4_is_a_three_d_torus():
    s = load_system("tpu_v4")
    assert [d.topology for d in s.network] == ["ring", "ring", "ring"]
    assert [d.size for d in s.network] == [16, 16, 16]


def test_dataflow_presets():
    for name in ("sn30", "wse2", "dragonfly"):
        assert load_system(name).chip.execution == "dataflow"
    wse = load_system("wse2")
    assert wse.chip.memory.kind == "external" and wse.chip.compute_tiles == 850000
    assert wse.chip.sram_bytes == 40e9
    sn = load_system("sn30")
    assert sn.chip.memory.kind.startswith("DDR") and sn.chip.memory.capacity_bytes >= 1e12


def test_dragonfly_is_fully_connected_twice():
    s = load_system("dragonfly")
    assert [d.topology for d in s.network] == ["fully_connected", "fully_connected"]


# ----------------------------------------------------------------------------- resizing


def test_num_chips_resizes_outermost_dimension():
    s = load_system("dgx_a100", num_chips=64)
    assert s.num_chips == 64 and s.network[-1].size == 8 and s.network[0].size == 8
    t = load_system("tpu_v4", num_chips=512)
    assert [d.size for d in t.network] == [16, 16, 2]


@pytest.mark.parametrize("n", [12, 0, -8, 100])
def test_num_chips_must_be_a_multiple_of_inner_dims(n):
    with pytest.raises(InputError) as info:
        load_system("dgx_a100", num_chips=n)
    msg = str(info.value)
    assert "num_chips" in msg and "dgx_a100.yaml" in msg and "\n" not in msg


# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    "text, kind, value",
    [
        ("80 GiB", "bytes", 80 * 2**30),
        ("40 MB", "bytes", 40e6),
        ("900 GB/s", "bandwidth", 900e9),
        ("200 Gb/s", "bandwidth", 25e9),
        ("400 Gbps", "bandwidth", 50e9),
        ("312 TFLOPS", "flops", 312e12),
        ("7.5 PFLOPS", "flops", 7.5e15),
        ("2 us", "time", 2e-6),
        ("5 ms", "time", 5e-3),
    ],
)
def test_unit_strings_parse(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


def test_unit_strings_in_yaml(tmp_path):
    data = _base()
    data["chip"]["memory"]["capacity_bytes"] = "80 GiB"
    data["network"][0]["link_bandwidth_Bps"] = "900 GB/s"
    data["network"][1]["link_bandwidth_Bps"] = "200 Gb/s"
    data["chip"]["peak_flops"] = "312 TFLOPS"
    data["network"][0]["latency_s"] = "2 us"
    s = load_system(_write(tmp_path, data))
    assert s.chip.memory.capacity_bytes == 80 * 2**30
    assert s.network[0].link_bandwidth_Bps == 900e9 and s.network[1].link_bandwidth_Bps == 25e9
    assert s.chip.peak("bf16") == 312e12 and s.chip.peak("fp64") == 312e12  # one number: every precision
    assert s.network[0].latency_s == 2e-6


# ----------------------------------------------------------------------------- bad input


def _base() -> dict:
    return yaml.safe_load((preset_dir("systems") / "dgx_a100.yaml").read_text())


def _write(tmp_path, data, name="sys.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def _set(data: dict, path: str, value):
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = data
    for k in keys[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value


_DELETE = object()


@pytest.mark.parametrize(
    "field, value, expected_field, words",
    [
        ("chip.foo", 1, "chip.foo", "unknown field"),
        ("network.0.bogus", "x", "network.0.bogus", "unknown field"),
        ("chip.sram_bytes", _DELETE, "chip.sram_bytes", "missing"),
        ("chip.memory", _DELETE, "chip.memory", "missing"),
        ("network.0.size", "eight", "network.0.size", "integer"),
        ("chip.compute_tiles", [1], "chip.compute_tiles", "integer"),
        ("chip.memory.capacity_bytes", -5, "chip.memory.capacity_bytes", "> 0"),
        ("chip.memory.capacity_bytes", 0, "chip.memory.capacity_bytes", "> 0"),
        ("chip.memory.capacity_bytes", "lots", "chip.memory.capacity_bytes", "GiB"),
        ("network.1.size", 0, "network.1.size", "greater than 0"),
        ("network.0.link_bandwidth_Bps", "-1 GB/s", "network.0.link_bandwidth_Bps", "> 0"),
        ("network.0.topology", "mesh", "network.0.topology", "ring"),
        ("network.1.efficiency", 1.2, "network.1.efficiency", "(0, 1]"),
        ("chip.efficiency.matmul", 1.5, "chip.efficiency.matmul", "(0, 1]"),
        ("network.1.name", "nvlink", "network", "unique"),
        ("chip.peak_flops.fp4", "1 PFLOPS", "chip.peak_flops.fp4", "fp16"),
        ("chip.peak_flops.bf16", "-1 TFLOPS", "chip.peak_flops.bf16", "> 0"),
        ("chip.peak_flops", "fast", "chip.peak_flops", "TFLOPS"),
        ("chip.execution", "magic", "chip.execution", "dataflow"),
    ],
)
def test_bad_spec_gives_one_line_error_with_file_and_field(tmp_path, field, value, expected_field, words):
    data = _base()
    _set(data, field, value)
    path = _write(tmp_path, data)
    with pytest.raises(InputError) as info:
        load_system(path)
    err = info.value
    msg = str(err)
    assert "\n" not in msg
    assert err.source == path and msg.startswith(path)
    assert err.field == expected_field
    assert words in err.message


def test_malformed_yaml(tmp_path):
    path = _write(tmp_path, "name: x\nchip: {name: [unclosed\n")
    with pytest.raises(InputError) as info:
        load_system(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg and "malformed YAML" in msg and "line" in msg


def test_top_level_must_be_a_mapping(tmp_path):
    path = _write(tmp_path, "- just\n- a list\n")
    with pytest.raises(InputError, match="mapping"):
        load_system(path)


def test_empty_network_is_rejected(tmp_path):
    data = _base()
    data["network"] = []
    with pytest.raises(InputError) as info:
        load_system(_write(tmp_path, data))
    assert info.value.field == "network"


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError):
        load_system(tmp_path / "nope.yaml")


def test_copy_of_preset_is_independent():
    a = load_system("dgx_a100")
    b = load_system(a, num_chips=16)
    assert a.num_chips == 1024 and b.num_chips == 16
    assert copy.deepcopy(a) == a
