"""Load a :class:`System` from a path, a preset name, a dict or an existing object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dfmodel.errors import InputError
from dfmodel.presets import resolve
from dfmodel.system.schema import System
from dfmodel.yamlio import read_yaml, validate


def load_system(spec: str | Path | dict[str, Any] | System, num_chips: int | None = None) -> System:
    """Validated system; ``num_chips`` resizes the outermost network dimension.

    >>> s = load_system({"name": "two", "chip": {"name": "c", "peak_flops": 1e12,
    ...     "sram_bytes": "1 MiB", "memory": {"kind": "DDR", "capacity_bytes": "1 GiB",
    ...     "bandwidth_Bps": "10 GB/s"}}, "network": [{"name": "r", "topology": "ring",
    ...     "size": 2, "link_bandwidth_Bps": "1 GB/s"}]}, num_chips=8)
    >>> s.num_chips
    8
    """
    if isinstance(spec, System):
        system, source = spec.model_copy(deep=True), f"<system {spec.name}>"
    elif isinstance(spec, dict):
        source = "<dict>"
        system = validate(System, spec, source)
    else:
        path = resolve(spec, "systems")
        if not path.exists():
            from dfmodel.presets import unknown_preset_message

            raise InputError(unknown_preset_message(spec, "systems"), source=str(spec))
        source = str(path)
        system = validate(System, read_yaml(path), source)
    if num_chips is not None:
        system = resize(system, num_chips, source)
    return system


def resize(system: System, num_chips: int, source: str = "<system>") -> System:
    """Copy of ``system`` whose outermost dimension is scaled so the total is ``num_chips``."""
    inner = 1
    for d in system.network[:-1]:
        inner *= d.size
    if num_chips < 1 or num_chips % inner:
        raise InputError(
            f"must be a positive multiple of the inner dimensions' product {inner}, got {num_chips}",
            source=source,
            field="num_chips",
        )
    out = system.model_copy(deep=True)
    out.network[-1] = out.network[-1].model_copy(update={"size": num_chips // inner})
    return out
