"""Groups of candidate mappings for a lazy (hierarchical) branch and bound.

A mapping space can hand :func:`dfmodel.inter_chip.search.search` *groups* instead of every
mapping: a :class:`SpaceNode` stands for ``count`` mappings and carries a lower bound on the
time and on the per-chip memory of every mapping in it (a relaxation: each inner knob at its
most favourable value independently). The search keeps groups on its best-bound-first queue and
expands one into its children only when it reaches the top below the cutoff; a group whose bound
is no better than the cutoff, or whose memory floor exceeds the chip, is pruned with all of its
``count`` mappings counted but never built. A node whose ``expand`` returns mappings (a *leaf
group*) promises that its bound and floor are exactly each of those mappings' own
(``model.lower_bound_s`` / ``model.memory_floor_bytes``), so they need no separate screen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(eq=False)
class SpaceNode:
    """``count`` candidate mappings sharing the knob values ``knobs`` (name, value pairs).

    ``bound_s`` <= the lower bound (hence the time) of each; ``floor_bytes`` <= the memory floor
    of each. ``expand()`` returns child nodes, or the mappings themselves (leaf group: they share
    this node's bound and floor exactly, and ``screen()``'s floor when given)."""

    bound_s: float
    floor_bytes: float
    count: int
    knobs: tuple
    expand: Callable[[], list]
    leaf: bool = False
    #: optional: a tighter memory floor, costlier to compute, that the search asks for only when
    #: the group reaches the top of the queue below the cutoff (before expanding it)
    screen: Callable[[], float] | None = None
    #: optional: when the group is pruned for memory, the same mappings with state offloaded to
    #: host memory (:mod:`dfmodel.inter_chip.offload`) as a group of their own, or None
    relief: Callable[[], "SpaceNode | None"] | None = None
    #: optional: a tighter time bound, costlier to compute (e.g. per-kernel and TP-collective
    #: floors), valid for every mapping of the group; the search asks for it only when the group
    #: first reaches the top of the queue below the cutoff, and re-queues the group under it when
    #: it is larger (lazy bound tightening: groups the cutoff prunes never pay for it)
    refine: Callable[[], float] | None = None
    #: optional: False when a floor proves that the host DRAM cannot hold the group's offloaded
    #: state (:mod:`dfmodel.inter_chip.host_floor`); asked with ``screen``, the group is then
    #: pruned for memory (no relief: its state is offloaded already)
    host_screen: Callable[[], bool] | None = None


__all__ = ["SpaceNode"]
