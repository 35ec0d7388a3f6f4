"""Write the example notebooks (no outputs stored): ``python notebooks/make_notebooks.py``.

The notebooks are generated from the cell sources below so that they stay reviewable as code;
edit here and re-run, do not edit the ``.ipynb`` files by hand. Every notebook reads the
environment variable ``QUICK`` (set to 1 by ``tests/test_notebooks.py``) and then runs a small
subset of its experiments, so CI executes all of them in a few minutes.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''import os

QUICK = os.environ.get("QUICK", "0") not in ("", "0")  # CI sets QUICK=1: a small subset
from dfmodel import plots  # noqa: E402  (plots picks the Agg backend; the next line restores inline)

%matplotlib inline'''


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# --------------------------------------------------------------------------------------------
# 1. Quickstart
# --------------------------------------------------------------------------------------------

QUICKSTART = [
    md("""
# DFModel quickstart: GPT-3 175B on DGX H100

`optimize(workload, system)` searches every valid mapping of a training workload onto a machine
-- tensor (TP), pipeline (PP) and data (DP) parallelism, micro-batch, interleaving, recompute,
sequence parallelism, distributed optimizer, which network dimensions each parallelism uses,
how every kernel is sharded and how the kernels on one chip are grouped -- and returns the
fastest, with a time breakdown that adds up to the iteration time.

Workloads and systems are YAML files; the shipped ones are presets named by file stem
(`dfmodel workloads`, `dfmodel systems` list them).
"""),
    code(SETUP),
    code('''
import time

from dfmodel import optimize

t0 = time.perf_counter()
result = optimize("gpt3_175b", "dgx_h100", num_chips=1024)
print(f"solved in {time.perf_counter() - t0:.1f} s")
'''),
    md("""
## The mapping

The same report `dfmodel solve -w gpt3_175b -s dgx_h100 --num-chips 1024` prints. `placement`
tells which network dimensions each parallelism spans (innermost first, `nvlink:8` = the 8 GPUs
of a node).
"""),
    code('''
from rich.console import Console

from dfmodel.report import render_result

render_result(result, Console(width=100))
'''),
    code('''
p = result.parallelism
print(f"TP {p.tp} x PP {p.pp} x DP {p.dp}; micro-batch {p.micro_batch} x {p.num_micro_batches}, "
      f"interleave {p.interleave}, recompute {p.recompute}, sequence parallel {p.sequence_parallel}")
print(f"{result.samples_per_s:.1f} samples/s, MFU {result.model_flops_utilization:.1%}, "
      f"${result.cost_usd / 1e6:.0f} M, {result.power_w / 1e3:.0f} kW")
d = result.to_dict()  # the documented JSON keys (also `dfmodel solve --json`)
sorted(d)
'''),
    md("""
## Where the time goes

`plots.plot_breakdown` stacks the components of one iteration; they add up exactly to the
iteration time. Several results can be compared side by side.
"""),
    code('''
plots.plot_breakdown(result, normalize=False);
'''),
    md("""
## The pipeline timeline

`plots.plot_pipeline` re-simulates the (interleaved) 1F1B schedule from the result's stage times
(`result.pipeline`): forward passes in blue, backward in orange, lighter shades for later model
chunks of a stage. The idle time at the start and end is the pipeline bubble; the data-parallel
gradient sync and the optimizer step that follow are not drawn.
"""),
    code('''
print(result.pipeline["layers_per_stage"], result.pipeline["num_micro_batches"], result.pipeline["interleave"])
plots.plot_pipeline(result);
'''),
    md("""
## On one chip: kernels and partitions

The intra-chip pass groups the kernels one chip runs for one layer (forward and backward,
after sharding) into partitions. A GPU runs kernel by kernel, so every kernel is its own
partition; a dataflow chip fuses several into one (see `sram_dram.ipynb`).
"""),
    code('''
plots.plot_partitions(result);
'''),
    md("""
## Comparing systems

The same model on the previous generation (DGX A100, same chip count), breakdowns side by side.
Skipped in quick mode (CI).
"""),
    code('''
if not QUICK:
    a100 = optimize("gpt3_175b", "dgx_a100", num_chips=1024)
    print(f"A100: {a100.iteration_time_s:.2f} s, H100: {result.iteration_time_s:.2f} s per iteration "
          f"({a100.iteration_time_s / result.iteration_time_s:.2f}x)")
    plots.plot_breakdown([a100, result], labels=["DGX A100", "DGX H100"]);
'''),
    md("""
From the command line, `dfmodel solve ... --plot out.png` writes the breakdown beside the
pipeline timeline, and `dfmodel plot result.json --kind partitions -o parts.png` draws the other
views from a saved result.
"""),
]


# --------------------------------------------------------------------------------------------
# 2. System design space
# --------------------------------------------------------------------------------------------

DESIGN = [
    md("""
# System design space: 80 systems for LLM training

Four accelerators x five topologies x four memory/interconnect options, all with **64 chips**,
each optimised for the same workload (GPT-3 13B, global batch 128 sequences of 2048 tokens).
For every system we report throughput, throughput per dollar and per watt, and compare the
dataflow accelerators with the kernel-by-kernel ones, as the DFModel paper does (it reports
dataflow ahead by 1.52x in throughput, 1.59x per dollar and 1.6x per watt).

All figures below are **modelling assumptions** taken from the shipped presets (`systems/*.yaml`,
which cite their sources and mark estimates); none is a measurement of a real product.
"""),
    code(SETUP),
    md("""
## Parameter tables

**Accelerators** (per chip; price and power without the off-chip memory, which is priced
separately). GPU and TPU run kernel by kernel; SN30 and WSE-2 are dataflow chips that fuse
kernels into partitions spatially pipelined over their compute tiles.

| chip | BF16 peak | vector | SRAM | tiles | execution | price | power | after preset |
|---|---|---|---|---|---|---|---|---|
| GPU (H100-like) | 989 TFLOPS | 134 TFLOPS | 50 MiB | 132 | kernel by kernel | $28,800 | 610 W | `dgx_h100` |
| TPU-like | 275 TFLOPS | 17 TFLOPS | 160 MiB | 8 | kernel by kernel | $8,000 | 150 W | `tpu_v4` |
| SN30-like | 640 TFLOPS | 320 TFLOPS | 640 MB | 1280 | dataflow | $40,000 | 500 W | `sn30` |
| WSE-2-like | 7.5 PFLOPS | 3.7 PFLOPS | 40 GB | 850,000 | dataflow | $2.5 M | 15 kW | `wse2` |

**Memory** (per chip): DDR = DDR5, 512 GB, 400 GB/s, $1,500, 40 W; HBM = HBM3, 80 GiB,
3,350 GB/s, $1,200, 90 W.

**Interconnect** (per chip, total off-chip bandwidth per direction, split over the topology's
ports): PCIe = 64 GB/s (Gen5 x16), $500, 20 W; NVLink = 450 GB/s (NVLink4), $2,000, 40 W;
both at 80 % efficiency.

**Topologies** for 64 chips (the network model takes dimensions of rings, fully connected groups
and switches):

| topology | dimensions | per-link bandwidth |
|---|---|---|
| 2-D torus | ring 8 x ring 8 | B/4 (4 links per chip) |
| 3-D torus | ring 4 x ring 4 x ring 4 | B/6 |
| dragonfly | fully connected 8 (group) x fully connected 8 (global) | B/14 per pair |
| DGX-1-like | 8 per node on a hybrid cube-mesh (as a ring, B/2 per link) x switch 8 | NIC 50 GB/s between nodes |
| DGX-2-like | 16 per node on a switch (B) x switch 4 | NIC 50 GB/s between nodes |
"""),
    code('''
import copy

CHIPS = {
    "GPU": dict(name="H100-like", peak_flops="989 TFLOPS", vector_flops="134 TFLOPS", sram_bytes="50 MiB",
                compute_tiles=132, execution="kernel_by_kernel", price_usd=28800, power_w=610,
                efficiency=dict(matmul=0.75, vector=0.6, memory=0.85, matmul_tile=[128, 256, 64],
                                kernel_overhead_s="4 us")),
    "TPU": dict(name="TPU-like", peak_flops="275 TFLOPS", vector_flops="17 TFLOPS", sram_bytes="160 MiB",
                compute_tiles=8, execution="kernel_by_kernel", price_usd=8000, power_w=150,
                efficiency=dict(matmul=0.8, vector=0.6, memory=0.85, matmul_tile=[128, 128, 128],
                                kernel_overhead_s="2 us")),
    "SN30": dict(name="SN30-like", peak_flops="640 TFLOPS", vector_flops="320 TFLOPS", sram_bytes="640 MB",
                 compute_tiles=1280, execution="dataflow", price_usd=40000, power_w=500,
                 efficiency=dict(matmul=0.7, vector=0.5, memory=0.8, matmul_tile=[32, 32, 32],
                                 kernel_overhead_s="50 us")),
    "WSE2": dict(name="WSE-2-like", peak_flops="7.5 PFLOPS", vector_flops="3.7 PFLOPS", sram_bytes="40 GB",
                 compute_tiles=850_000, execution="dataflow", price_usd=2_500_000, power_w=15000,
                 efficiency=dict(matmul=0.6, vector=0.5, memory=0.8, matmul_tile=[1, 1, 4],
                                 kernel_overhead_s="100 us")),
}
MEMORY = {
    "DDR": dict(kind="DDR5", capacity_bytes="512 GB", bandwidth_Bps="400 GB/s", price_usd=1500, power_w=40),
    "HBM": dict(kind="HBM3", capacity_bytes="80 GiB", bandwidth_Bps="3350 GB/s", price_usd=1200, power_w=90),
}
LINKS = {  # per chip: total bandwidth per direction, latency, efficiency, price, power
    "PCIe": dict(bw=64e9, latency="5 us", eff=0.8, price=500, power=20),
    "NVLink": dict(bw=450e9, latency="2 us", eff=0.8, price=2000, power=40),
}
NIC = dict(name="ib", topology="switch", link_bandwidth_Bps="50 GB/s", latency_s="5 us", efficiency=0.9,
           link_price_usd=2500, link_power_w=25, switch_radix=64, switch_price_usd=35000, switch_power_w=750)
TOPOLOGIES = ["torus2d", "torus3d", "dragonfly", "dgx1", "dgx2"]
MEMLINKS = [("DDR", "PCIe"), ("DDR", "NVLink"), ("HBM", "PCIe"), ("HBM", "NVLink")]


def network(topology, link):
    """The network dimensions (innermost first) of 64 chips; ``link`` from LINKS."""
    B, p, w = link["bw"], link["price"], link["power"]

    def dim(name, kind, size, share, **extra):  # share: fraction of the chip's bandwidth per link
        return dict(name=name, topology=kind, size=size, link_bandwidth_Bps=B * share, latency_s=link["latency"],
                    efficiency=link["eff"], link_price_usd=p * share, link_power_w=w * share, **extra)

    if topology == "torus2d":
        return [dim("x", "ring", 8, 1 / 4), dim("y", "ring", 8, 1 / 4)]
    if topology == "torus3d":
        return [dim(a, "ring", 4, 1 / 6) for a in "xyz"]
    if topology == "dragonfly":
        return [dim("local", "fully_connected", 8, 1 / 14), dim("global", "fully_connected", 8, 1 / 14)]
    if topology == "dgx1":
        return [dim("node", "ring", 8, 1 / 2), dict(NIC, size=8)]
    if topology == "dgx2":
        return [dim("node", "switch", 16, 1, switch_radix=16, switch_price_usd=16000, switch_power_w=800),
                dict(NIC, size=4)]
    raise KeyError(topology)


def make_system(chip, topology, memory, link):
    c = copy.deepcopy(CHIPS[chip])
    c["memory"] = dict(MEMORY[memory])
    return dict(name=f"{chip}/{topology}/{memory}+{link}", chip=c, network=network(topology, LINKS[link]))


POINTS = [(c, t, m, l) for c in CHIPS for t in TOPOLOGIES for m, l in MEMLINKS]
if QUICK:  # CI: every accelerator on the 2-D torus, with the cheapest and the fastest memory/link
    POINTS = [(c, "torus2d", m, l) for c in CHIPS for m, l in [("DDR", "PCIe"), ("HBM", "NVLink")]]
SYSTEMS = {p: make_system(*p) for p in POINTS}
print(len(SYSTEMS), "systems")
'''),
    md("""
## Run the optimizer on every system

One `optimize` per system, in parallel over the machine's cores (about 6 minutes for the 80
systems on 2 cores). Each outcome is kept as a record in
the same shape as a line of a `dfmodel sweep` results file, so the `plots` sweep views apply.
"""),
    code('''
import time
from concurrent.futures import ProcessPoolExecutor

import yaml

from dfmodel import optimize
from dfmodel.presets import resolve

workload = yaml.safe_load(resolve("gpt3_13b", "workloads").read_text())
workload["training"]["global_batch"] = 128

t0 = time.perf_counter()
records = []
with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    futures = {p: pool.submit(optimize, workload, s) for p, s in SYSTEMS.items()}
    for (chip, topo, mem, link), fut in futures.items():
        inputs = {"workload": "gpt3_13b", "system": SYSTEMS[(chip, topo, mem, link)]["name"],
                  "overrides": {"accelerator": chip, "topology": topo, "memory+link": f"{mem}+{link}",
                                "execution": CHIPS[chip]["execution"]}, "fixed": {}}
        try:
            rec = {"result": fut.result().to_dict(), "error": None}
        except Exception as exc:  # an infeasible system is a result too
            rec = {"result": None, "error": {"type": type(exc).__name__, "message": str(exc)}}
        records.append({"id": inputs["system"], "inputs": inputs, **rec})
print(f"{len(records)} systems in {time.perf_counter() - t0:.0f} s; "
      f"{sum(r['error'] is not None for r in records)} infeasible")
'''),
    code('''
rows = plots.as_rows(records)  # flat rows: override keys + dotted result keys
print(f"{'system':28s} {'samples/s':>10s} {'per $M':>8s} {'per kW':>8s} {'mapping':>18s}  bottleneck")
for r in rows:
    if r["error"]:
        print(f"{r['system']:28s} {r['error'][:60]}")
        continue
    mapping = f"TP{r['parallelism.tp']} PP{r['parallelism.pp']} DP{r['parallelism.dp']}"
    print(f"{r['system']:28s} {r['throughput.samples_per_s']:10.1f} {r['throughput_per_usd'] * 1e6:8.2f} "
          f"{r['throughput_per_w'] * 1e3:8.2f} {mapping:>18s}  {r['bottleneck']}")
'''),
    md("""
## Throughput over accelerators and topologies

One heat map per memory/interconnect option (cells: samples/s; grey = no mapping fits).
"""),
    code('''
import matplotlib.pyplot as plt

options = sorted({r["memory+link"] for r in rows})
fig, axes = plt.subplots(1, len(options), figsize=(5.2 * len(options), 3.6), layout="constrained", squeeze=False)
for ax, option in zip(axes[0], options):
    plots.plot_heatmap([r for r in rows if r["memory+link"] == option], x="topology", y="accelerator",
                       value="throughput.samples_per_s", ax=ax)
    ax.set_title(option, fontsize=10)
'''),
    md("""
## Throughput against cost and power

The Pareto front joins the systems no other system beats on both axes (cheaper *and* faster).
"""),
    code('''
fig, axes = plt.subplots(1, 2, figsize=(14, 5), layout="constrained")
plots.plot_pareto(rows, x="cost_usd", y="throughput.samples_per_s", hue="accelerator", ax=axes[0])
plots.plot_pareto(rows, x="power_w", y="throughput.samples_per_s", hue="accelerator", ax=axes[1]);
'''),
    md("""
## Dataflow vs kernel-by-kernel

Ratio of geometric means: the dataflow systems (SN30-like, WSE-2-like) over the
kernel-by-kernel ones (GPU, TPU-like), over the topology x memory/interconnect combinations
where all four accelerators found a mapping. Also the ratio for each pair of accelerators.
"""),
    code('''
import math

from IPython.display import Markdown, display

METRICS = {"throughput": "throughput.samples_per_s", "per dollar": "throughput_per_usd",
           "per watt": "throughput_per_w"}
PAPER = {"throughput": 1.52, "per dollar": 1.59, "per watt": 1.6}


def gmean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


ok = {(r["accelerator"], r["topology"], r["memory+link"]): r for r in rows if not r["error"]}
combos = sorted({(t, m) for _, t, m in ok if all((c, t, m) in ok for c in CHIPS)})
dataflow = [c for c in CHIPS if CHIPS[c]["execution"] == "dataflow"]
kbk = [c for c in CHIPS if CHIPS[c]["execution"] == "kernel_by_kernel"]
ratios = {}
for name, key in METRICS.items():
    df = gmean([ok[(c, t, m)][key] for c in dataflow for t, m in combos])
    kk = gmean([ok[(c, t, m)][key] for c in kbk for t, m in combos])
    ratios[name] = df / kk
print(f"{len(combos)} topology x memory/link combinations with all four accelerators")
for name in METRICS:
    print(f"dataflow / kernel-by-kernel, {name:10s}: {ratios[name]:.2f}x  (paper {PAPER[name]}x)")

pairs = [(d, k) for d in dataflow for k in kbk]
lines = ["| metric | **dataflow / kbk** | paper | " + " | ".join(f"{d}/{k}" for d, k in pairs) + " |",
         "|---|---|---|" + "---|" * len(pairs)]
for name, key in METRICS.items():
    per_pair = [gmean([ok[(d, t, m)][key] / ok[(k, t, m)][key] for t, m in combos]) for d, k in pairs]
    lines.append(f"| {name} | **{ratios[name]:.2f}x** | {PAPER[name]}x | "
                 + " | ".join(f"{v:.2f}x" for v in per_pair) + " |")
display(Markdown("\\n".join(lines)))
'''),
    md("""
### Why our ratios differ from the paper's

With all 80 systems (run without `QUICK`; the cell above recomputes the numbers), this version
found dataflow / kernel-by-kernel = **2.48x throughput, 0.16x per dollar, 0.37x per watt**
against the paper's 1.52x, 1.59x and 1.6x. The pair closest to the paper's comparison, SN30-like
over GPU, came out at **1.28x, 0.96x and 1.49x**. The ratios are set mostly by the **chips'
parameters, prices and powers**, which here are the presets' estimates, not the paper's inputs:

- **Equal chip count favours the wafer in throughput and ruins it per dollar and per watt.**
  A WSE-2-like chip has ~7.6x the GPU's peak and 40 GB of SRAM, so its systems lead in
  throughput (up to ~1,200 samples/s on the DGX-2-like topology with HBM and NVLink), but at
  an estimated $2.5 M and 15 kW per chip a 64-chip system costs ~$160 M and ~1 MW, some 80x a
  GPU system for 1.6-5.8x its throughput. The geometric mean over both dataflow chips inherits that
  factor; the paper normalises its systems differently (its cost and power models are not
  published in a form we could reuse).
- **Fusion pays where DRAM is slow.** With DDR the SN30-like chip runs 1.3-2.2x the GPU (fused
  partitions keep intermediate tensors in SRAM; the GPU is memory-bound), with HBM the GPU's
  higher peak (989 vs 640 TFLOPS) and matmul efficiency win. The paper's 1.52x is an average
  over the same kind of mix, so it depends on how many slow-memory systems are counted.
- **The TPU-like chip** is cheap and frugal ($8 k, 150 W), which lifts the kernel-by-kernel
  side per dollar and per watt more than in throughput.
- **Topology matters through the links, not the chips.** The DGX-like systems add a 50 GB/s
  NIC per chip, more than a torus gives each link when 64 GB/s of PCIe is split over 4-6 links,
  so PCIe systems gain most from them.
- The ratios here are geometric means over the combinations where every accelerator found a
  mapping, for one workload (GPT-3 13B, batch 128) at 64 chips; the paper's averaging and
  workload mix differ.

`sram_dram.ipynb` isolates the effect of dataflow execution itself: the same chip with only
the execution style switched.
"""),
]


# --------------------------------------------------------------------------------------------
# 3. SRAM x DRAM
# --------------------------------------------------------------------------------------------

SRAM_DRAM = [
    md("""
# SRAM size x DRAM bandwidth on a dataflow chip

The same chip (the SN30-like preset) with its on-chip SRAM and DRAM bandwidth varied, run
either **kernel by kernel** (every kernel reads its inputs from and writes its output to DRAM)
or as **dataflow** (kernels fused into partitions whose intermediate tensors stay in SRAM).
Everything else -- compute, network, price -- is identical, so the difference is the effect of
fusion alone. Workload: GPT-3 13B, global batch 64, on one 8-chip node.
"""),
    code(SETUP),
    code('''
import copy
import time

import yaml

from dfmodel import optimize
from dfmodel.presets import resolve

base = yaml.safe_load(resolve("sn30", "systems").read_text())
workload = yaml.safe_load(resolve("gpt3_13b", "workloads").read_text())
workload["training"]["global_batch"] = 64

SRAM_MB = [64, 160, 320, 640, 1280]
DRAM_GBPS = [100, 200, 400, 800, 1600]
if QUICK:
    SRAM_MB, DRAM_GBPS = [64, 640], [100, 1600]

records = []
t0 = time.perf_counter()
for execution in ("kernel_by_kernel", "dataflow"):
    for sram in SRAM_MB:
        for bw in DRAM_GBPS:
            s = copy.deepcopy(base)
            s["chip"].update(execution=execution, sram_bytes=f"{sram} MB")
            s["chip"]["memory"]["bandwidth_Bps"] = f"{bw} GB/s"
            over = {"chip.execution": execution, "chip.sram_MB": sram, "chip.memory.bandwidth_GBps": bw}
            rec = {"id": f"{execution}/{sram}MB/{bw}GBps",
                   "inputs": {"workload": "gpt3_13b", "system": "sn30", "overrides": over, "fixed": {}}}
            try:
                rec.update(result=optimize(workload, s, num_chips=8).to_dict(), error=None)
            except Exception as exc:
                rec.update(result=None, error={"type": type(exc).__name__, "message": str(exc)})
            records.append(rec)
print(f"{len(records)} points in {time.perf_counter() - t0:.0f} s")
rows = plots.as_rows(records)
'''),
    md("""
## Throughput (samples/s)

Kernel by kernel (left) the SRAM does not matter: every tensor goes through DRAM, so only the
bandwidth moves the throughput. With dataflow (right) a larger SRAM fits bigger partitions and
keeps more intermediate tensors on chip, so the same DRAM bandwidth goes further.
"""),
    code('''
import matplotlib.pyplot as plt

values = [r["throughput.samples_per_s"] for r in rows if not r["error"]]
fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
for ax, execution in zip(axes, ("kernel_by_kernel", "dataflow")):  # one colour scale for both
    plots.plot_heatmap([r for r in rows if r["chip.execution"] == execution], x="chip.memory.bandwidth_GBps",
                       y="chip.sram_MB", value="throughput.samples_per_s", vmin=min(values), vmax=max(values), ax=ax)
    ax.set_title(execution, fontsize=10)
'''),
    md("""
## Speed-up of dataflow over kernel by kernel, and partitions per layer
"""),
    code('''
by = {(r["chip.execution"], r["chip.sram_MB"], r["chip.memory.bandwidth_GBps"]): r for r in rows}
speedup = []
for sram in SRAM_MB:
    for bw in DRAM_GBPS:
        k, d = by[("kernel_by_kernel", sram, bw)], by[("dataflow", sram, bw)]
        if not k["error"] and not d["error"]:
            speedup.append({"sram_MB": sram, "dram_GBps": bw,
                            "speedup": d["throughput.samples_per_s"] / k["throughput.samples_per_s"],
                            "partitions": len(d["intra_chip.partitions"]), "bottleneck": d["bottleneck"]})
for s in speedup:
    print(f"SRAM {s['sram_MB']:5d} MB, DRAM {s['dram_GBps']:5d} GB/s: dataflow {s['speedup']:.2f}x, "
          f"{s['partitions']} partitions per layer, {s['bottleneck']}-bound")
fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
plots.plot_heatmap(speedup, x="dram_GBps", y="sram_MB", value="speedup", fmt="{:.2f}x", ax=axes[0])
plots.plot_heatmap(speedup, x="dram_GBps", y="sram_MB", value="partitions", fmt="{:.0f}", cmap="magma", ax=axes[1]);
'''),
    md("""
The gain is largest where DRAM bandwidth is scarce: fusion removes most of the DRAM traffic of
the intermediate tensors (attention scores, MLP activations), so a memory-bound kernel-by-kernel
chip becomes compute-bound. With ample bandwidth both styles are compute-bound and the gap closes
to the per-kernel overheads saved. On the full 5 x 5 grid this version found dataflow ahead by
1.76x (64 MB) to 3.43x (1280 MB) at 100 GB/s, and by 1.18x to 1.35x at 1600 GB/s.

The partitions of one point, kernels coloured by partition:
"""),
    code('''
best = max((r for r in records if r["result"] and r["inputs"]["overrides"]["chip.execution"] == "dataflow"),
           key=lambda r: r["result"]["throughput"]["samples_per_s"])
print(best["id"])
plots.plot_partitions(best["result"]);
'''),
]


# --------------------------------------------------------------------------------------------
# 4. Fidelity
# --------------------------------------------------------------------------------------------

FIDELITY = [
    md("""
# Fidelity: predicted vs measured

Published Megatron-LM training runs on NVIDIA Selene (DGX A100 80GB), each evaluated with its
published mapping fixed (`dfmodel.validate.validate_cases`; a knob a case leaves out, often the
micro-batch, is chosen by the optimizer). Cases: the shipped data set `megatron_a100`
(`calibration/megatron_a100.yaml`: Narayanan et al. SC21 Table 1; Korthikanti et al. 2022 Tables 3
and 5), or the file named by `DFMODEL_CASES`. Same as `dfmodel validate megatron_a100`.
"""),
    code(SETUP),
    code('''
import tempfile
from pathlib import Path

import yaml

from dfmodel.validate import resolve_cases, summary, validate_cases

cases_path = resolve_cases(os.environ.get("DFMODEL_CASES") or "megatron_a100")
print(cases_path, cases_path.exists())
if QUICK:  # CI: four cases of different sizes
    cases = yaml.safe_load(cases_path.read_text())
    keep = [c for c in cases if c["id"] in ("meg21-gpt-1.7B", "meg21-gpt-18B",
                                            "kor22-22B-seqpar_selective_recompute", "kor22-175B-full_recompute")]
    keep = keep or cases[:4]
    cases_path = Path(tempfile.mkdtemp()) / "cases.yaml"
    cases_path.write_text(yaml.safe_dump(keep))
rows = validate_cases(cases_path)
'''),
    code('''
print(f"{'case':40s} {'chips':>5s} {'mapping':28s} {'predicted':>10s} {'measured':>9s} {'error':>7s}")
for r in rows:
    pred = f"{r.predicted_s:10.3f}" if r.predicted_s is not None else f"{'-':>10s}"
    err = f"{r.error:+7.1%}" if r.error is not None else f"{'-':>7s}"
    print(f"{r.id:40s} {r.num_chips:5d} {r.mapping or r.message[:28]:28s} {pred} {r.measured_s:9.3f} {err}")
s = summary(rows)
print(f"\\n{s['evaluated']}/{s['cases']} cases: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
'''),
    md("""
## Parity plot

Each point is one run; on the diagonal the prediction equals the measurement, the bands are
+-10 % and +-20 %.
"""),
    code('''
import matplotlib.pyplot as plt

ok = [r for r in rows if r.predicted_s is not None]
fig, ax = plt.subplots(figsize=(6, 6), layout="constrained")
lo = min(min(r.measured_s, r.predicted_s) for r in ok) * 0.7
hi = max(max(r.measured_s, r.predicted_s) for r in ok) * 1.4
xs = [lo, hi]
ax.plot(xs, xs, color="black", linewidth=1, label="predicted = measured")
for band, alpha in ((0.1, 0.25), (0.2, 0.12)):
    ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs], color="#4c72b0",
                    alpha=alpha, linewidth=0, label=f"+-{band:.0%}")
for family, marker in (("meg21", "o"), ("kor22", "s")):
    pts = [r for r in ok if r.id.startswith(family)]
    ax.scatter([r.measured_s for r in pts], [r.predicted_s for r in pts], marker=marker, zorder=3,
               label={"meg21": "Narayanan et al. 2021", "kor22": "Korthikanti et al. 2022"}[family])
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlim(lo, hi)
ax.set_ylim(lo, hi)
ax.set_xlabel("measured iteration time (s)")
ax.set_ylabel("predicted iteration time (s)")
ax.set_title(f"dgx_a100 preset: mean |error| {s['mean_abs_error']:.1%}", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both");
'''),
]


# --------------------------------------------------------------------------------------------
# 5. Storage I/O at 16K GPUs (issue 8)
# --------------------------------------------------------------------------------------------

STORAGE = [
    md("""
# Storage for 16K GPUs: how much bandwidth, and what a cache buys

A training step also waits on I/O. This notebook sizes the storage of a **16,384-GPU DGX H100**
cluster (2,048 nodes) training the I/O-heavy example `vit_g14_images` (a ViT-g/14 image tower
fed ~1 MB JPEGs from a 400 M-sample dataset, see `workloads/vit_g14_images.yaml`).

The `dgx_h100` preset's storage block has three tiers, outermost first: a Lustre parallel file
system (DGX SuperPOD RA enhanced level: 500 GB/s read, 250 GB/s write, 40 GB/s per node), the
node's 8x 3.84 TB NVMe and the page cache. Per node and step the input model
(`dfmodel.inter_chip.input_pipeline`) takes each tier's hit ratio from capacity against the
dataset, its time from `min(aggregate / nodes, per-node)` bandwidth and request latency hidden
by the prefetch depth (EMLIO's regime), the storage NIC, and the CPU's decode time; the slowest
of them binds, and only what the step cannot hide is exposed.

Two knobs are swept: the parallel file system's aggregate read bandwidth and the capacity of a
**distributed cache** (Fluid + JindoCache style) pooled over the training nodes' NVMe.
"""),
    code(SETUP),
    code("""
import copy

import matplotlib.pyplot as plt
import numpy as np

from dfmodel import load_system, load_workload, optimize
from dfmodel.inter_chip.io import io_power_w, reprice_io

CHIPS = 16384
w = load_workload("vit_g14_images")
base = load_system("dgx_h100", num_chips=CHIPS)
nodes = base.storage.nodes(CHIPS)
# CI (QUICK) fixes the mapping found by the full search (TP 1 x PP 1); the full run searches
r = optimize(w, base, **({"tp": 1, "pp": 1} if QUICK else {}))
step_s = r.iteration_time_s - r.breakdown_s["input"] - r.breakdown_s["checkpoint"]
batch_bytes = w.training.global_batch * w.training.input_bytes_per_sample
print(f"{nodes} nodes, mapping TP {r.parallelism.tp} x PP {r.parallelism.pp} x DP {r.parallelism.dp}")
print(f"compute step {step_s * 1e3:.1f} ms; input load {r.io['steady_state']['load_s'] * 1e3:.1f} ms "
      f"(binding tier: {r.io['binding_tier']}); iteration {r.iteration_time_s * 1e3:.1f} ms")
print(f"the step consumes {batch_bytes / step_s / 1e12:.2f} TB/s of samples: "
      f"{batch_bytes / step_s / nodes / 1e9:.2f} GB/s per node")
"""),
    md("""
One solve prices the whole grid: the iteration is `max(step, load) + checkpoint`, the load does
not depend on the mapping and the checkpoint stall never grows when the step shrinks, so the
fastest-step mapping stays optimal for every storage configuration (`reprice_io`, exact within
the model; `tests/test_storage.py` checks it against full solves).

The distributed cache pools the training nodes' NVMe: each node contributes up to 30.72 TB and
serves its peers at half its drives' 25 GB/s (an estimate: the other half stays with the node's
own cache traffic), through the node's storage NIC; its request latency is taken as 200 us
(estimate: NVMe read plus one RDMA hop). Lustre's power scales with its bandwidth (more DDN
AI400X2-class appliances: the preset's 15 kW per 500 GB/s).
"""),
    code("""
def storage_system(fs_read_Bps, cache_bytes):
    spec = base.model_dump()
    tiers = spec["storage"]["tiers"]
    lustre = tiers[0]
    scale = fs_read_Bps / lustre["aggregate_read_Bps"]
    lustre.update(aggregate_read_Bps=fs_read_Bps, aggregate_write_Bps=lustre["aggregate_write_Bps"] * scale,
                  power_w=lustre["power_w"] * scale, price_usd=lustre["price_usd"] * scale)
    page_cache = tiers[-1]
    new = [lustre]
    if cache_bytes > 0:
        new.append({"name": "jindo", "kind": "distributed_cache", "capacity_bytes": cache_bytes,
                    "aggregate_read_Bps": nodes * 12.5e9, "latency_s": 200e-6, "eviction": "pin"})
    spec["storage"]["tiers"] = new + [page_cache]
    return load_system(spec)


fs_bw = np.geomspace(100e9, 20e12, 4 if QUICK else 15)
caches = [0.0, 100e12, 400e12] if QUICK else [0.0, 50e12, 100e12, 200e12, 300e12, 400e12]
t = np.zeros((len(caches), len(fs_bw)))
cold = np.zeros_like(t)
energy = np.zeros_like(t)
binding = np.empty(t.shape, dtype=object)
for i, c in enumerate(caches):
    for j, b in enumerate(fs_bw):
        s = storage_system(b, c)
        t[i, j], terms = reprice_io(r, w, s)
        cold[i, j] = t[i, j] - terms.input_s + terms.cold.exposed_s
        binding[i, j] = terms.steady.binding if terms.input_s > 0 else "compute"
        io_w = io_power_w(s)  # tiers, caches and storage NICs
        energy[i, j] = (r.power_w + io_w) * t[i, j] / w.training.global_batch

fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
ax = axes[0]
for i, c in enumerate(caches):
    ax.semilogx(fs_bw / 1e9, t[i] / step_s, marker="o", ms=3, label=f"cache {c / 1e12:.0f} TB")
ax.semilogx(fs_bw / 1e9, cold[0] / step_s, "k--", lw=1, label="first epoch (cold cache)")
ax.axvline(batch_bytes / step_s / 1e9, color="grey", lw=0.8, ls=":")
ax.set_xlabel("parallel file system aggregate read (GB/s)")
ax.set_ylabel("iteration / compute step")
ax.set_title("where I/O binds (16,384 GPUs)", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
ax = axes[1]
for i, c in enumerate(caches):
    ax.loglog(fs_bw / 1e9, energy[i], marker="o", ms=3, label=f"cache {c / 1e12:.0f} TB")
ax.set_xlabel("parallel file system aggregate read (GB/s)")
ax.set_ylabel("energy per sample, compute + I/O (J)")
ax.set_title("perf/W counts I/O (EMLIO-style accounting)", fontsize=10)
ax.grid(alpha=0.3, which="both");
"""),
    code("""
def needed_bandwidth(cache_bytes, lo=1e9, hi=1e15):
    # smallest file-system bandwidth at which the input no longer binds (load <= step); the
    # load is monotone in bandwidth (tested), so bisect in log space
    s = storage_system(hi, cache_bytes)
    if reprice_io(r, w, s)[1].input_s > 0:
        return float("inf"), reprice_io(r, w, s)[1].steady.binding
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if reprice_io(r, w, storage_system(mid, cache_bytes))[1].input_s > 0:
            lo = mid
        else:
            hi = mid
    return hi, "-"


print(f"{'cache':>8} {'hit':>6} {'FS bandwidth where I/O stops binding':>38} {'binding at 500 GB/s':>20}")
for c in caches:
    need, why = needed_bandwidth(c)
    terms = reprice_io(r, w, storage_system(500e9, c))[1]
    hit = next((st.hit_ratio for st in terms.steady.stages if st.name == "jindo"), 0.0)
    if need == float("inf"):
        need_s = f"never (binds on {why})"
    elif need <= 1.001e9:
        need_s = "any (the cache serves every sample)"
    else:
        need_s = f"{need / 1e9:,.0f} GB/s"
    print(f"{c / 1e12:6.0f} TB {hit:6.1%} {need_s:>38} {terms.steady.binding:>20}")
"""),
    md("""
Reading the figure: without a cache the file system must deliver the whole sample stream
(global batch x 1 MB per step, the dotted line) or the input binds; every terabyte of cache
removes its share of the dataset from that stream (hit ratio = cache / dataset under shuffled
access with a pinning cache), and a cache that holds the whole 400 TB dataset leaves the file
system only the first epoch, when every cache is cold (dashed line). The energy panel shows the
other side: past the knee more file-system bandwidth only adds storage power.

## Checkpoints at 16K GPUs: sync vs async

GPT-3 175B saves 175 B x 14 bytes (bf16 weights + fp32 master, Adam m and v) = 2.45 TB per
checkpoint. The stall per step depends on the interval, the mode and the write bandwidth.
"""),
    code("""
g = load_workload("gpt3_175b")
rg = optimize(g, base, tp=8, pp=8)
rows = []
for fs_write in (250e9, 1e12):
    s = storage_system(2 * fs_write, 0.0)  # file systems write at about half their read rate
    for interval in (50, 200, 1000):
        for mode in ("sync", "async"):
            gw = g.model_copy(deep=True)
            gw.training.checkpoint = type(w.training.checkpoint)(interval_steps=interval, mode=mode)
            total, terms = reprice_io(rg, gw, s)
            c = terms.checkpoint
            rows.append((fs_write, interval, mode, c.write_s, c.per_step_s, c.per_step_s / total, c.restart_s))
print(f"step {rg.iteration_time_s:.3f} s; checkpoint {terms.checkpoint.bytes_total / 1e12:.2f} TB")
print(f"{'write':>9} {'every':>6} {'mode':>6} {'write s':>8} {'s/step':>8} {'share':>7} {'restart s':>10}")
for fs_write, interval, mode, write_s, per_step, share, restart in rows:
    print(f"{fs_write / 1e9:6.0f} GB/s {interval:6d} {mode:>6} {write_s:8.2f} {per_step:8.4f} {share:7.2%} {restart:10.2f}")
"""),
]


NOTEBOOKS = {
    "quickstart.ipynb": QUICKSTART,
    "system_design_space.ipynb": DESIGN,
    "sram_dram.ipynb": SRAM_DRAM,
    "fidelity.ipynb": FIDELITY,
    "storage_io.ipynb": STORAGE,
}


def build(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives the same file
        cell["id"] = f"cell-{i}"
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = build(cells)
        nbformat.validate(nb)
        (HERE / name).write_text(nbformat.writes(nb) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
