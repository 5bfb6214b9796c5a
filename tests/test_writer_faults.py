"""A run file never lies, whatever stops its writer: another writer, a reader holding the old
file, a full disk, a kill during validation, an exception in a DDP worker."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from pytorch_lightning.demos.boring_classes import BoringModel

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, TrainingLoss
from dynamics.store import RunFileError, RunWriter, SeriesSpec

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dynamics.store import RunWriter, SeriesSpec
    writer = RunWriter.create(sys.argv[1], {"loss": {"train": SeriesSpec()}}, {}, {})
    for step in range(3):
        writer.append("loss", step, {"train": float(step)})
    writer.flush()
    print("writing", flush=True)
    time.sleep(60)
    """
)


def _loss_steps(path: Path) -> np.ndarray:
    return open_run(path).series("loss").step


def test_a_path_another_live_run_writes_is_refused_at_fit_start_in_one_line(
    tmp_path, quiet_trainer
):
    path = tmp_path / "run.h5"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "writing"
        recorder = DynamicsRecorder(path, [TrainingLoss()], overwrite=True)
        with pytest.raises(RunFileError) as refused:
            quiet_trainer(max_steps=2, callbacks=[recorder]).fit(BoringModel())
        message = str(refused.value)
        assert f"being written by another run (pid {holder.pid} on " in message
        assert "\n" not in message
        np.testing.assert_array_equal(_loss_steps(path), [0, 1, 2])  # the live run's file
    finally:
        holder.kill()
        holder.wait()
    # A killed writer holds nothing: the kernel dropped its lock.
    quiet_trainer(max_steps=2, callbacks=[DynamicsRecorder(path, overwrite=True)]).fit(
        BoringModel()
    )
    np.testing.assert_array_equal(_loss_steps(path), [0, 1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


RACING_FIT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import pytorch_lightning as pl
    from pytorch_lightning.demos.boring_classes import BoringModel
    sys.path.insert(0, sys.argv[3])
    from conftest import make_quiet_trainer
    from dynamics.callbacks import DynamicsRecorder

    me, other = Path(sys.argv[2]), Path(sys.argv[4])

    class WaitForTheOther(pl.Callback):
        # Runs after the recorder claimed the path: the other run tries while this one holds it.
        def on_fit_start(self, trainer, pl_module):
            deadline = time.monotonic() + 120
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    outcome = "trained"
    try:
        recorder = DynamicsRecorder(sys.argv[1], overwrite=True)
        trainer = make_quiet_trainer(max_steps=5, callbacks=[recorder, WaitForTheOther()])
        trainer.fit(BoringModel())
    except Exception as error:
        outcome = f"refused: {error}"
    finally:
        me.write_text(outcome)
    """
)


def test_two_runs_started_at_once_on_one_path_one_trains_and_one_is_refused(tmp_path):
    path, tests = tmp_path / "run.h5", Path(__file__).parent
    outcomes = [tmp_path / "first", tmp_path / "second"]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_FIT, str(path), str(mine), str(tests), str(theirs)]
        )
        for mine, theirs in (outcomes, outcomes[::-1])
    ]
    codes = [run.wait(timeout=300) for run in runs]
    assert codes == [0, 0]
    said = sorted(outcome.read_text() for outcome in outcomes)
    winner = runs[[o.read_text() for o in outcomes].index("trained")]
    assert said[0].startswith(f"refused: {path} is being written by another run (pid {winner.pid}")
    assert said[1] == "trained"
    run = open_run(path)
    assert run.status().state == "finished"
    np.testing.assert_array_equal(run.series("loss").step, np.arange(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "run.h5", "second"]


def test_two_writers_in_one_process_are_refused_too(tmp_path):
    path = tmp_path / "run.h5"
    first = RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, {})
    with pytest.raises(RunFileError, match=f"pid {os.getpid()} on "):
        RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, {}, overwrite=True)
    first.append("loss", 0, {"train": 1.0})
    first.close()
    assert open_run(path).status().state == "finished"
    np.testing.assert_array_equal(_loss_steps(path), [0])


def test_an_overwrite_while_a_reader_holds_the_old_file_keeps_it_until_the_new_one_exists(
    tmp_path, quiet_trainer
):
    path = tmp_path / "run.h5"
    quiet_trainer(max_steps=5, callbacks=[DynamicsRecorder(path)]).fit(BoringModel())
    with h5py.File(path, "r") as reader:
        recorder = DynamicsRecorder(path, [TrainingLoss()], overwrite=True)
        quiet_trainer(max_steps=2, callbacks=[recorder]).fit(BoringModel())
        # The reader still reads the old run, whole; the path holds the new one.
        np.testing.assert_array_equal(reader["series/loss/step"][:], np.arange(5))
        assert {"hidden_norms", "displacement"} <= set(reader["series"])
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, [0, 1])
    assert run.groups == ("loss",) and run.status().state == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


FULL_DISK_FIT = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    from pytorch_lightning.demos.boring_classes import BoringModel
    sys.path.insert(0, sys.argv[3])
    from conftest import make_quiet_trainer
    from dynamics.callbacks import DynamicsRecorder, Probe, SeriesSpec

    class Wide(Probe):
        name = "wide"
        def series(self):
            return {"wide": {"v": SeriesSpec((16384,))}}
        def on_step_end(self, trainer, pl_module, batch, outputs, step):
            return {"wide": {"v": np.full(16384, float(step))}}

    if sys.argv[2] != "tmpfs":  # no tmpfs to fill: the same write failure, from a file size cap
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
    recorder = DynamicsRecorder(sys.argv[1], [Wide()], flush_interval_s=0.0, block_rows=4)
    trainer = make_quiet_trainer(max_steps=60, callbacks=[recorder])
    trainer.fit(BoringModel())
    print("trained", trainer.global_step, flush=True)
    """
)


@pytest.fixture(params=["tmpfs", "size cap"])
def small_disk(request, tmp_path):
    """A folder where writing stops at 2 MiB, and how the fit fills it: a small tmpfs
    (``ENOSPC``; needs root) or a file size cap (``EFBIG``, where writes straddling the cap
    leave a file shorter than its recorded end)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if request.param == "size cap":
        yield folder, str(2 << 20)
        return
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield folder, "tmpfs"
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_stops_the_recording_not_the_training_and_keeps_only_true_rows(small_disk):
    folder, fill = small_disk
    path = folder / "run.h5"
    tests = Path(__file__).parent
    fit = subprocess.run(
        [sys.executable, "-c", FULL_DISK_FIT, str(path), fill, str(tests)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "trained 60" in fit.stdout
    assert fit.stderr.count("recording stopped") == 1, fit.stderr[-3000:]
    run = open_run(path)
    rows = run.series("wide")
    assert 0 < len(rows) < 60
    np.testing.assert_array_equal(rows.step, np.arange(len(rows)))
    # Every row read is a row written: its values are its step, never a fill value.
    np.testing.assert_array_equal(rows["v"], np.repeat(rows.step[:, None], 16384, axis=1))
    assert run.status().state in ("crashed", "killed")  # never "finished" or "running"


def test_a_file_the_disk_cannot_take_is_refused_in_one_line_and_leaves_nothing(tmp_path):
    path = tmp_path / "run.h5"
    create = textwrap.dedent(
        """
        import resource, signal, sys
        from dynamics.store import RunFileError, RunWriter, SeriesSpec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            RunWriter.create(sys.argv[1], {"loss": {"train": SeriesSpec()}}, {}, {})
        except RunFileError as error:
            print(error)
        """
    )
    made = subprocess.run(
        [sys.executable, "-c", create, str(path)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout == f"cannot create {path}: File too large\n"
    assert list(tmp_path.iterdir()) == []


SLOW_VALIDATION_FIT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pytorch_lightning.demos.boring_classes import BoringModel
    sys.path.insert(0, sys.argv[3])
    from conftest import make_quiet_trainer
    from dynamics.callbacks import DynamicsRecorder, TrainingLoss

    class SlowValidation(BoringModel):
        def validation_step(self, batch, batch_idx):
            Path(sys.argv[2]).touch()
            time.sleep(120)

    trainer = make_quiet_trainer(
        max_steps=100, val_check_interval=10, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[DynamicsRecorder(sys.argv[1], [TrainingLoss()])],  # the default interval
    )
    trainer.fit(SlowValidation())
    """
)


def test_a_kill_during_validation_keeps_every_row_recorded_before_it(tmp_path):
    path, validating = tmp_path / "run.h5", tmp_path / "validating"
    tests = Path(__file__).parent
    fit = subprocess.Popen(
        [sys.executable, "-c", SLOW_VALIDATION_FIT, str(path), str(validating), str(tests)]
    )
    try:
        deadline = time.monotonic() + 120
        while not validating.exists() and fit.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert validating.exists()
    finally:
        os.kill(fit.pid, signal.SIGKILL)
        fit.wait()
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(10))
    assert run.status().state == "killed" and run.status().last_step == 9


class FailsAtStepFive(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 5:
            raise FloatingPointError("loss diverged")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_an_exception_in_a_ddp_worker_keeps_the_rows_and_closes_the_file_as_crashed(
    tmp_path, quiet_trainer, strategy, monkeypatch
):
    # Spawned workers take the parent's sys.path and import this module to rebuild the model.
    monkeypatch.setattr(sys, "path", [*sys.path, str(Path(__file__).parents[1])])
    path = tmp_path / "run.h5"
    recorder = DynamicsRecorder(path, [TrainingLoss()])  # the default flush interval
    trainer = quiet_trainer(max_steps=20, strategy=strategy, devices=2, callbacks=[recorder])
    with pytest.raises(Exception, match="loss diverged"):
        trainer.fit(FailsAtStepFive())
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(5))
    status = run.status()
    assert status.state == "crashed" and status.last_step == 4
    assert status.exception == "FloatingPointError: loss diverged"
    with h5py.File(path, "r") as file:  # closed: a plain open refuses a file still open
        assert file["status/state"][()] == b"crashed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


def test_a_write_failure_the_disk_recovers_from_is_recorded_in_the_file(tmp_path, monkeypatch):
    path = tmp_path / "run.h5"
    writer = RunWriter.create(path, {"loss": {"train": SeriesSpec()}}, {}, {})
    for step in range(3):
        writer.append("loss", step, {"train": float(step)})
    writer.flush()
    writer.append("loss", 3, {"train": 3.0})
    flush = h5py.File.flush
    failures = iter([OSError("Can't write data (error message = 'No space left on device')")])

    def flush_failing_once(file):
        error = next(failures, None)
        if error is not None:
            raise error
        flush(file)

    monkeypatch.setattr(h5py.File, "flush", flush_failing_once)
    with pytest.warns(RuntimeWarning, match="recording stopped at step 3: .*No space left"):
        writer.flush()
    writer.append("loss", 4, {"train": 4.0})  # ignored from now on, without a word
    writer.close()
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, [0, 1, 2])
    assert [(e.step, e.probe, e.kind, e.message) for e in run.events()] == [
        (3, "writer", "error", "No space left on device")
    ]
    status = run.status()
    assert (status.state, status.exception) == (
        "crashed",
        "recording stopped: No space left on device",
    )
