"""Quantities with units in YAML.

Every size in a spec may be a plain number in SI base units (bytes, bytes/s, FLOP/s, seconds,
watts, US dollars) or a string with a unit:

- bytes: ``B``, ``KB MB GB TB PB`` (powers of 1000) and ``KiB MiB GiB TiB`` (powers of 1024);
- bandwidth: a byte unit over ``/s`` (``"900 GB/s"``), or bits: ``"200 Gb/s"``, ``"400 Gbps"``;
- compute: ``FLOPS`` with an SI prefix (``"312 TFLOPS"``, ``"1.2 PFLOP/s"``);
- time: ``s ms us ns``.

>>> parse_quantity("80 GiB", "bytes")
85899345920.0
>>> parse_quantity("200 Gb/s", "bandwidth")
25000000000.0
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

_SI = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_PATTERN = re.compile(rf"^\s*{_NUM}\s*([A-Za-zµ/]*)\s*$")

KINDS = ("bytes", "bandwidth", "flops", "time", "plain")


def _prefix(prefix: str) -> float | None:
    if prefix in _BIN:
        return _BIN[prefix]
    return _SI.get(prefix)


def _unit_scale(unit: str, kind: str) -> float | None:
    """Scale of ``unit`` to the SI base of ``kind``; None when the unit does not fit the kind."""
    if unit == "":
        return 1.0
    if kind == "time":
        return _TIME.get(unit)
    if kind == "bytes" and unit.endswith("B"):
        return _prefix(unit[:-1])
    if kind == "bandwidth":
        for suffix, factor in (("B/s", 1.0), ("Bps", 1.0), ("b/s", 0.125), ("bps", 0.125)):
            if unit.endswith(suffix):
                p = _prefix(unit[: -len(suffix)])
                return None if p is None else p * factor
    if kind == "flops":
        for suffix in ("FLOPS", "FLOP/s", "flops", "FLOPs"):
            if unit.endswith(suffix):
                return _prefix(unit[: -len(suffix)])
    return None


def parse_quantity(value: object, kind: str) -> float:
    """Number or unit string -> float in SI base units; raises ValueError naming what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number or a {kind} quantity, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m:
            scale = _unit_scale(m.group(2), kind)
            if scale is not None:
                return float(m.group(1)) * scale
    examples = {
        "bytes": "'80 GiB', '40 MB' or a number of bytes",
        "bandwidth": "'900 GB/s', '200 Gb/s' or a number of bytes/s",
        "flops": "'312 TFLOPS' or a number of FLOP/s",
        "time": "'1 us', '2 ms' or a number of seconds",
        "plain": "a number",
    }[kind]
    raise ValueError(f"expected {examples}, got {value!r}")


def _positive(x: float) -> float:
    if not x > 0:
        raise ValueError(f"must be > 0, got {x:g}")
    return x


def _non_negative(x: float) -> float:
    if not x >= 0:
        raise ValueError(f"must be >= 0, got {x:g}")
    return x


def _fraction(x: float) -> float:
    if not 0 < x <= 1:
        raise ValueError(f"must be in (0, 1], got {x:g}")
    return x


def _q(kind: str, check):
    return Annotated[float, BeforeValidator(lambda v: parse_quantity(v, kind)), AfterValidator(check)]


Bytes = _q("bytes", _positive)
BytesOrZero = _q("bytes", _non_negative)
BytesPerSec = _q("bandwidth", _positive)
FlopsPerSec = _q("flops", _positive)
Seconds = _q("time", _non_negative)
PositiveFloat = _q("plain", _positive)
NonNegativeFloat = _q("plain", _non_negative)
Fraction = _q("plain", _fraction)
