"""Every benchmark script imports: a renamed helper must not break `make bench` unnoticed.

The GPU check's sync count only fires on CUDA: here, on the CPU, the sync-debug mode's warning
is raised by hand in a fit.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dynamics.callbacks import Probe, TrainingLoss
from dynamics.store.writer import RunWriter

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


def test_gpu_check_counts_each_sync_by_step_and_cause(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gpu_check = load(FOLDER / "gpu_check.py", monkeypatch)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)

    class Enabled(gpu_check.SyncCounter):  # counting as on CUDA
        def __init__(self, probes, enabled):
            super().__init__(probes, enabled=True)

    monkeypatch.setattr(gpu_check, "SyncCounter", Enabled)
    # What a .item() warns in the mode, here by hand: in each write of the run file, at every
    # step and at every third.
    write = RunWriter._write

    def syncing_write(self, group):
        warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)
        return write(self, group)

    monkeypatch.setattr(RunWriter, "_write", syncing_write)

    class EveryStep(TrainingLoss):
        def on_step_end(self, *args):
            warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)
            return super().on_step_end(*args)

    class Every3(Probe):
        name = "every3"

        def __init__(self) -> None:
            super().__init__(every_n_steps=3)

        def on_step_end(self, *args):
            for _ in range(2):  # each one counts, not once per line
                warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)
            return {}

    done = gpu_check.fit(
        gpu_check.QUICK,
        "cpu",
        "32-true",
        7,
        lambda _: [EveryStep(), Every3()],
        tmp_path,
        count_syncs=True,
        validate=True,
    )
    findings: list[str] = []
    rows = gpu_check.sync_table_rows("32-true", "set", done.counter, findings)
    assert [row[2:7] for row in rows] == [  # steps 1-6: step 0 sets the probes up
        ["Every3", "0.67", "2/6", "2", "0"],
        ["EveryStep", "1.00", "6/6", "6", "0"],
        ["recorder (validation)", "0 in all", "", "", "1"],  # the flush before validation
    ]
    assert rows[1][7].startswith("tests/test_benchmarks_import.py:")
    assert [f.split(":")[0] for f in findings] == ["note", "FINDING"]
    assert done.recorded == {"loss": 7}


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
