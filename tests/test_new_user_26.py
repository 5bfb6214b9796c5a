"""A new user's campaign of ``dynamics watch`` (issue 26) on run files the feature was not
designed around: the output folder of ``dynamics run --seeds``, a plain loop resumed from a
checkpoint into the same file, a watched folder or file deleted, and the page in a browser.

Each test drives what the page polls (the :class:`Feed`, or the server over HTTP) and compares
what it is sent with what the file holds (``open_run(path).series(group)``).
"""

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import dynamics
from dynamics.analysis.live.feed import Feed
from dynamics.analysis.live.server import WatchServer
from dynamics.callbacks import HiddenStateNorms, TrainingLoss
from dynamics.experiments.seed_runs import run_path
from dynamics.store import RunWriter, SeriesSpec, names, open_run

SPECS = {"loss": {"train": SeriesSpec()}}


def write_run(path: Path, steps: range, value: float = 1.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = RunWriter.create(path, SPECS, {}, {"config": {}}, block_rows=4)
    for step in steps:
        writer.append("loss", step, {"train": value / (step + 1)})
    writer.close()
    return path


@pytest.fixture
def serve():
    """``serve(target)``: a watch server on any free port, stopped after the test."""
    servers = []

    def start(target: Path) -> WatchServer:
        server = WatchServer(target, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        thread.start()
        servers.append((server, thread))
        return server

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


def post(url: str, since: dict) -> dict:
    request = urllib.request.Request(url + "api/update", json.dumps(since).encode())
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def test_the_out_folder_of_a_seeded_dynamics_run_is_watched_run_by_run(tmp_path):
    # `dynamics run CONFIG --out OUT --seeds 0-1` writes OUT/<variant>/seed<k>.h5 and
    # OUT/summary.json; `dynamics watch OUT` (the folder the user named) found no run in it
    # and served an empty page with no word of why.
    paths = [
        write_run(run_path(tmp_path, variant, seed), range(5), value=1.0 + seed)
        for variant in ("shifted", "unshifted")
        for seed in (0, 1)
    ]
    (tmp_path / "summary.json").write_text("{}")
    feed = Feed(tmp_path)
    drawn = feed.figures()
    update = feed.update({})
    assert sorted(r["path"] for r in update["runs"]) == sorted(map(str, paths))
    labels = {r["label"] for r in update["runs"]}
    assert len(labels) == 4  # seed0.h5 is in both variants' folders: the labels must differ
    traces = [t for f in drawn["figures"] for t in f["figure"]["data"]]
    assert {t["meta"]["run"] for t in traces} == labels


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _fit(path, model, optimizer, steps, batches, state=None, crash_after=None, saved=None):
    """A plain loop recorded into ``path`` (resumed from ``state``) that crashes after step
    ``crash_after``; ``saved`` gets the model's, optimizer's and recorder's state after step 4,
    as a checkpoint there keeps them."""
    rec = dynamics.record(
        path,
        model,
        optimizer,
        loss_fn=_loss,
        probes=[TrainingLoss(), HiddenStateNorms()],
        overwrite=state is None,
    )
    if state is not None:
        rec.load_state_dict(state)
    with rec:
        for step in steps:
            with rec.batch(batches[step]) as b:
                loss = _loss(model, batches[step])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                b.loss(loss)
            if step == 4:
                model_state = {k: v.clone() for k, v in model.state_dict().items()}
                saved.extend((model_state, optimizer.state_dict(), rec.state_dict()))
            if step == crash_after:
                raise RuntimeError("the machine went down")


def test_a_run_resumed_from_a_checkpoint_is_redrawn_with_the_rows_it_rewrote(tmp_path):
    # A fit checkpointed at step 4 went on to step 9 and crashed; the user resumed it from the
    # checkpoint with another learning rate. The resume drops the file's rows after step 4 and
    # records steps 5 to 9 anew, in the same file under the same run id, so the watcher's key
    # never changed and a page that had drawn the first fit's steps 5 to 9 kept them.
    path = tmp_path / "plain.h5"
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1)) for _ in range(12)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    saved = []
    with pytest.raises(RuntimeError, match="went down"):
        _fit(path, model, optimizer, range(12), batches, crash_after=9, saved=saved)
    model_state, optimizer_state, state = saved
    feed = Feed(path)
    drawn = feed.figures()
    assert drawn["since"][""]["groups"]["loss"] == 9

    model.load_state_dict(model_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # the resume changes the rate
    optimizer.load_state_dict(optimizer_state)
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    _fit(path, model, optimizer, range(5, 12), batches, state=state)

    update = feed.update(drawn["since"])
    resumed = open_run(path).series("loss")
    if update["key"] == drawn["key"]:  # the page extends its traces: it must be sent steps 5..
        sent = update["rows"][""]["loss"]
        assert sent["step"] == resumed.step[5:].tolist()
        np.testing.assert_allclose(np.ravel(sent["series"]["train"]), resumed["train"][5:])
    else:  # the page draws its figures anew from the resumed file
        redrawn = feed.figures()
        assert redrawn["since"][""]["groups"]["loss"] == int(resumed.step[-1])


def test_a_watched_folder_that_is_deleted_says_so(tmp_path, serve):
    folder = tmp_path / "runs"
    write_run(folder / "a.h5", range(3))
    server = serve(folder)
    assert post(server.url, {})["runs"]  # followed
    shutil.rmtree(folder)
    update = post(server.url, {})  # was: no runs and no error, as if the folder were empty
    assert "no such file or directory" in update.get("error", "")
    assert str(folder) in update["error"]


def test_a_watched_file_that_is_deleted_reads_as_missing_not_as_corrupted(tmp_path):
    path = write_run(tmp_path / "run.h5", range(3))
    feed = Feed(path)
    since = feed.figures()["since"]
    path.unlink()
    (run,) = feed.update(since)["runs"]
    assert "no such file" in run["problem"].lower()
    assert "corrupted" not in run["problem"]  # was: "not a readable run file (truncated or
    # corrupted?): [Errno 2] No such file or directory"


def test_the_page_names_an_icon_so_a_browser_logs_no_404(tmp_path, serve):
    # Chromium asks for /favicon.ico; the watcher's 404 showed as a console error
    # ("Failed to load resource: ... 404") on the page the issue wants free of them.
    server = serve(write_run(tmp_path / "run.h5", range(3)))
    with urllib.request.urlopen(server.url, timeout=10) as reply:
        page = reply.read().decode()
    if "rel='icon'" in page or 'rel="icon"' in page:
        return  # the page names its own icon: the browser asks for no /favicon.ico
    try:
        with urllib.request.urlopen(server.url + "favicon.ico", timeout=10) as reply:
            assert reply.status < 300
    except urllib.error.HTTPError as error:
        pytest.fail(f"/favicon.ico answers {error.code} and the page names no icon")


def test_a_file_from_before_run_ids_replaced_by_another_is_redrawn(tmp_path):
    # Files written before run ids have none: an overwrite of one by another (both None) kept
    # the watcher's key, and the page kept the old run's steps 4 to 9 beside the new run's.
    path = write_run(tmp_path / "old.h5", range(10))
    with h5py.File(path, "r+") as file:
        del file.attrs[names.ATTR_RUN_ID]
    feed = Feed(path)
    drawn = feed.figures()
    replacement = write_run(tmp_path / "new.h5", range(4), value=5.0)
    with h5py.File(replacement, "r+") as file:
        del file.attrs[names.ATTR_RUN_ID]
    os.replace(replacement, path)  # as an overwrite renames its new file over the old one
    assert feed.update(drawn["since"])["key"] != drawn["key"]


def test_the_poll_that_sees_an_overwrite_reports_the_new_runs_status(tmp_path):
    # It sent the run with no state and no problem, which the page shows as "waiting", last
    # step "—", for a run that is running (or finished) at the path.
    path = write_run(tmp_path / "run.h5", range(10))
    feed = Feed(path)
    drawn = feed.figures()
    writer = RunWriter.create(path, SPECS, {}, {"config": {}}, overwrite=True, block_rows=4)
    writer.append("loss", 0, {"train": 1.0})
    writer.flush()
    (run,) = feed.update(drawn["since"])["runs"]
    writer.close()
    assert (run.get("state"), run.get("last_step")) == ("running", 0)


def test_a_poll_reads_no_finished_run_whose_file_did_not_change(tmp_path, monkeypatch):
    # Each poll opened and inspected every file of a folder (twice: once to tell a plane grid
    # from a run), finished or not: a folder of a few dozen finished runs kept the watcher
    # busy for about its whole polling period, on the cores the training shares.
    for name in ("a", "b", "c"):
        write_run(tmp_path / f"{name}.h5", range(5))
        # Finished a while ago: a file modified within QUIET_S may still change unseen by
        # its modification time (coarse on some file systems), so it is read again.
        os.utime(tmp_path / f"{name}.h5", (time.time() - 10, time.time() - 10))
    feed = Feed(tmp_path)
    since = feed.figures()["since"]
    update = feed.update(since)
    for run in update["runs"]:
        since[run["label"]]["events"] = run["events_seen"]
    opened = []
    real = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    again = feed.update(since)
    assert [r["state"] for r in again["runs"]] == ["finished"] * 3
    assert not any(again["rows"].values())  # no new rows
    assert opened == []
