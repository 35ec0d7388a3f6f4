"""Benchmark of the end-to-end optimizer (issue 4): full searches and a fixed mapping.

Run: .venv/bin/python benchmarks/bench_optimize.py [--quick] [--time-limit S] [--workers 1,2] [--scale]
Prints one row per case and worker count: wall time, CPU time (this process and its search
workers), iteration time, mapping, MFU, status (with the gap when a ``--time-limit`` cut the
search), evaluated/pruned. Without ``--time-limit`` every search runs to its proven optimum, however
long that takes (DeepSeek-V3's full search does not finish in minutes). ``--workers 1,2`` runs each
case serial and on two worker processes (issue 12: the answers must agree; the CPU column shows the
parallel overhead). ``--scale`` runs the full searches of issue 12's two-core measurement instead.
"""

from __future__ import annotations

import resource
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
    # issue 10: mixture of experts with expert parallelism (full searches); Mixtral on one NVL72 rack
    ("Mixtral 8x7B, 72 x gb200_nvl72 (one rack)", "mixtral_8x7b", "gb200_nvl72", 72, {}),
    ("DeepSeek-V3 671B, 2048 x dgx_h800", "deepseek_v3", "dgx_h800", 2048, {}),
]

#: issue 12's measurement of the two-core search: full searches at the systems' default sizes
SCALE_CASES = [
    ("GPT-3 175B, dgx_h100", "gpt3_175b", "dgx_h100", None, {}),
    ("Llama-3 70B, dgx_h100", "llama3_70b", "dgx_h100", None, {}),
    ("Llama-3.1 405B, dgx_h100", "llama3_405b", "dgx_h100", None, {}),
    ("Mixtral 8x7B, dgx_h100", "mixtral_8x7b", "dgx_h100", None, {}),
    ("DeepSeek-V3 671B, 2048 x dgx_h800", "deepseek_v3", "dgx_h800", 2048, {}),
]


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the search workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    quick = "--quick" in sys.argv
    limit_s = float(sys.argv[sys.argv.index("--time-limit") + 1]) if "--time-limit" in sys.argv else None
    workers = ([int(x) for x in sys.argv[sys.argv.index("--workers") + 1].split(",")]
               if "--workers" in sys.argv else [None])
    cases = SCALE_CASES if "--scale" in sys.argv else CASES
    table = Table("case", "workers", "wall s", "CPU s", "iteration s", "mapping", "MFU", "status",
                  "evaluated / pruned")
    for label, w, s, n, knobs in cases[-1:] if quick else cases:
        for j in workers:
            t0, c0 = time.perf_counter(), cpu_s()
            r = optimize(w, s, num_chips=n, time_limit_s=limit_s, workers=j, **knobs)
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
            p = r.parallelism
            mapping = (f"TP{p.tp} CP{p.cp} EP{p.ep} PP{p.pp} DP{p.dp} mb{p.micro_batch}x{p.num_micro_batches} "
                       f"v{p.interleave} {p.recompute} sp={p.sequence_parallel} zero={p.zero_stage}")
            table.add_row(label, "all" if j is None else str(j), f"{wall:.2f}", f"{cpu:.2f}", f"{r.iteration_time_s:.4f}",
                          mapping, f"{r.model_flops_utilization:.1%}",
                          r.solver.status + (f" (gap {r.solver.gap:.1%})" if r.solver.status != "optimal" else ""),
                          f"{r.solver.candidates_evaluated} / {r.solver.candidates_pruned}")
            print(f"{label} workers={j}: wall {wall:.2f} s, CPU {cpu:.2f} s, {r.iteration_time_s:.6g} s "
                  f"{r.solver.status} gap {r.solver.gap:.3g} {mapping}", file=sys.stderr, flush=True)
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
