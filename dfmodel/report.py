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
        f"distributed optimizer {p.distributed_optimizer}",
    )
    head.add_row("placement", dims)
    head.add_row("bottleneck", r.bottleneck + (" (input-bound)" if r.input_bound else ""))
    head.add_row("cost / power", f"${fmt(r.cost_usd)} / {fmt(r.power_w, 'W')}")
    s = r.solver
    bound = f", bound {fmt_time(s.lower_bound_s)}" if s.status != "optimal" and s.lower_bound_s is not None else ""
    head.add_row(
        "solver",
        f"{s.status} (gap {s.gap:.2%}{bound}), {s.backend}, {s.wall_s:.2f} s, "
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
    render_alternatives(r, console)
    for note in r.notes:
        console.print(f"note: {note}")


def _knobs(d: dict) -> str:
    def show(v):
        if isinstance(v, dict):  # a placement
            return "; ".join(f"{k}: {' x '.join(g) or '-'}" for k, g in v.items())
        return str(v)

    return ", ".join(f"{k} {show(v)}" for k, v in d.items())


def render_alternatives(r: Result, console: Console) -> None:
    """Runners-up (what differs from the winner, how much slower, their bottleneck) and, per knob
    value the winner does not use, why not: slower, bounded no better, or ruled out."""
    if r.alternatives:
        alt = Table("#", "time", "slower", "differs from the winner", "bottleneck", title="runners-up")
        for a in r.alternatives:
            alt.add_row(str(a["rank"]), fmt_time(a["iteration_time_s"]), f"+{a['slower_by']:.2%}",
                        _knobs(a["differs"]), a["bottleneck"])
        console.print(alt)
    rows = [v for v in r.why_not.values() if v["knob"] in ("tp", "pp", "dp", "micro_batch", "interleave", "recompute",
                                                          "sequence_parallel", "distributed_optimizer")]
    if rows:
        why = Table("knob", "value", "why not", title="why not another value (best of all mappings with it)")
        for v in rows:
            if v["status"] == "slower":
                text = f"best {fmt_time(v['best_s'])} ({v['slower_by']:+.2%})"
            elif v["status"] == "bound":
                text = (f">= {fmt_time(v['bound_s'])} ({v['slower_by']:+.2%}, proven by bound)" if v["slower_by"] >= 0
                        else f"not ruled out: unexplored, bound {fmt_time(v['bound_s'])} ({v['slower_by']:+.2%})")
                if "best_s" in v:
                    text += f", best evaluated {fmt_time(v['best_s'])}"
            else:
                counts = ", ".join(f"{k} {n}" for k, n in v.get("counts", {}).items())
                need = f", needs >= {fmt(v['needs_bytes'], 'B')} per chip" if "needs_bytes" in v else ""
                text = f"ruled out: {counts}{need}"
            why.add_row(v["knob"], str(v["value"]), text)
        console.print(why)
    if r.ruled_out:
        parts = ", ".join(f"{k} {n}" for k, n in r.ruled_out.items())
        console.print(f"ruled out with a bound better than the winner: {parts}")
