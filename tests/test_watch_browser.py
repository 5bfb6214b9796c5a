"""``dynamics watch`` in a real browser: headless Chromium follows a training run as it grows.

A real Lightning fit records into a run file in a subprocess, slowed to a few steps a second;
``dynamics watch`` serves it; Chromium (:mod:`tests.devtools`) opens the page and reads how
many points its figures hold, twice, and sees them grow; the fit is then killed and the page
says so. Cheaper writers (a :class:`~dynamics.store.RunWriter` driven step by step in a
subprocess) show a folder's second run joining, an overwritten file drawn anew, and a crash.
Every page must run without a console error and fetch nothing but from 127.0.0.1.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dynamics.analysis.figures.lines import DISPLAY_BUDGET
from dynamics.store import RunFileError, open_run
from tests.devtools import NEEDS_CHROMIUM, DevTools

pytestmark = NEEDS_CHROMIUM

DYNAMICS = str(Path(sys.executable).with_name("dynamics"))
#: How long a page may take to show what a file holds (the watcher polls every 0.25 s).
SEEN_WITHIN_S = 15.0

#: A small regression fit under Lightning, recorded by the default probes and flushed every
#: step, slowed by a sleep per step so that a watcher sees its rows arrive; it trains until
#: killed.
TRAINING = textwrap.dedent(
    """
    import sys, time
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from dynamics.callbacks import DynamicsRecorder

    class Slowly(pl.Callback):
        def on_train_batch_end(self, *args):
            time.sleep(0.05)

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02)

        def train_dataloader(self):
            x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)

    torch.set_num_threads(1)
    pl.Trainer(
        max_steps=1_000_000, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DynamicsRecorder(sys.argv[1], flush_interval_s=0.0), Slowly()],
    ).fit(Regression())
    """
)

#: A writer driven by its stdin: ``create PATH`` (a new run, replacing any file there; the run
#: written before is finished), ``rows N`` (N more rows of a loss, two norms and a spectrum
#: drawn as a heatmap, flushed), ``crash`` (the run closed as crashed), ``event MESSAGE`` (a
#: probe disabled at the last step). It answers ``done`` to each.
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dynamics.store import RunWriter, SeriesSpec, View, names
    loss = View("scalar", "Loss", "loss", log_y=True)
    norms = View("lines", "Norms", "norm")
    spectrum = View("heatmap", "Spectrum", "eigenvalue", log_y=True)
    layers = ("blocks.0", "blocks.1")
    specs = {"loss": {"train": SeriesSpec(view=loss)},
             "hidden_norms": {"norm": SeriesSpec((2,), columns=layers, view=norms)},
             "spectrum": {"eigenvalues": SeriesSpec((3,), view=spectrum)}}
    writer, step = None, 0
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "create":
            if writer is not None:
                writer.close()
            writer = RunWriter.create(argument, specs, {}, {"config": {}}, overwrite=True)
            step = 0
        elif command == "rows":
            for _ in range(int(argument)):
                writer.append("loss", step, {"train": 1.0 / (1 + step)})
                writer.append("hidden_norms", step, {"norm": np.array([1.0, 2.0]) * (1 + step)})
                eigenvalues = np.array([1, 10, 100]) * (1 + step)
                writer.append("spectrum", step, {"eigenvalues": eigenvalues})
                step += 1
            writer.flush()
        elif command == "event":
            writer.append_event(step - 1, "norms", "disabled", argument)
            writer.flush()
        elif command == "crash":
            writer.close(names.CRASHED, "FloatingPointError: loss diverged")
            writer = None
        print("done", flush=True)
    """
)

#: How many points the page's figures hold: the lengths of every trace's x (a heatmap's too).
POINTS = """[...document.querySelectorAll('.plotly-graph-div')]
  .flatMap(d => d.data || []).reduce((n, t) => n + (t.x ? t.x.length : 0), 0)"""
#: The status table: one {run, status, last_step, rate, flushed, note} per row.
RUNS = """JSON.stringify([...document.querySelectorAll('#runs tbody tr')].map(r => {
  const [run, status, last_step, rate, flushed, note] = [...r.children].map(c => c.textContent);
  return {run, status, last_step, rate, flushed, note, state: r.dataset.state};
}))"""
#: The traces drawn: {group, axis_end, run, series, points, last, z_rows, z_last} of each;
#: axis_end: where its x axis ends as drawn, last: the last step it holds, z_rows: the lengths
#: of a heatmap's rows, each of which must have a cell per point, z_last: their last cells
#: (both null for a line).
TRACES = """JSON.stringify([...document.querySelectorAll('.plotly-graph-div')].flatMap(d =>
  (d._fullData || []).map(f => [f, d.data[f.index]]).map(([f, t]) => ({group: d.dataset.group,
    axis_end: d._fullLayout['xaxis' + f.xaxis.slice(1)].range[1], run: (t.meta || {}).run,
    series: (t.meta || {}).series, points: t.x ? t.x.length : 0, last: t.x && t.x[t.x.length - 1],
    z_rows: t.z ? t.z.map(row => row.length) : null,
    z_last: t.z ? t.z.map(row => row[row.length - 1]) : null}))))"""
EVENTS = "[...document.querySelectorAll('#events li')].map(li => li.textContent)"


@pytest.fixture(scope="module")
def devtools(tmp_path_factory):
    browser = DevTools(tmp_path_factory.mktemp("watch-profile"))
    yield browser
    browser.close()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.fixture
def watcher():
    """``watch(target)`` starts ``dynamics watch target --port 0`` and returns its page's URL;
    every watcher started is stopped after the test."""
    started = []

    def watch(target: Path) -> str:
        process = subprocess.Popen(
            [DYNAMICS, "watch", str(target), "--port", "0", "--every", "0.25"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        line = process.stdout.readline()
        assert line.startswith("watching "), (line, process.stderr.read() if not line else "")
        return line.split(" at ")[1].split()[0]

    try:
        yield watch
    finally:
        for process in started:
            stop(process)


@pytest.fixture
def writer():
    """A :data:`WRITER` subprocess; ``writer(command)`` sends it one command and waits."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def send(command: str) -> None:
        process.stdin.write(command + "\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "done", command

    try:
        yield send
    finally:
        stop(process)


def until(read, done, within_s: float = SEEN_WITHIN_S):
    """``read()`` again every 0.2 s until ``done(value)``; the last value read."""
    deadline = time.monotonic() + within_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def runs(devtools: DevTools, session: str) -> list[dict]:
    return json.loads(devtools.evaluate(RUNS, session))


def traces(devtools: DevTools, session: str) -> list[dict]:
    return json.loads(devtools.evaluate(TRACES, session))


def points(devtools: DevTools, session: str) -> int:
    return devtools.evaluate(POINTS, session)


def clean(devtools: DevTools, session: str, url: str) -> None:
    """No error on the page, and nothing fetched but from the watcher."""
    assert devtools.errors(session) == []
    # a heatmap is drawn as an image of a data: URL
    assert [u for u in devtools.requests(session) if not u.startswith((url, "data:"))] == []


def readable(path: Path) -> bool:
    try:
        return path.exists() and open_run(path).status().last_step >= 0
    except RunFileError:
        return False


def test_a_training_run_is_followed_until_it_is_killed(devtools, watcher, tmp_path):
    path = tmp_path / "fit.h5"
    fit = subprocess.Popen(
        [sys.executable, "-c", TRAINING, str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert until(lambda: readable(path), bool, within_s=60), fit.stderr.read()
        url = watcher(path)
        session = devtools.open(url)
        first = until(lambda: points(devtools, session), lambda n: n > 0)
        assert first > 0
        # A second read once the page has polled enough to know the run's rate.
        shown = until(lambda: runs(devtools, session), lambda r: r and r[0]["rate"] != "—")
        later = points(devtools, session)
        assert later > first
        assert [r["status"] for r in shown] == ["running"]
        assert int(shown[0]["last_step"]) > 0
        # Rows a second of the run (steps), not of its groups added up; under 20 with the sleep.
        assert 0 < float(shown[0]["rate"]) <= 20
        drawn = traces(devtools, session)
        assert {t["group"] for t in drawn} >= {"loss", "hidden_norms", "displacement"}
        assert all(t["points"] > 0 and t["axis_end"] >= t["last"] for t in drawn), drawn
        os.kill(fit.pid, signal.SIGKILL)
        fit.wait()
        shown = until(lambda: runs(devtools, session), lambda r: r[0]["status"] == "killed")
        assert shown[0]["status"] == "killed" and shown[0]["state"] == "killed"
        clean(devtools, session, url)
    finally:
        stop(fit)


def test_a_run_joining_a_folder_is_drawn_beside_the_first(devtools, watcher, writer, tmp_path):
    writer(f"create {tmp_path / 'first.h5'}")
    writer("rows 30")
    url = watcher(tmp_path)
    session = devtools.open(url)
    until(lambda: traces(devtools, session), lambda t: t and all(x["points"] == 30 for x in t))
    writer(f"create {tmp_path / 'second.h5'}")
    writer("rows 10")
    drawn = until(
        lambda: traces(devtools, session), lambda t: {x["run"] for x in t} == {"first", "second"}
    )
    by_run = {(t["group"], t["run"]): t["points"] for t in drawn if t["series"] == "train"}
    assert by_run == {("loss", "first"): 30, ("loss", "second"): 10}
    writer("rows 5")
    drawn = until(
        lambda: traces(devtools, session),
        lambda t: all(x["points"] == (30 if x["run"] == "first" else 15) for x in t),
    )
    assert all(x["points"] == (30 if x["run"] == "first" else 15) for x in drawn), drawn
    assert sorted(r["run"] for r in runs(devtools, session)) == ["first", "second"]
    clean(devtools, session, url)


def test_an_overwritten_file_is_drawn_anew(devtools, watcher, writer, tmp_path):
    path = tmp_path / "run.h5"
    writer(f"create {path}")
    writer("rows 40")
    url = watcher(path)
    session = devtools.open(url)
    assert until(lambda: points(devtools, session), lambda n: n > 0) > 0
    before = points(devtools, session)
    writer(f"create {path}")  # the same path, another run: an overwrite
    writer("rows 5")
    after = until(lambda: points(devtools, session), lambda n: 0 < n < before)
    assert 0 < after < before
    writer("rows 5")
    assert until(lambda: points(devtools, session), lambda n: n == 2 * after) == 2 * after
    # Rows past twice the display budget: the traces are thinned anew, to the last step.
    writer(f"rows {2 * DISPLAY_BUDGET + 100}")
    last = 10 + 2 * DISPLAY_BUDGET + 100 - 1
    drawn = until(lambda: traces(devtools, session), lambda t: all(x["last"] == last for x in t))
    assert all(x["last"] == last and x["points"] <= 2 * DISPLAY_BUDGET for x in drawn), drawn
    assert all(x["axis_end"] >= last for x in drawn), drawn
    clean(devtools, session, url)


def test_a_crashed_run_shows_its_exception(devtools, watcher, writer, tmp_path):
    path = tmp_path / "run.h5"
    writer(f"create {path}")
    writer("rows 10")
    url = watcher(path)
    session = devtools.open(url)
    assert until(lambda: runs(devtools, session), lambda r: r and r[0]["status"] == "running")
    writer("rows 3")
    writer("event a norm was not finite")
    writer("crash")
    shown = until(lambda: runs(devtools, session), lambda r: r[0]["status"] == "crashed")
    assert shown[0]["status"] == "crashed" and shown[0]["last_step"] == "12"
    assert "FloatingPointError: loss diverged" in shown[0]["note"]
    # A line for the loss, one per norm, and the spectrum's heatmap: 13 steps each.
    assert until(lambda: points(devtools, session), lambda n: n == 4 * 13) == 4 * 13
    (heatmap,) = [t for t in traces(devtools, session) if t["z_rows"]]
    assert heatmap["z_rows"] == [13, 13, 13]  # extended by the rows after the first 10
    assert heatmap["z_last"] == pytest.approx(np.log10([13, 130, 1300]))  # on its log scale
    assert devtools.evaluate(EVENTS, session) == [
        "run · step 12 · norms · disabled: a norm was not finite"
    ]
    clean(devtools, session, url)
