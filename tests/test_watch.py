"""``dynamics watch`` without a browser: the reader's one-open update, the feed the page polls,
the server's endpoints and the command's bad input.

The page itself, in Chromium on a real training run, is tests/test_watch_browser.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import h5py
import numpy as np
import pytest

from dynamics.analysis.live.feed import Feed
from dynamics.analysis.live.server import WatchServer
from dynamics.errors import DynamicsError
from dynamics.store import RunWriter, SeriesSpec, open_run

SPECS = {
    "loss": {"train": SeriesSpec()},
    "hidden_norms": {"norm": SeriesSpec((2,), columns=("blocks.0", "blocks.1"))},
    "snapshots": {"theta": SeriesSpec((3,))},  # no view: never read by a watcher
}


def write_rows(writer: RunWriter, steps: range, scale: float = 1.0) -> None:
    for step in steps:
        writer.append("loss", step, {"train": scale / (step + 1)})
        writer.append("hidden_norms", step, {"norm": scale * np.array([step, 2.0 * step])})
    writer.flush()


def create(path: Path, overwrite: bool = False) -> RunWriter:
    return RunWriter.create(path, SPECS, {}, {"config": {}}, overwrite=overwrite, block_rows=4)


def test_update_reads_only_the_rows_after_each_groups_step(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(5))
    run = open_run(tmp_path / "run.h5")
    first = run.update({"loss": None, "hidden_norms": 2})
    assert first.run_id == run.run_id and first.status.state == "running"
    np.testing.assert_array_equal(first.rows["loss"].step, np.arange(5))
    np.testing.assert_array_equal(first.rows["hidden_norms"].step, [3, 4])
    np.testing.assert_array_equal(first.rows["hidden_norms"]["norm"], [[3, 6], [4, 8]])
    assert first.rows["hidden_norms"].columns["norm"] == ("blocks.0", "blocks.1")
    write_rows(writer, range(5, 8))
    writer.append_event(6, "probe", "disabled", "stepped aside")
    writer.close()
    later = run.update({"loss": 4})
    assert set(later.rows) == {"loss"} and later.status.state == "finished"
    np.testing.assert_allclose(later.rows["loss"]["train"], 1 / np.arange(6.0, 9.0), rtol=1e-6)
    assert [(e.step, e.kind) for e in later.events] == [(6, "disabled")]
    with pytest.raises(KeyError):
        run.update({"nope": None})


def test_polls_inspect_a_growing_file_whole_once_and_read_a_quiet_one_no_more(
    tmp_path, monkeypatch
):
    import dynamics.store.inspection as inspection

    whole = []
    inspect = inspection.inspect_file
    monkeypatch.setattr(inspection, "inspect_file", lambda f, p: whole.append(p) or inspect(f, p))
    path = tmp_path / "run.h5"
    writer = create(path)
    write_rows(writer, range(3))
    run = open_run(path)
    run.update({"loss": None})
    write_rows(writer, range(3, 5))
    grown = run.update({"loss": 2})
    np.testing.assert_array_equal(grown.rows["loss"].step, [3, 4])
    assert whole == [path]  # the growth was checked, not the whole file again
    writer.close()
    quiet = time.time() - 10  # finished a while ago: its stat tells whether it changed
    os.utime(path, (quiet, quiet))
    closed = run.update({"loss": 4})
    assert closed.status.state == "finished" and len(closed.rows["loss"]) == 0
    monkeypatch.setattr(h5py, "File", None)  # an unchanged, quiet file is not opened at all
    again = run.update({"loss": 4})
    assert again.status.state == "finished" and len(again.rows["loss"]) == 0
    assert again.rows["loss"]["train"].shape == (0,)


def test_a_quiet_file_written_again_is_read_again(tmp_path):
    path = tmp_path / "run.h5"
    writer = create(path)
    write_rows(writer, range(3))
    quiet = time.time() - 10
    os.utime(path, (quiet, quiet))
    run = open_run(path)
    assert len(run.update({"loss": 2}).rows["loss"]) == 0  # remembered: quiet and unchanged
    write_rows(writer, range(3, 6))  # the writer wakes up: a new modification time
    np.testing.assert_array_equal(run.update({"loss": 2}).rows["loss"].step, [3, 4, 5])
    assert len(run.update({"loss": 1}).rows["loss"]) == 4  # asking for more reads again
    writer.close()
    replacement = create(path, overwrite=True)
    write_rows(replacement, range(2))
    replacement.close()
    assert run.update({"loss": None}).run_id != run.run_id  # another file, read whole


def test_the_feed_draws_each_viewed_group_with_traces_naming_what_they_draw(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(6))
    drawn = Feed(tmp_path / "run.h5").figures()
    assert [f["group"] for f in drawn["figures"]] == ["loss", "hidden_norms"]
    assert drawn["since"] == {"": {"groups": {"loss": 5, "hidden_norms": 5}, "events": 0}}
    metas = [t.get("meta") for t in drawn["figures"][1]["figure"]["data"]]
    assert metas == [
        {"run": "", "series": "norm", "column": 0},
        {"run": "", "series": "norm", "column": 1},
    ]
    writer.close()


def test_an_update_sends_new_rows_non_finite_as_null_and_new_events_once(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(3))
    feed = Feed(tmp_path / "run.h5")
    since = feed.figures()["since"]
    writer.append("hidden_norms", 3, {"norm": np.array([np.nan, np.inf])})
    writer.append_event(3, "HessianSpectrum", "disabled", "cannot measure under X")
    writer.flush()
    update = feed.update(since)
    assert update["rows"] == {
        "": {"hidden_norms": {"step": [3], "series": {"norm": [[None, None]]}}}
    }
    json.dumps(update, allow_nan=False)  # strict JSON: a browser's JSON.parse reads it
    (run,) = update["runs"]
    assert run["state"] == "running" and run["last_step"] == 3 and run["events_seen"] == 1
    assert [e["message"] for e in run["events"]] == ["cannot measure under X"]
    since[""]["events"] = run["events_seen"]
    assert feed.update(since)["runs"][0]["events"] == []
    writer.close()


def test_a_page_holding_another_keys_figures_gets_statuses_but_no_rows(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(4))
    feed = Feed(tmp_path / "run.h5")
    drawn = feed.figures()
    stale = feed.update({}, key="another page's figures")
    assert not any(stale["rows"].values()) and stale["runs"][0]["last_step"] == 3
    fresh = feed.update({}, key=drawn["key"])
    assert fresh["rows"][""]["loss"]["step"] == [0, 1, 2, 3]
    writer.close()


def test_a_folder_feed_awaits_runs_and_each_new_run_changes_the_key(tmp_path):
    feed = Feed(tmp_path)
    empty = feed.figures()
    assert empty["figures"] == [] and feed.update({})["runs"] == []
    (tmp_path / "being-written.h5").write_bytes(b"\x89HDF")  # a file mid-creation
    first = create(tmp_path / "a.h5")
    write_rows(first, range(4))
    update = feed.update({})
    assert update["key"] != empty["key"]
    states = {r["label"]: (r.get("state"), r["problem"]) for r in update["runs"]}
    assert states["a"] == ("running", None)
    assert states["being-written"][0] is None and "too short" in states["being-written"][1]
    second = create(tmp_path / "b.h5")
    write_rows(second, range(2), scale=2.0)
    drawn = feed.figures()
    assert drawn["key"] != update["key"]
    runs = {t["meta"]["run"] for f in drawn["figures"] for t in f["figure"]["data"]}
    assert runs == {"a", "b"}  # overlaid, each run's traces named by its file
    first.close()
    second.close()


def test_an_overwritten_file_changes_the_key_and_its_new_rows_come_whole(tmp_path):
    path = tmp_path / "run.h5"
    writer = create(path)
    write_rows(writer, range(6))
    writer.close()
    feed = Feed(path)
    drawn = feed.figures()
    replacement = create(path, overwrite=True)  # renamed over the old file while followed
    write_rows(replacement, range(2), scale=3.0)
    assert feed.update(drawn["since"])["key"] != drawn["key"]
    redrawn = feed.figures()
    assert redrawn["since"][""]["groups"] == {"loss": 1, "hidden_norms": 1}
    replacement.close()


KILLABLE_WRITER = textwrap.dedent(
    """
    import sys, time
    from dynamics.store import RunWriter, SeriesSpec
    writer = RunWriter.create(sys.argv[1], {"loss": {"train": SeriesSpec()}}, {}, {})
    writer.append("loss", 0, {"train": 1.0})
    writer.flush()
    print("flushed", flush=True)
    time.sleep(60)
    """
)


def test_a_killed_writer_reads_as_killed_and_the_feed_holds_no_file_open(tmp_path):
    path = tmp_path / "run.h5"
    process = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "flushed"
        feed = Feed(path)
        since = feed.figures()["since"]
        assert feed.update(since)["runs"][0]["state"] == "running"
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert feed.update(since)["runs"][0]["state"] == "killed"
        assert str(path) not in open_files()  # an overwrite or a delete is never held up
    finally:
        process.kill()
        process.wait()


def test_a_report_of_a_running_run_says_how_to_follow_it_live(tmp_path, capsys):
    from dynamics.cli import main

    path = tmp_path / "live run.h5"
    process = subprocess.Popen(
        [sys.executable, "-c", KILLABLE_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "flushed"
        assert main(["report", str(path), "-o", str(tmp_path / "report.html")]) == 0
        command = f"dynamics watch '{path}'"
        assert (
            f"live: {path} is still running; follow it with: {command}" in capsys.readouterr().out
        )
        assert f"follow it live with <code>{command}</code>" in (
            tmp_path / "report.html"
        ).read_text().replace("&#x27;", "'")
    finally:
        process.kill()
        process.wait()
    assert main(["report", str(path), "-o", str(tmp_path / "after.html")]) == 0
    assert "live:" not in capsys.readouterr().out  # killed: nothing left to follow


def open_files() -> list[str]:
    """The paths this process holds open (Linux)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return held


def test_a_path_that_is_no_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(DynamicsError, match="no such file"):
        Feed(tmp_path / "missing.h5")
    (tmp_path / "notes.h5").write_text("not hdf5" * 200)
    with pytest.raises(DynamicsError, match="not a readable run file"):
        Feed(tmp_path / "notes.h5")


@pytest.fixture
def served(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(4))
    server = WatchServer(tmp_path / "run.h5", "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server, writer
    server.shutdown()
    server.server_close()
    thread.join()
    writer.close()


def request(url: str, body: bytes | None = None, host: str | None = None):
    headers = {"Host": host} if host else {}
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=10) as reply:
        return reply.status, reply.headers["Content-Type"], reply.read()


def test_the_server_serves_an_offline_page_and_the_feeds_json(served):
    server, writer = served
    status, kind, page = request(server.url)
    assert status == 200 and kind.startswith("text/html")
    assert b"<script src=" not in page and b"dynamics watch" in page  # plotly.js is inline
    _, kind, figures = request(server.url + "api/figures")
    drawn = json.loads(figures)
    assert kind == "application/json" and len(drawn["figures"]) == 2
    write_rows(writer, range(4, 6))
    _, _, body = request(server.url + "api/update", json.dumps(drawn["since"]).encode())
    assert json.loads(body)["rows"][""]["loss"]["step"] == [4, 5]


def test_the_server_refuses_foreign_hosts_and_malformed_updates(served):
    server, _ = served
    with pytest.raises(urllib.error.HTTPError) as refused:
        request(server.url, host="attacker.example:80")  # a DNS name rebound to 127.0.0.1
    assert refused.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as malformed:
        request(server.url + "api/update", b"{not json")
    assert malformed.value.code == 400
    _, _, body = request(server.url + "api/update", b'{"": {"groups": {"loss": "x"}}}')
    assert json.loads(body)["rows"][""]["loss"]["step"] == [0, 1, 2, 3]  # read as nothing seen


def watch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dynamics.cli", "watch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "notes.h5").write_text("not hdf5" * 200)
    writer = create(tmp_path / "run.h5")
    writer.close()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    cases = {
        "no such file": [str(tmp_path / "missing.h5")],
        "not a readable run file": [str(tmp_path / "notes.h5")],
        "in use": [str(tmp_path / "run.h5"), "--port", port],
        "--port must be": [str(tmp_path / "run.h5"), "--port", "70000"],
        "--every must be": [str(tmp_path / "run.h5"), "--every", "0"],
    }
    try:
        for message, args in cases.items():
            done = watch(*args)
            assert done.returncode == 2, (args, done.stderr)
            assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
    finally:
        taken.close()


def test_the_command_serves_until_stopped_and_warns_when_bound_beyond_this_machine(tmp_path):
    writer = create(tmp_path / "run.h5")
    write_rows(writer, range(3))
    writer.close()
    command = [sys.executable, "-m", "dynamics.cli", "watch", str(tmp_path / "run.h5")]
    process = subprocess.Popen(
        [*command, "--port", "0", "--host", "0.0.0.0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        assert json.loads(request(url + "api/figures")[2])["figures"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
        assert "anyone who can reach this machine" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
