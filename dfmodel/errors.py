"""Errors that reach the user as one line, never as a traceback.

Every error the CLI catches is a :class:`DFModelError`; its ``str`` is the whole message. Input
errors name the file, the field path and what is allowed; the CLI maps them to exit code 2.
"""

from __future__ import annotations


class DFModelError(Exception):
    """Base class: a failure with a one-line, user-facing message."""

    exit_code = 1


class InputError(DFModelError):
    """Bad input: malformed YAML, unknown/missing field, wrong type, bad value, cyclic graph.

    >>> str(InputError("must be > 0", source="sys.yaml", field="chip.sram_bytes"))
    'sys.yaml: chip.sram_bytes: must be > 0'
    """

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        self.message = message
        super().__init__(": ".join(p for p in (source, field, message) if p))


class InfeasibleError(DFModelError):
    """No mapping fits (memory, SRAM, divisibility); the message says what and by how much."""

    exit_code = 3


class SolverError(DFModelError):
    """A solver back-end failed for a reason other than infeasibility (licence, numerics)."""

    exit_code = 4


class TimeLimitError(SolverError):
    """The time limit passed before any mapping was evaluated (nothing to return yet)."""

    exit_code = 4
