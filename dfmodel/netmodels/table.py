"""The collective-cost table the mapping passes consume: built once per system, cached."""

from __future__ import annotations

from collections.abc import Sequence

from dfmodel.netmodels.collectives import CollectiveCost, collective_time, normalize_collective
from dfmodel.netmodels.group import Group, canonical
from dfmodel.netmodels.topologies import COLLECTIVES
from dfmodel.system.schema import System

# 1 KiB .. 1 GiB in steps of 4x: the sizes a report shows by default.
DEFAULT_SIZES_BYTES: tuple[int, ...] = tuple(4**k * 1024 for k in range(11))


class CostTable:
    """Fastest-algorithm costs for one system, memoised by ``(collective, round(bytes), group)``.

    Message sizes are rounded to whole bytes before the cost is computed, so the answer does not
    depend on which size first filled a cache entry.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "x", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e9}]})
    >>> t = CostTable(s)
    >>> t.time_s("p2p", 1e9, [("x", 2)])
    1.0
    """

    def __init__(self, system: System):
        self.system = system
        self._cache: dict[tuple[str, int, Group], CollectiveCost] = {}

    def cost(self, collective: str, message_bytes: float, group) -> CollectiveCost:
        """Fastest algorithm (see :func:`dfmodel.netmodels.collective_time`)."""
        key = None
        try:
            key = (normalize_collective(collective), round(float(message_bytes)), canonical(group))
        except (TypeError, ValueError, OverflowError):
            pass  # let collective_time raise its one-line error for the bad input
        if key is not None and key in self._cache:
            return self._cache[key]
        size = float(key[1]) if key is not None else message_bytes
        result = collective_time(self.system, collective, size, group)
        if key is not None:
            self._cache[key] = result
        return result

    def time_s(self, collective: str, message_bytes: float, group) -> float:
        return self.cost(collective, message_bytes, group).time_s

    def table(self, group, sizes_bytes: Sequence[float] = DEFAULT_SIZES_BYTES,
              collectives: Sequence[str] = COLLECTIVES) -> list[dict]:
        """Rows ``{collective, size_bytes, time_s, algorithm}`` for a report, one per pair."""
        rows = []
        for c in collectives:
            for size in sizes_bytes:
                cost = self.cost(c, size, group)
                rows.append({"collective": normalize_collective(c), "size_bytes": float(round(size)),
                             "time_s": cost.time_s, "algorithm": cost.algorithm})
        return rows

    def __len__(self) -> int:
        return len(self._cache)
