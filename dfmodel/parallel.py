"""Use every core: an ordered process pool over independent jobs (validation cases, sweep
points) and the worker count every parallel entry point defaults to.

Workers are forked (Linux): they inherit the parent's loaded modules, presets and the job list,
so only a job's index goes out and its (picklable) result comes back. Where ``fork`` is not
available, or one worker is asked for, jobs run in this process, in order: the serial path is
exactly the historical one. Inside a worker, :func:`default_workers` is 1, so a job that could
itself fan out (``optimize``) does not oversubscribe the cores its siblings are using.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from typing import Any, Callable, Sequence

from dfmodel.errors import InputError

_IN_WORKER = False  # True in a pool worker: nested parallelism stays off
_JOB: tuple[Callable, Sequence] | None = None  # (function, items) of the running map, inherited by fork


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; ``cpu_count`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers() -> int:
    """One worker per usable core, or 1 inside a worker of a pool already using them."""
    return 1 if _IN_WORKER else usable_cores()


@contextlib.contextmanager
def single_core():
    """Inside the block, :func:`default_workers` is 1 (``--jobs 1``: everything serial)."""
    global _IN_WORKER
    before, _IN_WORKER = _IN_WORKER, True
    try:
        yield
    finally:
        _IN_WORKER = before


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def resolve_workers(workers: int | None, field: str = "workers") -> int:
    """``workers`` checked (an integer >= 1), or the default when None."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"must be an integer >= 1, got {workers!r}", field=field)
    return workers


def _init_worker() -> None:
    global _IN_WORKER
    _IN_WORKER = True
    # Ctrl-C reaches the whole process group; the parent alone handles it (and ends the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(i: int) -> Any:
    fn, items = _JOB  # type: ignore[misc]
    return fn(items[i])


def ordered_map(fn: Callable[[Any], Any], items: Sequence, *, workers: int | None = None,
                on_result: Callable[[Any], None] | None = None) -> list:
    """``[fn(x) for x in items]`` on up to ``workers`` forked processes, results in the order of
    ``items`` (``on_result`` is called on each, in that order, as soon as it and all before it are
    done). An exception in a job is re-raised here, as the serial loop would."""
    global _JOB
    items = list(items)
    n = min(resolve_workers(workers), len(items))
    if n <= 1 or not fork_available():
        out = []
        for x in items:
            out.append(fn(x))
            if on_result is not None:
                on_result(out[-1])
        return out
    _JOB = (fn, items)
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(n, initializer=_init_worker) as pool:
            out = []
            # chunksize 1: jobs differ in cost by 100x (a 1T model's free search vs a 1B one)
            for r in pool.imap(_run, range(len(items)), chunksize=1):
                out.append(r)
                if on_result is not None:
                    on_result(r)
            return out
    finally:
        _JOB = None


__all__ = ["usable_cores", "default_workers", "resolve_workers", "ordered_map", "fork_available", "single_core"]
