"""Matplotlib figures. Each function returns a Figure that a notebook shows and the CLI saves."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless by default; notebooks switch backends themselves

import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dfmodel.graph.graph import DataflowGraph  # noqa: E402
from dfmodel.graph.kernel import Phase  # noqa: E402

PHASE_COLORS = {Phase.forward: "#8ab4f8", Phase.backward: "#f6ae6b", Phase.weight_grad: "#81c995"}


def layered_positions(graph: DataflowGraph) -> dict[str, tuple[float, float]]:
    """Kernels placed by topological generation (left to right), spread vertically."""
    g = nx.DiGraph(graph.nx)
    for layer, names in enumerate(nx.topological_generations(g)):
        for name in names:
            g.nodes[name]["layer"] = layer
    return nx.multipartite_layout(g, subset_key="layer")


def draw_graph(graph: DataflowGraph, colors: dict[str, str] | None = None) -> Figure:
    """The kernel graph, coloured by phase (or by ``colors``: kernel name -> colour)."""
    pos = layered_positions(graph)
    width = max(8.0, 0.6 * len(set(x for x, _ in pos.values())))
    fig, ax = plt.subplots(figsize=(width, 6))
    node_colors = [
        (colors or {}).get(k.name, PHASE_COLORS[k.phase]) for k in graph.kernels
    ]
    nx.draw_networkx(
        nx.DiGraph(graph.nx),
        pos,
        ax=ax,
        nodelist=[k.name for k in graph.kernels],
        node_color=node_colors,
        node_size=300,
        font_size=6,
        arrowsize=8,
        edge_color="#999999",
    )
    ax.set_title(f"{graph.name}: {len(graph.kernels)} kernels")
    ax.axis("off")
    return fig
