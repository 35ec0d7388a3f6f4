"""The ``dfmodel`` command: a thin layer over the public API.

Every command is a few lines that call the library; every :class:`DFModelError` becomes one
line on stderr and its exit code (2 bad input, 3 nothing fits, 4 solver unavailable or failed),
never a traceback. Output paths are checked before any work starts.
"""

from __future__ import annotations

import time

_STARTED_S = time.perf_counter()  # the command's start: --time-limit counts from here

import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path
from typing import Optional

import typer
import typer.rich_utils
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dfmodel.cli_format import console_width, fmt, fmt_bytes, fmt_time
from dfmodel.errors import DFModelError, InputError

# --help and tables use the whole width when stdout is a file or pipe (rich would cut at 80)
if typer.rich_utils.MAX_WIDTH is None and console_width() is not None:
    typer.rich_utils.MAX_WIDTH = min(console_width(), 160)

app = typer.Typer(
    help="DFModel: map a workload onto a machine and predict how fast it runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=console_width(sys.stdout))
err = Console(stderr=True, width=console_width(sys.stderr))


def writable(path: Optional[Path | str], option: str, *, makes_dirs: bool = False) -> None:
    """Fail fast (exit 2, one line) when ``path`` cannot be written, before any solving starts.

    ``makes_dirs``: the command creates missing directories (``sweep --out``), so the nearest
    existing ancestor must be a writable directory instead.
    """
    if path is None or str(path) == "-":
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError("is a directory, expected a file path", source=str(p), field=option)
    if makes_dirs:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise InputError(f"{str(parent)!r} is not a directory", source=str(p), field=option)
    if not parent.is_dir():
        raise InputError(f"directory {str(parent)!r} does not exist", source=str(p), field=option)
    import os

    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError("not writable (permission denied)", source=str(p), field=option)


def guarded(fn):
    """Turn DFModelError into a one-line message and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DFModelError as exc:
            # escape: messages hold brackets ("pip install 'dfmodel[gurobi]'") that rich would eat
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


@app.command()
@guarded
def systems() -> None:
    """List the shipped system presets, one line each."""
    from dfmodel.presets import list_presets
    from dfmodel.system import load_system

    table = Table("preset", "chips", "chip", "execution", "network", box=None)
    for path in list_presets("systems"):
        s = load_system(path)
        net = " x ".join(f"{d.name}:{d.topology}({d.size})" for d in s.network)
        table.add_row(path.stem, str(s.num_chips), s.chip.name, s.chip.execution, net)
    out.print(table)


@app.command()
@guarded
def workloads() -> None:
    """List the shipped workload presets, one line each."""
    from dfmodel.graph.build import summary
    from dfmodel.graph.workload import load_workload
    from dfmodel.presets import list_presets

    table = Table("preset", "kind", "params", "FLOP/iteration", "description", box=None)
    for path in list_presets("workloads"):
        w = load_workload(path)
        s = summary(w)
        table.add_row(path.stem, w.kind, fmt(s["params"]), fmt(s["flop_per_iteration"]), w.description)
    out.print(table)


@app.command()
@guarded
def check(file: Path = typer.Argument(..., help="A workload or system YAML file, or a preset name.")) -> None:
    """Validate a workload or system YAML; exit 2 with a one-line error if it is bad."""
    from dfmodel.graph.build import build_graphs
    from dfmodel.graph.workload import load_workload
    from dfmodel.presets import resolve
    from dfmodel.system import load_system
    from dfmodel.yamlio import read_yaml

    if not file.exists():  # a preset name: a workload first, then a system
        file = next((p for p in (resolve(file, "workloads"), resolve(file, "systems")) if p.exists()), file)
    if not file.exists():
        from dfmodel.presets import suggestion

        hint = suggestion(file, "workloads") or suggestion(file, "systems")
        raise InputError(f"no such file or workload/system preset{hint} (see dfmodel workloads, dfmodel systems)",
                         source=str(file))
    data = read_yaml(file)
    if "kind" in data:
        w = load_workload(file)
        g = build_graphs(w)
        out.print(f"ok: {file}: workload {w.name} ({w.kind}), {len(g.layer)} kernels per layer")
    else:
        s = load_system(file)
        out.print(f"ok: {file}: system {s.name}, {s.num_chips} chips of {s.chip.name}")


@app.command()
@guarded
def graph(
    workload: str = typer.Option(..., "--workload", "-w", help="Workload YAML or preset name."),
    batch: Optional[int] = typer.Option(None, help="Sequences/samples in the graph (default: global batch)."),
    kernels: bool = typer.Option(True, "--kernels/--no-kernels", help="List every kernel."),
    dot: Optional[Path] = typer.Option(None, help="Write the graph as Graphviz DOT."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the graph as JSON."),
    png: Optional[Path] = typer.Option(None, help="Draw the graph to a PNG file."),
) -> None:
    """Show a workload's dataflow graph: kernels, tensors, FLOP and parameters."""
    from dfmodel.graph.build import build_graphs, summary
    from dfmodel.graph.workload import load_workload

    for path, option in ((dot, "--dot"), (json_path, "--json"), (png, "--png")):
        writable(path, option)
    w = load_workload(workload)
    graphs = build_graphs(w, batch=batch)
    g = graphs.layer
    if kernels:
        table = Table("kernel", "kind", "phase", "FLOP", "output bytes", "weight bytes", title=g.name)
        table.columns[0].overflow = "fold"  # long kernel names wrap, never cut into look-alikes
        for k in g.kernels:
            table.add_row(k.name, k.kind.value, k.phase.value, fmt(k.flop), fmt_bytes(k.output_bytes), fmt_bytes(k.weight_bytes))
        out.print(table)
    s = summary(w, batch=batch)
    out.print(
        f"{w.name}: {s['kernels']} kernels, {s['tensors']} tensors per layer x {graphs.num_layers} layers; "
        f"FLOP per layer {fmt(s['flop_per_layer'])}, per iteration {fmt(s['flop_per_iteration'])}; "
        f"parameters {fmt(s['params'])} ({s['params']:.4g})"
    )
    if dot:
        dot.write_text(g.to_dot())
    if json_path:
        json_path.write_text(g.to_json())
    if png:
        from dfmodel.plots import draw_graph

        draw_graph(g).savefig(png, dpi=120, bbox_inches="tight")
    for path in (dot, json_path, png):
        if path:
            out.print(f"wrote {path}")


@app.command()
@guarded
def collective(
    system: str = typer.Option(..., "--system", "-s", help="System YAML or preset name."),
    size: str = typer.Option("1 GiB", help="Message size, e.g. '1 GiB' or 1e9."),
    group: Optional[str] = typer.Option(
        None, help="Dims and members, innermost first, e.g. 'nvlink=8,ib=4' (default: whole machine)."
    ),
    num_chips: Optional[int] = typer.Option(None, help="Resize the outermost dimension."),
) -> None:
    """Cost of every collective for one message size over a group of the network."""
    from dfmodel.netmodels import COLLECTIVES, CostTable
    from dfmodel.system import load_system
    from dfmodel.system.units import parse_quantity

    sys_ = load_system(system, num_chips=num_chips)
    try:
        size_bytes = parse_quantity(size, "bytes")
        members = [(d.name, d.size) for d in sys_.network]
        if group:
            members = [(name.strip(), int(n)) for name, n in (part.split("=") for part in group.split(","))]
    except ValueError as exc:
        raise InputError(f"{exc} (expected e.g. --size '1 GiB' --group nvlink=8,ib=4)", field="--size/--group") from None
    table_ = CostTable(sys_)
    group_label = " x ".join(f"{name}={n}" for name, n in members)
    table = Table("collective", "time", "algorithm", title=f"{fmt_bytes(size_bytes)} over {group_label}")
    for name in COLLECTIVES:
        try:
            c = table_.cost(name, size_bytes, tuple(members))
        except ValueError as exc:
            raise InputError(str(exc), source=system, field="--group") from None
        table.add_row(name, fmt_time(c.time_s), c.algorithm)
    out.print(table)


@app.command()
@guarded
def solve(
    workload: str = typer.Option(..., "--workload", "-w", help="Workload YAML or preset name."),
    system: str = typer.Option(..., "--system", "-s", help="System YAML or preset name."),
    tp: Optional[int] = typer.Option(None, help="Fix the tensor-parallel degree."),
    pp: Optional[int] = typer.Option(None, help="Fix the pipeline-parallel degree."),
    dp: Optional[int] = typer.Option(None, help="Fix the data-parallel degree."),
    micro_batch: Optional[int] = typer.Option(None, help="Fix the micro-batch size."),
    recompute: Optional[str] = typer.Option(None, help="none | selective | full."),
    sequence_parallel: Optional[bool] = typer.Option(
        None, "--sequence-parallel/--no-sequence-parallel",
        help="Fix sequence parallelism on or off (Korthikanti et al. 2022; needs TP > 1).",
    ),
    interleave: Optional[int] = typer.Option(None, help="Fix the pipeline interleaving (virtual stages)."),
    distributed_optimizer: Optional[bool] = typer.Option(
        None, "--distributed-optimizer/--no-distributed-optimizer",
        help="Fix optimizer-state sharding over DP replicas on or off (Megatron distributed optimizer).",
    ),
    cp: Optional[int] = typer.Option(None, help="Fix the context-parallel degree."),
    ep: Optional[int] = typer.Option(None, help="Fix the expert-parallel degree (MoE; carved out of dp x cp)."),
    zero: Optional[int] = typer.Option(None, help="Fix the ZeRO stage: 0-3 (1 = distributed optimizer, 3 = FSDP)."),
    cp_comm: Optional[str] = typer.Option(None, help="Context-parallel K/V exchange: ring | all_gather."),
    overlap_grad_reduce: Optional[bool] = typer.Option(
        None, "--overlap-grad-reduce/--no-overlap-grad-reduce",
        help="Fix Megatron's overlap_grad_reduce (DP gradient reduction under the last backward) on or off."),
    tp_comm_overlap: Optional[bool] = typer.Option(
        None, "--tp-comm-overlap/--no-tp-comm-overlap",
        help="Fix Megatron's tp_comm_overlap (TP collectives chunked under their GEMMs, TE userbuffers) on or off."),
    etp: Optional[int] = typer.Option(
        None, help="Fix expert tensor parallelism (MoE): 0 = same as TP (Megatron default), 1 = experts unsplit, "
        "the ep group spans the TP ranks (Megatron-Core --expert-tensor-parallel-size 1)."),
    overlap_moe_expert_parallel_comm: Optional[bool] = typer.Option(
        None, "--overlap-moe-expert-parallel-comm/--no-overlap-moe-expert-parallel-comm",
        help="Fix the MoE all-to-all overlap (Megatron-Core --overlap-moe-expert-parallel-comm, DeepSeek DualPipe) on or off."),
    overlap_param_gather: Optional[bool] = typer.Option(
        None, "--overlap-param-gather/--no-overlap-param-gather",
        help="Fix Megatron's overlap_param_gather (distributed-optimizer parameter all-gather hidden) on or off."),
    offload_optimizer: Optional[str] = typer.Option(
        None, help="Fix optimizer offload to host memory: none | host (ZeRO-Offload, CPU step) | delayed "
        "(ZeRO-Offload's one-step delayed update); default: tried where a mapping does not fit (needs a host block)."),
    offload_activations: Optional[bool] = typer.Option(
        None, "--offload-activations/--no-offload-activations",
        help="Fix activation offload to host memory (saved activations copied out in forward, prefetched in backward)."),
    offload_weights: Optional[bool] = typer.Option(
        None, "--offload-weights/--no-offload-weights",
        help="Fix weight offload to host memory (ZeRO-Infinity: layer weights streamed per layer; needs the optimizer offloaded)."),
    num_chips: Optional[int] = typer.Option(None, help="Resize the system's outermost dimension."),
    precision: Optional[str] = typer.Option(
        None, help="Override the workload's precision: fp64 | fp32 | bf16 | fp16 | fp8 (e.g. bf16 for an fp32 workload on TPU v4)."
    ),
    pipeline_layout: Optional[str] = typer.Option(
        None, help="Override the LLM workload's training.pipeline_layout: Megatron-Core's layout string, e.g. "
        "'Et|(tt|)*30mL' (E embedding, t layer, m MTP, L loss, | between virtual stages); pp x vp then equals its stages."),
    solver: str = typer.Option("auto", help="auto | highs | gurobi."),
    time_limit: Optional[float] = typer.Option(
        None, help="Seconds for the whole search (every MILP inside gets at most the time left); when it passes, "
        "the best mapping found is reported with status time_limit, its proven bound and gap."),
    alternatives: int = typer.Option(5, help="Runners-up to report, each exactly the next best (0: none)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1,
                                       help="Processes sharing the search (default: one per usable core; "
                                       "the answer is the same for any number)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the result as JSON to PATH, or '-' for stdout alone."),
    plot_path: Optional[Path] = typer.Option(
        None, "--plot", help="Save one figure: time breakdown beside the 1F1B pipeline timeline (.png, .svg, .pdf)."
    ),
) -> None:
    """Find the fastest mapping of a workload on a system and report it."""
    from dfmodel.graph.workload import load_workload
    from dfmodel.optimizer import optimize, with_pipeline_layout, with_precision
    from dfmodel.progress import search_progress
    from dfmodel.report import render_result
    from dfmodel.report_io import render_io
    from dfmodel.system import load_system

    from dfmodel.solvers.deadline import deadline_scope

    writable(json_out, "--json")
    writable(plot_path, "--plot")
    # --time-limit caps the command, not only the search: imports and loading count too
    left_s = None if time_limit is None else max(0.01, time_limit - (time.perf_counter() - _STARTED_S))
    with deadline_scope(left_s), search_progress(quiet=quiet, console=err) as progress:
        w = load_workload(workload)
        if precision is not None:
            w = with_precision(w, precision)
        if pipeline_layout is not None:
            w = with_pipeline_layout(w, pipeline_layout)
        s = load_system(system, num_chips=num_chips)
        result = optimize(
            w, s, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, recompute=recompute,
            sequence_parallel=sequence_parallel, interleave=interleave,
            distributed_optimizer=distributed_optimizer, solver=solver, time_limit_s=time_limit, cp=cp, ep=ep,
            zero=zero, alternatives=alternatives, progress=progress, workers=jobs,
            **{k: v for k, v in {"cp_comm": cp_comm, "overlap_grad_reduce": overlap_grad_reduce,
                                 "overlap_param_gather": overlap_param_gather,
                                 "tp_comm_overlap": tp_comm_overlap,
                                 "overlap_moe_expert_parallel_comm": overlap_moe_expert_parallel_comm,
                                 "etp": etp, "offload_optimizer": offload_optimizer,
                                 "offload_activations": offload_activations,
                                 "offload_weights": offload_weights}.items() if v is not None},
        )
    if plot_path:
        from dfmodel.plots import plot_result, save

        save(plot_result(result), plot_path)
    if json_out == "-":
        sys.stdout.write(result.to_json() + "\n")
        return
    render_result(result, out, system=s, workload=w)
    render_io(result, out)  # storage I/O tables (issue 8); nothing without a storage block
    if json_out:
        Path(json_out).write_text(result.to_json())
        out.print(f"wrote {json_out}")
    if plot_path:
        out.print(f"wrote {plot_path}")


@app.command()
@guarded
def validate(
    cases: str = typer.Argument(
        ..., help="A shipped data set (megatron_a100, h100_training, moe_training, other_families; h100_holdout, megatron_core_h100, megatron_bridge_h100: runs never fitted) or a cases YAML file."
    ),
    system: str = typer.Option("auto", "--system", "-s",
                               help="System YAML or preset name; auto = the preset of each case's chip."),
    free: bool = typer.Option(False, "--free", help="Also optimise with nothing fixed and compare."),
    ranges: bool = typer.Option(False, "--range", help="Also the best..worst prediction over the knobs a case leaves out."),
    attention: Optional[str] = typer.Option(None, "--attention",
                                            help="flash | unfused for every case (default: the case's, else the system's)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1,
                                       help="Cases run in parallel (default: one per usable core)."),
) -> None:
    """Predicted vs measured iteration time for published runs, with their mappings fixed.

    For every knob a case leaves out, the table shows the value the optimizer picked."""
    from dfmodel.progress import count_progress
    from dfmodel.validate import is_family_file, read_case_items, summary, validate_cases, validate_family_cases

    if attention not in (None, "flash", "unfused"):
        raise InputError(f"must be flash or unfused, got {attention!r}", field="--attention")
    if is_family_file(cases):  # DLRM / HPL / FFT cases (other_families.yaml)
        rows = validate_family_cases(cases, system, workers=jobs)
        ranges = ranges or any(r.range_s for r in rows)
    else:
        with count_progress("validate", len(read_case_items(cases)[1]), quiet=quiet, console=err) as advance:
            rows = validate_cases(cases, system, free=free, ranges=ranges, on_case=lambda r: advance(r.id),
                                  workload_overrides={"attention": attention} if attention else None, workers=jobs)
    table = Table("case", "chips", "mapping", "predicted", "measured", "error", "picked (unknown knobs)",
                  title=f"fidelity on {system}")
    if ranges:
        table.add_column("range best..worst")
    if free:
        table.add_column("free optimum")
        table.add_column("free mapping")
    for r in rows:
        cells = [r.id, str(r.num_chips), r.mapping or r.message, fmt_time(r.predicted_s) if r.predicted_s else "-",
                 fmt_time(r.measured_s), f"{r.error:+.1%}" if r.error is not None else "-",
                 " ".join(f"{k}={v}" for k, v in r.chosen.items()) or "-"]
        if ranges:
            cells.append(f"{fmt_time(r.range_s[0])}..{fmt_time(r.range_s[1])}" if r.range_s else "-")
        if free:
            cells += [fmt_time(r.free_predicted_s) if r.free_predicted_s else "-", r.free_mapping or "-"]
        table.add_row(*cells)
    out.print(table)
    s = summary(rows)
    if s["evaluated"]:
        out.print(f"{s['evaluated']}/{s['cases']} cases: mean absolute error {s['mean_abs_error']:.1%}, "
                  f"max absolute error {s['max_abs_error']:.1%}")
    else:
        out.print(f"0/{s['cases']} cases could be evaluated (see each case's reason)")


@app.command()
@guarded
def sweep(
    spec: Path = typer.Argument(..., help="Sweep YAML: workloads, systems, overrides, zip, fixed (see dfmodel.sweeps)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="JSON-lines results file (default: SPEC.jsonl)."),
    workers: Optional[int] = typer.Option(None, "--workers", "--jobs", "-j",
                                          help="Points run in parallel (default: one per core)."),
    resume: bool = typer.Option(False, "--resume", help="Run only the points not already in --out."),
    executor: str = typer.Option("process", help="process (this machine) | ray."),
    address: Optional[str] = typer.Option(None, help="Ray cluster address (default or unreachable: local Ray)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display on stderr."),
) -> None:
    """Run one optimize per point of a design-space grid; each result is appended to --out at once."""
    from dfmodel.sweeps import summary, sweep as run_sweep

    target = out_path or spec.with_suffix(".jsonl")
    from dfmodel.progress import enabled

    writable(target, "--out", makes_dirs=True)
    records = run_sweep(spec, out=target, workers=workers, resume=resume, executor=executor, address=address,
                        progress=enabled(quiet))
    out.print(summary(records, target), highlight=False)


@app.command()
@guarded
def plot(
    results: Path = typer.Argument(..., help="A sweep's JSON-lines results file, or one result (dfmodel solve --json)."),
    kind: str = typer.Option("breakdown", help="breakdown | pipeline | partitions | heatmap | pareto."),
    x: Optional[str] = typer.Option(None, help="heatmap: field on x (e.g. system.chip.sram_bytes); pareto: cost_usd or power_w."),
    y: Optional[str] = typer.Option(None, help="heatmap: field on y; pareto: default throughput.samples_per_s."),
    value: str = typer.Option("throughput.samples_per_s", help="heatmap: the field shown in the cells."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Figure file (.png, .svg, .pdf)."),
) -> None:
    """Draw results: breakdown bars, a pipeline timeline or partitions (of the fastest result
    in the file), or a heatmap / Pareto front over a sweep's points."""
    from dfmodel.plots import plot_results_file, save

    writable(out_path, "--out")
    try:
        fig = plot_results_file(results, kind, x=x, y=y, value=value)
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(str(exc), source=str(results), field=f"--kind {kind}") from None
    save(fig, out_path)
    out.print(f"wrote {out_path}")


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
