"""The search-at-scale matrix (issue 12): every shipped LLM workload on every shipped system, at
the system's default size and at 8x, 64x and 1024x of a node.

A node is the system's inner network dimensions (all but the outermost, which ``num_chips``
resizes): 8 GPUs of a DGX, 64 chips of an SN30 8x8 ring pair... A one-dimension system's node
is one chip. Each cell is one full ``optimize`` (nothing fixed) under ``--time-limit`` seconds
(default 10, the issue's target): a cell whose status is ``optimal`` was searched to proven
optimality within it; ``time_limit`` cells report the best found and its gap. Each cell runs in a
process forked from this one before any search, so it starts as ``dfmodel solve`` does, with
the package's content-keyed caches (lattice pair structures, plan floors) empty and its modules
imported (import time, paid once per process, is not search time): run in one
process, a cell reuses what the cells before it built (DeepSeek-V3 on 8192 dragonfly chips:
9.5 s after the 512-chip cell, 10.3-11 s cold). ``--warm``: every cell in this process (a
sweep's view).

Run:  python benchmarks/bench_matrix.py [--quick] [--warm] [--time-limit S] [--alternatives K]
                                        [--workloads a,b] [--systems a,b] [--sizes default,8,64,1024]
                                        [--all-workloads] [--json out.jsonl]
``--quick``: gpt3_13b and llama3_70b on dgx_h100 and sn30, default size and 8x.
Prints one row per cell: wall, CPU seconds (``cpu_s``: the search's own cost, its worker
processes included, when other processes share the cores), candidates evaluated / pruned, the winner, iteration time, status, gap.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import resource
import time

from rich.console import Console
from rich.table import Table

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import DFModelError
from dfmodel.presets import list_presets

# The modules a search imports on first use (every family, the graph builders, the parallel
# search's shared memory), imported once here: each cell forks from this process, so its wall is
# the search's own, as in a sweep, not ~40 modules' import (0.03 s with bytecode caches, 0.1 s
# where none are written: PYTHONDONTWRITEBYTECODE). The search's content caches still start empty.
import dfmodel.graph.build  # noqa: E402,F401
import dfmodel.inter_chip.llm_result  # noqa: E402,F401
import dfmodel.inter_chip.registry  # noqa: E402,F401
import dfmodel.solvers.pairwise  # noqa: E402,F401
import multiprocessing.popen_fork  # noqa: E402,F401
import multiprocessing.sharedctypes  # noqa: E402,F401
import multiprocessing.synchronize  # noqa: E402,F401

SIZES = ("default", "8", "64", "1024")
QUICK = {"workloads": ["gpt3_13b", "llama3_70b"], "systems": ["dgx_h100", "sn30"], "sizes": ["default", "8"]}


def llm_workloads() -> list[str]:
    return [p.stem for p in list_presets("workloads") if load_workload(p).kind == "llm"]


def other_workloads() -> list[str]:
    """The shipped DLRM, HPL, FFT and graph workloads (``--all-workloads``)."""
    return [p.stem for p in list_presets("workloads") if load_workload(p).kind != "llm"]


def all_systems() -> list[str]:
    return [p.stem for p in list_presets("systems")]


def node_chips(system_name: str) -> int:
    """Chips in one node: the product of every network dimension but the outermost."""
    dims = load_system(system_name).network
    return math.prod(d.size for d in dims[:-1]) if len(dims) > 1 else 1


def chips_for(system_name: str, size: str) -> int | None:
    return None if size == "default" else node_chips(system_name) * int(size)


def mapping_text(r) -> str:
    p = r.parallelism
    if not hasattr(p, "micro_batch"):  # DLRM / HPL / FFT / graph families: their own knobs
        d = r.to_dict()["parallelism"]
        return " ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, (dict, list)))
    extra = "".join(f" {k.upper()}{getattr(p, k)}" for k in ("cp", "ep") if getattr(p, k, 1) > 1)
    return (f"TP{p.tp} PP{p.pp} DP{p.dp}{extra} mb{p.micro_batch}x{p.num_micro_batches} v{p.interleave} "
            f"{p.recompute[:3]} sp={int(p.sequence_parallel)} zero={getattr(p, 'zero_stage', int(p.distributed_optimizer))}")


def cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the search's forked workers
    are reaped before optimize returns, so their time lands in RUSAGE_CHILDREN)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def run_cell(workload: str, system: str, size: str, time_limit_s: float, alternatives: int) -> dict:
    n = chips_for(system, size)
    t0, c0 = time.perf_counter(), cpu_s()
    row = {"workload": workload, "system": system, "size": size,
           "num_chips": n if n is not None else load_system(system).num_chips}
    try:
        r = optimize(workload, system, num_chips=n, time_limit_s=time_limit_s, alternatives=alternatives)
    except DFModelError as exc:
        row.update(wall_s=time.perf_counter() - t0, cpu_s=cpu_s() - c0, status=type(exc).__name__,
                   message=str(exc))
        return row
    row.update(wall_s=time.perf_counter() - t0, cpu_s=cpu_s() - c0, status=r.solver.status, gap=r.solver.gap,
               evaluated=r.solver.candidates_evaluated, pruned=r.solver.candidates_pruned,
               iteration_time_s=r.iteration_time_s, mapping=mapping_text(r), mfu=r.model_flops_utilization)
    return row


def run_cell_cold(workload: str, system: str, size: str, time_limit_s: float, alternatives: int) -> dict:
    """:func:`run_cell` in a process forked for it: the caches a search fills start empty."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_cell_child, args=(send, workload, system, size, time_limit_s, alternatives))
    child.start()
    send.close()
    try:
        row = recv.recv()
    except EOFError:  # the child died before it could answer (killed, out of memory)
        row = None
    child.join()
    return row or _failed_row(workload, system, size, "crashed", f"the cell's process exited with {child.exitcode}")


def _failed_row(workload: str, system: str, size: str, status: str, message: str) -> dict:
    """A cell that returned no result: its status and why."""
    return {"workload": workload, "system": system, "size": size, "num_chips": None, "wall_s": 0.0, "cpu_s": 0.0,
            "status": status, "message": message}


def _cell_child(conn, *args) -> None:
    try:
        conn.send(run_cell(*args))
    except BaseException as exc:  # noqa: BLE001 -- the parent prints it as the cell's status
        conn.send(_failed_row(*args[:3], type(exc).__name__, str(exc)))
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm", action="store_true", help="every cell in this process (caches carried over)")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--alternatives", type=int, default=5)
    ap.add_argument("--workloads")
    ap.add_argument("--all-workloads", action="store_true", help="the non-LLM presets too (DLRM, HPL, FFT, graphs)")
    ap.add_argument("--systems")
    ap.add_argument("--sizes")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    workloads = a.workloads.split(",") if a.workloads else QUICK["workloads"] if a.quick else llm_workloads()
    if a.all_workloads:
        workloads += [w for w in other_workloads() if w not in workloads]
    systems = a.systems.split(",") if a.systems else QUICK["systems"] if a.quick else all_systems()
    sizes = a.sizes.split(",") if a.sizes else QUICK["sizes"] if a.quick else list(SIZES)
    console = Console(width=220)
    table = Table("workload", "system", "chips", "wall s", "cpu s", "evaluated / pruned", "winner", "iteration", "status",
                  "gap", title=f"full search, time limit {a.time_limit:g} s per cell")
    out = open(a.json_path, "w") if a.json_path else None
    rows = []
    for w in workloads:
        for s in systems:
            for size in sizes:
                row = (run_cell if a.warm else run_cell_cold)(w, s, size, a.time_limit, a.alternatives)
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                ok = "iteration_time_s" in row
                table.add_row(
                    w, s, f"{row['num_chips']}" + ("" if size == "default" else f" ({size}x node)"),
                    f"{row['wall_s']:.2f}", f"{row['cpu_s']:.2f}",
                    f"{row['evaluated']} / {row['pruned']}" if ok else "-",
                    row.get("mapping", row.get("message", ""))[:90],
                    f"{row['iteration_time_s']:.4g} s" if ok else "-",
                    row["status"], f"{row['gap']:.1%}" if ok else "-",
                )
                console.print(f"{w} {s} {size}: {row['status']} in {row['wall_s']:.2f} s ({row['cpu_s']:.2f} s CPU)", style="dim")
    console.print(table)
    done = [r for r in rows if r["status"] == "optimal"]
    console.print(f"{len(done)}/{len(rows)} cells proven optimal within {a.time_limit:g} s; "
                  f"max wall {max(r['wall_s'] for r in rows):.2f} s, max CPU {max(r['cpu_s'] for r in rows):.2f} s "
                  f"(the limit is wall time: on a loaded machine CPU seconds say what the search cost)")
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    late = [r for r in rows if r["wall_s"] > a.time_limit + 1.0]
    console.print("by status: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())) +
                  f"; cells past the limit + 1 s: {len(late)}" +
                  ("".join(f"\n  {r['workload']}/{r['system']}/{r['size']}: {r['wall_s']:.2f} s" for r in late)))
    if out:
        out.close()


if __name__ == "__main__":
    main()
