"""DFModel: find the best mapping of a workload onto a machine, and predict how fast it runs.

Public API (imported lazily so ``import dfmodel`` stays fast)::

    from dfmodel import optimize, load_workload, load_system, build_graph
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_system": "dfmodel.system.loader",
    "System": "dfmodel.system.schema",
    "load_workload": "dfmodel.graph.workload",
    "build_graph": "dfmodel.graph.build",
    "build_graphs": "dfmodel.graph.build",
    "DataflowGraph": "dfmodel.graph.graph",
    "Kernel": "dfmodel.graph.kernel",
    "Tensor": "dfmodel.graph.kernel",
    "optimize": "dfmodel.optimizer",
    "Result": "dfmodel.result",
    "DFModelError": "dfmodel.errors",
    "InputError": "dfmodel.errors",
    "InfeasibleError": "dfmodel.errors",
    "sweep": "dfmodel.sweeps",
    "load_results": "dfmodel.sweeps",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dfmodel' has no attribute {name!r}")
