"""The one interface every workload family implements, and what the search asks of a cost model.

A family (:class:`Family`) turns a workload of its ``kind`` into a cost model and answers four
questions about it -- which mappings exist (``candidates``), how fast one could at best be
(``lower_bound_s``), how fast it is (``evaluate``), and the user-facing answer for the best one
(``result``). ``solve`` is the whole job (knob checks, best-bound-first search, Result), the
same for every family; :mod:`dfmodel.inter_chip.registry` maps ``kind:`` to the family.

This module imports nothing from the families (they, and the registry, import it), so there is
no import cycle between the interface and its implementations.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable


@runtime_checkable
class SearchModel(Protocol):
    """What :func:`dfmodel.inter_chip.search.search` needs of a cost model.

    ``lower_bound_s(m) <= evaluate(m).iteration_time_s`` and ``memory_floor_bytes(m) <=`` the
    evaluated memory for every mapping (the tests check both on every family); ``refined_bound_s``
    may return a tighter valid bound once inner solves it depends on are cached (None otherwise).
    """

    system: Any

    def memory_floor_bytes(self, m) -> float: ...

    def lower_bound_s(self, m) -> float: ...

    def refined_bound_s(self, m) -> float | None: ...

    def evaluate(self, m) -> Any: ...


@runtime_checkable
class Family(Protocol):
    """A workload family: ``kind``, its cost model, candidates, bound, evaluation and result."""

    kind: str

    def model(self, workload, system, *, solver: str = "auto", time_limit_s: float | None = None,
              knobs=None) -> SearchModel:
        """The family's cost model of ``workload`` on ``system`` (``knobs``: the fixed ones, for
        families whose model depends on them)."""

    def candidates(self, model, knobs) -> Iterable:
        """Every valid mapping (frozen, hashable, ordered dataclasses), fixed knobs fixed."""

    def lower_bound_s(self, model, mapping) -> float:
        """A valid lower bound on ``evaluate(model, mapping).iteration_time_s``."""

    def evaluate(self, model, mapping) -> Any:
        """The mapping's evaluation: ``iteration_time_s``, ``breakdown_s``, ``memory``, ``fits``."""

    def result(self, model, best, stats) -> Any:
        """The :class:`~dfmodel.result.Result` of the best evaluation (with the search stats)."""

    def solve(self, workload, system, knobs, *, solver: str = "auto", time_limit_s: float | None = None,
              exhaustive: bool = False) -> Any:
        """Check the knobs, search every candidate best-bound-first, return the Result."""


class ModelFamily:
    """A :class:`Family` whose bound and evaluation are its cost model's own methods; subclasses
    name the model class and the module functions (candidates, to_result, solve)."""

    kind = ""
    model_class: type | None = None
    #: the family module's plain functions, as ``staticmethod(...)`` in each subclass
    candidates_fn = result_fn = solve_fn = None

    def model(self, workload, system, *, solver="auto", time_limit_s=None, knobs=None):
        return self.model_class(workload, system, solver=solver, time_limit_s=time_limit_s)

    def candidates(self, model, knobs):
        return self.candidates_fn(model, knobs)

    def result(self, model, best, stats):
        return self.result_fn(model, best, stats)

    def solve(self, workload, system, knobs, *, solver="auto", time_limit_s=None, exhaustive=False):
        return self.solve_fn(workload, system, knobs, solver=solver, time_limit_s=time_limit_s, exhaustive=exhaustive)

    def lower_bound_s(self, model, mapping) -> float:
        return model.lower_bound_s(mapping)

    def evaluate(self, model, mapping):
        return model.evaluate(mapping)


__all__ = ["Family", "SearchModel", "ModelFamily"]
