"""Benchmark of the intra-chip pass: GPT-3 175B layer, TP 8, on the SN30-like dataflow chip.

Run ``python benchmarks/bench_intra_chip.py`` (add ``--cold`` to also time the MILP without a
warm start, ``--gurobi`` to add Gurobi where the licence allows, ``--no-streaming`` for the
resident-weights-only model). For each partition limit
(4, 8, 16, one per kernel) it prints the exact DP's wall time and objective, and the MILP's on
HiGHS warm-started from the DP plan: wall time, status, gap and objective. Not a timed test: the
figures depend on the machine (recorded ones: see the module's ``RECORDED`` string).

The per-chip graph is one layer (forward + backward + weight-gradient kernels, micro-batch 1,
sequence 2048) sharded over a TP group of 8 with the project's sharding pass
(:func:`dfmodel.inter_chip.sharding.megatron_shard` if present, else the sharding MILP
:func:`dfmodel.inter_chip.sharding.shard` with Megatron layouts, no sequence parallelism), which
also gives each communication kernel's network time.
"""

from __future__ import annotations

import argparse
import time

import dfmodel
from dfmodel.graph.build import build_graph
from dfmodel.intra_chip import CostModel, partition
from dfmodel.intra_chip.milp import build
from dfmodel.system.loader import load_system

RECORDED = """
With weight streaming (each partition picks its row tile and resident or streamed weights), same
2-core machine but shared with other jobs (load average ~3.5, so wall ~2x CPU). Back to back under
that load, the resident-only code before streaming took DP 1.5-1.7 s wall (1.0 s CPU) and MILP
5.0-5.6 s (solve 3.4-4.0 s) for 'all'. With streaming (and faster set costing):
 max_P   DP s     DP ms  #p |  MILP s solve s     status      gap   MILP ms   P  vars  rows  ints
     4   1.12   10.1573   3 |    3.49    2.47    optimal   0.000%   10.1573   4   509  1123   158
     8   1.00   10.1573   3 |    6.09    5.05    optimal   0.000%   10.1573   8  1055  2338   352
    16   1.10   10.1573   3 |    6.29    5.17    optimal   0.000%   10.1573   8  1055  2338   352
   all   1.05   10.1573   3 |    6.12    5.06    optimal   0.000%   10.1573   8  1055  2338   352
(DP CPU ~0.5 s. The last partition now streams its weights at tile 1: 486 MB of SRAM instead of
635 MB at tile 1/4, 0.03 % faster overall. --no-streaming: DP 0.9 s, MILP 6.7 s, 10.1603 ms.)

Resident weights only, before weight streaming, idle machine:
2-core machine, highspy 1.15.1, gurobipy 13.0.3 (size-limited licence); 42 kernels after sharding.
 max_P   DP s     DP ms  #p |  MILP s solve s     status      gap   MILP ms   P  vars  rows  ints | cold HiGHS | Gurobi
     4   0.60   10.1603   3 |    1.44    0.85    optimal   0.000%   10.1603   4   493  1103   146 | 1.12 s opt | 0.19 s opt
     8   0.56   10.1603   3 |    2.72    2.13    optimal   0.000%   10.1603   8  1023  2298   328 | 3.71 s opt | over licence
    16   0.58   10.1603   3 |    2.68    2.06    optimal   0.000%   10.1603   8  1023  2298   328 | 3.69 s opt | over licence
   all   0.56   10.1603   3 |    2.64    2.07    optimal   0.000%   10.1603   8  1023  2298   328 | 3.75 s opt | over licence
(MILP s = whole partition() call including the DP warm start; solve s = the solver alone.)
"""


def gpt3_layer_tp8(system, tp: int = 8):
    """``(per-chip graph, network seconds per kernel, how it was sharded)``."""
    graph = build_graph(dfmodel.load_workload("gpt3_175b"), batch=1)
    from dfmodel.inter_chip import sharding

    if hasattr(sharding, "megatron_shard"):
        sharded = sharding.megatron_shard(graph, tp)
        if isinstance(sharded, tuple):
            return sharded[0], sharded[1], "megatron_shard"
        return sharded, {}, "megatron_shard"
    from dfmodel.netmodels.table import CostTable

    group = sharding.TPGroup(tp, ((system.network[0].name, tp),))
    out = sharding.shard(graph, system, group, CostTable(system), sequence_parallel=False)
    return out.graph, dict(out.network_time_s), "sharding MILP (no sequence parallelism)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="also run the MILP without a warm start")
    ap.add_argument("--gurobi", action="store_true", help="also run Gurobi where the licence allows")
    ap.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per case (s)")
    ap.add_argument("--no-streaming", action="store_true", help="resident weights only")
    args = ap.parse_args(argv)
    kw = {"weight_streaming": not args.no_streaming}

    system = load_system("sn30")
    graph, net, how = gpt3_layer_tp8(system)
    cm = CostModel(graph, system, net, **kw)
    print(f"{graph.name}: {len(graph)} kernels, {len(graph.tensors)} tensors; sharded by {how}; "
          f"chip {system.chip.name} ({system.chip.sram_bytes / 1e6:.0f} MB SRAM, {system.chip.compute_tiles} tiles)")
    head = (f"{'max_P':>6} {'DP s':>6} {'DP ms':>9} {'#p':>3} | {'MILP s':>7} {'solve s':>7} {'status':>10} "
            f"{'gap':>8} {'MILP ms':>9} {'P':>3} {'vars':>5} {'rows':>5} {'ints':>5}")
    extra = []
    if args.cold:
        extra.append("cold")
    if args.gurobi:
        extra.append("gurobi")
    print(head + "".join(f" | {e:>22}" for e in extra))
    print("-" * (len(head) + 25 * len(extra)))
    for P in (4, 8, 16, None):
        t = time.perf_counter()
        d = partition(graph, system, network_time_s=net, method="dp", max_partitions=P, **kw)
        dp_s = time.perf_counter() - t
        t = time.perf_counter()
        m = partition(graph, system, network_time_s=net, method="milp", solver="highs", max_partitions=P,
                      time_limit_s=args.time_limit, **kw)
        milp_s = time.perf_counter() - t
        st = m.stats
        gap = f"{100 * m.gap:.3f}%" if m.gap is not None else "-"
        row = (f"{P if P else 'all':>6} {dp_s:6.2f} {d.time_s * 1e3:9.4f} {d.num_partitions:3d} | {milp_s:7.2f} "
               f"{st['solve_wall_s']:7.2f} {m.status:>10} {gap:>8} {m.time_s * 1e3:9.4f} {st['P']:3d} "
               f"{st['num_vars']:5d} {st['num_rows']:5d} {st['num_integer']:5d}")
        for e in extra:
            try:
                r = partition(graph, system, network_time_s=net, method="milp", max_partitions=P,
                              solver="gurobi" if e == "gurobi" else "highs", warm_start=(e != "cold"),
                              time_limit_s=args.time_limit, **kw)
                g = f"{100 * r.gap:.2f}%" if r.gap is not None else "-"
                row += f" | {r.stats['solve_wall_s']:6.2f}s {r.status[:8]:>8} {g:>6}"
            except dfmodel.DFModelError as err:
                row += f" | {'n/a: ' + str(err)[:16]:>22}"
        print(row)
        assert abs(m.time_s - d.time_s) <= 1e-6 * d.time_s or not m.proven_optimal, "MILP and DP disagree"
    print(f"\nbest plan ({d.num_partitions} partitions):")
    for i, p in enumerate(d.partitions):
        print(f"  {i}: {p.time_s * 1e3:.3f} ms (compute {p.compute_s * 1e3:.3f}, memory {p.memory_s * 1e3:.3f}, "
              f"network {p.network_s * 1e3:.3f}); SRAM {p.sram_bytes / 1e6:.0f} MB at tile {p.tile_fraction:g}, "
              f"weights {'streamed' if p.weights_streamed else 'resident'}; "
              f"{len(p.kernels)} kernels: {', '.join(p.kernels)}")
    form = build(cm, None)
    print(f"\nMILP for 'all': P reduced to {form.stats['P']} by the no-mergeable-neighbours bound "
          f"({form.stats['max_useful_partitions']}); {form.stats['separated_pairs']} capacity-separated pairs; "
          f"options (tile, streamed): {list(form.options)}")


if __name__ == "__main__":
    main()
