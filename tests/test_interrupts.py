"""Ctrl-C during ``dynamics run``: one line, exit 130, run files closed, no process left."""

import os
import signal
import subprocess
import time

import pytest
import yaml

from dynamics import open_run
from dynamics.store import names
from tests.conftest import DYNAMICS, TINY_EXPERIMENT

#: Long enough that the interrupt always lands in training, whatever the machine's load.
LONG = {**TINY_EXPERIMENT, "steps": 100_000, "eval_every": 1_000}


def _interrupted_run(tmp_path, *options, group: bool):
    """Start ``dynamics run`` in its own session, send SIGINT once a run file exists (to the
    whole process group, as a terminal's Ctrl-C does, or to the command alone), and return
    (completed process, run files)."""
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(LONG))
    out = tmp_path / "runs"
    command = [DYNAMICS, "run", tmp_path / "long.yaml", "--out", out, "--no-progress", *options]
    process = subprocess.Popen(
        list(map(str, command)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not list(out.rglob("*.h5")) and process.poll() is None:
        assert time.monotonic() < deadline, "no run file appeared"
        time.sleep(0.1)
    time.sleep(0.5)  # a few steps into training
    if group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert not _outlived(process.pid), "a child outlived the command"
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), sorted(
        out.rglob("*.h5")
    )


def _outlived(group: int) -> bool:
    """Whether a process of ``group`` is still there after a few seconds (a child that has
    exited may be a zombie for a moment, until init reaps it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def _closed(path):
    """The run's own process closed its file, as crashed by the interrupt (not killed)."""
    status = open_run(path).status()
    assert status.state == names.CRASHED and "KeyboardInterrupt" in status.exception, status


def test_ctrl_c_during_run_is_one_line_and_exit_130(tmp_path):
    result, runs = _interrupted_run(tmp_path, group=False)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "dynamics: interrupted\n"
    assert [p.name for p in runs] == ["unshifted.h5"]  # the variants after it never started
    _closed(runs[0])
    assert sorted(p.name for p in runs[0].parent.iterdir()) == ["unshifted.h5"]  # no lock left


def test_ctrl_c_with_parallel_jobs_ends_every_child_quietly(tmp_path):
    result, runs = _interrupted_run(tmp_path, "--seeds", "0-1", "--jobs", "2", group=True)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "dynamics: interrupted\n"  # no child's traceback
    assert runs and all(p.name == "seed0.h5" for p in runs)
    for path in runs:
        _closed(path)
    assert not list(tmp_path.rglob("*.lock"))


def test_a_child_that_missed_ctrl_c_while_starting_ends_before_training():
    """A child ignores Ctrl-C until it has imported; the parent's flag, set before it passes
    Ctrl-C on, stops a child that missed it, before it trains (it would run until terminated,
    its run file recorded as killed by SIGTERM)."""
    import multiprocessing

    from dynamics.experiments import launchers

    receive, send = multiprocessing.Pipe(duplex=False)
    interrupted = multiprocessing.Event()
    interrupted.set()
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as ended:
            launchers._child(send, interrupted, None, None, "unshifted", None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ended.value.code == launchers.INTERRUPTED
    assert not receive.poll()  # no result, no failure: it trained nothing
