"""Communication groups: which network dimensions a parallel group spans, and how many members
it has in each.

A group is a tuple of ``(dim_name, members)`` pairs, innermost dimension first::

    (("nvlink", 8), ("ib", 4))      # 32 chips: 8 GPUs of a node x 4 nodes
    (("nvlink", 4),)                # half of an 8-GPU NVSwitch node
    ()                              # one chip: every collective costs 0

``members`` may be a factor of a ``switch`` or ``fully_connected`` dimension (any subset of a
switch's ports, or of a clique, is again a switch or a clique), but must equal the size of a
``ring`` dimension (a piece of a ring is a line, which these models do not cover). Pairs with one
member are dropped: they add nothing to the group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dfmodel.errors import InputError
from dfmodel.system.schema import NetworkDim, System

Group = tuple[tuple[str, int], ...]


class NetworkGroupError(InputError, ValueError):
    """Bad collective request: unknown collective or dimension, or a member count that does not
    fit the dimension. Both an :class:`InputError` (one line for the user) and a ``ValueError``."""


@dataclass(frozen=True)
class GroupDim:
    """One dimension of a group: the network dimension and how many of its members take part."""

    dim: NetworkDim
    members: int

    @property
    def whole(self) -> bool:
        return self.members == self.dim.size

    @property
    def label(self) -> str:
        """``nvlink`` when the whole dimension is used, ``nvlink(4/8)`` for a factor of it."""
        return self.dim.name if self.whole else f"{self.dim.name}({self.members}/{self.dim.size})"


def group_size(group: Iterable[tuple[str, int]]) -> int:
    """Total members of a group: the product of its member counts (1 for the empty group)."""
    return math.prod(int(m) for _, m in group)


def check_members(dim: NetworkDim, members: int, system_name: str) -> None:
    """Raise :class:`NetworkGroupError` unless ``members`` of ``dim`` form a valid sub-group."""
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise NetworkGroupError(
            f"members must be a positive integer, got {members!r}",
            source=f"system {system_name}",
            field=f"group.{dim.name}",
        )
    if members == 1:
        return
    if dim.topology == "ring" and members != dim.size:
        raise NetworkGroupError(
            f"a ring dimension must be used whole: members must be 1 or {dim.size}, got {members}",
            source=f"system {system_name}",
            field=f"group.{dim.name}",
        )
    if dim.size % members:
        raise NetworkGroupError(
            f"members must divide the {dim.topology} dimension's size {dim.size}, got {members}",
            source=f"system {system_name}",
            field=f"group.{dim.name}",
        )


def resolve_group(system: System, group: Sequence[tuple[str, int]] | Sequence[Sequence]) -> tuple[GroupDim, ...]:
    """Validate ``group`` against ``system``; return its dimensions with more than one member.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "x", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e9}]})
    >>> [g.label for g in resolve_group(s, [("x", 4)])]
    ['x(4/8)']
    """
    if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
        raise NetworkGroupError(
            f"a group is a sequence of (dim_name, members) pairs, got {group!r}",
            source=f"system {system.name}",
            field="group",
        )
    out: list[GroupDim] = []
    seen: set[str] = set()
    for pair in group:
        try:
            name, members = pair
        except (TypeError, ValueError):
            raise NetworkGroupError(
                f"a group is a sequence of (dim_name, members) pairs, got element {pair!r}",
                source=f"system {system.name}",
                field="group",
            ) from None
        names = [d.name for d in system.network]
        if name not in names:
            raise NetworkGroupError(
                f"unknown network dimension {name!r}; the system has {', '.join(names)}",
                source=f"system {system.name}",
                field="group",
            )
        if name in seen:
            raise NetworkGroupError(
                f"dimension {name!r} appears twice; give each dimension once with its member count",
                source=f"system {system.name}",
                field="group",
            )
        seen.add(name)
        dim = system.dim(name)
        check_members(dim, members, system.name)
        if members > 1:
            out.append(GroupDim(dim, int(members)))
    return tuple(out)


def canonical(group: Sequence[tuple[str, int]]) -> Group:
    """Hashable form of a group (tuple of ``(str, int)`` pairs, one-member pairs dropped)."""
    return tuple((str(n), int(m)) for n, m in group if int(m) != 1)
