"""Per-case breakdown of the predicted step time next to the published one (issue 11 diagnosis).

For every case of a calibration dataset: the published mapping is fixed as in ``dfmodel validate``
(unknown knobs searched within Megatron's choices) and the prediction is split into the terms of
the model's breakdown (compute, exposed memory, TP / PP / DP / CP communication, bubble,
optimizer, ...), so a wrong term shows against the measured step time.

Run: PYTHONPATH=. python benchmarks/breakdown.py [h100_training | megatron_a100 | PATH]
"""

from __future__ import annotations

import sys

from dfmodel.errors import DFModelError
from dfmodel.validate import knobs_of, load_cases, optimize_as_megatron, resolve_cases, system_of, workload_of

#: Datasets whose runs predate FlashAttention (as benchmarks/calibrate.py evaluates them).
UNFUSED = ("megatron_a100",)


def main(name: str = "h100_training") -> None:
    path = resolve_cases(name)
    overrides = {"attention": "unfused"} if any(u in str(path) for u in UNFUSED) else {}
    for c in load_cases(path):
        w = workload_of(c)
        w["model"].update(overrides)
        try:
            r = optimize_as_megatron(w, system_of(c.system.chip), c.system.num_chips, knobs_of(c))
        except DFModelError as exc:
            print(f"{c.id:38s} not evaluable: {exc}")
            continue
        meas = c.measured.iteration_time_s
        parts = " ".join(f"{k}={v:.3f}" for k, v in r.breakdown_s.items() if v > 1e-4)
        print(f"{c.id:38s} {c.training.precision:6s} pred {r.iteration_time_s:8.3f} s  meas {meas:8.3f} s  "
              f"{r.iteration_time_s / meas - 1:+6.1%}  MFU {r.model_flops_utilization:.3f} | {parts}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
