"""Outer mapping knobs: one candidate of the inter-chip search."""

from __future__ import annotations

from dataclasses import dataclass, field

RECOMPUTE = ("none", "selective", "full")


class Placed:
    """Mixin for mappings with a ``placement``: ``((name, ((dim, members), ...)), ...)``."""

    placement: tuple

    def group(self, name: str) -> tuple[tuple[str, int], ...]:
        return dict(self.placement).get(name, ())

    def dims_report(self) -> dict[str, list[str]]:
        return {name: [f"{d}:{n}" for d, n in grp] for name, grp in self.placement}


@dataclass(frozen=True, order=True)
class Mapping(Placed):
    """Parallel degrees, their network placement and the training-schedule knobs.

    ``placement`` maps ``tp``/``pp``/``dp`` to ``(dim_name, members)`` tuples, innermost first.
    """

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    interleave: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    placement: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = field(default=(), compare=True)

@dataclass(frozen=True)
class Knobs:
    """What the user fixed (None = search it)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    interleave: int | None = None
    distributed_optimizer: bool | None = None


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
