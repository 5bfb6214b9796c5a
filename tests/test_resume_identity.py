"""A resume continues only the checkpoint's own run file, recorded with the same probes: other
files and other probes are refused at fit start in one line and left byte for byte as they
were; a run moved or copied to another path is followed, with a warning; a checkpoint without
recorder state never turns into a new file silently."""

import hashlib
import shutil
import warnings

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    HessianSpectrum,
    HiddenStateNorms,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.store import RunFileError, names

ARCH = dict(width=8, expansion=2, depth=2)
_X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
FULL_BATCH = DataLoader(TensorDataset(_X, _X.flip(-1)), batch_size=32)
STEPS = 6


class CountBatches(pl.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_start(self, *args):
        self.batches += 1


def fit(
    quiet_trainer, path, probes=None, ckpt=None, checkpoints=None, seed=0, counter=None, **recorder
):
    """A 6-step full-batch fit saving a checkpoint at step 3 into ``checkpoints``."""
    callbacks = [counter or CountBatches()]
    if path is not None:
        probes = [TrainingLoss()] if probes is None else probes
        callbacks.append(DynamicsRecorder(path, probes, flush_interval_s=1e9, **recorder))
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(checkpoints, every_n_train_steps=3, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=STEPS, enable_checkpointing=checkpoints is not None, callbacks=callbacks
    )
    trainer.fit(TeacherStudentModule(**ARCH, seed=seed), FULL_BATCH, ckpt_path=ckpt)


def recorded_run(quiet_trainer, tmp_path, probes=None, name="run.h5"):
    """A finished run and its checkpoint at step 3."""
    path = tmp_path / name
    fit(quiet_trainer, path, probes, checkpoints=tmp_path / "ckpt")
    return path, tmp_path / "ckpt" / "epoch=2-step=3.ckpt"


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(quiet_trainer, path, match, **kwargs):
    """Resume and expect a one-line refusal that leaves ``path`` as it was; the message."""
    before = digest(path) if path.exists() else None
    with pytest.raises(RunFileError, match=match) as error:
        fit(quiet_trainer, path, **kwargs)
    assert "\n" not in str(error.value)
    assert (digest(path) if path.exists() else None) == before
    return str(error.value)


def losses(path):
    series = open_run(path).series(names.LOSS)
    return series.step, series[names.LOSS_TRAIN]


# --- item 4: other probes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "before, after, change",
    [
        ([TrainingLoss], [TrainingLoss, HiddenStateNorms], "added HiddenStateNorms"),
        ([TrainingLoss, HiddenStateNorms], [TrainingLoss], "left out HiddenStateNorms"),
    ],
)
def test_a_resume_with_other_probes_is_refused_at_fit_start(
    tmp_path, quiet_trainer, before, after, change
):
    path, ckpt = recorded_run(quiet_trainer, tmp_path, [p() for p in before])
    rows = len(open_run(path).series(names.LOSS))
    counter = CountBatches()
    message = refused(
        quiet_trainer, path, change, probes=[p() for p in after], ckpt=ckpt, counter=counter
    )
    assert message.startswith(f"cannot resume {path}: its run was recorded with the probes")
    assert counter.batches == 0  # refused at fit start, before the sanity check and training
    run = open_run(path)
    assert len(run.series(names.LOSS)) == rows == STEPS
    assert run.status().state == names.FINISHED


@pytest.mark.parametrize(
    "before, after, difference",
    [
        (
            lambda: ParameterDisplacement(snapshot_every_n_steps=2),
            lambda: ParameterDisplacement(snapshot_budget_mb=0),
            r"series group 'snapshots' \(in the file, not declared\)",
        ),
        (
            lambda: ParameterDisplacement(snapshot_budget_mb=0),
            lambda: ParameterDisplacement(snapshot_every_n_steps=2),
            r"series group 'snapshots' \(not in the file\)",
        ),
        (
            lambda: HessianSpectrum(k=2, every_n_steps=3),
            lambda: HessianSpectrum(k=3, every_n_steps=3),
            r"hessian/eigenvalues \(declared \(3,\) float\d+, the file's \(2,\)",
        ),
    ],
)
def test_a_resume_whose_probes_declare_other_series_is_refused_before_any_write(
    tmp_path, quiet_trainer, before, after, difference
):
    path, ckpt = recorded_run(quiet_trainer, tmp_path, [TrainingLoss(), before()])
    refused(quiet_trainer, path, difference, probes=[TrainingLoss(), after()], ckpt=ckpt)
    assert open_run(path).status().state == names.FINISHED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "run.h5"]


# --- item 5: the checkpoint's own file -----------------------------------------------------


def test_a_file_replaced_by_another_run_is_refused(tmp_path, quiet_trainer):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    other = tmp_path / "other.h5"
    fit(quiet_trainer, other, seed=1)  # another θ0
    shutil.copy(other, path)
    message = refused(quiet_trainer, path, "not the file this checkpoint's fit wrote", ckpt=ckpt)
    assert "another θ0" in message


def test_a_relative_path_to_the_same_file_resumes_it_quietly(tmp_path, quiet_trainer, monkeypatch):
    straight = tmp_path / "straight.h5"
    fit(quiet_trainer, straight)
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    run_id = open_run(path).attrs[names.ATTR_RUN_ID]
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(quiet_trainer, "run.h5", ckpt=ckpt)
    assert not [w for w in caught if "continues at" in str(w.message)]
    assert open_run(path).attrs[names.ATTR_RUN_ID] == run_id
    np.testing.assert_array_equal(losses(path)[1], losses(straight)[1])


@pytest.mark.parametrize("how", ["moved folder", "copy"])
def test_a_run_at_another_path_is_followed_with_a_warning(tmp_path, quiet_trainer, how):
    straight = tmp_path / "straight.h5"
    fit(quiet_trainer, straight)
    (tmp_path / "a").mkdir()
    path, ckpt = recorded_run(quiet_trainer, tmp_path / "a")
    run_id = open_run(path).attrs[names.ATTR_RUN_ID]
    if how == "moved folder":
        shutil.move(tmp_path / "a", tmp_path / "b")
        ckpt, new = tmp_path / "b" / "ckpt" / ckpt.name, tmp_path / "b" / "run.h5"
    else:
        new = tmp_path / "a" / "copy.h5"
        shutil.copy(path, new)
        original = digest(path)
    with pytest.warns(UserWarning, match=f"fit wrote at {path}: the run continues at {new}"):
        fit(quiet_trainer, new, ckpt=ckpt)
    run = open_run(new)
    assert run.attrs[names.ATTR_RUN_ID] == run_id
    assert run.status().state == names.FINISHED
    np.testing.assert_array_equal(losses(new)[0], np.arange(STEPS))
    np.testing.assert_array_equal(losses(new)[1], losses(straight)[1])
    assert [e.probe for e in run.events()] == [names.EVENT_RECORDER]
    if how == "copy":
        assert digest(path) == original  # the original is not touched


def test_another_run_at_another_path_is_refused_naming_the_checkpoints_file(
    tmp_path, quiet_trainer
):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    other = tmp_path / "other.h5"
    fit(quiet_trainer, other)  # same θ0, another run
    message = refused(quiet_trainer, other, "not the file this checkpoint's fit wrote", ckpt=ckpt)
    assert message.endswith(f"(the checkpoint's fit wrote {path})")


def test_a_checkpoint_without_recorder_state_never_continues_a_file_silently(
    tmp_path, quiet_trainer
):
    fit(quiet_trainer, None, checkpoints=tmp_path / "ckpt")  # a fit without the recorder
    ckpt = tmp_path / "ckpt" / "epoch=2-step=3.ckpt"
    path = tmp_path / "run.h5"
    fit(quiet_trainer, path)
    message = refused(
        quiet_trainer, path, r"holds no DynamicsRecorder state .* overwrite=True", ckpt=ckpt
    )
    assert "cannot continue that run file" in message

    new = tmp_path / "new.h5"
    with pytest.warns(UserWarning, match="θ0 is the parameters at step 3 the checkpoint restored"):
        fit(quiet_trainer, new, ckpt=ckpt)
    run = open_run(new)
    np.testing.assert_array_equal(run.series(names.LOSS).step, [3, 4, 5])
    (event,) = run.events()
    assert (event.step, event.probe, event.kind) == (3, names.EVENT_RECORDER, names.EVENT_WARNING)
    assert "not the initialization" in event.message


# --- files and checkpoints of an older dynamics --------------------------------------------


def strip_identity(path, ckpt, checkpoint_keeps_hash):
    """Make ``path`` a file from before run ids and ``ckpt`` a checkpoint from before
    identities (or, with ``checkpoint_keeps_hash``, one that kept θ0's hash only)."""
    with h5py.File(path, "r+") as file:
        theta0 = file.attrs[names.ATTR_THETA0_SHA256]
        del file.attrs[names.ATTR_RUN_ID]
    checkpoint = torch.load(ckpt, weights_only=True)
    (state,) = [s for k, s in checkpoint["callbacks"].items() if k.startswith("DynamicsRecorder")]
    for key in ("run", "rows", "groups"):
        del state[key]
    if checkpoint_keeps_hash:
        state["run"] = {"run_id": None, "theta0_sha256": theta0}
    torch.save(checkpoint, ckpt)


@pytest.mark.parametrize("checkpoint_keeps_hash", [False, True])
def test_an_old_file_without_run_id_resumes_saying_how_it_was_identified(
    tmp_path, quiet_trainer, checkpoint_keeps_hash
):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    strip_identity(path, ckpt, checkpoint_keeps_hash)
    said = "θ0's hash" if checkpoint_keeps_hash else "keeps no run identity"
    with pytest.warns(UserWarning, match=said):
        fit(quiet_trainer, path, ckpt=ckpt)
    run = open_run(path)
    assert run.status().state == names.FINISHED
    np.testing.assert_array_equal(losses(path)[0], np.arange(STEPS))
    assert isinstance(run.attrs[names.ATTR_RUN_ID], str)  # it has one now


def test_an_old_checkpoint_onto_another_path_is_refused(tmp_path, quiet_trainer):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    strip_identity(path, ckpt, checkpoint_keeps_hash=False)
    copy = tmp_path / "copy.h5"
    shutil.copy(path, copy)
    refused(quiet_trainer, copy, "keeps no run identity that could prove", ckpt=ckpt)


def test_an_old_file_of_another_theta0_is_refused_by_its_hash(tmp_path, quiet_trainer):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    strip_identity(path, ckpt, checkpoint_keeps_hash=True)
    other = tmp_path / "other.h5"
    fit(quiet_trainer, other, seed=1)
    with h5py.File(other, "r+") as file:
        del file.attrs[names.ATTR_RUN_ID]
    shutil.copy(other, path)
    message = refused(quiet_trainer, path, "not the file this checkpoint's fit wrote", ckpt=ckpt)
    assert "another θ0" in message


def test_under_ddp_a_refused_resume_stops_every_rank_and_a_right_one_continues(
    tmp_path, quiet_trainer
):
    path = tmp_path / "ddp.h5"

    def ddp_fit(probes, ckpt=None):
        checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        recorder = DynamicsRecorder(path, probes, flush_interval_s=1e9)
        trainer = quiet_trainer(
            max_steps=STEPS,
            strategy="ddp_fork",
            devices=2,
            enable_checkpointing=True,
            callbacks=[recorder, checkpoint],
        )
        data = TeacherStudentData(**ARCH, batch_size=8)
        trainer.fit(TeacherStudentModule(**ARCH), data, ckpt_path=ckpt)

    ddp_fit([TrainingLoss(), ParameterDisplacement(snapshot_budget_mb=0)])
    ckpt, before = tmp_path / "ckpt" / "epoch=0-step=3.ckpt", digest(path)
    # Refused on rank zero at the first batch: the other rank stops too (a worker's error comes
    # back wrapped by the fork launcher).
    with pytest.raises(Exception, match=r"series group 'snapshots' \(not in the file\)"):
        ddp_fit([TrainingLoss(), ParameterDisplacement(snapshot_every_n_steps=2)], ckpt)
    assert digest(path) == before
    ddp_fit([TrainingLoss(), ParameterDisplacement(snapshot_budget_mb=0)], ckpt)
    run = open_run(path)
    assert run.status().state == names.FINISHED
    np.testing.assert_array_equal(losses(path)[0], np.arange(STEPS))


def test_a_checkpoint_saved_after_the_fit_keeps_the_files_identity(tmp_path, quiet_trainer):
    path = tmp_path / "run.h5"
    recorder = DynamicsRecorder(path, [TrainingLoss(), ParameterDisplacement()])
    trainer = quiet_trainer(max_steps=3, callbacks=[recorder])
    trainer.fit(TeacherStudentModule(**ARCH), FULL_BATCH)
    trainer.save_checkpoint(tmp_path / "end.ckpt")  # after the writer closed
    (state,) = [
        s
        for k, s in torch.load(tmp_path / "end.ckpt", weights_only=True)["callbacks"].items()
        if k.startswith("DynamicsRecorder")
    ]
    assert state["run"]["run_id"] == open_run(path).attrs[names.ATTR_RUN_ID]
    assert state["rows"]["loss"] == 3 and state["groups"]["displacement"] == "displacement"
    other = tmp_path / "other.h5"
    fit(quiet_trainer, other)  # same θ0, another run
    shutil.copy(other, path)
    refused(
        quiet_trainer, path, "not the file this checkpoint's fit wrote", ckpt=tmp_path / "end.ckpt"
    )


def test_the_runs_own_file_missing_a_row_before_the_checkpoint_is_refused(tmp_path, quiet_trainer):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    with h5py.File(path, "r+") as file:  # drop the row of step 1: steps 0, 2, 3, 4, 5
        for dataset in file["series/loss"].values():
            values = np.delete(dataset[:], 1, axis=0)
            dataset.resize(len(values), axis=0)
            dataset[:] = values
    refused(quiet_trainer, path, r"holds 2 rows of 'loss' through step 2, .* counted 3", ckpt=ckpt)


@pytest.mark.parametrize(
    "entry, value", [("run", "abc"), ("last_step", "x"), ("rows", {"loss": [1]})]
)
def test_an_edited_checkpoint_state_is_refused_in_one_line(tmp_path, quiet_trainer, entry, value):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    checkpoint = torch.load(ckpt, weights_only=False)
    (state,) = (v for k, v in checkpoint["callbacks"].items() if "DynamicsRecorder" in k)
    state[entry] = value
    torch.save(checkpoint, ckpt)
    message = refused(quiet_trainer, path, "edited or damaged checkpoint", ckpt=ckpt)
    assert repr(entry) in message


def test_a_read_only_run_file_is_refused_not_rewritten(tmp_path, quiet_trainer):
    path, ckpt = recorded_run(quiet_trainer, tmp_path)
    path.chmod(0o444)
    refused(quiet_trainer, path, "read-only", ckpt=ckpt)
    assert path.stat().st_mode & 0o777 == 0o444
