"""Offload to host memory (issue 10 item 6): the measurements of the closing note.

Run: ``PYTHONPATH=. python benchmarks/bench_offload.py`` (minutes; CPU seconds are printed, as
wall times on a shared machine are not comparable).

1. GPT-3 13B on one DGX A100 (8 GPUs): the free search, then with optimizer offload forced.
2. GPT-3 175B on 16 H100 (two DGX H100): does not fit without offload; the search picks it.
3. GPT-3 175B on 72 GB200 GPUs (Grace over NVLink-C2C) and on 72 H100 (PCIe Gen5) with the
   same offload forced: C2C makes it cheap.
4. ZeRO-Offload's published single-GPU point (Ren et al., ATC 2021, abstract and sec. 6:
   a 10B-parameter GPT-2 at ~40 TFLOPS on one V100-32GB of a DGX-2) with a DGX-2-like host.
"""

from __future__ import annotations

import sys
import time

from dfmodel import optimize
from dfmodel.errors import DFModelError
from dfmodel.system import load_system


def run(label, workload, system, **kw):
    t = time.process_time()
    try:
        r = optimize(workload, system, alternatives=0, **kw)
    except DFModelError as exc:
        print(f"{label}: {type(exc).__name__}: {exc}  [{time.process_time() - t:.1f} CPU s]")
        return None
    p, b, mem = r.parallelism, r.breakdown_s, r.memory_per_chip_bytes
    sys_ = load_system(system) if not isinstance(system, dict) else load_system(system)
    wl = workload if isinstance(workload, dict) else None
    precision = (wl or {}).get("training", {}).get("precision", "bf16")
    tflops = r.model_flops_utilization * sys_.chip.peak(precision) / 1e12
    print(f"{label}: {r.iteration_time_s:.3f} s, MFU {r.model_flops_utilization:.1%} ({tflops:.0f} TFLOPS/chip), TP{p.tp} PP{p.pp} DP{p.dp} mb{p.micro_batch} "
          f"v{p.interleave} {p.recompute} sp={p.sequence_parallel} ZeRO{p.zero_stage} offload(opt={p.offload_optimizer}, "
          f"act={p.offload_activations}, w={p.offload_weights}); offload {b.get('offload', 0):.3f} s, optimizer "
          f"{b['optimizer']:.3f} s; chip {mem['total'] / 2**30:.1f}/{mem['capacity'] / 2**30:.1f} GiB, host "
          f"{mem.get('host', 0) / 2**30:.1f}/{(mem.get('host_capacity') or 0) / 2**30:.1f} GiB per chip; "
          f"{r.solver.status}, {r.solver.candidates_evaluated} evaluated [{time.process_time() - t:.1f} CPU s]")
    return r


def dgx2_one_v100():
    """One V100-32GB of a DGX-2 with the DGX-2 host: 2x Xeon Platinum 8168 (6 channels of
    DDR4-2666 each = 256 GB/s), 1.5 TB DDR4, PCIe Gen3 x16 (~12 GB/s measured per direction).
    The chip is v100_fdr.yaml's; one GPU on the host (ZeRO-Offload's single-GPU runs)."""
    s = load_system("v100_fdr").model_dump()
    s.update(name="dgx2_1gpu", storage=None,
             network=[{"name": "nvlink", "topology": "switch", "size": 1, "link_bandwidth_Bps": 150e9}],
             host={"kind": "DDR4", "capacity_bytes": 1.5e12, "chips_per_host": 16,
                   "memory_bandwidth_Bps": 2 * 6 * 2666e6 * 8, "link_bandwidth_Bps": 12e9,
                   "reserve_bytes": 64 * 2**30})
    return s


GPT2_10B = {  # ZeRO-Offload Table 4-style GPT-2 10B: 50 layers, hidden 4096 (12 h^2 L = 10.1B)
    "kind": "llm", "name": "gpt2_10b",
    "model": {"hidden": 4096, "num_heads": 32, "num_layers": 50, "seq_len": 1024, "vocab_size": 50257},
    "training": {"global_batch": 8, "precision": "fp16"},
}


def main(which: str = "all") -> None:
    if which in ("all", "13b"):
        run("gpt3_13b x 8 dgx_a100, free", "gpt3_13b", load_system("dgx_a100", num_chips=8))
        run("gpt3_13b x 8 dgx_a100, --offload-optimizer host", "gpt3_13b", load_system("dgx_a100", num_chips=8),
            offload_optimizer="host")
        run("gpt3_13b x 8 dgx_a100, --offload-optimizer delayed", "gpt3_13b",
            load_system("dgx_a100", num_chips=8), offload_optimizer="delayed")
    if which in ("all", "175b"):
        h100 = load_system("dgx_h100", num_chips=16)
        run("gpt3_175b x 16 dgx_h100, no host", "gpt3_175b", h100.model_copy(update={"host": None}))
        run("gpt3_175b x 16 dgx_h100, free", "gpt3_175b", h100)
        run("gpt3_175b x 8 dgx_h100, free", "gpt3_175b", load_system("dgx_h100", num_chips=8))
    if which in ("all", "gb200"):
        # the same forced offload over NVLink-C2C (Grace) and over PCIe Gen5 (DGX H100), TP 8
        for name in ("gb200_nvl72", "dgx_h100"):
            s = load_system(name, num_chips=72)
            run(f"gpt3_175b x 72 {name}, tp 8", "gpt3_175b", s, tp=8)
            run(f"gpt3_175b x 72 {name}, tp 8, --offload-optimizer host", "gpt3_175b", s, tp=8,
                offload_optimizer="host")
            run(f"gpt3_175b x 72 {name}, tp 8, --offload-activations", "gpt3_175b", s, tp=8,
                offload_activations=True)
    if which in ("all", "zero_offload"):
        run("gpt2_10b x 1 V100 (DGX-2 host), free", GPT2_10B, dgx2_one_v100())
        run("gpt2_10b x 1 V100 (DGX-2 host), ZeRO-Offload as published (optimizer only)", GPT2_10B,
            dgx2_one_v100(), offload_optimizer="host", offload_activations=False, offload_weights=False)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
