"""Shipped presets -- systems, workloads and calibration data sets -- and how a name resolves to a file.

The repository's top-level ``systems/``, ``workloads/`` and ``calibration/`` folders are the single
source of truth. A wheel (or a non-editable ``pip install .``) carries them as package data under
``dfmodel/data/<kind>/`` (see ``setup.py``); an editable install or a checkout on ``PYTHONPATH``
reads them beside the package. ``DFMODEL_HOME`` overrides the root.

>>> resolve("gpt3_13b", "workloads").name
'gpt3_13b.yaml'
>>> suggestion("dgx_a10", "systems")
" (did you mean 'dgx_a100'?)"
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

KINDS = ("systems", "workloads", "calibration")
_PACKAGE = Path(__file__).resolve().parent


def project_root() -> Path:
    """Where the preset folders live: ``DFMODEL_HOME``, the checkout, or the installed package data."""
    env = os.environ.get("DFMODEL_HOME")
    if env:
        return Path(env)
    checkout = _PACKAGE.parent
    if (checkout / "systems").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout
    return _PACKAGE / "data"


def preset_dir(kind: str) -> Path:
    """``kind`` is ``systems``, ``workloads`` or ``calibration``."""
    return project_root() / kind


def list_presets(kind: str) -> list[Path]:
    d = preset_dir(kind)
    return sorted(d.glob("*.yaml")) if d.is_dir() else []


def resolve(name_or_path: str | Path, kind: str) -> Path:
    """A path that exists, else a preset name (with or without ``.yaml``) in ``kind``."""
    p = Path(name_or_path)
    if p.exists():
        return p
    stem = p.name.removesuffix(".yaml")
    candidate = preset_dir(kind) / f"{stem}.yaml"
    return candidate if candidate.exists() else p


def did_you_mean(word: str, choices, *, cutoff: float = 0.6) -> str | None:
    """The closest of ``choices`` to ``word`` (difflib ratio >= ``cutoff``), or None.

    >>> did_you_mean("num_layer", ["num_layers", "num_heads", "hidden"])
    'num_layers'
    >>> did_you_mean("zzz", ["hidden"]) is None
    True
    """
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return close[0] if close else None


def suggestion(name: str | Path, kind: str) -> str:
    """`` (did you mean 'x'?)`` for a misspelled preset name, else an empty string."""
    stem = Path(name).name.removesuffix(".yaml")
    best = did_you_mean(stem, [p.stem for p in list_presets(kind)])
    return f" (did you mean {best!r}?)" if best else ""


def unknown_preset_message(name: str | Path, kind: str) -> str:
    """One line for a name that is neither a file nor a preset: the nearest preset and the list."""
    label = {"systems": "system", "workloads": "workload", "calibration": "calibration data set"}[kind]
    names = ", ".join(p.stem for p in list_presets(kind)) or "none"
    return f"no such file or {label} preset{suggestion(name, kind)}; presets: {names}"
