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
]


def main() -> None:
    quick = "--quick" in sys.argv
    table = Table("case", "wall s", "iteration s", "mapping", "MFU", "status", "evaluated / pruned")
    for label, w, s, n, knobs in CASES[-1:] if quick else CASES:
        t0 = time.perf_counter()
        r = optimize(w, s, num_chips=n, **knobs)
        wall = time.perf_counter() - t0
        p = r.parallelism
        mapping = (f"TP{p.tp} PP{p.pp} DP{p.dp} mb{p.micro_batch}x{p.num_micro_batches} v{p.interleave} "
                   f"{p.recompute} sp={p.sequence_parallel} dopt={p.distributed_optimizer}")
        table.add_row(label, f"{wall:.2f}", f"{r.iteration_time_s:.3f}", mapping, f"{r.model_flops_utilization:.1%}",
                      r.solver.status, f"{r.solver.candidates_evaluated} / {r.solver.candidates_pruned}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
