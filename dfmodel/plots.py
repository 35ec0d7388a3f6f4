"""Matplotlib figures. Each function returns a Figure that a notebook shows and the CLI saves.

One result (a :class:`~dfmodel.result.Result` or its ``to_dict()``):

- :func:`plot_breakdown` -- stacked bars of the iteration-time breakdown (several results side
  by side for comparison);
- :func:`plot_pipeline` -- the 1F1B (or interleaved 1F1B) timeline, re-simulated with
  :func:`dfmodel.inter_chip.pipeline.simulate_1f1b` from the result's stage times;
- :func:`plot_partitions` -- the intra-chip partitions over the kernel graph, with their times;
- :func:`plot_result` -- breakdown and timeline side by side (what ``dfmodel solve --plot`` saves).

Many results (the records of a sweep's JSON-lines file, the flat rows or DataFrame of
:func:`dfmodel.sweeps.load_results`, or a list of ``Result``/``to_dict()``):

- :func:`plot_heatmap` -- a value over two swept fields;
- :func:`plot_pareto` -- throughput against cost or power, the Pareto front marked.

Field names are the flat, dotted names of :func:`dfmodel.sweeps.load_results`: an override key
as swept (``system.chip.sram_bytes``, ``num_chips``, ``tp``), the inputs ``workload`` and
``system``, and the result's keys joined with dots (``throughput.samples_per_s``, ``cost_usd``,
``breakdown_s.compute``, ``parallelism.tp``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless by default; notebooks switch backends themselves

import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dfmodel.algorithms import pareto_front  # noqa: F401 -- re-exported (was defined here)
from dfmodel.graph.graph import DataflowGraph  # noqa: E402
from dfmodel.graph.kernel import Phase  # noqa: E402
from dfmodel.result import BREAKDOWN_KEYS  # noqa: E402

PHASE_COLORS = {Phase.forward: "#8ab4f8", Phase.backward: "#f6ae6b", Phase.weight_grad: "#81c995"}

#: One colour per breakdown component (same order as :data:`dfmodel.result.BREAKDOWN_KEYS`).
BREAKDOWN_COLORS = {
    "compute": "#4c72b0",
    "memory": "#55a868",
    "tp_comm": "#c44e52",
    "pp_comm": "#dd8452",
    "dp_comm": "#8172b3",
    "bubble": "#bbbbbb",
    "optimizer": "#937860",
    "checkpoint": "#8c8c3c",
    "input": "#da8bc3",
    "cp_comm": "#ccb974",
    "ep_comm": "#64b5cd",
    "offload": "#6b8e23",
}
FORWARD_COLOR = "#4c72b0"
BACKWARD_COLOR = "#dd8452"


# --------------------------------------------------------------------------------------------
# Inputs: results and rows
# --------------------------------------------------------------------------------------------


def result_dict(result: Any) -> dict:
    """A result as the plain dict of ``Result.to_dict()`` (accepts a Result, that dict, a
    sweep record ``{"result": {...}}``, or a path to ``dfmodel solve --json`` output)."""
    if hasattr(result, "to_dict") and hasattr(result, "breakdown_s"):
        return result.to_dict()
    if isinstance(result, (str, Path)):
        return result_dict(json.loads(Path(result).read_text()))
    if isinstance(result, Mapping):
        if "breakdown_s" in result:
            return dict(result)
        if isinstance(result.get("result"), Mapping):
            return dict(result["result"])
        if result.get("result", 1) is None:
            raise ValueError(f"point {result.get('id')} has no result ({result.get('error')})")
    raise TypeError(f"expected a Result, its to_dict() or a sweep record, got {type(result).__name__}")


def result_label(d: Mapping) -> str:
    return f"{d.get('workload', '?')} on {d.get('system', '?')} ({d.get('num_chips', '?')} chips)"


def _flatten(d: Mapping, prefix: str, out: dict) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and k not in ("overrides",):
            _flatten(v, key + ".", out)
        else:
            out[key] = v


def flatten_record(rec: Mapping) -> dict:
    """One flat row of a sweep record (same keys as :func:`dfmodel.sweeps.record_row`).

    A record is ``{"id", "inputs": {"workload", "system", "overrides", "fixed"}, "result" |
    "error"}``; a bare ``Result.to_dict()`` is flattened as it is.
    """
    if "inputs" not in rec:
        row: dict = {}
        _flatten(rec, "", row)
        return row
    try:  # the sweep module's own flattening, when it is there
        from dfmodel.sweeps import record_row

        return record_row(dict(rec))
    except ImportError:  # pragma: no cover - the fallback mirrors record_row
        pass
    inputs = rec.get("inputs", {})
    err = rec.get("error")
    row = {"id": rec.get("id"), "index": rec.get("index"),
           "workload": inputs.get("workload"), "system": inputs.get("system")}
    row.update(inputs.get("overrides", {}))
    row.update({f"fixed.{k}": v for k, v in inputs.get("fixed", {}).items()})
    row["error_type"] = err["type"] if isinstance(err, Mapping) else None
    row["error"] = f"{err['type']}: {err['message']}" if isinstance(err, Mapping) else err
    row["wall_s"] = rec.get("wall_s")
    result = dict(rec.get("result") or {})
    result.pop("workload", None)
    result.pop("system", None)
    _flatten(result, "", row)
    return row


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines results file (a torn last line is skipped)."""
    try:
        from dfmodel.sweeps import read_records

        return read_records(path)
    except ImportError:  # pragma: no cover
        pass
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def as_rows(data: Any) -> list[dict]:
    """Flat rows from a results file path, a DataFrame, sweep records, flat rows or Results."""
    if isinstance(data, (str, Path)):
        data = read_jsonl(data)
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas DataFrame
        return [dict(r) for r in data.to_dict("records")]
    rows = []
    for item in data:
        if hasattr(item, "to_dict") and hasattr(item, "breakdown_s"):
            item = item.to_dict()
        rows.append(flatten_record(item) if ("inputs" in item or "breakdown_s" in item) else dict(item))
    return rows


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def field(row: Mapping, key: str) -> Any:
    """``row[key]`` of a flat row; None when absent or NaN."""
    v = row.get(key)
    if _missing(v) and key.startswith("result."):
        v = row.get(key.removeprefix("result."))
    return None if _missing(v) else v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)


# --------------------------------------------------------------------------------------------
# One result
# --------------------------------------------------------------------------------------------


def _time_scale(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def plot_breakdown(results: Any, labels: Sequence[str] | None = None, *, normalize: bool = False,
                   stacked: bool = True, ax=None) -> Figure:
    """The iteration time split into ``compute, memory, tp_comm, pp_comm, dp_comm, bubble,
    optimizer, input``.

    ``results``: one result or a list (Result, ``to_dict()`` or sweep record). ``stacked``:
    one horizontal bar per result, stacked by component; else one bar per component (grouped
    by result), labelled with its time and share. ``normalize`` shows shares of each iteration
    instead of seconds. Every result has one bar segment per component (zero-width when the
    component is zero), so ``len(ax.patches) = results x 8`` either way.
    """
    if isinstance(results, (Mapping, str, Path)) or hasattr(results, "breakdown_s"):
        results = [results]
    dicts = [result_dict(r) for r in results]
    if not dicts:
        raise ValueError("plot_breakdown needs at least one result")
    labels = list(labels) if labels is not None else [result_label(d) for d in dicts]
    if len(labels) != len(dicts):
        raise ValueError(f"{len(labels)} labels for {len(dicts)} results")
    totals = [sum(d["breakdown_s"].get(k, 0.0) for k in BREAKDOWN_KEYS) for d in dicts]
    scale, unit = _time_scale(max(totals))
    xlabel = "share of iteration" if normalize else f"time per iteration ({unit})"

    def width(i: int, key: str) -> float:
        v = dicts[i]["breakdown_s"].get(key, 0.0)
        return v / totals[i] if normalize and totals[i] > 0 else v * scale

    n = len(dicts)
    if ax is None:
        rows = n if stacked else len(BREAKDOWN_KEYS) * (n if n > 1 else 0.6)
        fig, ax = plt.subplots(figsize=(9, 1.6 + 0.5 * rows), layout="constrained")
    else:
        fig = ax.figure
    if stacked:
        ys = list(range(n))[::-1]  # first result on top
        left = [0.0] * n
        for key in BREAKDOWN_KEYS:
            widths = [width(i, key) for i in range(n)]
            ax.barh(ys, widths, left=left, color=BREAKDOWN_COLORS[key], label=key, height=0.6,
                    edgecolor="white", linewidth=0.5)
            left = [a + b for a, b in zip(left, widths)]
        for y, end, total in zip(ys, left, totals):
            tscale, tunit = _time_scale(total)
            ax.text(end, y, f" {total * tscale:.3g} {tunit}", va="center", fontsize=8)
        ax.set_yticks(ys, labels, fontsize=8)
        ax.set_xlim(0, max(left) * 1.18 if max(left) > 0 else 1)
        ax.legend(ncols=4, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    else:
        h = 0.8 / n
        ymax = 0.0
        for i in range(n):
            ys = [len(BREAKDOWN_KEYS) - 1 - j + 0.4 - h * (i + 0.5) for j in range(len(BREAKDOWN_KEYS))]
            widths = [width(i, k) for k in BREAKDOWN_KEYS]
            ax.barh(ys, widths, height=h * 0.9, label=labels[i] if n > 1 else None,
                    color=[BREAKDOWN_COLORS[k] for k in BREAKDOWN_KEYS], edgecolor="black",
                    linewidth=0.4, alpha=1.0 if n == 1 else 1.0 - 0.5 * i / max(n - 1, 1))
            for y, w, k in zip(ys, widths, BREAKDOWN_KEYS):
                share = dicts[i]["breakdown_s"].get(k, 0.0) / totals[i] if totals[i] > 0 else 0.0
                ax.text(w, y, f" {w:.3g} ({100 * share:.1f}%)" if not normalize else f" {100 * w:.1f}%",
                        va="center", fontsize=7)
            ymax = max(ymax, max(widths))
        ax.set_yticks(range(len(BREAKDOWN_KEYS))[::-1], list(BREAKDOWN_KEYS), fontsize=8)
        ax.set_xlim(0, ymax * 1.35 if ymax > 0 else 1)
        if n > 1:
            ax.legend(fontsize=7, frameon=False)
        elif labels[0]:
            ax.set_title(labels[0], fontsize=9)
    ax.set_xlabel(xlabel)
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def pipeline_events(result: Any, p2p_s: float = 0.0):
    """The simulated 1F1B events of a result's pipeline (see :func:`plot_pipeline`)."""
    from dfmodel.inter_chip.pipeline import simulate_1f1b

    d = result_dict(result)
    pipe = d.get("pipeline") or {}
    if not pipe.get("stage_forward_s"):
        raise ValueError(f"{result_label(d)} has no pipeline (only LLM results have stage times)")
    return simulate_1f1b(pipe["stage_forward_s"], pipe["stage_backward_s"], int(pipe["num_micro_batches"]),
                         int(pipe.get("interleave") or 1), p2p_s=p2p_s)


def _shade(color: str, i: int, n: int) -> tuple[float, float, float]:
    """``color`` lightened for chunk ``i`` of ``n`` (chunk 0 darkest)."""
    r, g, b = to_rgb(color)
    f = 0.55 * i / max(n - 1, 1)
    return (r + (1 - r) * f, g + (1 - g) * f, b + (1 - b) * f)


def elision_window(events, stage_fwd_s: Sequence[float], stage_bwd_s: Sequence[float], *,
                   keep_cycles: int = 2) -> tuple[float, float] | None:
    """The stretch ``(t1, t2)`` of a long steady state to leave out of a timeline, or None.

    The steady state runs from the end of stage 0's first backward (every stage then busy) to
    the start of the last forward (the drain begins). Its period is the bottleneck stage's
    forward + backward per micro-batch. ``keep_cycles`` periods are kept at each end; the rest is
    elided when it spans more than two periods.

    >>> from dfmodel.inter_chip.pipeline import simulate_1f1b
    >>> ev = simulate_1f1b([1.0] * 2, [2.0] * 2, 20)
    >>> elision_window(ev, [1.0] * 2, [2.0] * 2)   # steady 6 s .. 58 s, 3 s period, 2 kept each end
    (12.0, 52.0)
    """
    period = max(f + b for f, b in zip(stage_fwd_s, stage_bwd_s))
    first_b = [e.end_s for e in events if e.kind == "B" and e.stage == 0]
    last_f = [e.start_s for e in events if e.kind == "F"]
    if not first_b or not last_f:
        return None
    t1 = min(first_b) + keep_cycles * period
    t2 = max(last_f) - keep_cycles * period
    return (t1, t2) if t2 - t1 > 2 * period else None


def _clip(events, window: tuple[float, float] | None, gap_s: float):
    """Events as drawn: ``(event, x0, x1)`` with the window cut out and later times shifted back
    by its length minus ``gap_s`` (room for the elision mark); events inside it are dropped."""
    if window is None:
        return [(e, e.start_s, e.end_s) for e in events], 0
    t1, t2 = window
    shift = (t2 - t1) - gap_s
    out, dropped = [], 0
    for e in events:
        if e.end_s <= t1:
            out.append((e, e.start_s, e.end_s))
        elif e.start_s >= t2:
            out.append((e, e.start_s - shift, e.end_s - shift))
        elif e.start_s < t1:  # runs into the cut: drawn up to it
            out.append((e, e.start_s, t1))
        elif e.end_s > t2:  # runs out of the cut: drawn from it
            out.append((e, t2 - shift, e.end_s - shift))
        else:
            dropped += 1
    return out, dropped


def timeline_boxes(ax) -> list[tuple[float, float, int]]:
    """``(x0, x1, stage)`` of every box :func:`plot_pipeline` drew (read back from the figure)."""
    boxes = []
    for coll in ax.collections:
        if coll.get_gid() != "pipeline":
            continue
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            boxes.append((float(x0), float(x1), int(round((y0 + y1) / 2))))
    return boxes


def plot_pipeline(result: Any, *, p2p_s: float = 0.0, max_labels: int = 400, elide: bool | None = None,
                  ax=None) -> Figure:
    """The pipeline timeline of one iteration: forward (blue) and backward (orange) of every
    micro-batch on every stage, as the 1F1B schedule runs them (interleaved chunks lighter).

    Re-simulated by :func:`~dfmodel.inter_chip.pipeline.simulate_1f1b` from the result's
    ``pipeline`` (stage times per micro-batch, micro-batch count, interleave); ``p2p_s`` adds a
    latency per stage-to-stage transfer (the result does not store it; 0 by default). The data-
    parallel sync and the optimizer step after the pipeline are not drawn.

    A long steady state (``elide``; default: when there are more than ``max_labels`` operations)
    is shown as warm-up, two steady-state cycles, a hatched band saying how much was left out,
    two more cycles and the cool-down (:func:`elision_window`); the time axis keeps true times.
    Boxes are drawn as one collection per colour (read them back with :func:`timeline_boxes`),
    so 10,000 operations draw in well under a second. Micro-batch numbers are written in the
    boxes when there are at most ``max_labels`` of them and they fit.

    The title gives the bubble as the breakdown counts it -- the bottleneck stage's idle time
    over the iteration -- and, separately, the idle share of all stages in the timeline, which
    also counts faster stages waiting for slower ones.
    """
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    d = result_dict(result)
    events = pipeline_events(d, p2p_s=p2p_s)
    pipe = d["pipeline"]
    fwd, bwd = pipe["stage_forward_s"], pipe["stage_backward_s"]
    pp = len(fwd)
    v = int(pipe.get("interleave") or 1)
    m = int(pipe["num_micro_batches"])
    span = max(e.end_s for e in events)
    elide = len(events) > max_labels if elide is None else elide
    window = elision_window(events, fwd, bwd) if elide else None
    gap = 0.03 * (span - (window[1] - window[0])) if window else 0.0
    drawn, dropped = _clip(events, window, gap)
    shown_span = max(x1 for _, _, x1 in drawn)
    scale, unit = _time_scale(span)
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 1.6 + 0.45 * pp), layout="constrained")
    else:
        fig = ax.figure
    groups: dict[tuple, list] = {}
    for e, x0, x1 in drawn:
        color = _shade(FORWARD_COLOR if e.kind == "F" else BACKWARD_COLOR, e.chunk, v)
        y0 = e.stage - 0.4
        groups.setdefault(color, []).append([(x0 * scale, y0), (x1 * scale, y0), (x1 * scale, y0 + 0.8),
                                             (x0 * scale, y0 + 0.8)])
    thin = len(drawn) <= 100 * pp  # white separators only while they stay thin
    for color, polys in groups.items():
        ax.add_collection(PolyCollection(polys, facecolors=[color], edgecolors="white",
                                         linewidths=0.4 if thin else 0.0, gid="pipeline"))
    digits = len(str(m - 1))
    label = len(drawn) <= max_labels and min(x1 - x0 for _, x0, x1 in drawn) >= shown_span * 0.006 * digits
    if label:
        for e, x0, x1 in drawn:
            ax.text((x0 + x1) / 2 * scale, e.stage, str(e.micro_batch), ha="center", va="center", fontsize=6,
                    color="white" if e.chunk == 0 else "black")
    if window:
        t1, t2 = window
        ax.axvspan(t1 * scale, (t1 + gap) * scale, facecolor="#eeeeee", edgecolor="#999999", hatch="//", lw=0.5)
        ax.text((t1 + gap / 2) * scale, (pp - 1) / 2, f"{(t2 - t1) * scale:.3g} {unit} of steady state elided "
                f"({dropped} operations)", rotation=90, ha="center", va="center", fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
        shift = (t2 - t1) - gap
        ax.xaxis.set_major_formatter(FuncFormatter(
            lambda x, _: "" if t1 * scale < x < (t1 + gap) * scale
            else f"{(x if x <= t1 * scale else x + shift * scale):.4g}"))
    busy = sum(e.end_s - e.start_s for e in events)
    idle = 1 - busy / (pp * span) if span > 0 else 0.0
    b = max(range(pp), key=lambda i: fwd[i] + bwd[i])
    bubble_s = span - m * (fwd[b] + bwd[b])  # the bottleneck stage's idle time, as the breakdown counts it
    iteration = float(d.get("iteration_time_s") or span)
    ax.set_xlim(0, shown_span * scale * 1.01)
    ax.set_ylim(pp - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(pp), [f"stage {i}" for i in range(pp)], fontsize=8)
    ax.set_xlabel(f"time ({unit})")
    layers = pipe.get("layers_per_stage")
    sub = f", layers per stage {layers}" if layers and len(set(layers)) > 1 else (
        f", {layers[0]} layers per stage" if layers else "")
    ax.set_title(f"1F1B pipeline: pp {pp}, {m} micro-batches, interleave {v}{sub}; {span * scale:.3g} {unit}"
                 + (f" (chunks 0-{v - 1} dark to light)" if v > 1 else "")
                 + f"\nbubble {max(bubble_s, 0.0) / iteration:.1%} of the iteration (bottleneck stage {b} idle, "
                 f"as in the breakdown); all stages idle {idle:.1%} of this timeline (bubble plus waiting "
                 f"on slower stages)", fontsize=9)
    handles = [Patch(color=FORWARD_COLOR, label="forward"), Patch(color=BACKWARD_COLOR, label="backward")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def plot_result(result: Any, *, p2p_s: float = 0.0) -> Figure:
    """Breakdown (left) and pipeline timeline (right) of one result, in one figure; results
    without a pipeline (non-LLM families) get the breakdown alone."""
    d = result_dict(result)
    has_pipe = bool((d.get("pipeline") or {}).get("stage_forward_s"))
    if not has_pipe:
        fig = plot_breakdown(d, labels=[""], stacked=False)
        fig.suptitle(result_label(d), fontsize=10)
        return fig
    pp = len(d["pipeline"]["stage_forward_s"])
    fig = plt.figure(figsize=(16, max(3.2, 1.6 + 0.45 * pp)), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[1, 2.4])
    plot_breakdown(d, labels=[""], stacked=False, ax=left.subplots())
    plot_pipeline(d, p2p_s=p2p_s, ax=right.subplots())
    par = d.get("parallelism", {})
    tput = (d.get("throughput") or {}).get("samples_per_s")
    fig.suptitle(f"{result_label(d)}: TP {par.get('tp')} x PP {par.get('pp')} x DP {par.get('dp')}, "
                 f"{_fmt(d['iteration_time_s'])} s per iteration"
                 + (f", {_fmt(tput)} samples/s" if tput else ""), fontsize=10)
    return fig


def _partition_colors(n: int) -> list:
    cmap = plt.get_cmap("tab20" if n <= 20 else "turbo")
    if n <= 20:
        # tab20 pairs dark/light shades: take the darks first so neighbours differ most
        order = list(range(0, 20, 2)) + list(range(1, 20, 2))
        return [cmap(order[i] / 19.999) for i in range(n)]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def partitions_of(result: Any) -> list[dict]:
    """The intra-chip partitions (kernel lists and times) of a result or a PartitionResult."""
    if hasattr(result, "partitions") and not isinstance(result, Mapping):
        return [p.to_dict() if hasattr(p, "to_dict") else dict(p) for p in result.partitions]
    if isinstance(result, Sequence) and not isinstance(result, (str, Mapping)):
        return [p.to_dict() if hasattr(p, "to_dict") else dict(p) for p in result]
    intra = result_dict(result).get("intra_chip") or {}
    return list(intra.get("partitions") or [])


def _graph_of_result(d: Mapping) -> DataflowGraph | None:
    """The one-layer (or one-step) kernel graph of a result's workload, if it is a preset."""
    from dfmodel.errors import DFModelError
    from dfmodel.graph.build import build_graphs
    from dfmodel.graph.workload import load_workload, resolve_for_chip
    from dfmodel.system.loader import load_system

    try:
        w = load_workload(d["workload"])
        if d.get("system"):  # the attention kernels the solve used (flash on GPUs)
            w = resolve_for_chip(w, load_system(d["system"]).chip)
        return build_graphs(w).layer
    except (DFModelError, KeyError, AttributeError, OSError, ValueError):
        return None


def plot_partitions(graph: Any, partition_result: Any = None) -> Figure:
    """The intra-chip partitions over the kernel graph (top) and their times (bottom).

    ``plot_partitions(graph, partition_result)`` with a :class:`DataflowGraph` and a
    :class:`~dfmodel.intra_chip.PartitionResult` (or its partition list); or
    ``plot_partitions(result)`` with an optimizer result, whose workload's layer graph is
    rebuilt from the presets.

    Kernels are laid out left to right in execution order, coloured by partition (through
    :func:`draw_graph`'s ``colors``), each partition shaded over its kernels; below, one bar
    per partition under its kernels with its time per micro-batch and its compute / memory /
    network terms. Kernels the graph does not have (the collectives that sharding inserts,
    ``comm*``) are counted in the bar labels only; when the graph cannot be rebuilt or other
    names do not match, only the bars are drawn. ``len(bar axes .patches) = partitions``.
    """
    if partition_result is None:
        d = result_dict(graph)
        parts = partitions_of(d)
        graph = _graph_of_result(d)
        per = (d.get("intra_chip") or {}).get("per") or "layer (forward + backward)"
        title = f"{result_label(d)}: {len(parts)} partitions per {per}"
    else:
        parts = partitions_of(partition_result)
        title = f"{getattr(graph, 'name', 'graph')}: {len(parts)} partitions"
    if not parts:
        raise ValueError("no intra-chip partitions to draw")
    colors = _partition_colors(len(parts))
    if graph is not None:
        known = {k.name for k in graph.kernels}
        extra = {k for p in parts for k in p["kernels"]} - known
        if any(not k.startswith("comm") for k in extra):
            graph = None
    # x slots: one per drawn kernel (graph) or one per partition (no graph)
    spans, slot = [], 0
    for p in parts:
        n = sum(1 for k in p["kernels"] if k in known) if graph is not None else 1
        n = max(n, 1)
        spans.append((slot, slot + n))
        slot += n
    if graph is not None:
        fig = plt.figure(figsize=(min(max(11.0, 0.42 * slot), 30), 8.5), layout="constrained")
        ax_g, ax_b = fig.subplots(2, 1, height_ratios=[3, 2], sharex=True)
        kernel_color, pos = {}, {}
        for pi, p in enumerate(parts):
            i = spans[pi][0]
            for k in p["kernels"]:
                if k in known:
                    kernel_color[k] = colors[pi]
                    pos[k] = (float(i), (0.0, 1.0, 0.5)[i % 3])
                    i += 1
        drawn = [k for k in graph.kernels if k.name in pos]
        sub = DataflowGraph(drawn, [t for t in graph.tensors if t.producer in pos and t.consumer in pos
                                   or (t.producer in pos and t.consumer is None)
                                   or (t.consumer in pos and t.producer is None)], name=graph.name)
        draw_graph(sub, colors=kernel_color, ax=ax_g, pos=pos, label_rotation=35)
        for pi, (a, b) in enumerate(spans):
            ax_g.axvspan(a - 0.45, b - 0.55, color=colors[pi], alpha=0.12, linewidth=0)
        ax_g.set_ylim(-0.4, 1.6)
        ax_g.set_title(title, fontsize=10)
    else:
        fig, ax_b = plt.subplots(figsize=(max(8.0, 0.35 * len(parts)), 4), layout="constrained")
        ax_b.set_title(title, fontsize=10)
    times = [p["time_s"] for p in parts]
    scale, unit = _time_scale(max(times))
    xs = [(a + b - 1) / 2 for a, b in spans]
    ax_b.bar(xs, [t * scale for t in times], width=[(b - a) - 0.1 for a, b in spans], color=colors,
             edgecolor="black", linewidth=0.4)
    for key, marker in (("compute_s", "_"), ("memory_s", "x"), ("network_s", ".")):
        vals = [p.get(key, 0.0) * scale for p in parts]
        if any(vals):
            ax_b.scatter(xs, vals, marker=marker, color="black", s=25, zorder=3, label=key.removesuffix("_s"))
    labels = [p["kernels"][0] + (f" +{len(p['kernels']) - 1}" if len(p["kernels"]) > 1 else "") for p in parts]
    ax_b.set_xticks(xs, labels, rotation=60 if len(parts) > 4 else 0, ha="right" if len(parts) > 4 else "center",
                    fontsize=7)
    ax_b.tick_params(axis="x", labelbottom=True)
    ax_b.set_ylabel(f"time per micro-batch ({unit})")
    ax_b.legend(fontsize=7, frameon=False)
    ax_b.set_xlim(-0.6, slot + 0.2)
    ax_b.spines[["top", "right"]].set_visible(False)
    return fig


# --------------------------------------------------------------------------------------------
# Many results (sweeps)
# --------------------------------------------------------------------------------------------


def _sort_key(v: Any):
    """Numbers by value, quantity strings ("2 TB/s", "640 MB") by their value too, then the rest."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    if isinstance(v, str):
        from dfmodel.system.units import parse_quantity

        for kind in ("bytes", "bandwidth", "flops", "time"):
            try:
                return (0, parse_quantity(v, kind), v)
            except (ValueError, TypeError):
                continue
    return (1, 0.0, str(v))


def plot_heatmap(rows: Any, x: str, y: str, value: str = "throughput.samples_per_s", *,
                 reduce: str = "max", fmt: str | None = None, cmap: str = "viridis", vmin: float | None = None,
                 vmax: float | None = None, ax=None) -> Figure:
    """``value`` over the grid of ``x`` and ``y`` values (each a field name, e.g. an override
    key ``system.chip.sram_bytes``), one annotated cell each.

    Several rows in one cell (other fields varied too) are reduced with ``reduce`` (``max``,
    ``min`` or ``mean``); a cell with no successful row is grey with "-". ``vmin``/``vmax`` fix
    the colour scale (to compare several heat maps). The figure keeps the
    grid in ``fig.dfmodel_grid`` (``{"x": [...], "y": [...], "values": [[...]]}``, None for
    missing cells).
    """
    import numpy as np

    rows = as_rows(rows)
    cells: dict[tuple, list[float]] = {}
    xs, ys = set(), set()
    for r in rows:
        xv, yv = field(r, x), field(r, y)
        if xv is None or yv is None:
            continue
        xs.add(xv)
        ys.add(yv)
        val = field(r, value)
        if val is not None and not field(r, "error"):
            cells.setdefault((xv, yv), []).append(float(val))
    if not xs or not ys:
        raise ValueError(f"no rows with both {x!r} and {y!r}")
    xs_l, ys_l = sorted(xs, key=_sort_key), sorted(ys, key=_sort_key)
    agg = {"max": max, "min": min, "mean": lambda v: sum(v) / len(v)}[reduce]
    grid = np.full((len(ys_l), len(xs_l)), np.nan)
    for (xv, yv), vals in cells.items():
        grid[ys_l.index(yv), xs_l.index(xv)] = agg(vals)
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(xs_l), 1.4 + 0.55 * len(ys_l)), layout="constrained")
    else:
        fig = ax.figure
    ax.set_facecolor("#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto", origin="lower", vmin=vmin, vmax=vmax)
    lo, hi = im.get_clim()
    mid = (lo + hi) / 2
    for i in range(len(ys_l)):
        for j in range(len(xs_l)):
            v = grid[i, j]
            text = "-" if not np.isfinite(v) else (fmt.format(v) if fmt else _cell_text(v))
            dark = np.isfinite(v) and v < mid
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(xs_l)), [_fmt(v) for v in xs_l], fontsize=7, rotation=30 if len(xs_l) > 6 else 0)
    ax.set_yticks(range(len(ys_l)), [_fmt(v) for v in ys_l], fontsize=7)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    fig.colorbar(im, ax=ax, label=value, shrink=0.9)
    ax.set_title(f"{value} ({reduce} per cell)" if any(len(v) > 1 for v in cells.values()) else value, fontsize=9)
    fig.dfmodel_grid = {"x": xs_l, "y": ys_l,
                        "values": [[None if not np.isfinite(v) else float(v) for v in row] for row in grid]}
    return fig


def _cell_text(v: float) -> str:
    return f"{v:.0f}" if 1e3 <= abs(v) < 1e6 else f"{v:.3g}"


def _label_front(ax, points: list[tuple[float, float]], labels: list[str]) -> None:
    """Label front points, tied points once ("+n tied"), skipping labels that would overlap."""
    merged: dict[tuple[float, float], list[str]] = {}
    for p, lab in zip(points, labels):
        merged.setdefault(p, []).append(lab)
    ax.autoscale_view()  # data -> pixel transform with the final limits (layout may still shift it a little)
    placed: list[tuple[float, float]] = []
    for p, labs in merged.items():
        px, py = ax.transData.transform(p)
        if any(abs(px - qx) < 120 and abs(py - qy) < 11 for qx, qy in placed):
            continue
        placed.append((px, py))
        text = labs[0] + (f" (+{len(labs) - 1} tied)" if len(labs) > 1 else "")
        ax.annotate(text, p, textcoords="offset points", xytext=(4, 4), fontsize=7)


def plot_pareto(rows: Any, x: str = "cost_usd", y: str = "throughput.samples_per_s", *,
                label: str | None = None, hue: str | None = None, minimize_x: bool = True,
                logx: bool | None = None, logy: bool = False, annotate_front: bool = True, ax=None) -> Figure:
    """Scatter of ``y`` (higher is better) against ``x`` (``cost_usd`` or ``power_w``, lower is
    better) over the rows that succeeded; the Pareto front is joined by a step line and its
    points ringed (and labelled with the ``label`` field, default ``system``).

    ``hue`` colours the points by a field (e.g. ``chip.execution`` in your own rows). The
    figure keeps the front in ``fig.dfmodel_front`` (list of ``(x, y, label)``).
    """
    rows = [r for r in as_rows(rows) if not field(r, "error")]
    pts, labs, hues = [], [], []
    for r in rows:
        xv, yv = field(r, x), field(r, y)
        if xv is None or yv is None:
            continue
        pts.append((float(xv), float(yv)))
        labs.append(str(field(r, label or "system") or field(r, "id") or ""))
        hues.append(field(r, hue) if hue else None)
    if not pts:
        raise ValueError(f"no successful rows with both {x!r} and {y!r}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    else:
        fig = ax.figure
    groups = sorted(set(hues), key=_sort_key) if hue else [None]
    palette = plt.get_cmap("tab10")
    for gi, g in enumerate(groups):
        idx = [i for i, h in enumerate(hues) if h == g]
        ax.scatter([pts[i][0] for i in idx], [pts[i][1] for i in idx], s=28, alpha=0.8,
                   color=palette(gi % 10), label=str(g) if hue else "points")
    front = pareto_front(pts, minimize_x=minimize_x)
    fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
    ax.step(fx, fy, where="post", color="black", linewidth=1, label="Pareto front")
    ax.scatter(fx, fy, s=90, facecolors="none", edgecolors="black", linewidths=1.2)
    spread = max(p[0] for p in pts) / max(min(p[0] for p in pts), 1e-300)
    if logx if logx is not None else spread > 30:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if annotate_front:
        _label_front(ax, [pts[i] for i in front], [labs[i] for i in front])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{y} vs {x}: {len(front)} of {len(pts)} points on the Pareto front", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    ax.grid(alpha=0.3)
    fig.dfmodel_front = [(pts[i][0], pts[i][1], labs[i]) for i in front]
    return fig


# --------------------------------------------------------------------------------------------
# Files (the ``dfmodel plot`` command)
# --------------------------------------------------------------------------------------------

PLOT_KINDS = ("breakdown", "pipeline", "partitions", "heatmap", "pareto")


def load_results_file(path: str | Path) -> list[dict]:
    """Records of a results file: a sweep's JSON lines, or one ``dfmodel solve --json`` result
    (returned as a one-record list ``[{"id": stem, "inputs": ..., "result": ...}]``)."""
    from dfmodel.errors import InputError

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    try:
        one = json.loads(text)
    except ValueError:
        one = None
    if isinstance(one, dict) and "breakdown_s" in one:
        return [{"id": path.stem, "inputs": {"workload": one.get("workload"), "system": one.get("system"),
                                             "overrides": {}, "fixed": {}}, "result": one, "error": None}]
    records = read_jsonl(path)
    if not records:
        raise InputError("no results in file (expected JSON lines of a sweep or one result JSON)", source=str(path))
    return records


def _record_label(rec: Mapping) -> str:
    inputs = rec.get("inputs") or {}
    over = ", ".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in (inputs.get("overrides") or {}).items())
    return f"{inputs.get('workload')} / {inputs.get('system')}" + (f" ({over})" if over else "")


def plot_results_file(path: str | Path, kind: str = "breakdown", *, x: str | None = None, y: str | None = None,
                      value: str = "throughput.samples_per_s") -> Figure:
    """The figure ``dfmodel plot`` saves (see :data:`PLOT_KINDS`): ``breakdown`` draws one bar
    per successful point; ``pipeline`` and ``partitions`` the fastest point's; ``heatmap`` needs
    ``x`` and ``y``; ``pareto`` takes ``x`` (default ``cost_usd``) and ``y`` (default
    ``throughput.samples_per_s``)."""
    if kind not in PLOT_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(PLOT_KINDS)}")
    records = load_results_file(path)
    ok = [r for r in records if r.get("result")]
    if kind == "heatmap":
        if not x or not y:
            raise ValueError("a heatmap needs --x and --y (swept fields, e.g. system.chip.sram_bytes)")
        return plot_heatmap(records, x, y, value)
    if kind == "pareto":
        return plot_pareto(records, x or "cost_usd", y or "throughput.samples_per_s")
    if not ok:
        raise ValueError("no point of the file has a result")
    ok.sort(key=lambda r: (r.get("index") is None, r.get("index") or 0))  # grid order, not finishing order
    if kind == "breakdown":
        return plot_breakdown([r["result"] for r in ok], labels=[_record_label(r) for r in ok])
    best = min(ok, key=lambda r: r["result"]["iteration_time_s"])
    return plot_pipeline(best["result"]) if kind == "pipeline" else plot_partitions(best["result"])


# --------------------------------------------------------------------------------------------
# Kernel graph
# --------------------------------------------------------------------------------------------


KIND_COLORS = {  # fill of a kernel box: what it computes
    "matmul": "#8ab4f8", "elementwise": "#c5e1a5", "reduction": "#ffe082", "embedding": "#ce93d8",
    "fft": "#80cbc4", "lu_panel": "#ffab91", "comm": "#e0e0e0",
}


def layer_order(graph: DataflowGraph, sweeps: int = 6) -> list[list[str]]:
    """Kernels in dataflow layers (longest path from an input), each layer ordered to cut crossings.

    Layer ``i`` holds the kernels whose longest chain of producers has ``i`` kernels, so every
    edge goes left to right; backward and weight-gradient kernels start after the last forward
    layer (they run after the forward), and a kernel without producers sits just before its
    first consumer. Within a layer, kernels are sorted by the mean rank of their
    neighbours in the previous layer, then the next (barycentre heuristic of Sugiyama et al.,
    IEEE SMC 1981), alternating for ``sweeps`` passes.

    >>> from dfmodel.graph.build import build_graphs
    >>> from dfmodel.graph.workload import load_workload
    >>> layers = layer_order(build_graphs(load_workload("gpt3_13b"), batch=1).layer)
    >>> layers[0], len(layers)
    (['fwd.ln1'], 24)
    """
    g = nx.DiGraph(graph.nx)
    order = list(nx.topological_sort(g))
    topo = {n: i for i, n in enumerate(order)}
    forward = {k.name for k in graph.kernels if k.phase == Phase.forward}
    level: dict[str, int] = {}
    for n in [x for x in order if x in forward] + [x for x in order if x not in forward]:
        # backward and weight-gradient kernels run after the whole forward (1F1B), so they start after it
        floor = 1 + max((level[f] for f in forward), default=-1) if n not in forward else 0
        level[n] = max([level[p] + 1 for p in g.predecessors(n)] + [floor])
    for n in reversed(order):  # an entry point (the incoming gradient) sits just before its first use
        if g.in_degree(n) == 0 and g.out_degree(n) > 0:
            level[n] = max(level[n], min(level[s] for s in g.successors(n)) - 1)
    layers = [sorted((n for n in g if level[n] == li), key=topo.get) for li in range(max(level.values(), default=-1) + 1)]
    rank = {n: i for layer in layers for i, n in enumerate(layer)}
    for sweep in range(sweeps):
        seq = range(1, len(layers)) if sweep % 2 == 0 else range(len(layers) - 2, -1, -1)
        for li in seq:
            near = g.predecessors if sweep % 2 == 0 else g.successors

            def centre(n, near=near):
                ranks = [rank[x] for x in near(n)]
                return sum(ranks) / len(ranks) if ranks else rank[n]

            layers[li].sort(key=lambda n: (centre(n), rank[n]))
            rank.update({n: i for i, n in enumerate(layers[li])})
    return layers


def _box_label(name: str) -> str:
    """A kernel name on two lines at its first dot (``bwd.attn_scores`` -> ``bwd.`` / ``attn_scores``)."""
    head, dot, tail = name.partition(".")
    return f"{head}.\n{tail}" if dot and tail else name


def _box_edge_pt(label: str, cos: float, sin: float) -> float:
    """Distance (points) from a label box's centre to its edge along a direction (font size 7)."""
    lines = label.split("\n")
    half_w = 2.1 * max(len(line) for line in lines) + 4.0
    half_h = 4.5 * len(lines) + 4.0
    return min(half_w / max(cos, 1e-3), half_h / max(sin, 1e-3))


def layered_positions(graph: DataflowGraph, *, dx: float = 1.0, dy: float = 1.0) -> dict[str, tuple[float, float]]:
    """Kernels placed left to right by :func:`layer_order`, each layer centred vertically."""
    pos = {}
    for li, layer in enumerate(layer_order(graph)):
        for i, name in enumerate(layer):
            pos[name] = (li * dx, ((len(layer) - 1) / 2 - i) * dy)
    return pos


def draw_graph(graph: DataflowGraph, colors: dict[str, Any] | None = None, ax=None, *,
               pos: dict[str, tuple[float, float]] | None = None, label_rotation: float = 0) -> Figure:
    """The kernel graph, left to right in dataflow order: one box per kernel, filled by kernel
    kind (or by ``colors``: kernel name -> colour), outlined by phase, with a legend of both.

    Layers come from :func:`layer_order`; a layer is as wide as its longest label, so labels
    never overlap and a 40-kernel layer stays readable (the figure grows instead). ``pos``
    places the kernels yourself (``label_rotation`` then tilts the labels, as the partition view
    does); ``ax`` draws into an existing axes.
    """
    from matplotlib.patches import FancyArrowPatch, Patch

    own_layout = pos is None
    layers = layer_order(graph) if own_layout else None
    labels = {k.name: (_box_label(k.name) if own_layout else k.name) for k in graph.kernels}
    chars = max((len(line) for lab in labels.values() for line in lab.split("\n")), default=4)
    col_in = 0.085 * chars + 0.55  # inches per layer: label at font size 7 plus room for arrows
    if own_layout:
        pos = layered_positions(graph, dx=col_in, dy=0.62)
    if ax is None:
        n_cols = len(layers) if layers else len({x for x, _ in pos.values()})
        n_rows = max((len(layer) for layer in layers), default=1) if layers else 4
        fig, ax = plt.subplots(figsize=(min(max(6.0, n_cols * col_in + 1.5), 80.0), max(3.0, 0.62 * n_rows + 1.6)))
    else:
        fig = ax.figure
    kinds = {k.name: k.kind.value for k in graph.kernels}
    phases = {k.name: k.phase for k in graph.kernels}
    g = nx.DiGraph(graph.nx)
    bow = 0.35  # how far an edge bends off the straight line (data units), so long edges clear the boxes
    for u, v in g.edges():
        (x0, y0), (x1, y1) = pos[u], pos[v]
        length = max(((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5, 1e-9)
        rad = 0.0 if length <= col_in * 1.5 else bow / length
        cos, sin = abs(x1 - x0) / length, abs(y1 - y0) / length
        ax.add_patch(FancyArrowPatch(pos[u], pos[v], arrowstyle="-|>", mutation_scale=8, color="#9e9e9e",
                                     lw=0.7, shrinkA=_box_edge_pt(labels[u], cos, sin),
                                     shrinkB=_box_edge_pt(labels[v], cos, sin) + 1,
                                     connectionstyle=f"arc3,rad={rad:.4f}", zorder=1))
    for k in graph.kernels:
        x, y = pos[k.name]
        face = (colors or {}).get(k.name, KIND_COLORS.get(kinds[k.name], "#eeeeee"))
        ax.text(x, y, labels[k.name], ha="center" if not label_rotation else "left",
                va="center" if not label_rotation else "bottom", rotation=label_rotation, fontsize=7, zorder=3,
                gid="kernel", bbox={"boxstyle": "round,pad=0.3", "facecolor": face,
                                    "edgecolor": PHASE_COLORS.get(phases[k.name], "#616161"), "linewidth": 1.6})
    xs = [x for x, _ in pos.values()]
    ys = [y for _, y in pos.values()]
    if own_layout:
        ax.set_xlim(min(xs) - col_in * 0.6, max(xs) + col_in * 0.6)
        ax.set_ylim(min(ys) - 0.6 - bow, max(ys) + 0.6)
    else:
        ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_title(f"{graph.name}: {len(graph.kernels)} kernels, dataflow left to right")
    ax.axis("off")
    used_kinds = [kd for kd in KIND_COLORS if kd in set(kinds.values())]
    handles = [] if colors else [Patch(facecolor=KIND_COLORS[kd], edgecolor="none", label=kd) for kd in used_kinds]
    handles += [Patch(facecolor="white", edgecolor=c, linewidth=1.6, label=f"{ph.value} (outline)")
                for ph, c in PHASE_COLORS.items() if ph in set(phases.values())]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              title="kernel kind" if not colors else None, title_fontsize=7)
    return fig


def save(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` (format from the suffix) and close it."""
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path
