"""Live progress on stderr for long solves, sweeps and validation (rich), quiet when stderr is
not a terminal or the user asked for quiet; stdout (tables, ``--json -``) is never touched."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dfmodel.cli_format import fmt_time


def enabled(quiet: bool = False, stream=None) -> bool:
    """Show progress only on an interactive stderr and without ``--quiet``."""
    stream = sys.stderr if stream is None else stream
    return not quiet and bool(getattr(stream, "isatty", lambda: False)())


def _bar(console: Console, what: str) -> Progress:
    return Progress(
        TextColumn(f"[bold]{what}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True,
    )


@contextlib.contextmanager
def search_progress(*, quiet: bool = False, console: Console | None = None):
    """Yield a callback for ``optimize(progress=...)`` (None when quiet): candidates settled of
    those enumerated, best so far, proven bound and gap, elapsed and ETA."""
    if not enabled(quiet, None if console is None else console.file):
        yield None
        return
    with _bar(console or Console(stderr=True), "search") as bar:
        task = bar.add_task("search", total=None, info="enumerating")

        def update(p) -> None:
            info = f"{p.evaluated} evaluated"
            if p.best_s is not None:
                info += f", best {fmt_time(p.best_s)}"
            if p.bound_s is not None and p.gap is not None:
                info += f", bound {fmt_time(p.bound_s)}, gap {p.gap:.1%}"
            bar.update(task, total=max(p.candidates, 1), completed=min(p.done, p.candidates), info=info)

        yield update


@contextlib.contextmanager
def count_progress(what: str, total: int, *, quiet: bool = False, console: Console | None = None):
    """Yield ``advance(info="")`` for a loop of ``total`` items (sweep points, validation cases)."""
    if not enabled(quiet, None if console is None else console.file):
        yield lambda info="": None
        return
    with _bar(console or Console(stderr=True), what) as bar:
        task = bar.add_task(what, total=total, info="")

        def advance(info: str = "") -> None:
            bar.update(task, advance=1, info=info)

        yield advance


__all__ = ["enabled", "search_progress", "count_progress"]
