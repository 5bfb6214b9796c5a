"""The import-layer contract names every module of the package, so none escapes the check."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_top_level_module_sits_in_a_layer():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {
        name.strip()
        for contract in config["contracts"]
        for layer in contract.get("layers", ())
        for name in layer.replace("|", ":").split(":")
    }
    package = ROOT / "dynamics"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    modules |= {"callbacks", "analysis"}  # installed inside dynamics from the top level
    missing = sorted(f"dynamics.{m}" for m in modules if f"dynamics.{m}" not in layered)
    assert not missing, f"add to the layers in pyproject.toml: {missing}"
