"""Damaged run files, read by every command and the public API: one line or a valid answer.

One small real run is recorded once per session with every standard probe; each mutation of
:mod:`tests.damaged_runs` damages a copy of it. Every command that reads run files is run
in-process on each (through the CLI's ``main``), and so is the public reading API: each case is
answered by one line on stderr and exit 2 (a :class:`DynamicsError` of one line), or succeeds
because what is left is still a valid run; never a traceback, and nothing overwritten.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from dynamics import open_run
from dynamics.analysis import figures
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.model import load_into
from dynamics.store import names

# The tests run in importlib mode, which keeps tests/ off sys.path: load the generator by path.
_spec = importlib.util.spec_from_file_location(
    "damaged_runs", Path(__file__).with_name("damaged_runs.py")
)
damaged_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(damaged_runs)
MUTATIONS, make_damaged = damaged_runs.MUTATIONS, damaged_runs.make_damaged

ARCHITECTURE = dict(width=4, expansion=2, depth=2)


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory, quiet_trainer) -> tuple[Path, Path]:
    """Two tiny teacher–student runs sharing θ0, recorded with every standard probe: the
    second, which the mutations damage, on the plane of both initial gradients."""
    folder = tmp_path_factory.mktemp("real")
    paths = []
    for shift in ("none", "expected"):
        probes = [
            TrainingLoss(),
            HiddenStateNorms(),
            ParameterDisplacement(),
            LoggedMetrics([names.VAL_LOSS]),
            GradientPlane(partner=paths[0] if paths else None),  # the second: on their plane
            HessianSpectrum(k=2, every_n_steps=3),
        ]
        path = folder / f"{shift}.h5"
        recorder = DynamicsRecorder(path, probes, config={"shift": shift})
        module = TeacherStudentModule(**ARCHITECTURE, shift=shift)
        data = TeacherStudentData(**ARCHITECTURE, batch_size=8, heldout_size=16)
        trainer = quiet_trainer(
            max_steps=6, val_check_interval=3, num_sanity_val_steps=0, callbacks=[recorder]
        )
        trainer.fit(module, data)
        paths.append(path)
    return tuple(paths)


def _digest(path: Path) -> str:
    if path.is_dir():
        return "".join(_digest(p) for p in sorted(path.iterdir()))
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _commands(damaged: Path, good: Path, out: Path) -> dict[str, list[str]]:
    html = ["-o", str(out / "out.html")]
    return {
        "info": ["info", str(damaged)],
        "info_json": ["info", str(damaged), "--json"],
        "overshoot": ["overshoot", str(damaged)],
        "overshoot_json": ["overshoot", str(damaged), "--json"],
        "report": ["report", str(damaged), *html],
        "compare_other": ["compare", str(good), str(damaged), *html],
        "compare_reference": ["compare", str(damaged), str(good), *html],
        "plane": [
            *("plane", str(damaged), str(good), *html),
            *("--grid", "3", "--processes", "1", "--no-progress"),
        ],
    }


COMMANDS = list(_commands(Path(), Path(), Path()))


def _assert_one_line(text: str) -> None:
    assert text.count("\n") <= 1 and "Traceback" not in text, text
    assert text.strip(), "an error without a message"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_command_answers_a_damaged_file_in_one_line(
    real_runs, tmp_path, capsys, mutation, command
):
    damaged = make_damaged(real_runs[1], mutation, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    before = _digest(damaged), _digest(real_runs[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = main(_commands(damaged, real_runs[0], out)[command])
        except SystemExit as exit_:
            code = exit_.code
    stderr = capsys.readouterr().err
    assert code in (0, 2), (code, stderr)
    if code == 2:
        assert stderr.startswith("dynamics"), stderr
        _assert_one_line(stderr)
        assert not list(out.iterdir()), "a failed command left output"
    assert (_digest(damaged), _digest(real_runs[0])) == before, "a reader changed its input"


def _api_calls(run) -> list:
    """Every public reading call on an open run, as a notebook would make them."""
    calls = [run.summary, run.status, run.events, run.train_loss, run.heldout_loss]
    calls += [run.validation_metrics, run.stored_states]
    for group in run.groups:
        calls += [lambda g=group: run.series(g).to_pandas(long=True), lambda g=group: run.views(g)]
    calls += [lambda n=name: run.vector(n) for name in run.vector_names]
    # Into the run's own variant: the unshifted class is refused for a shifted run.
    calls += [
        lambda: load_into(
            run, TeacherStudentModule(**ARCHITECTURE, shift=run.config.get("shift", "none"))
        )
    ]
    draws = (figures.loss, figures.hidden_norms, figures.eigenvalues, figures.displacement)
    draws += (figures.plane_path, figures.plane_share)
    # First: a group drawn by a dedicated figure is refused by figures.group, in one line.
    groups = [lambda g=group: figures.group(run, g) for group in run.groups]
    return groups + calls + [lambda d=draw: d(run) for draw in draws]


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_public_api_answers_a_damaged_file_in_one_line(real_runs, tmp_path, mutation):
    damaged = make_damaged(real_runs[1], mutation, tmp_path)
    before = _digest(damaged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            calls = _api_calls(open_run(damaged))
        except DynamicsError as error:
            _assert_one_line(str(error))
            calls = []
        for call in calls:
            try:
                call()
            except DynamicsError as error:
                _assert_one_line(str(error))
    assert _digest(damaged) == before


def test_the_real_runs_pass_every_call(real_runs):
    run = open_run(real_runs[1])
    for call in _api_calls(run)[len(run.groups) :]:  # figures.group refuses some groups
        call()
    assert np.isfinite(open_run(real_runs[1]).vector(names.THETA0)).all()


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        ("schema_version_string", "schema_version is '1', not an integer"),
        ("schema_version_negative", "schema_version is -1, not a version"),
        ("schema_version_newer", "schema version 99 is newer than this dynamics reads"),
        ("directory", "is a directory, not a run file"),
        ("config_list", "attribute 'config' is a JSON list, not a JSON object"),
        ("columns_not_json", "series/hidden_norms/norm has an attribute that is not valid JSON"),
        ("layout_without_shapes", "attribute 'layout' has no list of shapes"),
        ("step_deleted", "series/loss/step is missing"),
        ("step_2d", "series/loss/step has shape (6, 2), not 1 axes"),
        ("step_strings", "series/loss/step holds |S21, not integers"),
        ("norm_1d", "series/hidden_norms/norm names 2 columns, but its rows have shape ()"),
        ("norm_3d", "series/hidden_norms/norm names 2 columns, but its rows have shape (2, 1)"),
        ("series_complex", "series/loss/train holds complex64, not real numbers"),
        ("theta0_short", "vectors/theta0 has shape (165,), the parameter layout (168,)"),
        ("probe_batch_wrong_shape", "the rebuilt model cannot take the stored probe batch"),
    ],
)
def test_a_damaged_file_is_named_with_its_group_and_what_is_wrong(
    real_runs, tmp_path, capsys, mutation, message
):
    damaged = make_damaged(real_runs[1], mutation, tmp_path)
    html = str(tmp_path / "plane.html")
    argv = ["plane", str(damaged), str(real_runs[0]), "-o", html, "--grid", "3", "--processes", "1"]
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and damaged.name in stderr, stderr


def test_non_finite_vectors_and_snapshots_are_damage_not_values(real_runs, tmp_path):
    for mutation, message in [
        ("theta0_inf", "vectors/theta0 holds 168 non-finite entries of 168"),
        ("theta0_some_nan", "vectors/theta0 holds 84 non-finite entries"),
        ("g0_inf", "vectors/g0 holds 168 non-finite entries"),
        ("theta_final_nan", "vectors/theta_final is unwritten (NaN) though its step is stored"),
    ]:
        run = open_run(make_damaged(real_runs[1], mutation, tmp_path))
        name = message.split()[0].split("/")[1]
        with pytest.raises(DynamicsError, match=re.escape(message)):
            run.vector(name)
    run = open_run(make_damaged(real_runs[1], "snapshots_nan", tmp_path))
    with pytest.raises(DynamicsError, match="snapshots/theta holds non-finite parameters at step"):
        run.stored_states()


def test_a_run_killed_before_theta_final_neither_lists_nor_returns_it(real_runs, tmp_path):
    run = open_run(make_damaged(real_runs[1], "killed_before_theta_final", tmp_path))
    assert run.status().state == names.KILLED
    assert run.vector(names.THETA_FINAL) is None
    assert names.THETA_FINAL not in run.summary()["vectors"]
    assert names.THETA0 in run.summary()["vectors"]


def test_report_and_compare_read_a_directory_of_run_files(real_runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(real_runs[0].parent), "-o", str(out)]) == 0
    assert all(f">{run.stem}<" in out.read_text() for run in real_runs)  # both sections
    others = tmp_path / "others"
    others.mkdir()
    shutil.copyfile(real_runs[1], others / real_runs[1].name)
    compared = tmp_path / "compare.html"
    assert main(["compare", str(real_runs[0]), str(others), "-o", str(compared)]) == 0
    assert real_runs[1].stem in compared.read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty), "-o", str(tmp_path / "none.html")]) == 2
    assert "is a directory holding no run file" in capsys.readouterr().err


def test_a_file_being_created_is_read_once_it_is_whole(real_runs, tmp_path):
    """A reader arriving while a file is being created waits a moment for it, then reads it;
    a file that stays unreadable is one line after the short wait."""
    from dynamics.store.reader import LIVE_RETRY_S

    path = tmp_path / "live.h5"
    path.write_bytes(b"\x89HDF\r\n")  # what a reader can meet between two of HDF5's writes
    threading.Timer(0.3, shutil.copyfile, (real_runs[1], path)).start()
    assert open_run(path).groups == open_run(real_runs[1]).groups
    path.write_bytes(b"\x89HDF\r\n")
    started = time.monotonic()
    with pytest.raises(DynamicsError, match="not a readable run file"):
        open_run(path)
    assert time.monotonic() - started >= LIVE_RETRY_S


# ---------------------------------------------------------------------------------------------
# Untrusted files: read only in child processes, under a time and a memory limit

UNTRUSTED = damaged_runs.UNTRUSTED
#: The address space a reading command gets: torch and a plane of the tiny run fit in 2 GiB,
#: so a 64 GiB declared dataset or a 1 GiB chunk read whole cannot.
MEMORY_LIMIT = int(2.5 * 2**30)
#: Seconds each command may take on a crafted file (the child's start, torch's import, comes on
#: top): a refusal takes milliseconds, the tiny run's plane about one second.
COMMAND_SECONDS = 15
_PLANTED = """
import collections, pathlib
pathlib.Path("IMPORTED").write_text("the run file's module ran")
Batch = collections.namedtuple("Batch", ["x", "y"])
"""
_CHILD = r"""
import contextlib, io, json, resource, sys, time, warnings
limit, commands, results = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
warnings.simplefilter("ignore")
from dynamics.cli import main
answers = []
for argv in commands:
    stderr, started = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    answers.append({"argv": argv, "code": code, "stderr": stderr.getvalue(),
                    "seconds": time.monotonic() - started})
    with open(results, "w") as file:
        json.dump(answers, file)
"""


def _untrusted_commands(damaged: Path, good: Path, out: Path) -> list[list[str]]:
    commands = _commands(damaged, good, out)
    return [commands[name] for name in ("info", "overshoot", "report", "compare_reference")] + [
        commands["plane"]
    ]


def _regular_files(folder: Path) -> dict[str, str]:
    """Digests of the folder's regular files (a FIFO is never opened: it would block)."""
    return {p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file()}


def _read_in_child(tmp_path: Path, damaged: Path, good: Path) -> tuple[list[dict], str]:
    """Every command on ``damaged``, in a child process limited in memory and time, from a
    working directory holding a planted module; its answers and its stdout."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    (cwd / f"{damaged_runs.PLANTED_MODULE}.py").write_text(_PLANTED)
    results = tmp_path / "answers.json"
    commands = _untrusted_commands(damaged, good, out)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(MEMORY_LIMIT), json.dumps(commands), str(results)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60 + COMMAND_SECONDS * len(commands),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert not (cwd / "IMPORTED").exists(), "a module the run file named was imported"
    return json.loads(results.read_text()), child.stdout


@pytest.mark.parametrize("kind", list(UNTRUSTED))
def test_an_untrusted_file_is_refused_in_one_line_within_time_and_memory(real_runs, tmp_path, kind):
    folder = tmp_path / "runs"
    folder.mkdir()
    damaged = make_damaged(real_runs[1], kind, folder)
    refusal = UNTRUSTED[kind][1]
    before = _regular_files(folder), _digest(real_runs[0])
    answers, stdout = _read_in_child(tmp_path, damaged, real_runs[0])
    assert "Beautiful is better than ugly" not in stdout, "the module `this` was imported"
    assert len(answers) == len(_untrusted_commands(damaged, real_runs[0], tmp_path))
    for answer in answers:
        where = f"{answer['argv'][0]}: {answer['stderr']}"
        assert answer["seconds"] < COMMAND_SECONDS, where
        if refusal is not None:
            assert answer["code"] == 2 and refusal in answer["stderr"], where
        assert answer["code"] in (0, 2), where
        if answer["code"] == 2:
            assert answer["stderr"].startswith("dynamics"), where
            _assert_one_line(answer["stderr"])
    if refusal is not None:
        assert not list((tmp_path / "out").iterdir()), "a refused command left output"
    assert (_regular_files(folder), _digest(real_runs[0])) == before, "a reader changed a file"


def test_a_crafted_named_tuple_is_rebuilt_from_its_fields_alone(real_runs, tmp_path):
    from dynamics.model.probe_batch import probe_batch

    run = open_run(make_damaged(real_runs[1], "named_tuple_planted_module", tmp_path))
    batch = probe_batch(run)
    assert type(batch).__name__ == "Batch" and batch._fields == ("x", "y")
    assert type(batch).__module__ != damaged_runs.PLANTED_MODULE
    assert damaged_runs.PLANTED_MODULE not in sys.modules
    run = open_run(make_damaged(real_runs[1], "named_tuple_bad_fields", tmp_path))
    with pytest.raises(DynamicsError, match="not 256 or fewer distinct identifiers"):
        probe_batch(run)


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        ("status_pid_huge", "status/pid is 4611686018427387904, not a process id"),
        ("status_pid_zero", "status/pid is 0, not a process id"),
    ],
)
def test_a_status_pid_that_is_no_process_id_is_damage(
    real_runs, tmp_path, capsys, mutation, message
):
    damaged = make_damaged(real_runs[1], mutation, tmp_path)
    assert main(["info", str(damaged)]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr, stderr
    _assert_one_line(stderr)


def test_a_theta_final_step_that_is_no_step_is_damage(real_runs, tmp_path):
    for mutation, value in (("theta_final_step_inf", "inf"), ("theta_final_step_negative", "-3.0")):
        run = open_run(make_damaged(real_runs[1], mutation, tmp_path))
        with pytest.raises(DynamicsError, match=f"theta_final_step is {value}, not a step"):
            run.stored_states()


def test_a_live_runs_later_reads_retry_like_its_open(real_runs, tmp_path):
    """A reader that opened a live run and reads again while the writer is between two of
    HDF5's writes waits a moment for the file, as its open did."""
    path = tmp_path / "live.h5"
    shutil.copyfile(real_runs[1], path)
    run = open_run(path)
    path.write_bytes(b"\x89HDF\r\n")  # modified now: a live file, unreadable for a moment
    threading.Timer(0.3, shutil.copyfile, (real_runs[1], path)).start()
    assert run.status().state == names.FINISHED


def test_a_file_replaced_after_its_open_is_inspected_again(real_runs, tmp_path):
    """Each read opens the file anew, and each open inspects it: a run file swapped for one
    that keeps its data in another file is refused on the next read, not read."""
    path = tmp_path / "run.h5"
    shutil.copyfile(real_runs[1], path)
    run = open_run(path)
    (tmp_path / "crafted").mkdir()
    crafted = make_damaged(real_runs[1], "external_storage_text", tmp_path / "crafted")
    shutil.copyfile(crafted, path)
    with pytest.raises(DynamicsError, match="external storage"):
        run.series(names.LOSS)
