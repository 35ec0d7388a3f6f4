"""Render a :class:`~dfmodel.result.Result` as rich tables on the terminal.

Each workload family reads its own figures: LLMs the TP x PP x DP mapping, MFU and tokens/s; HPL
the P x Q grid, NB, Rmax in Pflop/s and the fraction of peak (as the TOP500 list reports them);
FFT the decomposition, the time per transform and the fraction of peak; DLRM the embedding
sharding plan and samples/s. The family is read from ``result.pipeline`` (the keys each family's
``to_result`` writes), so a result loaded back from JSON renders the same way.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dfmodel.cli_format import fmt, fmt_bytes, fmt_time
from dfmodel.result import Result


def family_of(r: Result) -> str:
    """``hpl``, ``fft``, ``dlrm`` or ``llm`` (also the graph family), from the result's own keys."""
    p = r.pipeline or {}
    if "per_group_s" in p:
        return "hpl"
    if "decomposition" in p:
        return "fft"
    if "plan" in p:
        return "dlrm"
    return "llm"


def peak_system_flops(r: Result, system: Any, workload: Any) -> float | None:
    """Rpeak: chips x the chip's peak at the workload's precision (None without the objects)."""
    if system is None or workload is None:
        return None
    try:
        return r.num_chips * system.chip.peak(workload.precision)
    except (ValueError, AttributeError):
        return None


def _llm_rows(r: Result) -> list[tuple[str, str]]:
    p = r.parallelism
    tput = f"{r.samples_per_s:.4g} samples/s"
    if r.tokens_per_s != r.samples_per_s:  # LLMs; the graph family counts samples only
        tput += f", {fmt(r.tokens_per_s, 'tokens/s')}"
    return [
        ("throughput", tput),
        ("MFU / HFU", f"{r.model_flops_utilization:.1%} / {r.hardware_flops_utilization:.1%}"),
        ("mapping", f"TP {p.tp} x PP {p.pp} x DP {p.dp}, micro-batch {p.micro_batch} x {p.num_micro_batches}, "
                    f"interleave {p.interleave}, recompute {p.recompute}, sequence parallel {p.sequence_parallel}, "
                    f"distributed optimizer {p.distributed_optimizer}"
                    + "".join(f", {k} {v}" for k, v in (("CP", getattr(p, "cp", 1)), ("EP", getattr(p, "ep", 1)),
                                                       ("ZeRO stage", getattr(p, "zero_stage", 0))) if v not in (0, 1))
                    + (f" ({p.cp_comm})" if getattr(p, "cp", 1) > 1 else "")
                    + _offload_text(p)),
    ]


def _offload_text(p) -> str:
    """What the mapping offloads to host memory (empty: nothing)."""
    parts = [f"optimizer ({p.offload_optimizer})"] if getattr(p, "offload_optimizer", "none") != "none" else []
    parts += [k for k in ("activations", "weights") if getattr(p, f"offload_{k}", False)]
    return f", offload to host: {', '.join(parts)}" if parts else ""


def _hpl_rows(r: Result, rpeak: float | None, workload: Any) -> list[tuple[str, str]]:
    P, Q = r.pipeline["grid"]
    nb = getattr(workload, "nb", None)
    frac = r.model_flops_utilization  # useful flop / (time x Rpeak): HPL's Rmax / Rpeak
    rows = [("process grid", f"P x Q = {P} x {Q}" + (f", NB {nb}" if nb else "") +
             (f", N {workload.n:,}" if getattr(workload, "n", None) else ""))]
    if rpeak:
        rows.append(("Rmax", f"{frac * rpeak / 1e15:.4g} Pflop/s of Rpeak {rpeak / 1e15:.4g} Pflop/s ({frac:.1%})"))
    else:
        rows.append(("Rmax / Rpeak", f"{frac:.1%}"))
    rows.append(("schedule", str(r.pipeline.get("schedule", "-"))))
    return rows


def _fft_rows(r: Result, rpeak: float | None) -> list[tuple[str, str]]:
    p, pipe = r.parallelism, r.pipeline
    grid = pipe.get("grid") or []
    shape = " x ".join(str(g) for g in grid if g and g > 1) or "1"
    per_transform = 1.0 / r.samples_per_s if r.samples_per_s else float("nan")
    frac = r.model_flops_utilization
    rows = [
        ("decomposition", f"{pipe['decomposition']} {shape} ({p.tp} chips per transform), {p.dp} group(s) share "
                          f"the batch, {p.micro_batch} transform(s) x {p.num_micro_batches} chunk(s) per group"),
        ("time per transform", fmt_time(per_transform) + f" ({r.samples_per_s:.4g} transforms/s)"),
    ]
    achieved = f", {frac * rpeak / 1e12:.4g} Tflop/s nominal (5 N log2 N)" if rpeak else ""
    rows.append(("fraction of peak", f"{frac:.2%}{achieved}"))
    return rows


def _dlrm_rows(r: Result) -> list[tuple[str, str]]:
    p, pipe = r.parallelism, r.pipeline
    return [
        ("throughput", f"{r.samples_per_s:,.0f} samples/s"),
        ("sharding plan", f"{pipe.get('plan_label', '-')}: {p.tp} chips share one copy of the tables, "
                          f"{p.dp} replica(s); MLPs data-parallel over all {r.num_chips} chips"),
        ("micro-batch", f"{p.micro_batch} per chip x {p.num_micro_batches}"
                        + (", distributed optimizer" if p.distributed_optimizer else "")),
        ("MFU", f"{r.model_flops_utilization:.1%}"),
    ]


def head_rows(r: Result, *, system: Any = None, workload: Any = None) -> list[tuple[str, str]]:
    """The summary rows of one result, in the family's own terms."""
    kind = family_of(r)
    rpeak = peak_system_flops(r, system, workload)
    label = "run time" if kind == "hpl" else "iteration time"
    rows = [(label, fmt_time(r.iteration_time_s))]
    rows += {"hpl": lambda: _hpl_rows(r, rpeak, workload), "fft": lambda: _fft_rows(r, rpeak),
             "dlrm": lambda: _dlrm_rows(r), "llm": lambda: _llm_rows(r)}[kind]()
    dims = "; ".join(f"{k}: {' x '.join(v) or '-'}" for k, v in r.parallelism.dims.items())
    s = r.solver
    bound = f", bound {fmt_time(s.lower_bound_s)}" if s.status != "optimal" and s.lower_bound_s is not None else ""
    rows += [
        ("placement", dims),
        ("bottleneck", r.bottleneck + (" (input-bound)" if r.input_bound else "")),
        ("cost / power", f"${fmt(r.cost_usd)} / {fmt(r.power_w, 'W')}"),
        ("solver", f"{s.status} (gap {s.gap:.2%}{bound}), {s.backend}, {s.wall_s:.2f} s, "
                   f"{s.candidates_evaluated} evaluated, {s.candidates_pruned} pruned"),
    ]
    return rows


def render_result(r: Result, console: Console, *, system: Any = None, workload: Any = None) -> None:
    """Summary, breakdown and memory tables, then the notes. ``system``/``workload`` (loaded objects)
    add the figures that need the chip's peak (HPL Rmax in Pflop/s, FFT Tflop/s)."""
    head = Table(title=f"{r.workload} on {r.system} ({r.num_chips} chips)", show_header=False)
    for k, v in head_rows(r, system=system, workload=workload):
        head.add_row(k, escape(v))
    console.print(head)
    unit = {"hpl": "run", "fft": "batch of transforms"}.get(family_of(r), "iteration")
    br = Table("component", "time", "share", title=f"breakdown of one {unit}")
    for k, v in r.breakdown_s.items():
        br.add_row(k, fmt_time(v), f"{v / r.iteration_time_s:.1%}")
    mem = Table("memory per chip", "bytes")
    for k, v in r.memory_per_chip_bytes.items():
        mem.add_row(k, fmt_bytes(v))
    console.print(br)
    console.print(mem)
    render_alternatives(r, console)
    for note in r.notes:
        console.print(f"note: {escape(note)}", highlight=False)


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
