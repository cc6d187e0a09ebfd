"""A module imported at its first attribute, for the libraries most services never use.

The api, the data worker and the conductor import every spec (shared/specs/) to find the
served one, and most specs use numpy only inside `process_prompt` or a media path: numpy
at the top of each would cost each of those processes ~0.15 s of CPU and ~13 MiB at
start-up for a text model (issue 49). A module writes

    if TYPE_CHECKING:
        import numpy as np
    else:
        np = deferred("numpy")

and `np.asarray(...)` imports numpy on its first use; nothing is put in `sys.modules`
before the real import, so every other importer sees numpy as usual.
"""

from __future__ import annotations

import importlib
from typing import Any


class Deferred:
    """Stands for the module `name` until an attribute is read, then defers to it."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred(name: str) -> Any:
    """The module `name`, imported at its first attribute (see the module docstring)."""
    return Deferred(name)
