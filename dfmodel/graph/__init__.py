"""Dataflow graphs: kernels, tensors, the graph, and builders from workload YAML."""

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor

__all__ = ["DataflowGraph", "Kernel", "KernelKind", "Phase", "Tensor"]
