"""Benchmark of design-space sweeps (issue 5): points per minute on this machine.

Run: .venv/bin/python benchmarks/bench_sweep.py [--workers N ...] [--executor process|ray]
The sweep: GPT-3 13B on dgx_a100 / dgx_h100 / tpu_v4 x 64, 128, 256 chips x three memory
bandwidths = 27 points. tpu_v4 resizes in steps of 256 chips (16 x 16 x N torus), so its 64- and
128-chip points fail at once with an InputError: they are recorded, and the solved-points rate is
printed apart. Default: one run with 1 worker and one with a worker per core, to show the scaling.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dfmodel.sweeps import default_workers, sweep

SPEC = {
    "workloads": ["gpt3_13b"],
    "systems": ["dgx_a100", "dgx_h100", "tpu_v4"],
    "num_chips": [64, 128, 256],
    "overrides": {"system.chip.memory.bandwidth_Bps": ["1.2 TB/s", "2 TB/s", "3.35 TB/s"]},
}


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the pool's workers, once shut down)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="*", default=None, help="worker counts to time")
    ap.add_argument("--executor", default="process", choices=("process", "ray"))
    args = ap.parse_args()
    counts = args.workers or sorted({1, default_workers()})
    table = Table("executor", "workers", "points", "solved", "failed", "wall s", "points/min", "solved/min",
                  "CPU s / point")
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            t0, c0 = time.perf_counter(), _cpu_s()
            recs = sweep(SPEC, out=Path(tmp) / "r.jsonl", workers=n, executor=args.executor, progress=False)
            wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        solved = sum(r["error"] is None for r in recs)
        # CPU seconds do not depend on what else the machine runs: cores / (CPU s per point) is
        # the rate an otherwise idle machine would reach (Ray workers are not our children: n/a)
        table.add_row(args.executor, str(n), str(len(recs)), str(solved), str(len(recs) - solved), f"{wall:.1f}",
                      f"{60 * len(recs) / wall:.1f}", f"{60 * solved / wall:.1f}",
                      f"{cpu / len(recs):.2f}" if args.executor == "process" else "n/a")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
