"""Packaging hook: ship the top-level preset folders inside the wheel.

``systems/``, ``workloads/`` and ``calibration/`` stay at the repository's top level (the single
source of truth); setuptools maps them to ``dfmodel.data.<kind>`` so a wheel or a non-editable
``pip install .`` carries them as package data. ``dfmodel.presets`` finds them there, or beside
the package in a checkout / editable install. All other metadata is in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

DATA = {f"dfmodel.data.{kind}": kind for kind in ("systems", "workloads", "calibration")}

setup(
    packages=find_packages(include=["dfmodel", "dfmodel.*"]) + list(DATA),
    package_dir=DATA,
    package_data={"dfmodel": ["py.typed"], **{pkg: ["*.yaml", "*.md"] for pkg in DATA}},
)
