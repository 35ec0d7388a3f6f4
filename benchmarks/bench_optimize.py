"""Benchmark of the end-to-end optimizer (issue 4): full searches and a fixed mapping.

Run: .venv/bin/python benchmarks/bench_optimize.py [--quick]
Prints one row per case: wall time, iteration time, mapping, MFU, status, evaluated/pruned.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from dfmodel import optimize

CASES = [
    ("GPT-3 175B, 1024 x dgx_a100", "gpt3_175b", "dgx_a100", 1024, {}),
    ("GPT-3 1T, 1024 x sn30 (dataflow)", "gpt3_1t", "sn30", 1024, {}),
    ("Llama-3 70B, 512 x dgx_h100", "llama3_70b", "dgx_h100", 512, {}),
    ("GPT-3 175B fixed mapping (TP8 PP8 DP16, mb1)", "gpt3_175b", "dgx_a100", 1024,
     {"tp": 8, "pp": 8, "dp": 16, "micro_batch": 1, "recompute": "selective", "sequence_parallel": True,
      "interleave": 1, "distributed_optimizer": True}),
    # issue 10: the NeMo Llama 3.1 405B recipe with context parallelism (dgxc-benchmarking, 576 H100)
    ("Llama-3.1 405B cp2 recipe (TP8 PP9 CP2 DP4, v7, mb1)", "llama3_405b", "dgx_h100", 576,
     {"tp": 8, "pp": 9, "cp": 2, "dp": 4, "interleave": 7, "micro_batch": 1}),
    ("Llama-3.1 405B 128K (TP8 CP16 PP16 DP8)", "llama3_405b_128k", "dgx_h100", 16384,
     {"tp": 8, "cp": 16, "pp": 16, "dp": 8, "micro_batch": 1}),
    # issue 10: mixture of experts with expert parallelism (full searches). Mixtral's recipe
    # batch (256) has no dp dividing the preset's 1008 chips (14 racks): one NVL72 rack.
    ("Mixtral 8x7B, 72 x gb200_nvl72 (one rack)", "mixtral_8x7b", "gb200_nvl72", 72, {}),
    ("DeepSeek-V3 671B, 2048 x dgx_h800", "deepseek_v3", "dgx_h800", 2048, {}),
]


def main() -> None:
    quick = "--quick" in sys.argv
    table = Table("case", "wall s", "iteration s", "mapping", "MFU", "status", "evaluated / pruned")
    for label, w, s, n, knobs in CASES[-1:] if quick else CASES:
        t0 = time.perf_counter()
        r = optimize(w, s, num_chips=n, **knobs)
        wall = time.perf_counter() - t0
        p = r.parallelism
        mapping = (f"TP{p.tp} CP{p.cp} PP{p.pp} DP{p.dp} mb{p.micro_batch}x{p.num_micro_batches} v{p.interleave} "
                   f"{p.recompute} sp={p.sequence_parallel} zero={p.zero_stage}")
        table.add_row(label, f"{wall:.2f}", f"{r.iteration_time_s:.3f}", mapping, f"{r.model_flops_utilization:.1%}",
                      r.solver.status, f"{r.solver.candidates_evaluated} / {r.solver.candidates_pruned}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
