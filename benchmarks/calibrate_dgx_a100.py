"""Fit the dgx_a100 preset's efficiency factors to the Megatron-LM measurements (issue 5).

Grid search over a few GLOBAL factors (the same for every case; all in (0, 1] except the
per-kernel overhead): matmul and vector efficiency, memory efficiency, kernel overhead, and
the DP overlap. Objective: mean absolute relative error of iteration time, subject to the max.
Prints every grid point and the best; the chosen values are then written into
systems/dgx_a100.yaml by hand, with this script named as their source.

Run: .venv/bin/python benchmarks/calibrate_dgx_a100.py [CASES.yaml or data-set name, default megatron_a100]
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

from dfmodel.presets import resolve
from dfmodel.validate import DEFAULT_SYSTEM, load_cases, summary, evaluate_case
from dfmodel.yamlio import read_yaml

CASES = sys.argv[1] if len(sys.argv) > 1 else "megatron_a100"  # the shipped data set (calibration/)
GRID = {
    "matmul": [0.6, 0.65, 0.7],
    "vector": [0.3, 0.6],
    "memory": [0.7, 0.85],
    "kernel_overhead_s": [5e-6, 15e-6],
}


def system_with(base: dict, **eff) -> dict:
    s = copy.deepcopy(base)
    s["chip"]["efficiency"].update(eff)
    return s


def main() -> None:
    base = read_yaml(resolve(DEFAULT_SYSTEM, "systems"))
    cases = load_cases(CASES)
    results = []
    for values in itertools.product(*GRID.values()):
        eff = dict(zip(GRID, values))
        rows = [evaluate_case(c, system_with(base, **eff)) for c in cases]
        s = summary(rows)
        results.append((s["mean_abs_error"], s["max_abs_error"], eff, rows))
        print(f"{eff}  mean {s['mean_abs_error']:.1%}  max {s['max_abs_error']:.1%}", flush=True)
    mean, worst, eff, rows = min(results, key=lambda r: (r[0] if r[1] <= 0.2 else 1 + r[0]))
    print(f"\nbest: {eff}  mean {mean:.1%}  max {worst:.1%}")
    for r in rows:
        print(f"  {r.id:40s} {r.mapping:36s} predicted {r.predicted_s:8.3f} s  measured {r.measured_s:8.3f} s  {r.error:+.1%}")


if __name__ == "__main__":
    main()
