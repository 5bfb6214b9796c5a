"""mkdocs hook: the package laid out as installed, for the API reference to read.

`callbacks/` and `analysis/` install as `dynamics.callbacks` and `dynamics.analysis`
(package-dir in pyproject.toml), so the checkout's `dynamics/` lacks them. Before the pages are
rendered this copies the three folders into build/api-src/dynamics, as `make lint` lays them
out for import-linter, and mkdocstrings reads the copy statically (mkdocs.yml: paths). It runs
at startup: mkdocstrings resolves its paths in its own config event, before a hook's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Where each folder of the checkout sits in the installed package.
LAYOUT = {
    "dynamics": "dynamics",
    "callbacks": "dynamics/callbacks",
    "analysis": "dynamics/analysis",
}
ROOT = Path(__file__).resolve().parents[2]  # docs/hooks/ -> the checkout
TARGET = ROOT / "build" / "api-src"


def on_startup(command: str, dirty: bool) -> None:
    shutil.rmtree(TARGET, ignore_errors=True)
    for source, place in LAYOUT.items():
        shutil.copytree(ROOT / source, TARGET / place, ignore=shutil.ignore_patterns("__pycache__"))
