"""TrainingLoss under gradient accumulation and manual optimization."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import DynamicsRecorder, TrainingLoss


class Regression(LightningModule):
    """A linear regression that keeps every loss its training_step computed."""

    def __init__(self, batches: int = 18) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.batches = batches
        self.losses: list[float] = []

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        return loss

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4 * self.batches, 4, generator=generator)
        return DataLoader(TensorDataset(x, 3 * x[:, :1] + 1), batch_size=4)


def test_accumulated_steps_record_the_mean_unscaled_micro_batch_loss(tmp_path, quiet_trainer):
    module, path = Regression(batches=18), tmp_path / "acc.h5"
    trainer = quiet_trainer(
        max_steps=6, accumulate_grad_batches=4, callbacks=[DynamicsRecorder(path, [TrainingLoss()])]
    )
    trainer.fit(module)
    # 18 batches an epoch: four steps of 4 micro-batches, one of the last 2, then 4 again
    bounds = np.cumsum([0, 4, 4, 4, 4, 2, 4])
    expected = [np.mean(module.losses[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    assert len(module.losses) == bounds[-1]
    loss = open_run(path).series("loss")
    np.testing.assert_array_equal(loss.step, np.arange(6))
    np.testing.assert_allclose(loss["train"], expected, rtol=1e-6)


class Manual(Regression):
    """Manual optimization whose training_step returns nothing and logs its loss."""

    def __init__(self, log_as: str | None = "train_loss") -> None:
        super().__init__(batches=3)
        self.automatic_optimization = False
        self.log_as = log_as

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        if self.log_as:
            self.log(self.log_as, loss, on_step=True, on_epoch=True)


@pytest.mark.parametrize("key", ["train_loss", "objective"])
def test_manual_optimization_records_the_logged_loss(tmp_path, quiet_trainer, key):
    module, path = Manual(log_as=key), tmp_path / "manual.h5"
    probe = TrainingLoss() if key == "train_loss" else TrainingLoss(loss_key=key)
    with pytest.warns(UserWarning, match=f"recording the logged '{key}_step'"):
        quiet_trainer(max_steps=7, callbacks=[DynamicsRecorder(path, [probe])]).fit(module)
    run = open_run(path)
    # three batches an epoch: the epoch means logged under the bare key are never taken
    np.testing.assert_allclose(run.series("loss")["train"], module.losses, rtol=1e-6)
    assert [(e.step, e.probe, e.kind) for e in run.events()] == [(0, "loss", "warning")]


def test_a_step_with_no_loss_at_all_is_nan_with_one_event(tmp_path, quiet_trainer):
    path = tmp_path / "none.h5"
    with pytest.warns(UserWarning, match="returned no loss and logged no 'train_loss'"):
        quiet_trainer(max_steps=4, callbacks=[DynamicsRecorder(path, [TrainingLoss()])]).fit(
            Manual(log_as=None)
        )
    run = open_run(path)
    assert np.isnan(run.series("loss")["train"]).all() and len(run.series("loss")) == 4
    [event] = run.events()
    assert event.kind == "warning" and "TrainingLoss(loss_key=...)" in event.message
