"""Safe YAML loading and pydantic validation with one-line errors naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

from dfmodel.errors import InputError

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load``; any problem becomes an :class:`InputError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror or exc})", source=str(path)) from None
    text = decode_text(raw, str(path))
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


def decode_text(raw: bytes, source: str) -> str:
    r"""UTF-8 text of a file, or a one-line :class:`InputError` for a binary or otherwise encoded file.

    >>> decode_text("caf\u00e9".encode(), "x.yaml")
    'café'
    >>> decode_text(b"name: caf\xe9", "x.yaml")
    Traceback (most recent call last):
    ...
    dfmodel.errors.InputError: x.yaml: byte 9: not UTF-8 text (re-save the file as UTF-8)
    """
    if b"\x00" in raw[:8192]:
        raise InputError("binary file, expected YAML text", source=source)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("not UTF-8 text (re-save the file as UTF-8)", source=source, field=f"byte {exc.start}") from None


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
    # the innermost union the first error is a branch of (a workload's ``kind`` union is outer:
    # ``training.userbuffers_sms``'s literal-or-dict union sits inside its LLMWorkload branch)
    for cut in reversed([i for i, item in enumerate(loc) if _is_tag(item)]):
        siblings = [first] + [
            e for e in errors[1:]
            if len(e["loc"]) > cut and tuple(e["loc"][:cut]) == loc[:cut]
            and _is_tag(e["loc"][cut]) and e["loc"][cut] != loc[cut]
        ]
        if len(siblings) > 1:
            return max(siblings, key=lambda e: len(field_path(tuple(e["loc"])).split(".")))
    return first


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


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field annotation (through Optional, list, dict, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _branches(model: type[BaseModel]) -> list[type[BaseModel]]:
    """A root model's union branches (``WorkloadFile`` -> ``LLMWorkload``, ...), else the model itself."""
    return _models_in(model.model_fields["root"].annotation) if "root" in model.model_fields else [model]


def allowed_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names allowed beside the last step of ``loc`` (an error location inside ``model``)."""
    current = _branches(model)
    for step in loc[:-1]:
        by_name = {c.__name__: c for c in current}
        if isinstance(step, str) and step in by_name:  # a union branch named after its class
            current = [by_name[step]]
            continue
        nxt = [b for m in current if isinstance(step, str) and step in m.model_fields
               for sub in _models_in(m.model_fields[step].annotation) for b in _branches(sub)]
        if nxt:
            current = nxt
        # list indices, dict keys and validator steps keep the current models
    names: list[str] = []
    for m in current:
        names += [n for n in m.model_fields if n not in names]
    return names


def hint_for(err: dict, errors: list[dict], model: type[BaseModel]) -> tuple[dict, str]:
    """The error to report and a "did you mean" hint for a misspelled key.

    A misspelled required field shows as two errors -- the right name missing and the wrong name
    unknown; report the unknown key (what the user wrote) with the name it should be.
    """
    from dfmodel.presets import did_you_mean

    loc = tuple(err["loc"])
    if err.get("type") == "missing":
        extras = [e for e in errors if e.get("type") == "extra_forbidden" and tuple(e["loc"][:-1]) == loc[:-1]]
        for extra in extras:
            if did_you_mean(str(extra["loc"][-1]), [loc[-1]]):
                return extra, f"; did you mean {loc[-1]!r}?"
        return err, ""
    if err.get("type") == "extra_forbidden":
        best = did_you_mean(str(loc[-1]), allowed_fields(model, loc))
        return err, f"; did you mean {best!r}?" if best else ""
    return err, ""


def validate(model: type[M], data: Any, source: str | None) -> M:
    """Validate ``data`` against ``model``; the first error becomes a one-line :class:`InputError`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err, hint = hint_for(most_specific_error(errors), errors, model)
        raise InputError(validation_message(err) + hint, source=source, field=field_path(err["loc"])) from None
