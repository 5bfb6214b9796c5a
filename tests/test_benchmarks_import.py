"""Every benchmark script imports: a renamed helper must not break `make bench` unnoticed.

The GPU check's sync counting only fires on CUDA: its attribution is checked here on the CPU
with the sync-debug mode's warning raised by hand.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dynamics.callbacks import Probe

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARKS = sorted(FOLDER.glob("bench_*.py")) + [FOLDER / "gpu_check.py"]


def load(script: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)  # dataclasses look their module up
    spec.loader.exec_module(module)  # runs the imports, not main (guarded by __name__)
    return module


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_script_imports(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        load(script, monkeypatch)
    except ModuleNotFoundError as error:
        if error.name in {"pyhessian", "hessian_eigenthings", "curvlinops"}:
            pytest.skip(f"optional peer {error.name} not installed")
        raise


def test_gpu_check_attributes_each_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_check = load(FOLDER / "gpu_check.py", monkeypatch)

    class Syncing(Probe):
        def on_step_end(self, *args):
            warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)  # as .item() in the mode
            return {}

    counter = gpu_check.SyncCounter([], enabled=False)
    counter.step = 3
    with gpu_check.counted_syncs(counter):
        for _ in range(2):  # each one counts, not once per line
            Syncing().on_step_end()
        warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)
    assert [(s.step, s.cause, s.in_writer) for s in counter.syncs] == [
        (3, "Syncing", False),
        (3, "Syncing", False),
        (3, "training loop", False),
    ]
    assert counter.syncs[0].where.startswith("tests/test_benchmarks_import.py:")
    assert counter.step is None  # the count ends with the context


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_gpu_check_without_cuda_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    gpu_check = load(FOLDER / "gpu_check.py", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cuda"])
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
