"""Names a package exports but loads on first use (PEP 562), so that importing one torch-free
module of a package (the bias audit's result, spectral broadening) does not import torch
through the package's ``__init__``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, whose names live in the
    modules ``homes`` gives (name -> module).

    Example::

        __all__, __getattr__, __dir__ = lazy_exports(__name__, {"audit": "dynamics.bias.auditing"})
    """
    # A submodule of the name would win: importing it sets the package's attribute to the
    # module, and __getattr__ is asked only for attributes that are missing.
    shadowed = [n for n, home in homes.items() if home.rsplit(".", 1)[-1] == n]
    if shadowed:
        raise ImportError(f"{package}: {shadowed} would be shadowed by submodules of that name")
    names = sorted(homes)

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
