"""Resuming a recorded fit from a checkpoint: every probe continues as if never stopped, and a
file that is not the run's whole file is refused in one line and left as it was."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    HessianSpectrum,
    HiddenStateNorms,
    ParameterDisplacement,
    ProbeUnavailable,
    TrainingLoss,
)
from dynamics.callbacks.probe_loss import ProbeLoss
from dynamics.experiments import TeacherStudentModule
from dynamics.geometry.plane import plane_from_gradients
from dynamics.params.vectors import parameter_vector
from dynamics.store import RunFileError

ARCH = dict(width=8, expansion=2, depth=2)
# Full-batch training, so a resumed fit sees exactly the batches an uninterrupted one does.
_X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
FULL_BATCH = DataLoader(TensorDataset(_X, _X.flip(-1)), batch_size=32)


def every_probe(plane):
    return [
        TrainingLoss(),
        HiddenStateNorms(),
        ParameterDisplacement(snapshot_every_n_steps=2),
        HessianSpectrum(k=2, every_n_steps=3, warm_start=True),
        plane,
    ]


def fit(tmp_path, path, probes, max_steps, ckpt_path=None, quiet_trainer=None):
    checkpoint = ModelCheckpoint(tmp_path / path.stem, every_n_train_steps=5, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[DynamicsRecorder(path, probes, flush_interval_s=1e9), checkpoint],
    )
    trainer.fit(TeacherStudentModule(**ARCH), FULL_BATCH, ckpt_path=ckpt_path)


def plane_probe(kind, tmp_path, quiet_trainer):
    if kind == "partner":
        partner = tmp_path / "partner.h5"
        other_batch = (_X[:16], -_X[:16])  # another g0 at the same θ0
        fit(tmp_path, partner, [GradientPlane(batch=other_batch)], 1, quiet_trainer=quiet_trainer)
        return lambda: GradientPlane(partner=partner)
    theta0 = parameter_vector(TeacherStudentModule(**ARCH)).double().numpy()
    rng = np.random.default_rng(0)
    basis = plane_from_gradients(theta0, rng.normal(size=theta0.size), rng.normal(size=theta0.size))
    return lambda: GradientPlane(basis=basis, at_end=True, grid=4, checkpoints=3)


@pytest.mark.parametrize("kind", ["basis", "partner"])
def test_resume_with_every_probe_under_default_checkpoint_loading(tmp_path, quiet_trainer, kind):
    plane = plane_probe(kind, tmp_path, quiet_trainer)
    straight, resumed = tmp_path / "straight.h5", tmp_path / "resumed.h5"
    fit(tmp_path, straight, every_probe(plane()), 10, quiet_trainer=quiet_trainer)
    fit(tmp_path, resumed, every_probe(plane()), 8, quiet_trainer=quiet_trainer)
    checkpoint = tmp_path / "resumed" / "epoch=4-step=5.ckpt"
    # What Lightning's default load does in this torch: tensors and plain values only.
    callbacks = torch.load(checkpoint, weights_only=True)["callbacks"]
    (state,) = [s for key, s in callbacks.items() if key.startswith("DynamicsRecorder")]
    assert "ritz" in state["probes"]["hessian"]  # the warm start of the row at step 6
    fit(tmp_path, resumed, every_probe(plane()), 10, checkpoint, quiet_trainer)

    a, b = open_run(straight), open_run(resumed)
    assert set(a.groups) == set(b.groups) >= {"loss", "hessian", "plane", "snapshots"}
    np.testing.assert_array_equal(a.series("hessian").step, [0, 3, 6, 9])
    # Bit-equal: the resumed fit restores the parameters, optimizer, probe batch and warm-start
    # vectors exactly, and every measurement is a deterministic function of them on the CPU.
    for group in a.groups:
        np.testing.assert_array_equal(a.series(group).step, b.series(group).step, err_msg=group)
        for name, values in a.series(group).values.items():
            np.testing.assert_array_equal(values, b.series(group)[name], err_msg=f"{group}/{name}")
    assert set(a.vector_names) == set(b.vector_names)
    if kind == "basis":
        assert "plane_end.plane.losses" in a.vector_names
    for name in a.vector_names:
        np.testing.assert_array_equal(a.vector(name), b.vector(name), err_msg=name)


def test_resume_refuses_another_runs_file_and_one_that_lost_rows(tmp_path, quiet_trainer):
    probes = [TrainingLoss()]
    path = tmp_path / "run.h5"
    fit(tmp_path, path, probes, 8, quiet_trainer=quiet_trainer)
    kept = tmp_path / "kept.h5"
    shutil.copy(path, kept)
    other = tmp_path / "other.h5"
    fit(tmp_path, other, probes, 3, quiet_trainer=quiet_trainer)  # another run, same θ0
    checkpoint = tmp_path / "run" / "epoch=4-step=5.ckpt"
    shutil.copy(other, path)
    before = digest(path)
    with pytest.raises(RunFileError, match=r"not the file this checkpoint's fit wrote: .*same θ0"):
        fit(tmp_path, path, probes, 10, checkpoint, quiet_trainer)
    assert digest(path) == before
    # The run's own file, cut back to 3 rows: its id is right, its rows are not.
    shutil.copy(kept, path)
    with h5py.File(path, "r+") as file:
        for dataset in file["series/loss"].values():
            dataset.resize(3, axis=0)
    before = digest(path)
    with pytest.raises(
        RunFileError, match=r"holds rows through step 2 of 'loss'.*step 4 as written"
    ):
        fit(tmp_path, path, probes, 10, checkpoint, quiet_trainer)
    assert digest(path) == before
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == ["kept.h5", "other.h5", "run.h5"]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


RESUME_EACH = textwrap.dedent(
    """
    import json, sys
    from dynamics.errors import DynamicsError
    from dynamics.store import RunWriter
    for path in sys.argv[1:]:
        try:
            RunWriter.resume(path, {"loss": 3})
            print(json.dumps([path, "resumed"]), flush=True)
        except DynamicsError as error:
            print(json.dumps([path, str(error)]), flush=True)
    """
)


def test_resume_refuses_cut_and_foreign_files_and_leaves_them_as_they_were(tmp_path, quiet_trainer):
    fit(tmp_path, tmp_path / "real.h5", [TrainingLoss()], 6, quiet_trainer=quiet_trainer)
    real = (tmp_path / "real.h5").read_bytes()
    folder = tmp_path / "files"
    folder.mkdir()
    files = {}
    for fraction in (0.05, 0.3, 0.5, 0.8, 0.99):
        path = folder / f"cut{fraction}.h5"
        path.write_bytes(real)
        os.truncate(path, int(len(real) * fraction))
        files[path] = "truncated"
    with h5py.File(folder / "foreign.h5", "w") as foreign:
        foreign["x"] = np.arange(5)
        foreign.create_group("series")
    files[folder / "foreign.h5"] = "not a dynamics run file"
    (folder / "random.h5").write_bytes(np.random.default_rng(0).bytes(4096))
    files[folder / "random.h5"] = "not an HDF5 file"
    (folder / "empty.h5").write_bytes(b"")
    files[folder / "empty.h5"] = "not an HDF5 file"
    before = {path: digest(path) for path in files}

    # In a subprocess with a timeout: a SWMR read of a cut file retried for many minutes.
    result = subprocess.run(
        [sys.executable, "-c", RESUME_EACH, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    answers = dict(json.loads(line) for line in result.stdout.splitlines())
    for path, reason in files.items():
        message = answers[str(path)]
        assert message.startswith("cannot resume") and reason in message, (path, message)
        assert "\n" not in message
        assert digest(path) == before[path], path
    assert sorted(folder.iterdir()) == sorted(files)  # no .resuming, .lock or other leftover


@dataclasses.dataclass
class CustomBatch:
    x: torch.Tensor


def test_a_probe_batch_of_a_custom_class_is_not_checkpointed_and_the_probe_steps_aside(tmp_path):
    plain = ProbeLoss("HessianSpectrum", "eval", {"x": [torch.ones(2)], "n": 3})
    custom = ProbeLoss("HessianSpectrum", "eval", CustomBatch(torch.ones(2)))
    for loss in (plain, custom):
        torch.save(loss.state_dict(), tmp_path / "state.pt")
        fresh = ProbeLoss("HessianSpectrum", "eval")
        fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        if loss is plain:
            assert fresh.batch.keys() == {"x", "n"} and torch.equal(
                fresh.batch["x"][0], torch.ones(2)
            )
    trainer = SimpleNamespace(strategy=None)
    with pytest.raises(ProbeUnavailable, match="CustomBatch"):
        fresh.setup(trainer, TeacherStudentModule(**ARCH), None)
