"""Where a parallel group can sit on the network, and how the network splits among parallelisms.

Chips are numbered in mixed radix over the network dimensions, innermost fastest. A parallel
group occupies a *contiguous run* of dimensions ``i..j`` (innermost first):

- the dimensions strictly between ``i`` and ``j`` are used whole;
- the first (``i``) and the last (``j``) may each be a factor of their dimension -- the first
  because an inner parallelism already took the rest of it, the last because an outer one takes
  the rest -- but only for ``switch`` and ``fully_connected`` dimensions (a ring is used whole);
- when ``i < j`` both end factors are > 1 (otherwise the run is really shorter).

Placements that skip a dimension (e.g. the x and z rings of a torus without y), or that interleave
two parallelisms inside one dimension other than as inner factor x outer factor, are not
enumerated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from dfmodel.netmodels.group import Group, NetworkGroupError
from dfmodel.system.schema import NetworkDim, System


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _partial_ok(dim: NetworkDim, members: int) -> bool:
    """May ``members`` (a factor of the dimension) be used on their own?"""
    if dim.size % members:
        return False
    return members == dim.size or dim.topology != "ring"


def groups_for(system: System, degree: int) -> list[Group]:
    """Every contiguous placement of a group of ``degree`` members (see module docstring).

    Ordered by first dimension, then by last dimension, then by the first dimension's factor.
    ``degree == 1`` gives ``[()]``; a degree that fits nowhere gives ``[]``.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> groups_for(s, 4)
    [(('nv', 4),), (('nv', 2), ('ib', 2)), (('ib', 4),)]
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise NetworkGroupError(f"degree must be a positive integer, got {degree!r}", field="degree")
    if degree == 1:
        return [()]
    dims = system.network
    out: list[Group] = []
    for i, first in enumerate(dims):
        for j in range(i, len(dims)):
            if i == j:
                if degree <= first.size and _partial_ok(first, degree):
                    out.append(((first.name, degree),))
                continue
            middle = math.prod(d.size for d in dims[i + 1 : j])
            if degree % middle:
                continue
            rest = degree // middle
            last = dims[j]
            for m_first in _divisors(first.size):
                if m_first == 1 or rest % m_first:
                    continue
                m_last = rest // m_first
                if m_last == 1 or not _partial_ok(first, m_first) or not _partial_ok(last, m_last):
                    continue
                group = ((first.name, m_first), *((d.name, d.size) for d in dims[i + 1 : j]), (last.name, m_last))
                out.append(group)
    return out


def _split_in_order(system: System, order: Sequence[str], degrees: Mapping[str, int]) -> dict[str, Group] | None:
    """Mixed-radix assignment: each parallelism in ``order`` takes the next ``degree`` members."""
    dims = system.network
    idx, left = 0, dims[0].size  # dimension being filled, and how many of its members are free
    out: dict[str, Group] = {}
    for name in order:
        need = degrees[name]
        group: list[tuple[str, int]] = []
        while need > 1:
            while left == 1:
                idx += 1
                if idx >= len(dims):
                    return None
                left = dims[idx].size
            dim = dims[idx]
            take = need if need < left else left
            if left % take or need % take:
                return None
            if take != dim.size and dim.topology == "ring":
                return None
            group.append((dim.name, take))
            need //= take
            left //= take
        out[name] = tuple(group)
    return out


def split_dims(system: System, degrees: Mapping[str, int], order: Sequence[str] | None = None) -> list[dict[str, Group]]:
    """Every way to lay the parallelisms ``degrees`` (e.g. ``{"tp": 4, "dp": 64, "pp": 4}``) on
    the network, one per nesting order.

    With a nesting order (innermost first, e.g. ``("tp", "dp", "pp")``) the layout is fixed:
    chips are numbered in mixed radix and each parallelism takes the next ``degree`` members,
    possibly a factor of a switch / fully connected dimension and continuing outward (a ring is
    taken whole). ``order=None`` tries every order of the names (``degrees``' own order first)
    and returns the distinct layouts that fit; a given ``order`` returns at most one. The product
    of the degrees must equal the chip count. Every dict lists the names in ``degrees``' order;
    a degree of 1 gets the empty group ``()``.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> split_dims(s, {"tp": 4, "dp": 8, "pp": 4}, order=("tp", "dp", "pp"))
    [{'tp': (('nv', 4),), 'dp': (('nv', 2), ('ib', 4)), 'pp': (('ib', 4),)}]
    """
    names = list(degrees)
    for n in names:
        d = degrees[n]
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise NetworkGroupError(f"degree of {n!r} must be a positive integer, got {d!r}", field="degrees")
    total = math.prod(degrees.values())
    if total != system.num_chips:
        raise NetworkGroupError(
            f"the degrees {dict(degrees)} multiply to {total}, not the system's {system.num_chips} chips",
            source=f"system {system.name}",
            field="degrees",
        )
    if order is not None:
        if sorted(order) != sorted(names):
            raise NetworkGroupError(f"order {list(order)} must list exactly the names {names}", field="order")
        orders: Sequence[Sequence[str]] = [tuple(order)]
    else:
        orders = list(itertools.permutations(names))
    out: list[dict[str, Group]] = []
    for o in orders:
        layout = _split_in_order(system, o, degrees)
        if layout is None:
            continue
        layout = {n: layout[n] for n in names}
        if layout not in out:
            out.append(layout)
    return out


def merge_groups(system: System, *groups: Group) -> Group:
    """The group spanned by several disjoint groups together (e.g. Megatron-Core's dp x cp ranks
    that reduce gradients together): members multiply per network dimension, innermost first.

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> merge_groups(s, (("nv", 2),), (("nv", 4), ("ib", 4)))
    (('nv', 8), ('ib', 4))
    """
    members: dict[str, int] = {}
    for group in groups:
        for dim, n in group:
            members[dim] = members.get(dim, 1) * n
    return tuple((d.name, members[d.name]) for d in system.network if members.get(d.name, 1) > 1)


def inner_group(system: System, group: Group, size: int) -> Group | None:
    """The innermost ``size`` members of ``group`` (a sub-group carved out of it, e.g. Megatron-
    Core's expert-parallel ranks inside the dp x cp ranks), or None when ``size`` does not split
    it along its dimensions (or would use part of a ring).

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> inner_group(s, (("nv", 4), ("ib", 4)), 8), inner_group(s, (("nv", 4),), 3)
    ((('nv', 4), ('ib', 2)), None)
    """
    dims = {d.name: d for d in system.network}
    out: list[tuple[str, int]] = []
    need = size
    for dim, n in group:
        if need == 1:
            break
        take = n if need % n == 0 else need
        if n % take or not _partial_ok(dims[dim], take):
            return None
        out.append((dim, take))
        need //= take
    return tuple(out) if need == 1 else None
