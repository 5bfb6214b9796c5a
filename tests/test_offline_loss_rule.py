"""Offline tools on a module whose training step reads ``self.trainer`` (issue 22 item 10), and
`dynamics report DIR` with a file that has nothing to report."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.analysis.measures.rebuilt_loss import rebuilt_surface
from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.errors import DynamicsError
from dynamics.model import load_into
from dynamics.model.probe_batch import probe_batch
from dynamics.passes.loss_rule import module_loss
from dynamics.store import RunWriter, SeriesSpec
from tests.conftest import make_quiet_trainer


class LogsTheLearningRate(pl.LightningModule):
    """A training step as users write it: it logs the optimizer's learning rate."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class WithDynamicsLoss(LogsTheLearningRate):
    """The same module with the loss rule's own method: offline tools need no Trainer."""

    def dynamics_loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)


def _fit(path, module) -> None:
    probes = [ParameterDisplacement(), GradientPlane()]
    make_quiet_trainer(
        max_steps=3,
        callbacks=[DynamicsRecorder(path, probes)],
    ).fit(module)


def test_a_training_step_reading_the_trainer_says_to_define_dynamics_loss(tmp_path):
    path = tmp_path / "lr.h5"
    _fit(path, LogsTheLearningRate())  # in the fit the module has its Trainer: g0 is taken
    run = open_run(path)
    assert run.vector("g0") is not None and not run.events()
    with pytest.raises(DynamicsError, match=r"uses self\.trainer.*define dynamics_loss\(batch\)"):
        rebuilt_surface(run, model=f"{__file__}:LogsTheLearningRate", trust=True)
    # The documented fix: the same run, rebuilt as the module with dynamics_loss, evaluates.
    surface = rebuilt_surface(run, model=f"{__file__}:WithDynamicsLoss", trust=True)
    module = WithDynamicsLoss()
    load_into(run, module, step=0)
    expected = float(module_loss(module, probe_batch(run)))
    assert surface.loss(run.vector("theta0")) == pytest.approx(expected, rel=1e-6)


def test_other_runtime_errors_of_a_training_step_are_not_renamed():
    class Broken(LogsTheLearningRate):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        module_loss(Broken(), (torch.zeros(2, 3), torch.zeros(2, 1)))


def test_report_of_a_folder_skips_a_file_with_no_series_and_names_it(tmp_path, dynamics):
    folder = tmp_path / "runs"
    folder.mkdir()
    _fit(folder / "good.h5", WithDynamicsLoss())
    # A run whose only group holds no drawn series (a snapshot-only file).
    RunWriter.create(
        folder / "empty.h5", {"snapshots": {"theta": SeriesSpec((2,))}}, {}, {}
    ).close()
    out = tmp_path / "report.html"
    result = dynamics("report", folder, "-o", out)
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "skipped" in line and "empty.h5" in line and "no series to report" in line
    page = out.read_text()
    assert "good" in page and "1 run(s)" in page
    alone = dynamics("report", folder / "empty.h5", "-o", tmp_path / "alone.html")
    assert alone.returncode == 2 and "no series to report" in alone.stderr


def test_a_run_recorded_without_a_loss_function_says_so_offline():
    from dynamics.passes.loss_rule import LossUnavailable, loss_rule_from_dict

    with pytest.raises(LossUnavailable, match="recorded without a loss function"):
        loss_rule_from_dict({"rule": "none"})
    with pytest.raises(LossUnavailable, match="unknown loss rule 'other'"):
        loss_rule_from_dict({"rule": "other"})
