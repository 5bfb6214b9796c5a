"""Runs whose training diverged (issue 21, item 7): a NaN that training produced is data.

``info`` says at which step the run diverged, ``compare`` shows its finite part, ``plane``
draws its finite checkpoints; a θT that is NaN without any measurement showing divergence is
still damage, refused in one line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.errors import DynamicsError
from dynamics.experiments import TeacherStudentData, TeacherStudentModule
from dynamics.store import names

ARCHITECTURE = dict(width=8, expansion=2, depth=2)
STEPS = 10


class PoisonedAt(pl.LightningModule):
    """A linear regression whose loss is made NaN at one known step: from there on its
    parameters are NaN too (the NaN gradient reaches every weight)."""

    def __init__(self, poisoned_step: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.global_step == self.hparams.poisoned_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        return DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=8)


def _record(path: Path, quiet_trainer, module, data=None, probes=None) -> Path:
    probes = probes or [TrainingLoss(), GradientPlane(), ParameterDisplacement()]
    recorder = DynamicsRecorder(path, probes)
    quiet_trainer(max_steps=STEPS, callbacks=[recorder]).fit(module, data)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, quiet_trainer) -> dict[str, Path]:
    """Two teacher–student runs sharing θ0: ``ok`` converging, ``diverged`` (shifted, so its
    initial gradient differs) with a learning rate that makes it diverge."""
    folder = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, lr, shift in (("ok", 1e-2, "none"), ("diverged", 1e6, "expected")):
        torch.manual_seed(0)
        module = TeacherStudentModule(**ARCHITECTURE, shift=shift, lr=lr, optimizer="sgd")
        data = TeacherStudentData(**ARCHITECTURE, shift=shift, batch_size=16, heldout_size=16)
        paths[name] = _record(folder / f"{name}.h5", quiet_trainer, module, data)
    return paths


def _first_nonfinite_step(path: Path) -> int:
    """Read with h5py alone: the first step whose loss or snapshot is not finite."""
    with h5py.File(path) as file:
        loss = file["series/loss"]
        snapshots = file["series/snapshots"]
        bad_loss = loss["step"][:][~np.isfinite(loss["train"][:])]
        bad_theta = snapshots["step"][:][~np.isfinite(snapshots["theta"][:]).all(axis=1)]
    return int(min(bad_loss.min(), bad_theta.min()))


def test_a_loss_made_nan_at_a_known_step_is_divergence_at_that_step(tmp_path, quiet_trainer):
    torch.manual_seed(0)
    path = _record(tmp_path / "poisoned.h5", quiet_trainer, PoisonedAt(3))
    run = open_run(path)
    assert run.diverged_at == 3
    theta_final = run.vector(names.THETA_FINAL)  # returned as data, not refused
    assert theta_final is not None and np.isnan(theta_final).all()
    states = run.stored_states()
    finite = {s.step: bool(np.isfinite(s.theta).all()) for s in states}
    assert finite[3] and not finite[4] and not finite[STEPS]  # θ3 finite; its step's loss NaN
    assert run.summary()["diverged_at"] == 3


def test_info_says_at_which_step_the_run_diverged(runs, dynamics):
    expected = _first_nonfinite_step(runs["diverged"])
    assert 0 < expected < STEPS
    text = dynamics("info", runs["diverged"])
    assert text.returncode == 0, text.stderr
    assert f"diverged at step {expected}:" in text.stdout
    as_json = dynamics("info", runs["diverged"], "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["diverged_at"] == expected
    converged = dynamics("info", runs["ok"])
    assert converged.returncode == 0 and "diverged at" not in converged.stdout
    assert json.loads(dynamics("info", runs["ok"], "--json").stdout)["diverged_at"] is None


def test_compare_shows_the_finite_part_and_says_the_run_diverged(runs, dynamics, tmp_path):
    step = _first_nonfinite_step(runs["diverged"])
    out = tmp_path / "compare.html"
    result = dynamics("compare", runs["ok"], runs["diverged"], "-o", out)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    tables = " ".join(re.findall(r"<table.*?</table>", page, re.S))
    assert f"diverged at step {step}" in tables  # its summary row and the pair's row
    assert not re.search(r">\s*(nan|inf)", tables, re.I) and "nan°" not in tables
    assert f"diverged.h5 diverged at step {step}: its θT is not finite" in page  # no barrier
    assert "θ0 → θT (ok)" in tables  # the converged run's line is still drawn


def test_plane_draws_the_finite_checkpoints_of_a_diverged_run(runs, dynamics, tmp_path):
    step = _first_nonfinite_step(runs["diverged"])
    out = tmp_path / "plane.html"
    args = ("plane", runs["ok"], runs["diverged"], "-o", out, "--grid", "4")
    result = dynamics(*args, "--processes", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert f"diverged.h5 diverged at step {step} (its θT is not finite)" in result.stdout
    with h5py.File(out.with_suffix(".plane.h5")) as views:
        titles = [views[v].attrs["title"] for v in views]
        assert [t for t in titles if "out-of-plane" in t] == ["out-of-plane view of ok (p̂, w)"]
        for view in views.values():
            assert np.isfinite(view["losses"][:]).all()  # heatmaps around the finite θ
            path = view["trajectory"].get("diverged")
            if path is not None:
                assert path["step"][:].max() < step and np.isfinite(path["a"][:]).all()
    assert "diverged at step" in out.read_text()


def test_the_endpoints_plane_of_a_diverged_run_is_one_line(
    runs, dynamics, one_line_error, tmp_path
):
    out = tmp_path / "plane.html"
    result = dynamics(
        "plane", runs["ok"], runs["diverged"], "-o", out, "--plane", "gradient-endpoints"
    )
    one_line_error(result)
    assert "diverged at step" in result.stderr and "no direction joins" in result.stderr
    assert not out.exists()


def _edited(source: Path, folder: Path, **datasets: object) -> Path:
    path = folder / source.name
    shutil.copyfile(source, path)
    with h5py.File(path, "r+") as file:
        for name, make in datasets.items():
            dataset = file[name.replace("__", "/")]
            dataset[...] = make(dataset[...])
    return path


def test_a_nan_theta_final_no_measurement_explains_is_still_damage(
    runs, tmp_path, dynamics, one_line_error
):
    nan = lambda v: np.full_like(v, np.nan)  # noqa: E731
    unwritten = _edited(runs["ok"], tmp_path, vectors__theta_final=nan)
    assert open_run(unwritten).diverged_at is None
    result = dynamics("info", unwritten)
    one_line_error(result)
    assert "unwritten (NaN) though its step is stored" in result.stderr
    # A loss NaN from its first row (none returned) explains nothing either.
    (tmp_path / "b").mkdir()
    no_loss = _edited(runs["ok"], tmp_path / "b", vectors__theta_final=nan, series__loss__train=nan)
    with pytest.raises(DynamicsError, match="no recorded loss or displacement shows"):
        open_run(no_loss).vector(names.THETA_FINAL)


def test_a_nan_loss_while_the_parameters_stay_finite_is_no_divergence(runs, tmp_path):
    # An AMP step skipped at the end: the loss is NaN, the parameters are not.
    def last_nan(values):
        values[-2:] = np.nan
        return values

    run = open_run(_edited(runs["ok"], tmp_path, series__loss__train=last_nan))
    assert run.diverged_at is None
    assert np.isfinite(run.vector(names.THETA_FINAL)).all()


def test_no_point_takes_the_buffers_of_a_diverged_state(tmp_path, quiet_trainer, small_cnn):
    from dynamics.geometry.nearest_buffers import NearestBuffers

    torch.manual_seed(0)
    module = small_cnn(lr=1e6)  # BatchNorm: every stored state has buffers
    path = _record(tmp_path / "cnn.h5", quiet_trainer, module, probes=[ParameterDisplacement()])
    run = open_run(path)
    assert run.diverged_at is not None
    states = run.stored_states()
    assert not np.isfinite(states[-1].theta).all()
    nearest = NearestBuffers.of_run(run, small_cnn())
    # θ0 is its own nearest state; a NaN distance would have won argmin.
    assert nearest.nearest(torch.from_numpy(states[0].theta)) == 0
    finite = [s for s in states if np.isfinite(s.theta).all()]
    far = torch.from_numpy(finite[-1].theta) * 10
    assert nearest.nearest(far) < len(finite)
