"""System specs: chip, memory, network dimensions; loading and per-kernel cost formulas."""

from dfmodel.system.loader import load_system, resize
from dfmodel.system.schema import Chip, Efficiency, Host, Memory, NetworkDim, Precision, Storage, System

__all__ = [
    "Chip",
    "Efficiency",
    "Host",
    "Memory",
    "NetworkDim",
    "Precision",
    "Storage",
    "System",
    "load_system",
    "resize",
]
