"""Where shipped presets live and how a name or path resolves to a file.

Presets are the YAML files in the repository's ``systems/`` and ``workloads/`` folders (the
package is installed editable, so they sit beside it). ``DFMODEL_HOME`` overrides the root.
"""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    env = os.environ.get("DFMODEL_HOME")
    return Path(env) if env else Path(__file__).resolve().parent.parent


def preset_dir(kind: str) -> Path:
    """``kind`` is ``systems`` or ``workloads``."""
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
