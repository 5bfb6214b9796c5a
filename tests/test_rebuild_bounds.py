"""Memory bounds before a model is rebuilt or a held-out batch is loaded (issue 21, item 10).

Crafted init args in a run file (a width or depth far from the run's) are refused before the
model is materialized: it is built on the meta device and checked against the run's layout,
and a constructor registering far more submodules than the run recorded is stopped while it
runs. A ``--barrier-batch`` declaring more bytes than its bound is refused before
``torch.load``. Each case runs as a user runs it, under a 3 GiB address-space limit.
"""

from __future__ import annotations

import io
import json
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import h5py
import pytest
import torch

from dynamics import open_run
from dynamics.analysis.measures import loss_barrier
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.model.rebuild import rebuild_module
from dynamics.store import names

ARCHITECTURE = dict(width=8, expansion=2, depth=2)
DYNAMICS = str(Path(sys.executable).with_name("dynamics"))
MEMORY_LIMIT = 3 * 2**30
#: Seconds a refusal may take on this shared machine, the interpreter's start included.
WITHIN_S = 120


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _run_limited(*args: object) -> tuple[subprocess.CompletedProcess, float]:
    """The ``dynamics`` console script under the address-space limit, and its seconds."""
    start = time.monotonic()
    result = subprocess.run(
        [DYNAMICS, *map(str, args)],
        capture_output=True,
        text=True,
        preexec_fn=_limited,
        timeout=WITHIN_S * 2,
    )
    return result, time.monotonic() - start


def test_torch_imports_under_the_memory_limit():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, dynamics.model.rebuild, dynamics.analysis.pages.run_comparison",
        ],
        preexec_fn=_limited,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory, quiet_trainer) -> tuple[Path, Path]:
    """Two tiny runs sharing θ0 on the plane of their initial gradients (shifted and not)."""
    folder = tmp_path_factory.mktemp("bounds")
    paths = []
    for shift in ("none", "expected"):
        torch.manual_seed(0)
        path = folder / f"{shift}.h5"
        recorder = DynamicsRecorder(path, [GradientPlane(), ParameterDisplacement()])
        module = TeacherStudentModule(**ARCHITECTURE, shift=shift)
        data = TeacherStudentData(**ARCHITECTURE, shift=shift, batch_size=8, heldout_size=8)
        quiet_trainer(max_steps=3, callbacks=[recorder]).fit(module, data)
        paths.append(path)
    return tuple(paths)


def _crafted(source: Path, folder: Path, **init_args: object) -> Path:
    """A copy of the run whose recorded init args say ``init_args``."""
    path = folder / f"crafted_{source.name}"
    shutil.copyfile(source, path)
    with h5py.File(path, "r+") as file:
        record = json.loads(file.attrs[names.ATTR_MODULE])
        record["init_args"].update(init_args)
        file.attrs[names.ATTR_MODULE] = json.dumps(record)
    return path


def _assert_refused(result: subprocess.CompletedProcess, seconds: float, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dynamics"), result.stderr
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    assert all(word in result.stderr for word in words), result.stderr
    assert seconds < WITHIN_S, f"refused after {seconds:.0f} s"


@pytest.mark.parametrize(
    ("init_args", "words"),
    [
        # 4 GB of parameters: more than the limit allows, so only a refusal before the model
        # is materialized answers in one line (a real build fails to allocate).
        ({"width": 8000}, ("differs from the run's", "shape (8000,), layout (8,)")),
        ({"depth": 10**7}, ("registers more than", "the run recorded 12")),
    ],
)
def test_crafted_init_args_are_refused_before_the_model_is_built(runs, tmp_path, init_args, words):
    crafted = _crafted(runs[1], tmp_path, **init_args)
    out = tmp_path / "plane.html"
    result, seconds = _run_limited(
        "plane", runs[0], crafted, "-o", out, "--grid", "3", "--processes", "1"
    )
    _assert_refused(result, seconds, crafted.name, *words)
    assert not out.exists() and not out.with_suffix(".plane.h5").exists()


def test_a_crafted_depth_is_stopped_while_the_constructor_runs(runs, tmp_path):
    run = open_run(_crafted(runs[1], tmp_path, depth=10**7))
    start = time.monotonic()
    with pytest.raises(DynamicsError, match="registers more than 64 submodules"):
        rebuild_module(run)
    assert time.monotonic() - start < 10
    # The run's own init args still rebuild it, its frozen hash and submodules checked.
    assert rebuild_module(open_run(runs[1])) is not None


def test_a_model_that_matches_the_layout_but_not_the_memory_is_refused(runs, monkeypatch):
    monkeypatch.setattr("dynamics.model.rebuild.available_bytes", lambda: 1000)
    with pytest.raises(DynamicsError, match="more than 0.0 GiB for its parameters and buffers"):
        rebuild_module(open_run(runs[0]))


def _deflated_zeros(path: Path, megabytes: int) -> Path:
    """A ``torch.save`` file of one float32 tensor of zeros, its records deflated: a few
    hundred kilobytes on disk that declare ``megabytes`` of data."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(megabytes * 2**18), buffer)
    buffer.seek(0)
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(path, "w") as target:
        for record in source.infolist():
            target.writestr(record.filename, source.read(record), zipfile.ZIP_DEFLATED)
    return path


def test_a_deflated_barrier_batch_is_refused_before_it_is_loaded(runs, tmp_path, monkeypatch):
    bomb = _deflated_zeros(tmp_path / "bomb.pt", 256)
    assert bomb.stat().st_size < 2**20
    out = tmp_path / "compare.html"
    result, seconds = _run_limited("compare", *runs, "-o", out, "--barrier-batch", bomb)
    _assert_refused(result, seconds, "bomb.pt: declares 256.0 MiB", "64 MiB")
    assert not out.exists()
    # What torch.load would have allocated is never asked for.
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(DynamicsError, match="more than the 64.0 MiB"):
        loss_barrier.load_batch(bomb, [open_run(p) for p in runs])


def test_the_bound_of_a_held_out_batch_follows_the_runs_probe_batches(runs, tmp_path):
    loaded = [open_run(p) for p in runs]
    probe = sum(
        loaded[0].vector(n).nbytes
        for n in loaded[0].vector_names
        if n.startswith(names.PROBE_BATCH_PREFIX)
    )
    assert loss_barrier.held_out_bound(loaded) == max(64 * 2**20, 1024 * probe)
    # A deflated batch within the bound loads as before.
    small = _deflated_zeros(tmp_path / "small.pt", 1)
    assert loss_barrier.load_batch(small, loaded).batch.numel() == 2**18
