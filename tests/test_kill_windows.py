"""A writer killed at any point of overwriting or resuming a run file leaves the path holding a
readable run file, the old one or the new one, never a file nothing can open.

Each case forks a real Lightning fit whose writer kills itself (SIGKILL) at one named point of
the sequence (``dynamics.store.writer._reached``, a hook only tests replace), then reads the
path as a user would (``open_run``, ``dynamics info``) and finishes the run with a fit that
succeeds.
"""

import hashlib
import multiprocessing
import os
import signal

import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import dynamics.store.writer as writer_module
from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, TrainingLoss
from dynamics.experiments import TeacherStudentModule
from dynamics.store import names

ARCH = dict(width=8, expansion=2, depth=2)
_X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
FULL_BATCH = DataLoader(TensorDataset(_X, _X.flip(-1)), batch_size=32)

#: Every point of creating (overwriting) and of resuming a file, in order; the file is renamed
#: into place at "renamed".
CREATE_POINTS = ("staged", "opened", "swmr", "renamed")
RESUME_POINTS = ("copied", "opened", "swmr", "renamed")


def fit(quiet_trainer, path, max_steps, ckpt_path=None, overwrite=False):
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(path.with_suffix(""), every_n_train_steps=3, save_top_k=-1)
    recorder = DynamicsRecorder(path, [TrainingLoss()], overwrite=overwrite, flush_interval_s=1e9)
    trainer = quiet_trainer(
        max_steps=max_steps, enable_checkpointing=True, callbacks=[recorder, checkpoint]
    )
    trainer.fit(TeacherStudentModule(**ARCH), FULL_BATCH, ckpt_path=ckpt_path)


def _killed_at(point, *args, **kwargs):
    def kill_there(reached):
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    writer_module._reached = kill_there
    fit(*args, **kwargs)


def fit_killed_at(point, *args, **kwargs):
    """Run :func:`fit` in a forked process killed at ``point``; fails if it was not."""
    process = multiprocessing.get_context("fork").Process(
        target=_killed_at, args=(point, *args), kwargs=kwargs
    )
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL, f"not killed at {point!r}: {process.exitcode}"


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_readable(path, dynamics):
    """The path holds a run file every reader opens; its run."""
    run = open_run(path)
    info = dynamics("info", path)
    assert info.returncode == 0, info.stderr
    assert "Traceback" not in info.stderr
    return run


def loss_steps(path):
    return list(open_run(path).series(names.LOSS).step)


@pytest.mark.parametrize("point", CREATE_POINTS)
def test_an_overwrite_killed_at_each_point_leaves_the_old_run_or_the_new(
    tmp_path, point, quiet_trainer, dynamics
):
    path = tmp_path / "run.h5"
    fit(quiet_trainer, path, 4)
    old, old_id = digest(path), open_run(path).attrs[names.ATTR_RUN_ID]

    fit_killed_at(point, quiet_trainer, path, 2, overwrite=True)
    run = assert_readable(path, dynamics)
    if CREATE_POINTS.index(point) < CREATE_POINTS.index("renamed"):
        assert digest(path) == old  # the old run, untouched
        assert run.status().state == names.FINISHED
    else:
        assert run.attrs[names.ATTR_RUN_ID] != old_id  # the new run, killed before any row
        assert run.status().state == names.KILLED
        assert run.recorded(names.LOSS) is None

    # The next run on that path succeeds and clears the leftovers.
    fit(quiet_trainer, path, 2, overwrite=True)
    assert loss_steps(path) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.h5"]


@pytest.mark.parametrize("point", RESUME_POINTS)
def test_a_resume_killed_at_each_point_leaves_the_run_readable_and_resumable(
    tmp_path, point, quiet_trainer, dynamics
):
    path = tmp_path / "run.h5"
    fit(quiet_trainer, path, 6)
    old, old_id = digest(path), open_run(path).attrs[names.ATTR_RUN_ID]
    straight = open_run(path).series(names.LOSS)[names.LOSS_TRAIN]
    checkpoint = tmp_path / "run" / "epoch=2-step=3.ckpt"

    fit_killed_at(point, quiet_trainer, path, 6, ckpt_path=checkpoint)
    run = assert_readable(path, dynamics)
    assert run.attrs[names.ATTR_RUN_ID] == old_id  # a resume keeps the run
    if RESUME_POINTS.index(point) < RESUME_POINTS.index("renamed"):
        assert digest(path) == old
        assert run.status().state == names.FINISHED
    else:  # the file cut back to the checkpoint, its resumed writer killed
        assert loss_steps(path) == [0, 1, 2]
        assert run.status().state == names.KILLED

    fit(quiet_trainer, path, 6, ckpt_path=checkpoint)  # resumable still, from the same checkpoint
    resumed = open_run(path)
    assert resumed.status().state == names.FINISHED
    np.testing.assert_array_equal(resumed.series(names.LOSS)[names.LOSS_TRAIN], straight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.h5"]
