"""Capital cost and power of a whole system, from the per-part figures in its spec.

Formulas (one place):

- chips: ``N * (chip.price_usd + memory.price_usd)`` and ``N * (chip.power_w + memory.power_w)``;
- links per dimension of size ``p`` (``N / p`` instances of the dimension): a ring has ``p``
  links (``1`` when ``p == 2``, none when ``p == 1``), fully connected ``p (p - 1) / 2``, a
  switch ``p`` (one per member);
- switches per switch dimension instance: one when ``p <= radix``, else a two-level folded Clos
  with ``ceil(2p / radix)`` leaves and ``ceil(leaves / 2)`` spines (radix defaults to ``p``).
"""

from __future__ import annotations

import math

from dfmodel.system.schema import NetworkDim, System


def links_per_instance(dim: NetworkDim) -> int:
    p = dim.size
    if p == 1:
        return 0
    if dim.topology == "ring":
        return 1 if p == 2 else p
    if dim.topology == "fully_connected":
        return p * (p - 1) // 2
    return p


def switches_per_instance(dim: NetworkDim) -> int:
    if dim.topology != "switch" or dim.size == 1:
        return 0
    radix = dim.switch_radix or dim.size
    if dim.size <= radix:
        return 1
    leaves = math.ceil(2 * dim.size / radix)
    return leaves + math.ceil(leaves / 2)


def _network_totals(system: System) -> tuple[float, float]:
    n = system.num_chips
    usd = watts = 0.0
    for dim in system.network:
        instances = n // dim.size
        links = instances * links_per_instance(dim)
        switches = instances * switches_per_instance(dim)
        usd += links * dim.link_price_usd + switches * dim.switch_price_usd
        watts += links * dim.link_power_w + switches * dim.switch_power_w
    return usd, watts


def system_cost_usd(system: System) -> float:
    """Purchase cost of chips, their memory, links and switches.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "price_usd": 100, "memory": {"kind": "DDR", "capacity_bytes": 1e9,
    ...     "bandwidth_Bps": 1e10, "price_usd": 10}}, "network": [{"name": "r",
    ...     "topology": "ring", "size": 4, "link_bandwidth_Bps": 1e9, "link_price_usd": 5}]})
    >>> system_cost_usd(s)
    460.0
    """
    chip = system.chip
    return system.num_chips * (chip.price_usd + chip.memory.price_usd) + _network_totals(system)[0]


def system_power_w(system: System) -> float:
    """Power of chips, their memory, links and switches."""
    chip = system.chip
    return system.num_chips * (chip.power_w + chip.memory.power_w) + _network_totals(system)[1]
