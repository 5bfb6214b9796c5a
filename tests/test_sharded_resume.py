"""A sharded fit resumed from a checkpoint continues its run file as an uninterrupted fit
writes it, under FSDP1 and FSDP2 on two forked gloo processes: every row, every vector and the
trained parameters. Both checkpoints are torch.distributed.checkpoint folders: FSDP1's default
whole-state checkpoint crashes on the CPU (a segmentation fault in torch's FSDP state-dict hook
cloning a parameter offloaded to the CPU it is on), so FSDP1 saves sharded states here."""

from __future__ import annotations

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
    TrainingLoss,
    TrajectoryGeometry,
)
from dynamics.experiments import TeacherStudentModule
from dynamics.store import names
from tests import sharded
from tests.conftest import make_quiet_trainer

ARCH = dict(width=8, expansion=2, depth=3)
STEPS = 6
# One batch per rank and epoch (a DistributedSampler splits the 32 rows): a resumed fit sees
# the batches an uninterrupted one does, which a stream restarted at resume would not give.
_X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
_Y = _X.flip(-1).tanh()
DATA = DataLoader(TensorDataset(_X, _Y), batch_size=16)


def every_probe() -> list:
    return [
        TrainingLoss(),
        HiddenStateNorms(),
        ParameterDisplacement(snapshot_every_n_steps=2),
        TrajectoryGeometry(per_tensor=True),
        GradientPlane(),
        HessianSpectrum(k=2, every_n_steps=2),
    ]


def strategy(name: str):
    if name == "fsdp1":
        return sharded.CPUFSDPStrategy(state_dict_type="sharded")
    return sharded.strategy(name)


def fit(name: str, path, folder, max_steps: int, ckpt_path=None, probes=every_probe) -> None:
    """The fit under ``name``, checkpointed every 2 steps into ``folder``, its final
    parameters saved beside the run file, resumed from ``ckpt_path`` if given."""
    torch.manual_seed(0)
    module = sharded.module_for(name, TeacherStudentModule)(**ARCH)
    callbacks = [
        DynamicsRecorder(path, probes(), flush_interval_s=1e9),
        ModelCheckpoint(folder, every_n_train_steps=2, save_top_k=-1, save_last=True),
        sharded.FinalParameters(path.with_suffix(".pt")),
    ]
    # sharded.fit's Trainer, with checkpoints and a checkpoint to resume from.
    trainer = make_quiet_trainer(
        max_steps=max_steps,
        devices=2,
        strategy=strategy(name),
        callbacks=callbacks,
        enable_checkpointing=True,
        limit_val_batches=0,
    )
    trainer.fit(module, DATA, ckpt_path=ckpt_path)


def _problems(run) -> list[str]:
    return [
        f"{e.probe}: {e.message}"
        for e in run.events()
        if e.kind in (names.EVENT_DISABLED, names.EVENT_ERROR)
    ]


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_a_resumed_sharded_fit_continues_its_run_file_as_an_uninterrupted_one(tmp_path, name):
    straight, resumed = tmp_path / "straight.h5", tmp_path / "resumed.h5"
    fit(name, straight, tmp_path / "straight", STEPS)
    fit(name, resumed, tmp_path / "resumed", 3)  # stopped after step 3
    checkpoint = tmp_path / "resumed" / "epoch=1-step=2.ckpt"
    assert (checkpoint / "meta.pt").is_file()  # a torch.distributed.checkpoint folder
    fit(name, resumed, tmp_path / "resumed", STEPS, ckpt_path=checkpoint)

    a, b = open_run(straight), open_run(resumed)
    assert _problems(a) == [] and _problems(b) == []
    groups = {"loss", "hidden_norms", "displacement", "trajectory", "hessian", "snapshots"}
    assert set(a.groups) == set(b.groups) >= groups
    np.testing.assert_array_equal(a.series("trajectory").step, np.arange(STEPS))
    np.testing.assert_array_equal(a.series("hessian").step, [0, 2, 4])
    for group in a.groups:
        np.testing.assert_array_equal(a.series(group).step, b.series(group).step, err_msg=group)
        for series, values in a.series(group).values.items():
            np.testing.assert_array_equal(b.series(group)[series], values, err_msg=series)
    # Not an accident: the path after the checkpoint goes on from the one before it.
    path_length = a.series("trajectory")["path_length"]
    assert np.all(np.diff(path_length) > 0)
    assert set(a.vector_names) == set(b.vector_names) >= {"theta0", "theta_final", "g0"}
    for vector in a.vector_names:
        np.testing.assert_array_equal(b.vector(vector), a.vector(vector), err_msg=vector)

    expected, got = torch.load(straight.with_suffix(".pt")), torch.load(resumed.with_suffix(".pt"))
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)


def test_a_checkpoint_given_to_fit_resumes_a_sharded_fit(tmp_path):
    path, folder = tmp_path / "run.h5", tmp_path / "checkpoints"
    fit("fsdp2", path, folder, 3, probes=lambda: [TrainingLoss()])
    checkpoint = folder / "epoch=1-step=2.ckpt"
    fit("fsdp2", path, folder, 4, checkpoint, probes=lambda: [TrainingLoss()])
    np.testing.assert_array_equal(open_run(path).series("loss").step, np.arange(4))


def test_each_ranks_own_probe_batch_is_restored(tmp_path):
    """Under DDP as under FSDP: each rank's default probe batch is its own first batch (rows
    0, 2, ... on rank zero, 1, 3, ... on rank one)."""
    straight, resumed = tmp_path / "straight.h5", tmp_path / "resumed.h5"
    probes = lambda: [HessianSpectrum(k=2, every_n_steps=2)]  # noqa: E731
    fit("ddp", straight, tmp_path / "straight", 4, probes=probes)
    fit("ddp", resumed, tmp_path / "resumed", 3, probes=probes)
    checkpoint = tmp_path / "resumed" / "epoch=1-step=2.ckpt"
    fit("ddp", resumed, tmp_path / "resumed", 4, checkpoint, probes=probes)
    expected, got = open_run(straight).series("hessian"), open_run(resumed).series("hessian")
    np.testing.assert_array_equal(got.step, [0, 2])
    np.testing.assert_array_equal(got["eigenvalues"], expected["eigenvalues"])


def test_a_checkpoint_of_two_ranks_resumed_on_one_says_the_probe_batches_cannot_follow(tmp_path):
    path, folder = tmp_path / "run.h5", tmp_path / "checkpoints"
    probes = lambda: [TrainingLoss(), HessianSpectrum(k=2, every_n_steps=2)]  # noqa: E731
    fit("ddp", path, folder, 3, probes=probes)
    torch.manual_seed(0)
    trainer = make_quiet_trainer(
        max_steps=4, callbacks=[DynamicsRecorder(path, probes())], limit_val_batches=0
    )
    trainer.fit(TeacherStudentModule(**ARCH), DATA, ckpt_path=folder / "epoch=1-step=2.ckpt")
    run = open_run(path)
    np.testing.assert_array_equal(run.series("loss").step, np.arange(4))
    (event,) = [e for e in run.events() if e.kind == names.EVENT_DISABLED]
    assert event.probe == "hessian" and "probe batches of 2 ranks" in event.message
