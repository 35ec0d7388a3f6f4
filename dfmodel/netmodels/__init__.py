"""Collective communication costs on multi-dimensional networks (alpha-beta models).

Message size ``S`` (``message_bytes``) means, per collective:

==============  ===============================================
all_reduce      the buffer each member holds (input = output)
reduce_scatter  the full input each member holds (output S/p)
all_gather      the full gathered output (each member adds S/p)
all_to_all      each member's whole local buffer (S/p to each)
broadcast       the buffer
p2p             the message (to the adjacent member)
==============  ===============================================

A group is a tuple of ``(dim_name, members)`` pairs, innermost first (see
:mod:`dfmodel.netmodels.group`); its members may be a factor of a switch or fully connected
dimension. Formulas: :mod:`~dfmodel.netmodels.formulas`; per-topology algorithms:
:mod:`~dfmodel.netmodels.topologies`; composition over dimensions:
:mod:`~dfmodel.netmodels.collectives`; placements: :mod:`~dfmodel.netmodels.placement`.

>>> from dfmodel.system import load_system
>>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
...                 {"name": "ib", "topology": "switch", "size": 4, "link_bandwidth_Bps": 1e10}]})
>>> collective_time(s, "all_reduce", 2**30, (("nv", 8), ("ib", 4))).algorithm
'pipelined over dims: ring reduce-scatter over nv, ring all-reduce over ib, ring all-gather over nv'
"""

from dfmodel.netmodels.collectives import (
    CollectiveCost,
    StepCost,
    algorithms,
    collective_time,
    normalize_collective,
)
from dfmodel.netmodels.group import Group, NetworkGroupError, group_size, resolve_group
from dfmodel.netmodels.placement import groups_for, inner_group, merge_groups, split_dims
from dfmodel.netmodels.table import DEFAULT_SIZES_BYTES, CostTable
from dfmodel.netmodels.topologies import COLLECTIVES

__all__ = [
    "COLLECTIVES",
    "DEFAULT_SIZES_BYTES",
    "CollectiveCost",
    "CostTable",
    "Group",
    "NetworkGroupError",
    "StepCost",
    "algorithms",
    "collective_time",
    "group_size",
    "groups_for",
    "normalize_collective",
    "resolve_group",
    "split_dims",
    "inner_group",
    "merge_groups",
]
