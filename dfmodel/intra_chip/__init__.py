"""Intra-chip pass: group the kernels one chip runs into sequential partitions (fusion).

Entry point :func:`partition` (see its docstring); the cost of a partition lives in
:mod:`dfmodel.intra_chip.cost`, the exact DP over ideals in :mod:`dfmodel.intra_chip.ideals`, the
MILP in :mod:`dfmodel.intra_chip.milp`.
"""

from dfmodel.intra_chip.api import partition
from dfmodel.intra_chip.cost import CostModel
from dfmodel.intra_chip.result import PartitionReport, PartitionResult

__all__ = ["partition", "CostModel", "PartitionReport", "PartitionResult"]
