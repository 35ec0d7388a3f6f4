"""Render a :class:`~dfmodel.result.Result` as rich tables on the terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dfmodel.cli_format import fmt, fmt_time
from dfmodel.result import Result


def render_result(r: Result, console: Console) -> None:
    p = r.parallelism
    head = Table(title=f"{r.workload} on {r.system} ({r.num_chips} chips)", show_header=False)
    head.add_row("iteration time", fmt_time(r.iteration_time_s))
    tput = f"{r.samples_per_s:.4g} samples/s"
    if r.tokens_per_s != r.samples_per_s:  # LLMs; other families count samples only
        tput += f", {fmt(r.tokens_per_s, 'tokens/s')}"
    head.add_row("throughput", tput)
    head.add_row("MFU / HFU", f"{r.model_flops_utilization:.1%} / {r.hardware_flops_utilization:.1%}")
    dims = "; ".join(f"{k}: {' x '.join(v) or '-'}" for k, v in p.dims.items())
    head.add_row(
        "mapping",
        f"TP {p.tp} x PP {p.pp} x DP {p.dp}, micro-batch {p.micro_batch} x {p.num_micro_batches}, "
        f"interleave {p.interleave}, recompute {p.recompute}, sequence parallel {p.sequence_parallel}, "
        f"distributed optimizer {p.distributed_optimizer}"
        + "".join(f", {k} {v}" for k, v in (("CP", getattr(p, "cp", 1)), ("EP", getattr(p, "ep", 1)),
                                           ("ZeRO stage", getattr(p, "zero_stage", 0))) if v not in (0, 1))
        + (f" ({p.cp_comm})" if getattr(p, "cp", 1) > 1 else ""),
    )
    head.add_row("placement", dims)
    head.add_row("bottleneck", r.bottleneck + (" (input-bound)" if r.input_bound else ""))
    head.add_row("cost / power", f"${fmt(r.cost_usd)} / {fmt(r.power_w, 'W')}")
    s = r.solver
    head.add_row(
        "solver",
        f"{s.status} (gap {s.gap:.2%}), {s.backend}, {s.wall_s:.2f} s, "
        f"{s.candidates_evaluated} evaluated, {s.candidates_pruned} pruned",
    )
    console.print(head)
    br = Table("component", "time", "share", title="breakdown of one iteration")
    for k, v in r.breakdown_s.items():
        br.add_row(k, fmt_time(v), f"{v / r.iteration_time_s:.1%}")
    mem = Table("memory per chip", "bytes")
    for k, v in r.memory_per_chip_bytes.items():
        mem.add_row(k, fmt(v, "B"))
    console.print(br)
    console.print(mem)
    for note in r.notes:
        console.print(f"note: {note}")
