"""``kind: graph``: an explicit list of kernels and tensors, turned into a DataflowGraph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, Tensor

if TYPE_CHECKING:  # annotation only: workload.py builds the graph at load time (no import cycle)
    from dfmodel.graph.workload import GraphWorkload


def build_explicit(w: GraphWorkload) -> DataflowGraph:
    """The graph as written; cycles and unknown kernel names raise InputError naming the file and
    the field path (e.g. ``tensors.3.consumer``).

    >>> from dfmodel.graph.workload import load_workload
    >>> build_explicit(load_workload("tiny_mlp")).topological_names()[0]
    'fwd.fc1'
    """
    kernels = [Kernel(**k.model_dump()) for k in w.kernels]
    tensors = [Tensor(**{**t.model_dump(), "shape": tuple(t.shape)}) for t in w.tensors]
    meta = {"family": "graph", "workload": w.name, "batch": w.batch, "precision": w.precision.value,
            "bytes_per_element": w.precision.bytes}
    return DataflowGraph(kernels, tensors, name=f"{w.name}.graph", meta=meta, source=w.source)
