"""How much of a weak-scaling family's measured step-time growth data-parallel traffic could explain
(issue 11 diagnosis: "measured step time GROWS with scale at fixed per-GPU work, the model is flat").

A weak-scaling family is the cases of one data set whose ids differ only in the trailing GPU count
(``dgxc-nemotron4-340b-fp8-128`` .. ``-2048``): same model, TP/PP/VP, micro-batches per replica;
only the data-parallel width grows. The only modelled work that grows with it is the gradient
reduce-scatter / all-reduce and the parameter all-gather over the data-parallel ranks. Their
whole time, ``sync_s`` (every collective of the step, overlapped or not, as the cost table prices
them), is the most that traffic can add to a step: even fully exposed, the step grows by at most

    bound = sync_s(largest) - sync_s(smallest)

against a measured growth ``measured(largest) - measured(smallest)``. A family whose measured growth
exceeds the bound cannot be explained by data-parallel traffic volume or latency, however its
overlap is modelled; what remains is outside the traffic model (stragglers, fabric congestion,
run-to-run spread).

``sync_s`` is read by recording what the LLM evaluation hands :func:`pipeline.dp_sync_exposed_s`
(only overlapped syncs pass there; a case whose sync is not overlapped shows ``-``).

Run: PYTHONPATH=. python benchmarks/scale_bound.py [h100_holdout h100_training ...]
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

import dfmodel.inter_chip.pipeline as pipe
from dfmodel.validate import knobs_of, load_cases, optimize_as_megatron, resolve_cases, system_of, workload_of


def family_key(case_id: str) -> str | None:
    """``'dgxc-nemotron4-340b-fp8-2048'`` -> ``'dgxc-nemotron4-340b-fp8'``; None without a trailing count.

    >>> family_key("dgxc-nemotron4-340b-fp8-2048"), family_key("deepseek-v3")
    ('dgxc-nemotron4-340b-fp8', None)
    """
    m = re.fullmatch(r"(.+)-(\d+)", case_id)
    return m.group(1) if m else None


def replica_work(case) -> tuple:
    """What one data-parallel replica runs: (tp, pp, vp, micro-batch, samples per replica). Cases of
    a family with different replica work are not weak scaling (a fixed global batch, strong
    scaling, or another micro-batch) and are kept apart."""
    p, t = case.parallelism, case.training
    return p.tp, p.pp, p.virtual_pipeline, t.micro_batch, t.global_batch / p.dp


def weak_scaling_families(cases) -> dict[str, list]:
    """Cases grouped by family and replica work, each group sorted by GPU count, at least two."""
    groups = defaultdict(list)
    for c in cases:
        key = family_key(c.id)
        if key is not None:
            groups[(key, replica_work(c))].append(c)
    return {k[0]: sorted(v, key=lambda c: c.system.num_chips) for k, v in groups.items() if len(v) > 1}


def growth_bound(sync_s: list[float], measured_s: list[float]) -> tuple[float, float]:
    """(measured growth, largest traffic-explainable growth) from the smallest to the largest scale,
    both as fractions of the smallest scale's measured step.

    >>> [round(x, 4) for x in growth_bound([0.2, 0.4], [3.0, 3.3])]
    [0.1, 0.0667]
    """
    base = measured_s[0]
    return (measured_s[-1] - base) / base, (sync_s[-1] - sync_s[0]) / base


def _sync_of(case) -> tuple[float, float | None]:
    """(predicted step, whole data-parallel sync seconds or None) of one case as validate runs it."""
    seen: list[float] = []
    orig = pipe.dp_sync_exposed_s

    def spy(**kw):
        seen.append(kw["sync_s"])
        return orig(**kw)

    pipe.dp_sync_exposed_s = spy
    try:
        r = optimize_as_megatron(workload_of(case), system_of(case.system.chip), case.system.num_chips, knobs_of(case))
    finally:
        pipe.dp_sync_exposed_s = orig
    return r.iteration_time_s, (max(seen) if seen else None)


def main(names: list[str]) -> None:
    for name in names:
        for key, cases in weak_scaling_families(load_cases(resolve_cases(name))).items():
            rows = [(c, *_sync_of(c)) for c in cases]
            syncs = [s for _, _, s in rows]
            meas = [c.measured.iteration_time_s for c, _, _ in rows]
            scale = f"{cases[0].system.num_chips}->{cases[-1].system.num_chips}"
            if None in syncs:
                print(f"{key:36s} {scale:10s} sync not overlapped in every case: -")
                continue
            grown, bound = growth_bound(syncs, meas)
            pred = (rows[-1][1] - rows[0][1]) / rows[0][1]
            verdict = "beyond traffic" if grown > bound else "within"
            print(f"{key:36s} {scale:10s} measured {grown:+6.1%}  predicted {pred:+6.1%}  "
                  f"traffic bound {bound:+6.1%}  sync {syncs[0]:.3f}->{syncs[-1]:.3f} s  {verdict}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["h100_holdout", "h100_training"])
