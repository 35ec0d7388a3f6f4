"""Human-readable numbers for tables, and the console width for output that is not a terminal.

One convention for bytes everywhere (tables, titles, errors): binary prefixes, ``1 GiB = 2**30 B``
(memory capacities and message sizes are powers of two). Rates and FLOP use decimal prefixes.
"""

from __future__ import annotations

import os
import sys

# rich cuts at 80 columns when stdout is not a terminal; a file or pipe gets the full rows instead
PIPE_WIDTH = 240


def fmt(x: float, unit: str = "") -> str:
    """Engineering notation: 1.23e+15 -> '1.23 P'.

    >>> fmt(1.23e15, "FLOP")
    '1.23 PFLOP'
    """
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_bytes(x: float) -> str:
    """Bytes with binary prefixes (the convention of every table and error message).

    >>> fmt_bytes(2**30), fmt_bytes(85.9e9), fmt_bytes(512)
    ('1 GiB', '80 GiB', '512 B')
    """
    for power, prefix in ((60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if abs(x) >= 2**power:
            return f"{x / 2**power:.3g} {prefix}B"
    return f"{x:.3g} B"


def fmt_time(seconds: float) -> str:
    """
    >>> fmt_time(0.01366), fmt_time(229.9)
    ('13.66 ms', '229.9 s')
    """
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def console_width(stream=None) -> int | None:
    """None (rich measures the terminal) on a terminal; else ``$COLUMNS`` or :data:`PIPE_WIDTH`."""
    stream = stream or sys.stdout
    if hasattr(stream, "isatty") and stream.isatty():
        return None
    cols = os.environ.get("COLUMNS", "")
    return int(cols) if cols.isdigit() and int(cols) > 0 else PIPE_WIDTH
