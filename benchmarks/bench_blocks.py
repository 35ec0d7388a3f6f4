"""Per-block solve benchmark and bit-identity oracle (issue 12).

Record which blocks a time-limited ``optimize`` solves, then replay exactly those block solves
on a fresh model and print CPU seconds per call plus a fingerprint of every result, so two
versions of the code can be compared call by call.

Run:
  python benchmarks/bench_blocks.py record WORKLOAD SYSTEM CHIPS LIMIT_S keys.json
  python benchmarks/bench_blocks.py replay WORKLOAD SYSTEM CHIPS keys.json out.json [MAX_CALLS]
  python benchmarks/bench_blocks.py compare a.json b.json
"""

from __future__ import annotations

import json
import sys
import time


def _model(workload, system, chips):
    from dfmodel.inter_chip.llm import LLMModel
    from dfmodel.graph.workload import load_workload
    from dfmodel.system.loader import load_system

    return LLMModel(load_workload(workload), load_system(system, num_chips=int(chips) or None))


def record(workload, system, chips, limit_s, out):
    from dfmodel import optimize
    from dfmodel.inter_chip.llm import LLMModel

    keys = []
    orig = LLMModel.block

    def block(self, which, micro_batch, tp, tp_group, sp, cp=1, ep=1, whole_experts=False):
        keys.append([which, micro_batch, tp, [list(p) for p in (tp_group or ())], sp, cp, ep, whole_experts])
        return orig(self, which, micro_batch, tp, tp_group, sp, cp, ep, whole_experts)

    LLMModel.block = block
    t0 = time.process_time()
    try:
        optimize(workload, system, num_chips=int(chips) or None, time_limit_s=float(limit_s))
    except Exception as e:  # noqa: BLE001 -- a time limit without incumbent still recorded keys
        print("optimize:", type(e).__name__, e)
    uniq = list({json.dumps(k): k for k in keys}.values())
    print(f"recorded {len(uniq)} distinct blocks in {time.process_time() - t0:.1f} CPU s")
    json.dump(uniq, open(out, "w"))


def fingerprint(b):
    if b is None:
        return None

    def pt(p):
        return None if p is None else [repr(p.time_s), {k: repr(v) for k, v in p.parts_s.items()},
                                       [sorted((k, repr(v) if isinstance(v, float) else str(v)) for k, v in r.items())
                                        for r in p.partitions], p.proven_optimal]

    sh = b.sharded
    on = None if b.onchip is None else repr(b.onchip)
    return {"plan": sorted(sh.plan.strategy.items()), "boundary": sh.plan.boundary_layout,
            "objective": repr(sh.plan.objective_s), "net": sorted((k, repr(v)) for k, v in sh.network_time_s.items()),
            "fwd": pt(b.fwd), "bwd": pt(b.bwd), "core": pt(b.attention_core), "core_bwd": pt(b.attention_core_bwd),
            "onchip": on, "params": repr(b.params_per_chip)}


def replay(workload, system, chips, keys_path, out, max_calls=None):
    keys = json.load(open(keys_path))[: int(max_calls) if max_calls else None]
    m = _model(workload, system, chips)
    for k in keys:  # build the graphs outside the timing
        m.graphs(k[1], k[5], k[6] if k[0] == "layer" else 1)
    res, total = [], 0.0
    for which, mb, tp, group, sp, cp, ep, whole in keys:
        group = tuple(tuple(p) for p in group)
        t0 = time.process_time()
        try:
            b = m.block(which, mb, tp, group, sp, cp, ep, whole)
            fp = fingerprint(b)
        except Exception as e:  # noqa: BLE001
            fp = f"{type(e).__name__}: {e}"
        total += time.process_time() - t0
        res.append(fp)
    print(f"{len(keys)} block solves: {total:.2f} CPU s, {1e3 * total / max(1, len(keys)):.2f} ms/call")
    json.dump(res, open(out, "w"))


def compare(a, b):
    A, B = json.load(open(a)), json.load(open(b))
    diff = [i for i, (x, y) in enumerate(zip(A, B)) if x != y]
    print(f"{len(A)} vs {len(B)} results, {len(diff)} differ", diff[:20])
    for i in diff[:3]:
        x, y = A[i], B[i]
        if isinstance(x, dict) and isinstance(y, dict):
            print(i, {k: (x[k], y[k]) for k in x if x[k] != y.get(k)})
        else:
            print(i, x, y)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"record": record, "replay": replay, "compare": compare}[cmd](*args)
