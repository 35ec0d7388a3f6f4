"""Terminal tables for a result's storage I/O: input (steady and first epoch), tiers, checkpoint
and I/O energy (the ``io`` section of :class:`~dfmodel.result.Result`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dfmodel.cli_format import fmt, fmt_time
from dfmodel.result import Result


def _pct(x: float) -> str:
    return f"{x:.1%}"


def render_io(r: Result, console: Console) -> None:
    """Print the I/O tables; nothing when the system has no storage block."""
    io = r.io
    if not io:
        return
    head = Table(title="storage I/O per iteration", show_header=False)
    t = r.iteration_time_s
    head.add_row("input (steady state)", f"{fmt_time(io['input_s'])} exposed ({_pct(io['input_s'] / t)}), "
                 f"binding tier: {io['binding_tier']}")
    steady, cold = io.get("steady_state"), io.get("first_epoch")
    if steady:
        bound = steady["stages"].get(steady["binding"], {}).get("bound", "")
        head.add_row("input load per step", f"{fmt_time(steady['load_s'])} ({bound}-bound) vs step "
                     f"{fmt_time(t - io['input_s'] - io['checkpoint_s'])}")
    if cold:
        extra = io.get("first_epoch_extra_s")
        head.add_row("input (first epoch, cold)", f"{fmt_time(cold['exposed_s'])} exposed per step, load "
                     f"{fmt_time(cold['load_s'])}, binding tier: {cold['binding']}"
                     + (f"; +{fmt_time(extra)} over the epoch ({io['epoch_steps']:.4g} steps)" if extra else ""))
    ck = io.get("checkpoint")
    head.add_row("checkpoint", f"{fmt_time(io['checkpoint_s'])} per step ({_pct(io['checkpoint_s'] / t)})"
                 if ck is None else
                 f"{fmt_time(io['checkpoint_s'])} per step ({_pct(io['checkpoint_s'] / t)}): {fmt(ck['bytes_total'], 'B')} "
                 f"to {ck['tier']} every {ck['interval_steps']:.4g} steps, {ck['mode']}; write "
                 f"{fmt_time(ck['write_s'])}, stall {fmt_time(ck['stall_s'])}")
    if ck is not None:
        head.add_row("restart", f"{fmt_time(ck['restart_s'])} from {ck['restart_tier']} "
                     f"(cold from {ck['tier']}: {fmt_time(ck['restart_cold_s'])})")
    e = io["energy_j_per_step"]
    head.add_row("energy per step", f"compute {fmt(e['compute'], 'J')} + I/O {fmt(e['io'], 'J')} "
                 f"({fmt(io['power_w'], 'W')} storage) = {fmt(e['total'], 'J')}"
                 + (f"; {io['samples_per_j']:.4g} samples/J" if io.get("samples_per_j") else ""))
    console.print(head)
    if steady:
        tiers = Table("stage", "bytes", "hit", "steady", "1st epoch", "bound",
                      title="input per node and step (tiers innermost first, storage NIC, CPU)")
        names = [n for n, s in steady["stages"].items() if s["kind"] not in ("network", "cpu")]
        home = names[-1] if names else None  # the outermost tier holds the dataset: no hit ratio
        for name, s in steady["stages"].items():
            c = cold["stages"].get(name, {}) if cold else {}
            tier = s["kind"] not in ("network", "cpu")
            hit = "home" if name == home else (_pct(s["hit_ratio"]) if tier else "-")
            tiers.add_row(name, _pct(s["share"]) if tier else "-", hit,
                          fmt_time(s["time_s"]), fmt_time(c.get("time_s", 0.0)), s["bound"])
        console.print(tiers)
