import os
import shutil
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from dynamics import RunFileError, open_run
from dynamics.store import RunWriter, SeriesSpec, View
from dynamics.store.schema import SCHEMA_VERSION

SERIES = {
    "loss": {"train": SeriesSpec()},
    "hidden_norms": {"norm": SeriesSpec((3,), columns=("a", "b", "c"))},
}


def write_run(path, steps=range(10), **kwargs):
    writer = RunWriter.create(
        path, SERIES, {"theta0": SeriesSpec((4,))}, {"config": {"lr": 0.1}}, **kwargs
    )
    for step in steps:
        writer.append("loss", step, {"train": float(step)})
        writer.append("hidden_norms", step, {"norm": np.full(3, step, dtype=np.float32)})
    writer.write_vector("theta0", np.arange(4.0))
    writer.close()


def test_round_trip(tmp_path):
    write_run(tmp_path / "run.h5")
    run = open_run(tmp_path / "run.h5")
    assert run.config == {"lr": 0.1}
    assert set(run.groups) == {"loss", "hidden_norms"}
    norms = run.series("hidden_norms")
    assert norms.columns == {"norm": ("a", "b", "c")}
    np.testing.assert_array_equal(norms.step, np.arange(10))
    np.testing.assert_array_equal(norms["norm"][:, 1], np.arange(10))
    np.testing.assert_array_equal(run.vector("theta0"), np.arange(4.0))
    summary = run.summary()
    assert summary["series"]["loss"] == {
        "rows": 10,
        "first_step": 0,
        "last_step": 9,
        "series": {"train": []},
    }


def test_file_is_readable_by_hdf5_1_10_tools(tmp_path):
    write_run(tmp_path / "run.h5")
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert file.id.get_create_plist().get_version()[0] <= 3  # superblock of HDF5 1.10
    h5dump = shutil.which("h5dump")
    if h5dump is None:
        pytest.skip("h5dump not installed (.ci/run installs Debian's hdf5-tools, HDF5 1.10)")
    dump = subprocess.run(
        [h5dump, "-d", "/series/loss/train", str(tmp_path / "run.h5")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "(0): 0, 1, 2, 3, 4, 5, 6, 7, 8, 9" in dump


def test_existing_file_is_never_clobbered(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path)
    before = path.read_bytes()
    with pytest.raises(RunFileError, match="exists"):
        write_run(path)
    assert path.read_bytes() == before
    write_run(path, steps=range(3), overwrite=True)
    assert len(open_run(path).series("loss")) == 3


@pytest.mark.parametrize("damage", ["not_hdf5", "not_run", "newer", "truncated", "missing"])
def test_bad_files_raise_one_line_errors(tmp_path, damage):
    path = tmp_path / "bad.h5"
    if damage == "not_hdf5":
        path.write_text("hello")
    elif damage == "not_run":
        with h5py.File(path, "w") as file:
            file["x"] = 1
    elif damage == "newer":
        write_run(path)
        with h5py.File(path, "r+") as file:
            file.attrs["schema_version"] = SCHEMA_VERSION + 1
    elif damage == "truncated":
        write_run(path, steps=range(2000))
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    with pytest.raises(RunFileError) as error:
        open_run(path)
    assert "\n" not in str(error.value)


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "run.h5"
    write_run(path)
    writer = RunWriter.resume(path, {"loss": 4, "hidden_norms": 6})
    writer.append("loss", 5, {"train": 50.0})
    writer.close()
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, [0, 1, 2, 3, 4, 5])
    assert run.series("loss")["train"][-1] == 50.0
    np.testing.assert_array_equal(run.series("hidden_norms").step, np.arange(7))
    np.testing.assert_array_equal(run.vector("theta0"), np.arange(4.0))


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from dynamics.store import RunWriter, SeriesSpec
    writer = RunWriter.create(sys.argv[1], {"loss": {"train": SeriesSpec((64,))}}, {}, {},
                              block_rows=5, flush_interval_s=1e9)
    step = 0
    while True:  # blocks of 5 rows are written as they fill, the file flushed every 7 rows
        writer.append("loss", step, {"train": np.full(64, step, dtype=np.float32)})
        if step % 7 == 6:
            writer.flush()
            print(step, flush=True)
        step += 1
    """
)


@pytest.mark.parametrize("blocks", [3, 40])
def test_sigkill_loses_at_most_the_unflushed_rows(tmp_path, blocks):
    path = tmp_path / "live.h5"
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    for _ in range(blocks):
        flushed = int(process.stdout.readline())
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    series = open_run(path).series("loss")
    assert len(series) >= flushed + 1
    np.testing.assert_array_equal(series.step, np.arange(len(series)))
    np.testing.assert_array_equal(series["train"][:, 0], np.arange(len(series)))
    # and the killed file can be resumed for writing
    writer = RunWriter.resume(path, {"loss": flushed})
    writer.append("loss", flushed + 1, {"train": np.zeros(64)})
    writer.close()
    assert open_run(path).series("loss").step[-1] == flushed + 1


@pytest.mark.parametrize(
    ("kind", "shape"), [("scalar", (3,)), ("lines", ()), ("panels", (2, 2)), ("heatmap", ())]
)
def test_a_series_whose_view_cannot_draw_its_rows_is_refused_where_it_is_declared(kind, shape):
    with pytest.raises(ValueError, match=f"a {kind} view draws rows of"):
        SeriesSpec(shape=shape, view=View(kind, "title"))


def test_create_refuses_a_directory(tmp_path):
    with pytest.raises(RunFileError, match="is a directory"):
        RunWriter.create(tmp_path, {"loss": {"train": SeriesSpec()}}, {}, {}, overwrite=True)
    assert list(tmp_path.iterdir()) == []


def test_a_series_named_step_is_its_own_beside_the_step_index(tmp_path):
    # Its dataset has a safe name of its own (names.series_name), so no name is refused.
    writer = RunWriter.create(tmp_path / "run.h5", {"loss": {"step": SeriesSpec()}}, {}, {})
    writer.append("loss", 3, {"step": 7.0})
    writer.close()
    rows = open_run(tmp_path / "run.h5").series("loss")
    assert rows.step.tolist() == [3] and rows["step"].tolist() == [7.0]


def test_a_group_is_written_once_its_rows_fill_block_bytes(tmp_path):
    """The rows that fill ``block_bytes`` are counted from the group's first row (a group's rows
    keep their shapes): rows of 40 bytes against 100 are written three at a time."""
    writer = RunWriter.create(
        tmp_path / "r.h5",
        {"wide": {"x": SeriesSpec((10,))}},
        {},
        {},
        block_rows=256,
        block_bytes=100,
        flush_interval_s=1e9,
    )
    dataset = writer._file["series"]["wide"]["x"]
    written = []
    for step in range(7):
        writer.append("wide", step, {"x": np.full(10, step, dtype=np.float32)})
        written.append(dataset.shape[0])
    assert written == [0, 0, 3, 3, 3, 6, 6]
    writer.close()
    np.testing.assert_array_equal(open_run(tmp_path / "r.h5").series("wide")["x"][:, 0], range(7))
