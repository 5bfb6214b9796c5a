"""``dynamics info`` summarizes a run from its step indexes and extents, never its data."""

import json
import shutil
import time

import h5py
import numpy as np
import pytest

from dynamics.cli import main
from dynamics.store import RunWriter, SeriesSpec, names

#: One snapshot row: 4 Mi float32 parameters, 16 MiB.
_SNAPSHOT_WIDTH = 1 << 22
_SNAPSHOT_ROWS = 64  # 1 GiB of snapshots
_LOSS_ROWS = 2048


@pytest.fixture
def gigabyte_run(tmp_path):
    """A run file holding 1 GiB of parameter snapshots beside a loss series, written through
    the store's writer as the recorder writes one; removed after the test."""
    if shutil.disk_usage(tmp_path).free < 3 << 30:
        pytest.skip("needs 1 GiB of free disk for the run file, with room to spare")
    path = tmp_path / "big.h5"
    series = {
        names.LOSS: {names.LOSS_TRAIN: SeriesSpec()},
        names.SNAPSHOTS: {names.SNAPSHOT_THETA: SeriesSpec((_SNAPSHOT_WIDTH,))},
    }
    try:
        writer = RunWriter.create(path, series, {}, {names.ATTR_RUN_NAME: "big"})
        theta = np.ones(_SNAPSHOT_WIDTH, dtype=np.float32)  # real bytes: the file is 1 GiB
        every = _LOSS_ROWS // _SNAPSHOT_ROWS
        for step in range(_LOSS_ROWS):
            writer.append(names.LOSS, step, {names.LOSS_TRAIN: np.float32(1.0 / (step + 1))})
            if step % every == 0:
                writer.append(names.SNAPSHOTS, step, {names.SNAPSHOT_THETA: theta})
        writer.close()
        yield path
    finally:
        path.unlink(missing_ok=True)


def test_info_reads_steps_and_shapes_only(gigabyte_run, monkeypatch, capsys):
    """Timed in process: the command's reading, not the interpreter's start (~0.7 s here)."""
    assert gigabyte_run.stat().st_blocks * 512 >= 1 << 30  # really on disk, not sparse
    read = []
    original = h5py.Dataset.__getitem__

    def spy(dataset, key):
        read.append(dataset.name)
        return original(dataset, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
    start = time.perf_counter()
    assert main(["info", str(gigabyte_run), "--json"]) == 0
    elapsed = time.perf_counter() - start
    summary = json.loads(capsys.readouterr().out)
    snapshots = summary["series"][names.SNAPSHOTS]
    every = _LOSS_ROWS // _SNAPSHOT_ROWS
    assert snapshots == {
        "rows": _SNAPSHOT_ROWS,
        "first_step": 0,
        "last_step": (_SNAPSHOT_ROWS - 1) * every,
        "series": {names.SNAPSHOT_THETA: [_SNAPSHOT_WIDTH]},
    }
    loss = summary["series"][names.LOSS]
    assert (loss["rows"], loss["first_step"], loss["last_step"]) == (_LOSS_ROWS, 0, _LOSS_ROWS - 1)
    assert loss["series"] == {names.LOSS_TRAIN: []}
    # No value dataset is read, only step indexes (and the small status and event datasets),
    # but for the scalar series that say whether the run diverged.
    divergence = {
        f"/series/{names.LOSS}/{names.LOSS_TRAIN}",
        f"/series/{names.DISPLACEMENT}/{names.DISPLACEMENT_TOTAL}",
    }
    values = [name for name in read if name.startswith("/series/") and "/step" not in name]
    assert set(values) <= divergence
    assert f"/series/{names.SNAPSHOTS}/step" in read
    assert elapsed < 1.0, f"info took {elapsed:.2f} s on a 1 GiB run"
