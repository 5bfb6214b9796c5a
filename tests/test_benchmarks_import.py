"""Every benchmark script imports: a renamed helper must not break `make bench` unnoticed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_script_imports(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)  # runs the imports, not main (guarded by __name__)
    except ModuleNotFoundError as error:
        if error.name in {"pyhessian", "hessian_eigenthings", "curvlinops"}:
            pytest.skip(f"optional peer {error.name} not installed")
        raise
