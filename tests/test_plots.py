"""Plots: each function returns a Figure with the bars / rectangles / points its inputs imply;
the CLI writes real images. Fast: synthetic results, one small solve through the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dfmodel import plots
from dfmodel.inter_chip.pipeline import makespan_s, simulate_1f1b
from dfmodel.result import BREAKDOWN_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_result(tput=10.0, cost=1e6, power=1e4, breakdown=None, pipeline=None, **extra) -> dict:
    b = breakdown or {k: 0.0 for k in BREAKDOWN_KEYS}
    b = {k: b.get(k, 0.0) for k in BREAKDOWN_KEYS}
    d = {"workload": "w", "system": "s", "num_chips": 8, "iteration_time_s": sum(b.values()),
         "breakdown_s": b, "throughput": {"samples_per_s": tput, "tokens_per_s": tput * 2048},
         "cost_usd": cost, "power_w": power, "pipeline": pipeline or {}, "intra_chip": {}}
    d.update(extra)
    return d


def record(i, overrides, result=None, error=None) -> dict:
    return {"id": f"p{i}", "index": i, "inputs": {"workload": "w", "system": "s", "overrides": overrides, "fixed": {}},
            "result": result, "error": error, "wall_s": 0.1}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dfmodel.cli", *args], capture_output=True, text=True)


# ---------------------------------------------------------------------------------- breakdown


@pytest.mark.parametrize("stacked", [True, False])
def test_breakdown_one_segment_per_component_and_result(stacked):
    a = fake_result(breakdown={"compute": 2.0, "memory": 0.5, "bubble": 0.25})
    b = fake_result(breakdown={"compute": 1.0, "dp_comm": 1.0})
    fig = plots.plot_breakdown([a, b], labels=["a", "b"], stacked=stacked)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * len(BREAKDOWN_KEYS)
    widths = sorted(round(p.get_width(), 9) for p in ax.patches if p.get_width() > 0)
    assert widths == [0.25, 0.5, 1.0, 1.0, 2.0]
    if stacked:  # each bar ends at its iteration time
        ends: dict[float, float] = {}
        for p in ax.patches:
            ends[p.get_y()] = max(ends.get(p.get_y(), 0.0), p.get_x() + p.get_width())
        assert sorted(ends.values()) == pytest.approx([2.0, 2.75])


def test_breakdown_normalized_bars_add_up_to_one():
    fig = plots.plot_breakdown(fake_result(breakdown={"compute": 3.0, "memory": 1.0}), normalize=True)
    assert sum(p.get_width() for p in fig.axes[0].patches) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("pp,m,v", [(3, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2)])
def test_pipeline_one_rectangle_per_forward_and_backward(pp, m, v):
    fwd = [1.0 + 0.1 * i for i in range(pp)]
    bwd = [2.0 * t for t in fwd]
    pipe = {"layers_per_stage": [4] * pp, "stage_forward_s": fwd, "stage_backward_s": bwd,
            "num_micro_batches": m, "interleave": v}
    fig = plots.plot_pipeline(fake_result(pipeline=pipe))
    boxes = plots.timeline_boxes(fig.axes[0])
    assert len(boxes) == pp * m * 2 * v
    # drawn exactly as simulated: same makespan, and no two operations of a stage overlap
    span = makespan_s(simulate_1f1b(fwd, bwd, m, v))
    assert max(x1 for _, x1, _ in boxes) == pytest.approx(span)
    for stage in range(pp):
        row = sorted((x0, x1) for x0, x1, s in boxes if s == stage)
        assert len(row) == 2 * m * v
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(row, row[1:]))


def long_pipeline(pp=8, m=96, v=6):
    fwd = [1.0 + 0.02 * i for i in range(pp)]
    bwd = [2.0 * t for t in fwd]
    return {"layers_per_stage": [12] * pp, "stage_forward_s": fwd, "stage_backward_s": bwd,
            "num_micro_batches": m, "interleave": v}


def test_long_steady_state_is_elided():
    """96 micro-batches x v6 x 8 stages (9,216 operations): warm-up, cycles and cool-down are
    drawn, the steady state between them is cut (what keeps the drawing fast is the number of
    boxes, asserted here; wall time is the benchmarks' job, not a unit test's)."""
    pipe = long_pipeline()
    events = simulate_1f1b(pipe["stage_forward_s"], pipe["stage_backward_s"], 96, 6)
    fig = plots.plot_pipeline(fake_result(pipeline=pipe))
    fig.canvas.draw()
    boxes = plots.timeline_boxes(fig.axes[0])
    assert len(boxes) < len(events) / 3  # most of the steady state is left out...
    assert any("elided" in t.get_text() for t in fig.axes[0].texts)  # ...and the figure says so
    t1, t2 = plots.elision_window(events, pipe["stage_forward_s"], pipe["stage_backward_s"])
    kept = [e for e in events if e.end_s <= t1 or e.start_s >= t2]
    assert len(boxes) >= len(kept)  # every operation outside the cut is drawn (cut ones clipped)
    # the drawn span is the true span less the cut, plus the band marking it
    assert max(x1 for _, x1, _ in boxes) < makespan_s(events) - (t2 - t1) * 0.9
    plt.close(fig)


def test_title_bubble_agrees_with_the_breakdown(solved):
    _, result = solved
    fig = plots.plot_pipeline(result)
    title = fig.axes[0].get_title()
    share = result["breakdown_s"]["bubble"] / result["iteration_time_s"]
    assert f"bubble {share:.1%} of the iteration" in title
    plt.close(fig)


def test_pipeline_needs_stage_times():
    with pytest.raises(ValueError, match="no pipeline"):
        plots.plot_pipeline(fake_result())


# ---------------------------------------------------------------------------------- partitions


def test_partitions_over_a_graph_colour_kernels_by_partition():
    from dfmodel.graph.build import build_graphs
    from dfmodel.intra_chip import partition
    from dfmodel.system import load_system

    graph = build_graphs("tiny_mlp").layer
    pr = partition(graph, load_system("sn30"))
    fig = plots.plot_partitions(graph, pr)
    ax_graph, ax_bars = fig.axes
    assert len(ax_bars.patches) == pr.num_partitions
    assert [p.get_height() for p in ax_bars.patches] == pytest.approx([p.time_s * s for p in pr.partitions
                                                                       for s in [plots._time_scale(pr.time_s)[0]]])
    nodes = kernel_nodes(ax_graph)  # one labelled box per kernel
    assert len(nodes) == len(graph.kernels)
    # as many distinct node colours as partitions
    assert len({c for _, c in nodes}) == pr.num_partitions
    assert_nodes_above_their_bars(fig)


# ---------------------------------------------------------------------------------- sweeps


def grid_records():
    recs, i = [], 0
    for a in (1, 2, 4):
        for b in ("x", "y"):
            if (a, b) == (4, "y"):
                recs.append(record(i, {"chip.a": a, "net.b": b}, error={"type": "InfeasibleError", "message": "no"}))
            else:
                recs.append(record(i, {"chip.a": a, "net.b": b}, fake_result(tput=10 * a + (b == "y"))))
            i += 1
    recs.append(record(i, {"chip.a": 1, "net.b": "x"}, fake_result(tput=99.0)))  # a second point in one cell
    return recs


def test_heatmap_cells_hold_the_best_value_and_mark_missing():
    fig = plots.plot_heatmap(grid_records(), x="chip.a", y="net.b", value="throughput.samples_per_s")
    g = fig.dfmodel_grid
    assert g["x"] == [1, 2, 4] and g["y"] == ["x", "y"]
    assert g["values"] == [[99.0, 20.0, 40.0], [11.0, 21.0, None]]
    assert sum(t.get_text() == "-" for t in fig.axes[0].texts) == 1


def test_heatmap_accepts_flat_rows_and_a_dataframe():
    rows = plots.as_rows(grid_records())
    assert rows[0]["chip.a"] == 1 and rows[0]["throughput.samples_per_s"] == 10.0
    a = plots.plot_heatmap(rows, "chip.a", "net.b").dfmodel_grid
    pd = pytest.importorskip("pandas")
    b = plots.plot_heatmap(pd.DataFrame(rows), "chip.a", "net.b").dfmodel_grid
    assert a == b


def test_pareto_front_is_exactly_the_non_dominated_points():
    rng = random.Random(7)
    recs = [record(i, {}, fake_result(tput=rng.uniform(1, 100), cost=rng.uniform(1e5, 1e7))) for i in range(60)]
    recs.append(record(60, {}, error={"type": "InfeasibleError", "message": "x"}))
    fig = plots.plot_pareto(recs, x="cost_usd", y="throughput.samples_per_s")
    front = {(x, y) for x, y, _ in fig.dfmodel_front}
    pts = [(r["result"]["cost_usd"], r["result"]["throughput"]["samples_per_s"]) for r in recs if r["result"]]

    def dominates(p, q):
        return p[0] <= q[0] and p[1] >= q[1] and p != q

    for q in pts:
        assert (q in front) == (not any(dominates(p, q) for p in pts))
    assert 1 <= len(front) < len(pts)
    xs = [x for x, _, _ in fig.dfmodel_front]
    ys = [y for _, y, _ in fig.dfmodel_front]
    assert xs == sorted(xs) and ys == sorted(ys)  # cheaper is slower along the front


def test_pareto_front_small_cases():
    assert plots.pareto_front([(1, 1), (2, 3), (3, 2), (2, 2)]) == [0, 1]
    assert plots.pareto_front([(1, 1), (1, 1)]) == [0, 1]
    assert plots.pareto_front([(1, 1), (2, 3)], minimize_x=False) == [1]


# ---------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """One real solve through the CLI, with --plot and --json."""
    d = tmp_path_factory.mktemp("solve")
    png, js = d / "solve.png", d / "result.json"
    proc = cli("solve", "-w", "gpt3_13b", "-s", "dgx_a100", "--num-chips", "16", "--tp", "2", "--pp", "2",
               "--dp", "4", "--micro-batch", "2", "--interleave", "1", "--plot", str(png), "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {png}" in proc.stdout
    return png, json.loads(js.read_text())


def test_solve_plot_writes_a_png(solved):
    png, result = solved
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_real_result_plots(solved):
    _, result = solved
    pipe = result["pipeline"]
    fig = plots.plot_pipeline(result)
    assert len(plots.timeline_boxes(fig.axes[0])) == len(pipe["stage_forward_s"]) * pipe["num_micro_batches"] * 2
    fig = plots.plot_result(result)
    assert len(fig.axes) == 2
    fig = plots.plot_partitions(result)
    assert len(fig.axes[-1].patches) == len(result["intra_chip"]["partitions"])
    assert any(k.startswith("comm") for p in result["intra_chip"]["partitions"] for k in p["kernels"])
    assert_nodes_above_their_bars(fig)


def kernel_nodes(ax) -> list[tuple[float, tuple]]:
    """(x, fill colour) of every kernel box :func:`plots.draw_graph` drew."""
    return [(t.get_position()[0], tuple(t.get_bbox_patch().get_facecolor())) for t in ax.texts
            if t.get_gid() == "kernel"]


def assert_nodes_above_their_bars(fig):
    """Every kernel node sits over its partition's bar and has the bar's colour."""
    ax_graph, ax_bars = fig.axes
    bars = ax_bars.patches
    for x, color in kernel_nodes(ax_graph):
        (bar,) = [b for b in bars if b.get_x() <= x <= b.get_x() + b.get_width()]
        assert tuple(bar.get_facecolor()) == pytest.approx(tuple(color))


@pytest.mark.parametrize("kind,extra", [("heatmap", ["--x", "chip.a", "--y", "net.b"]), ("pareto", []),
                                        ("breakdown", [])])
def test_plot_command_writes_images(tmp_path, kind, extra):
    f = tmp_path / "results.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in grid_records()) + '{"id": "torn')
    out = tmp_path / f"{kind}.png"
    proc = cli("plot", str(f), "--kind", kind, *extra, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_command_bad_input_is_one_line_exit_2(tmp_path):
    f = tmp_path / "results.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in grid_records()))
    for args in (["--kind", "nope"], ["--kind", "heatmap", "--x", "chip.a"], ["--kind", "heatmap", "--x", "q", "--y", "r"]):
        proc = cli("plot", str(f), *args, "--out", str(tmp_path / "x.png"))
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    proc = cli("plot", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


def test_heatmap_orders_quantity_strings_by_value(tmp_path):
    recs = [record(i, {"system.chip.memory.bandwidth_Bps": bw, "num_chips": n}, fake_result(tput=float(i)))
            for i, (bw, n) in enumerate([(bw, n) for bw in ("10 TB/s", "2 TB/s", "500 GB/s") for n in (16, 8)])]
    g = plots.plot_heatmap(recs, "system.chip.memory.bandwidth_Bps", "num_chips").dfmodel_grid
    assert g["x"] == ["500 GB/s", "2 TB/s", "10 TB/s"] and g["y"] == [8, 16]
    assert g["values"] == [[5.0, 3.0, 1.0], [4.0, 2.0, 0.0]]
    # the sweep module's DataFrame gives the same grid
    sweeps = pytest.importorskip("dfmodel.sweeps")
    pytest.importorskip("pandas")
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plots.plot_heatmap(sweeps.load_results(f), "system.chip.memory.bandwidth_Bps", "num_chips").dfmodel_grid == g


# ---------------------------------------------------------------------------------- kernel graph


@pytest.mark.parametrize("workload", ["gpt3_175b", "dlrm"])
def test_graph_png_is_layered_left_to_right_without_overlapping_labels(workload):
    """A 30-kernel decoder layer and the 45-kernel DLRM graph: every edge points right, no two
    kernel boxes overlap, and the legend names every kernel kind drawn."""
    import networkx as nx

    from dfmodel.graph.build import build_graphs
    from dfmodel.graph.workload import load_workload

    g = build_graphs(load_workload(workload), batch=1).layer
    pos = plots.layered_positions(g)
    for u, v in nx.DiGraph(g.nx).edges():
        assert pos[u][0] < pos[v][0], (u, v)
    fig = plots.draw_graph(g)
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_bbox_patch().get_window_extent(renderer) for t in ax.texts if t.get_gid() == "kernel"]
    assert len(boxes) == len(g.kernels)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {k.kind.value for k in g.kernels} <= legend
    plt.close(fig)
