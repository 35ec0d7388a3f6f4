"""Dataflow chips keep saved activations in SRAM between forward and backward where they fit
(issue 11, item 11); HPL's look-ahead and live-buffer accounting (issue 11, item 10)."""

from __future__ import annotations

import math

import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.onchip_stash import OnChipStash, layer_times, onchip_graphs
from dfmodel.intra_chip import partition

SMALL_LLM = {
    "kind": "llm",
    "name": "small",
    "model": {"hidden": 1024, "num_heads": 16, "num_layers": 8, "seq_len": 512, "vocab_size": 8192},
    "training": {"global_batch": 16, "precision": "bf16"},
}


def dataflow_system(sram: str, chips: int = 1) -> dict:
    return {
        "name": "rdu",
        "chip": {"name": "rdu", "peak_flops": {"bf16": "300 TFLOPS"}, "vector_flops": "150 TFLOPS",
                 "sram_bytes": sram, "compute_tiles": 1024, "execution": "dataflow",
                 "memory": {"kind": "DDR", "capacity_bytes": "1 TB", "bandwidth_Bps": "100 GB/s"},
                 "efficiency": {"matmul": 0.7, "vector": 0.5, "memory": 0.8, "kernel_overhead_s": "10 us"}},
        "network": [{"name": "x", "topology": "ring", "size": chips, "link_bandwidth_Bps": "100 GB/s",
                     "latency_s": "2 us"}],
    }


def tiny_graph(stash_bytes: float) -> DataflowGraph:
    """x -> f (forward) -> y -> g (forward) -> out; b (backward) reads the stash s made by f."""
    f = Kernel("f", KernelKind.matmul, {"m": 256, "n": 256, "k": 256}, flop=2 * 256**3, output_bytes=stash_bytes)
    g = Kernel("g", KernelKind.matmul, {"m": 256, "n": 256, "k": 256}, flop=2 * 256**3, output_bytes=131072)
    b = Kernel("b", KernelKind.matmul, {"m": 256, "n": 256, "k": 256}, flop=4 * 256**3, output_bytes=131072,
               phase=Phase.backward)
    tensors = [Tensor("x", None, "f", 131072), Tensor("y", "f", "g", 131072), Tensor("out", "g", None, 131072),
               Tensor("s", "f", "b", stash_bytes), Tensor("dy", None, "b", 131072), Tensor("dx", "b", None, 131072)]
    return DataflowGraph([f, g, b], tensors, name="tiny")


def test_stash_is_neither_written_nor_read_on_chip():
    """Closed form on a tiny graph: the on-chip plans move exactly the stash's bytes less, each way."""
    stash = 4.0e6
    g = tiny_graph(stash)
    s = load_system(dataflow_system("1 GB"))
    g_f, g_b, S = onchip_graphs(g, ["f", "g"], ["b"])
    assert S == stash
    dram_f = partition(g.subgraph(["f", "g"]), s)
    dram_b = partition(g.subgraph(["b"]), s)
    on_f, on_b = partition(g_f, s), partition(g_b, s)
    bytes_of = lambda res: sum(p.memory_bytes for p in res.partitions)  # noqa: E731
    assert bytes_of(dram_f) - bytes_of(on_f) == pytest.approx(stash)
    assert bytes_of(dram_b) - bytes_of(on_b) == pytest.approx(stash)
    assert on_f.time_s < dram_f.time_s and on_b.time_s < dram_b.time_s


def test_layers_on_chip_closed_form():
    st = OnChipStash(stash_bytes=10.0, fwd_s=1.0, bwd_s=2.0, peak_sram_bytes=5.0)
    assert st.layers_on_chip(45.0, layers=8, in_flight=1) == 4  # (45 - 5) // 10
    assert st.layers_on_chip(45.0, layers=8, in_flight=2) == 2
    assert st.layers_on_chip(5.0, layers=8, in_flight=1) == 0  # too big: DRAM
    assert st.layers_on_chip(1e9, layers=8, in_flight=4) == 8
    # full recompute: one layer's stash plus every layer's checkpoint, all or nothing
    assert st.layers_on_chip(5 + 10 + 8 * 1.0, layers=8, in_flight=1, full_recompute=True, checkpoint_bytes=1.0) == 8
    assert st.layers_on_chip(5 + 10 + 8 * 1.0 - 1e-9, layers=8, in_flight=1, full_recompute=True,
                             checkpoint_bytes=1.0) == 0
    # k layers on chip, n - k through DRAM: the mean per layer is exact
    f, b, k = layer_times(3.0, 6.0, st, sram_bytes=45.0, layers=8, in_flight=1)
    assert k == 4 and f == pytest.approx((4 * 1.0 + 4 * 3.0) / 8) and b == pytest.approx((4 * 2.0 + 4 * 6.0) / 8)


def _llm_time(sram: str, **knobs) -> float:
    from dfmodel.inter_chip.llm_family import solve_llm

    return solve_llm(load_workload(SMALL_LLM), load_system(dataflow_system(sram)), Knobs(**knobs)).iteration_time_s


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_llm_on_dataflow_chip_stash_fits_vs_not(recompute):
    """A stash that fits SRAM skips DRAM (faster); one that does not changes nothing; more SRAM
    is never slower."""
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.inter_chip.search import llm_candidates

    knobs = dict(micro_batch=1, recompute=recompute, tp=1, pp=1, dp=1)
    small, big = load_system(dataflow_system("64 MiB")), load_system(dataflow_system("64 GB"))
    w = load_workload(SMALL_LLM)
    evs = {}
    for name, s in (("small", small), ("big", big)):
        model = LLMModel(w, s)
        m = next(iter(llm_candidates(model, Knobs(**knobs))))
        layer = model.block("layer", m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
        assert layer.onchip is not None and layer.onchip.stash_bytes > 0
        evs[name] = (model.evaluate(m).iteration_time_s, layer, model, m)
    t_small, layer_s, model_s, m_s = evs["small"]
    t_big, layer_b, model_b, m_b = evs["big"]
    # too big for 64 MiB: every saved activation goes through DRAM (the stash of 8 layers)
    assert layer_s.onchip.layers_on_chip(64 * 2**20, 8, 1, full_recompute=recompute == "full",
                                         checkpoint_bytes=model_s._checkpoint_bytes(m_s)) == 0
    assert t_big < t_small
    # the refined bound stays valid with on-chip stashes
    assert model_b.refined_bound_s(m_b) <= t_big * (1 + 1e-12)
    assert _llm_time("64 GB", **knobs) <= _llm_time("1 GB", **knobs) * (1 + 1e-12) <= \
        _llm_time("64 MiB", **knobs) * (1 + 1e-12)


def test_kernel_by_kernel_chips_have_no_onchip_stash():
    from dfmodel.inter_chip.llm import LLMModel

    s = dataflow_system("64 GB")
    s["chip"]["execution"] = "kernel_by_kernel"
    model = LLMModel(load_workload(SMALL_LLM), load_system(s))
    assert model.block("layer", 1, 1, (), False).onchip is None


# -- HPL -----------------------------------------------------------------------------------------

def _hpl(n: int, nb: int, chips: int, preset: str = "dgx_h100"):
    from dfmodel.inter_chip.hpl import HPLModel

    return HPLModel(load_workload({"kind": "hpl", "name": "h", "n": n, "nb": nb}), load_system(preset, num_chips=chips),
                    solver="auto", time_limit_s=None)


def test_hpl_one_chip_look_ahead_closed_form():
    """One chip, no network: each group takes its update plus its panel's own arithmetic (the
    look-ahead shares the chip), the first group also its first panel; then the solve."""
    from dfmodel.inter_chip.hpl import HPLMapping

    s = dataflow_system("50 MiB")
    s["chip"]["execution"] = "kernel_by_kernel"
    s["chip"]["peak_flops"] = {"fp64": "60 TFLOPS", "bf16": "900 TFLOPS"}
    s["chip"]["memory"] = {"kind": "HBM", "capacity_bytes": "80 GB", "bandwidth_Bps": "3 TB/s"}
    model = _hpl(8192, 256, 1, s)
    ev = model.evaluate(HPLMapping(1, 1, (("P", ()), ("Q", ()))))
    ct = ev.chip
    want = 0.0
    for i, gi in enumerate(model.groups):
        t_p, _ = ct.kernel_time(f"{gi.tag}.panel")
        if gi.update_flop <= 0:
            want += t_p
            continue
        t_b, _ = ct.kernel_time(f"{gi.tag}.bcast")
        t_s, _ = ct.kernel_time(f"{gi.tag}.swap")
        t_u, _ = ct.kernel_time(f"{gi.tag}.update")
        row = ct._by_kernel()[f"{gi.tag}.panel"]
        work = max(row["compute_s"], row["memory_s"])
        want += t_s + max(t_u + work, t_p + t_b) + ((t_p + t_b) / gi.steps if i == 0 else 0.0)
    want += ct.kernel_time("solve")[0]
    assert ev.iteration_time_s == pytest.approx(want, rel=1e-12)
    assert ev.iteration_time_s > sum(ct.kernel_time(f"{g.tag}.update")[0] for g in model.groups
                                     if g.update_flop > 0)


def test_hpl_fits_at_published_memory_fill_at_scale():
    """3,328 H100 at 90 % HBM fill (NVIDIA's HPL.dat sizing): the intra-chip DRAM check sees one
    step's panel and U block, not a group's sum, so the published fill evaluates."""
    from dfmodel.inter_chip.hpl import HPLMapping
    from dfmodel.netmodels import split_dims

    chips, nb = 3328, 1024
    n = int(math.sqrt(0.9 * chips * 80e9 / 8) // nb * nb)
    model = _hpl(n, nb, chips)
    lay = next(iter(split_dims(model.system, {"P": 52, "Q": 64})))
    ev = model.evaluate(HPLMapping(52, 64, (("P", lay["P"]), ("Q", lay["Q"]))))
    assert ev.fits and math.isfinite(ev.iteration_time_s)


def test_eos_case_chip_count_agrees_with_its_rpeak():
    """The shipped Eos case's GPU count makes Rpeak per GPU a possible H100 FP64 tensor rate
    (between the 1,590 MHz base-clock and 1,980 MHz boost-clock peaks, 53.8-67 TFLOPS)."""
    from dfmodel.validate import _chips, _extra, load_family_cases

    case = next(c for c in load_family_cases("other_families") if c.id == "hpl-eos-202311")
    per_gpu_tf = _extra(case, "Rpeak") * 1e3 / _chips(case)
    assert 53.8 * 0.98 <= per_gpu_tf <= 67.0


def test_pipeline_stages_keep_what_their_in_flight_micro_batches_allow():
    """pp = 2: each stage decides with its own layers and in-flight micro-batches (stage 0 holds
    more); the time lies between the refined bound and the all-DRAM time, and a chip with more
    SRAM is never slower."""
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.inter_chip.search import llm_candidates

    times = []
    for sram in ("64 MiB", "600 MiB", "64 GB"):
        model = LLMModel(load_workload(SMALL_LLM), load_system(dataflow_system(sram, chips=2)))
        m = next(iter(llm_candidates(model, Knobs(micro_batch=1, recompute="none", tp=1, pp=2, dp=1))))
        ev = model.evaluate(m)
        assert model.refined_bound_s(m) <= ev.iteration_time_s * (1 + 1e-12)
        times.append(ev.iteration_time_s)
        layer = model.block("layer", 1, 1, m.group("tp"), m.sequence_parallel)
        if layer.onchip is not None:  # stage 0 (more in flight) never keeps more layers than stage 1
            k = [layer.onchip.layers_on_chip(float(model.system.chip.sram_bytes), 4, f) for f in (2, 1)]
            assert k[0] <= k[1]
    assert times[2] <= times[1] * (1 + 1e-12) <= times[0] * (1 + 1e-12)
    assert times[2] < times[0]
