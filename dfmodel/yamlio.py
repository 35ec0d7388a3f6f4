"""Safe YAML loading and pydantic validation with one-line errors naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dfmodel.errors import InputError

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load``; any problem becomes an :class:`InputError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise InputError(f"malformed YAML: {problem}", source=str(path), field=where) from None
    if not isinstance(data, dict):
        raise InputError("expected a YAML mapping at top level", source=str(path), field="<root>")
    return data


def field_path(loc: tuple) -> str:
    """pydantic ``loc`` tuple -> dotted path, e.g. ``('network', 1, 'size')`` -> ``network.1.size``.

    Tagged-union and function-validator steps (``function-after[...]``, class names) are skipped.
    """
    parts = []
    for item in loc:
        s = str(item)
        if "[" in s or s[:1].isupper():
            continue
        parts.append(s)
    return ".".join(parts) or "<root>"


def validation_message(err: dict) -> str:
    """One pydantic error dict -> 'what is allowed' text."""
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    msg = str(err.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def validate(model: type[M], data: Any, source: str | None) -> M:
    """Validate ``data`` against ``model``; the first error becomes a one-line :class:`InputError`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(validation_message(err), source=source, field=field_path(err["loc"])) from None
