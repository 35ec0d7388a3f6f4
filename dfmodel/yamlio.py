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
    return ".".join(str(item) for item in loc if not _is_tag(item)) or "<root>"


def _is_tag(item: object) -> bool:
    """A loc step that names a validator, union branch or dict key marker, not a field."""
    s = str(item)
    return "[" in s or s[:1].isupper()


def most_specific_error(errors: list[dict]) -> dict:
    """The error to report: the first, unless it is one branch of a failed union.

    For a union such as ``peak_flops: float | dict[Precision, float]`` pydantic reports one error
    per branch (loc steps named after the branch). Of the first error's sibling branches, the one
    that got deepest into the input names the real problem (``chip.peak_flops.fp4`` rather than
    "expected a number" for the float branch); ties keep the first.
    """
    first = errors[0]
    loc = tuple(first["loc"])
    cut = next((i for i, item in enumerate(loc) if _is_tag(item)), None)
    if cut is None:
        return first
    siblings = [first] + [
        e for e in errors[1:]
        if len(e["loc"]) > cut and tuple(e["loc"][:cut]) == loc[:cut]
        and _is_tag(e["loc"][cut]) and e["loc"][cut] != loc[cut]
    ]
    return max(siblings, key=lambda e: len(field_path(tuple(e["loc"])).split(".")))


def validation_message(err: dict) -> str:
    """One pydantic error dict -> 'what is allowed' text."""
    kind = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    if loc and loc[-1] == "[key]":
        return f"invalid key {err.get('input')!r}: {err.get('msg', 'not allowed')}"
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
        err = most_specific_error(exc.errors())
        raise InputError(validation_message(err), source=source, field=field_path(err["loc"])) from None
