"""The notebook form of ``dynamics watch``: a widget whose figures grow with a live run file.

The widget is built without a kernel (ipywidgets then sends nothing) on run files written in
this process while the test reads them; ``refresh()`` polls at once, so no test waits for the
widget's thread, except the ones about that thread.
"""

import subprocess
import sys
import time

import numpy as np
import pytest

import dynamics
from dynamics.analysis.figures.lines import DISPLAY_BUDGET
from dynamics.analysis.live.widget import Watch, watch
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec, View, open_run
from dynamics.store.views import STANDARD_VIEWS

LAYERS = ("blocks.0", "blocks.1")
SPECS = {
    "loss": {"train": SeriesSpec(view=STANDARD_VIEWS["loss"]["train"])},
    "hidden_norms": {
        "norm": SeriesSpec((2,), columns=LAYERS, view=STANDARD_VIEWS["hidden_norms"]["norm"])
    },
    "spectrum": {
        "power": SeriesSpec((3,), view=View("heatmap", "Power spectrum", "power", log_y=True))
    },
}
#: A poll interval no test outlasts: the thread waits while the test calls refresh().
QUIET_S = 3600.0


def append(writer, steps, scale=1.0):
    for step in steps:
        writer.append("loss", step, {"train": scale / (1 + step)})
        writer.append("hidden_norms", step, {"norm": scale * np.array([step, 2.0 * step])})
        writer.append(
            "spectrum", step, {"power": scale * np.array([1.0, 10.0, 100.0]) * (1 + step)}
        )
    writer.flush()


def live_run(path, steps, scale=1.0, overwrite=False):
    writer = RunWriter.create(path, SPECS, {}, {"config": {}}, overwrite, block_rows=64)
    append(writer, steps, scale)
    return writer


@pytest.fixture
def writer(tmp_path):
    writer = live_run(tmp_path / "live.h5", range(10))
    yield writer
    writer.close()


def traces(live, group, run=""):
    return [t for t in live.figures[group].data if t.meta["run"] == run]


def assert_drawn_as_stored(live, path, run=""):
    """Every trace of ``run`` holds the file's rows of what its meta names, whole."""
    stored = open_run(path)
    for group in ("loss", "hidden_norms", "spectrum"):
        series = stored.series(group)
        for trace in traces(live, group, run):
            values = series[trace.meta["series"]].reshape(len(series), -1)
            np.testing.assert_array_equal(trace.x, series.step)
            if trace.type == "heatmap":
                np.testing.assert_allclose(np.asarray(trace.z), np.log10(values.astype(float)).T)
            else:
                np.testing.assert_array_equal(trace.y, values[:, trace.meta["column"]])


def test_traces_grow_by_exactly_the_appended_rows(writer):
    live = watch(writer.path, every_s=QUIET_S)
    try:
        assert set(live.figures) == {"loss", "hidden_norms", "spectrum"}
        before = {g: [len(t.x) for t in traces(live, g)] for g in live.figures}
        assert before == {"loss": [10], "hidden_norms": [10, 10], "spectrum": [10]}
        drawn = {g: live.figures[g] for g in live.figures}
        append(writer, range(10, 17))
        live.refresh()
        after = {g: [len(t.x) for t in traces(live, g)] for g in live.figures}
        assert after == {g: [n + 7 for n in lengths] for g, lengths in before.items()}
        assert all(live.figures[g] is drawn[g] for g in drawn)  # extended in place
        assert_drawn_as_stored(live, writer.path)
        live.refresh()  # nothing new: nothing added
        assert {g: [len(t.x) for t in traces(live, g)] for g in live.figures} == after
        assert "<b>live</b>: running · step 16" in live.status.value
    finally:
        live.stop()


def test_a_trace_past_twice_the_display_budget_is_decimated_again(writer):
    live = watch(writer.path, every_s=QUIET_S)
    try:
        for step in range(10, 2 * DISPLAY_BUDGET + 20):
            writer.append("loss", step, {"train": 1.0 / (1 + step)})
        writer.flush()
        live.refresh()
        [loss] = traces(live, "loss")
        assert len(loss.x) <= DISPLAY_BUDGET + 2  # drawn anew from the decimated view
        assert loss.x[-1] == 2 * DISPLAY_BUDGET + 19
    finally:
        live.stop()


def test_a_run_that_joins_the_folder_is_drawn_beside_the_first(tmp_path):
    first = live_run(tmp_path / "a.h5", range(5))
    live = watch(tmp_path, every_s=QUIET_S)
    try:
        assert {t.meta["run"] for t in live.figures["loss"].data} == {"a"}
        second = live_run(tmp_path / "b.h5", range(3), scale=2.0)
        live.refresh()
        assert {t.meta["run"] for t in live.figures["loss"].data} == {"a", "b"}
        append(second, range(3, 6), scale=2.0)
        append(first, range(5, 8))
        live.refresh()
        assert_drawn_as_stored(live, tmp_path / "a.h5", "a")
        assert_drawn_as_stored(live, tmp_path / "b.h5", "b")
        assert "<b>a</b>: running · step 7" in live.status.value
        assert "<b>b</b>: running · step 5" in live.status.value
        second.close()
    finally:
        live.stop()
        first.close()


def test_an_empty_folder_waits_for_its_first_run(tmp_path):
    live = watch(tmp_path, every_s=QUIET_S)
    try:
        assert live.figures == {} and "no run yet" in live.status.value
        live_run(tmp_path / "late.h5", range(4)).close()
        live.refresh()
        assert [len(t.x) for t in traces(live, "loss", "late")] == [4]
    finally:
        live.stop()


def test_a_replaced_file_is_drawn_anew(tmp_path):
    path = tmp_path / "run.h5"
    live_run(path, range(20)).close()
    live = watch(path, every_s=QUIET_S)
    try:
        old = live.figures["loss"]
        live_run(
            path, range(6), scale=3.0, overwrite=True
        ).close()  # an overwrite: another run at the path
        live.refresh()
        assert live.figures["loss"] is old  # redrawn in place
        assert [len(t.x) for t in traces(live, "loss")] == [6]
        assert_drawn_as_stored(live, path)
        assert "<b>run</b>: finished · step 5" in live.status.value
    finally:
        live.stop()


def test_stop_ends_the_thread_and_refresh_still_polls(writer):
    live = watch(writer.path, every_s=0.05)
    assert live.following
    live.stop()
    assert not live.following
    append(writer, range(10, 12))
    live.refresh()
    assert [len(t.x) for t in traces(live, "loss")] == [12]
    assert "not following" in live.status.value


def test_the_thread_ends_by_itself_once_every_run_has_ended(writer):
    live = watch(writer.path, every_s=0.05)
    time.sleep(0.2)
    assert live.following  # running: still polled
    append(writer, range(10, 13))
    writer.close()
    live._thread.join(timeout=10)
    assert not live.following
    assert [len(t.x) for t in traces(live, "loss")] == [13]
    assert "<b>live</b>: finished · step 12" in live.status.value
    assert "not following" in live.status.value


def test_events_are_listed_under_the_status(writer):
    writer.append_event(4, "hessian", "warning", "stepped aside: out of memory")
    writer.flush()
    live = watch(writer.path, every_s=QUIET_S)
    try:
        assert "1 events" in live.status.value
        assert "step 4 · hessian · warning: stepped aside: out of memory" in live.status.value
        writer.append_event(9, "hessian", "warning", "again")
        writer.flush()
        live.refresh()
        assert live.status.value.count("stepped aside") == 1 and "2 events" in live.status.value
    finally:
        live.stop()


@pytest.mark.parametrize("module", ["ipywidgets", "anywidget"])
def test_a_missing_widget_package_says_how_to_install_it(writer, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package raises
    with pytest.raises(
        DynamicsError,
        match=rf"^{module} is not installed; pip install 'dynamics-for-pytorch\[notebook\]'$",
    ):
        watch(writer.path)


def test_a_bad_path_is_the_feeds_one_line_error(tmp_path):
    with pytest.raises(DynamicsError, match="no such file or directory$"):
        watch(tmp_path / "missing.h5")
    (tmp_path / "notes.h5").write_text("not a run")
    with pytest.raises(DynamicsError) as error:
        watch(tmp_path / "notes.h5")
    assert "\n" not in str(error.value) and "notes.h5" in str(error.value)


def test_watch_is_exported_lazily_and_import_dynamics_stays_light():
    assert dynamics.watch is watch and isinstance(watch, type(lambda: 0)) and Watch
    code = (
        "import sys, dynamics\n"
        "assert 'watch' in dynamics.__all__\n"
        "heavy = [m for m in ('plotly', 'ipywidgets', 'anywidget') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_notebook_cell_shows_the_widget_and_its_thread_extends_it_in_a_real_kernel(writer):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    cells = [
        f"import time, dynamics\nlive = dynamics.watch({str(writer.path)!r}, every_s=0.1)\nlive",
        "deadline = time.monotonic() + 20\n"
        "while len(live.figures['loss'].data[0].x) < 13 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "live.stop()\n"
        "print(len(live.figures['loss'].data[0].x), live.following)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3")
    with client.setup_kernel():
        client.execute_cell(notebook.cells[0], 0)
        append(writer, range(10, 13))  # while the kernel's widget follows the file
        client.execute_cell(notebook.cells[1], 1)
    [shown] = notebook.cells[0].outputs
    assert "application/vnd.jupyter.widget-view+json" in shown["data"]
    assert notebook.cells[1].outputs[0]["text"].strip() == "13 False"
