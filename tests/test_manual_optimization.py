"""Manual optimization: probes never call a training step that steps the optimizer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, GradientPlane, HessianSpectrum, ProbeUnavailable
from dynamics.params.vectors import parameter_vector
from dynamics.passes.loss_rule import LossUnavailable, loss_source, module_loss


class ManualRegressor(pl.LightningModule):
    """Steps its optimizer and scheduler itself, as GAN-style and RL modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.training_steps = 0

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)]

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 4, generator=generator), torch.randn(48, 2, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=generator)


class ManualWithLoss(ManualRegressor):
    def dynamics_loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(ManualRegressor().train_dataloader()))


def test_the_loss_rule_refuses_a_manual_training_step_before_calling_it() -> None:
    module = ManualRegressor()
    with pytest.raises(LossUnavailable, match="automatic_optimization = False.*dynamics_loss"):
        loss_source(module)
    with pytest.raises(LossUnavailable):
        module_loss(module, _batch())
    assert module.training_steps == 0
    assert loss_source(ManualWithLoss()) == "dynamics_loss"


@pytest.mark.parametrize("probe", [HessianSpectrum, GradientPlane])
def test_probes_step_aside_at_setup_without_dynamics_loss(probe) -> None:
    module = ManualRegressor()
    theta = parameter_vector(module)
    with pytest.raises(ProbeUnavailable, match=f"{probe.__name__}: ManualRegressor optimizes"):
        probe().setup(SimpleNamespace(strategy=None), module, _batch())
    assert module.training_steps == 0
    assert torch.equal(parameter_vector(module), theta)


def test_probes_measure_dynamics_loss_and_leave_training_bit_identical(
    tmp_path, quiet_trainer
) -> None:
    def fit(callbacks) -> torch.Tensor:
        pl.seed_everything(0, verbose=False)
        module = ManualWithLoss()
        quiet_trainer(max_steps=6, callbacks=callbacks).fit(module)
        assert module.training_steps == 6  # the probes' passes never called it
        return parameter_vector(module)

    probes = [HessianSpectrum(k=2, every_n_steps=2), GradientPlane()]
    recorded = fit([DynamicsRecorder(tmp_path / "run.h5", probes)])
    assert torch.equal(recorded, fit([]))
    run = open_run(tmp_path / "run.h5")
    np.testing.assert_array_equal(run.series("hessian").step, [0, 2, 4])
    assert np.isfinite(run.series("hessian")["eigenvalues"]).all()
    settings = {p["name"]: p["settings"] for p in run.attrs["probes"]}
    assert settings["hessian"]["loss"] == settings["plane"]["loss"] == "dynamics_loss"
