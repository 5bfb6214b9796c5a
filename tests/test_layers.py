"""The import contracts name every module of the package, and break on an upward import."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_every_top_level_module_sits_in_a_layer():
    layered = {
        name.strip()
        for contract in CONFIG["contracts"]
        for layer in contract.get("layers", ())
        for name in layer.replace("|", ":").split(":")
    }
    package = ROOT / "dynamics"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    modules |= {"callbacks", "analysis"}  # installed inside dynamics from the top level
    missing = sorted(f"dynamics.{m}" for m in modules if f"dynamics.{m}" not in layered)
    assert not missing, f"add to the layers in pyproject.toml: {missing}"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    linter = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [linter, "--config", ROOT / "pyproject.toml", "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory) -> Path:
    """The package laid out as installed (callbacks/ and analysis/ inside), as `make lint` does."""
    tree = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "dynamics", tree / "dynamics")
    shutil.copytree(ROOT / "callbacks", tree / "dynamics" / "callbacks")
    shutil.copytree(ROOT / "analysis", tree / "dynamics" / "analysis")
    return tree


@pytest.mark.parametrize(
    ("module", "imports"),
    [
        ("dynamics/store/upward.py", "dynamics.model.rebuild"),  # a lower wing imports a higher
        ("dynamics/params/upward.py", "dynamics.store"),
        ("dynamics/curvature/sideways.py", "dynamics.geometry.plane"),  # independent siblings
        ("dynamics/analysis/upward.py", "dynamics.callbacks.probe"),
    ],
)
def test_an_upward_import_breaks_the_contract(installed_layout, module, imports):
    assert _lint(installed_layout).returncode == 0
    added = installed_layout / module
    added.write_text(f"import {imports}\n")
    try:
        result = _lint(installed_layout)
    finally:
        added.unlink()
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-2000:]
