"""One wall-clock deadline for a whole call, passed down to every solver it runs.

``optimize(time_limit_s=...)`` opens a :func:`deadline_scope`; the outer search stops when it
passes, and every MILP solve started inside gets ``min(its own limit, time left)``
(:func:`clamp`), so the call as a whole ends within about a second of the limit -- the
contract a MILP solver gives for one model (return the incumbent, its bound and the gap).

>>> with deadline_scope(None):
...     clamp(5.0)
5.0
>>> with deadline_scope(1e9):
...     clamp(None) > 1e8
True
"""

from __future__ import annotations

import contextlib
import contextvars
import time

from dfmodel.errors import TimeLimitError

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("dfmodel_deadline", default=None)

#: a solve never gets less than this (HiGHS/Gurobi need a few ms to return their incumbent)
MIN_SOLVE_S = 0.01


def deadline() -> float | None:
    """The active deadline on :func:`time.perf_counter`'s clock (None: no limit)."""
    return _DEADLINE.get()


def time_left_s() -> float | None:
    """Seconds until the active deadline (negative once passed; None: no limit)."""
    d = _DEADLINE.get()
    return None if d is None else d - time.perf_counter()


def expired() -> bool:
    left = time_left_s()
    return left is not None and left <= 0.0


class DeadlineExpired(TimeLimitError):
    """Raised by long non-MILP passes (the intra-chip DP) when the deadline has passed: the
    evaluation in progress is abandoned and the search returns what it has."""


def check() -> None:
    """Raise :class:`DeadlineExpired` when the active deadline has passed."""
    if expired():
        raise DeadlineExpired("time limit reached during an evaluation")


def clamp(time_limit_s: float | None) -> float | None:
    """A solver's own limit capped by the time left before the active deadline."""
    left = time_left_s()
    if left is None:
        return time_limit_s
    left = max(left, MIN_SOLVE_S)
    return left if time_limit_s is None else min(time_limit_s, left)


#: [seconds spent in the outermost :func:`interruptible` sections, their nesting depth] (per process)
_INTERRUPTIBLE = [0.0, 0]


@contextlib.contextmanager
def interruptible():
    """Mark a pass that stops at the deadline on its own (a MILP solve: :func:`clamp`; the
    intra-chip DP: :func:`check`). Its time is counted (:func:`interruptible_seconds`), so the
    outer search reserves before the deadline only what an evaluation cannot cut short."""
    _INTERRUPTIBLE[1] += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _INTERRUPTIBLE[1] -= 1
        if _INTERRUPTIBLE[1] == 0:  # nested sections count once
            _INTERRUPTIBLE[0] += time.perf_counter() - t0


def interruptible_seconds() -> float:
    """Seconds this process has spent inside :func:`interruptible` sections so far.

    >>> before = interruptible_seconds()
    >>> with interruptible():
    ...     with interruptible():
    ...         time.sleep(0.01)
    >>> 0.01 <= interruptible_seconds() - before < 0.02
    True
    """
    return _INTERRUPTIBLE[0]


@contextlib.contextmanager
def deadline_scope(time_limit_s: float | None):
    """Run the block under a deadline ``time_limit_s`` seconds from now (None: keep any outer
    deadline). A nested scope never extends an outer one."""
    if time_limit_s is None:
        yield
        return
    new = time.perf_counter() + float(time_limit_s)
    outer = _DEADLINE.get()
    token = _DEADLINE.set(new if outer is None else min(outer, new))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


@contextlib.contextmanager
def grace_scope(extra_s: float):
    """Run the block with the active deadline moved ``extra_s`` seconds later (no deadline: no
    change). Only for the one evaluation that gives a time-limited search its first incumbent:
    the contract is "within about a second of the limit", and a search that returns no mapping
    at all helps nobody."""
    d = _DEADLINE.get()
    if d is None:
        yield
        return
    token = _DEADLINE.set(d + max(0.0, float(extra_s)))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


__all__ = ["deadline", "grace_scope", "time_left_s", "expired", "check", "clamp", "deadline_scope", "DeadlineExpired",
           "interruptible", "interruptible_seconds"]
