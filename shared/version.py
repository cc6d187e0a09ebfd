"""mstar's version (`mstar --version`, `GET /version`): the installed package's, else the
`version` in the checkout's pyproject.toml (services run from a checkout on PYTHONPATH)."""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@functools.cache
def mstar_version() -> str:
    try:
        return importlib.metadata.version("mstar")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(tomllib.loads(PYPROJECT.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
