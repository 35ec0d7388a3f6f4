"""From a workload's ``kind:`` to the :class:`~dfmodel.inter_chip.family_api.Family` that solves it.

>>> sorted(FAMILIES)
['dlrm', 'fft', 'graph', 'hpl', 'llm']
>>> family_for("hpl").kind
'hpl'

A new family is one class implementing the interface and one entry here; ``optimize``, the
CLI and sweeps reach it through :func:`family_for`.
"""

from __future__ import annotations

from dfmodel.errors import InputError
from dfmodel.inter_chip.dlrm import DLRMFamily
from dfmodel.inter_chip.family_api import Family
from dfmodel.inter_chip.fft import FFTFamily
from dfmodel.inter_chip.graph_family import GraphFamily
from dfmodel.inter_chip.hpl import HPLFamily
from dfmodel.inter_chip.llm_family import LLMFamily

FAMILIES: dict[str, Family] = {f.kind: f for f in (LLMFamily(), DLRMFamily(), HPLFamily(), FFTFamily(), GraphFamily())}


def family_for(kind: str | None, *, source: str | None = None) -> Family:
    """The family of ``kind``; InputError naming the kinds there are."""
    try:
        return FAMILIES[kind]
    except KeyError:
        raise InputError(f"no family for workload kind {kind!r} (kinds: {', '.join(sorted(FAMILIES))})",
                         source=source, field="kind") from None


__all__ = ["FAMILIES", "family_for"]
