"""A new user's sharded fits (issue 24): models the FSDP ports were not designed around, each
recorded under DDP and under FSDP1/FSDP2 on two forked gloo processes, rows compared."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from dynamics import open_run
from dynamics.callbacks import (
    DynamicsRecorder,
    HessianSpectrum,
    ParameterDisplacement,
    TrainingLoss,
    TrajectoryGeometry,
)
from dynamics.model import rebuild_module
from tests import sharded
from tests.conftest import SmallCNN


class ShardedSmallCNN(SmallCNN):
    """SmallCNN as a user shards it for FSDP2: each top-level child, then the root."""

    def configure_model(self) -> None:
        fully_shard(self.features)
        fully_shard(self.head)
        fully_shard(self)


def _hessian_rows(name: str, path) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    module = (ShardedSmallCNN if name == "fsdp2" else SmallCNN)()
    probes = [TrainingLoss(), HessianSpectrum(k=2, every_n_steps=2)]
    # FSDP leaves every rank its own BatchNorm statistics; DDP copies rank 0's to every rank
    # before each forward unless told not to. Alike, the ranks' models are the same.
    strategy = DDPStrategy(start_method="fork", broadcast_buffers=False) if name == "ddp" else None
    options = {"strategy": strategy} if strategy else {}
    sharded.fit(
        name, module, None, [DynamicsRecorder(path, probes)], limit_val_batches=0, **options
    )
    series = open_run(path).series("hessian")
    return {"step": series.step} | {k: np.asarray(series[k]) for k in ("loss", "eigenvalues")}


@pytest.mark.parametrize("name", ["fsdp1", "fsdp2"])
def test_batchnorm_cnn_hessian_rows_equal_ddp_with_each_ranks_own_statistics(name, tmp_path):
    expected = _hessian_rows("ddp", tmp_path / "ddp.h5")
    got = _hessian_rows(name, tmp_path / f"{name}.h5")
    np.testing.assert_array_equal(got["step"], expected["step"])
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["eigenvalues"], expected["eigenvalues"], rtol=1e-4)


class FrozenFront(pl.LightningModule):
    """A regression net whose first layer (most of the entries) is frozen: under FSDP1's one
    flat parameter rank zero then holds frozen entries only, as with a frozen embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Linear(8, 32)
        self.head = nn.Linear(32, 1)
        self.front.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.front(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=generator)
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def test_rank_with_frozen_entries_only_notes_no_missing_gradient(tmp_path):
    series, notes = {}, {}
    for name in ("ddp", "fsdp1"):
        torch.manual_seed(0)
        path = tmp_path / f"{name}.h5"
        sharded.fit(name, FrozenFront(), None, [DynamicsRecorder(path, [TrajectoryGeometry()])])
        run = open_run(path)
        series[name] = np.asarray(run.series("trajectory")["gradient_cosine"])
        notes[name] = [e.message for e in run.events() if e.probe == "trajectory"]
    np.testing.assert_allclose(series["fsdp1"], series["ddp"], rtol=1e-5)
    assert np.isfinite(series["fsdp1"]).all()
    assert notes["fsdp1"] == notes["ddp"] == []


def test_an_fsdp2_runs_recorded_module_rebuilds_offline(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "fsdp2.h5"
    probes = [ParameterDisplacement()]
    sharded.fit("fsdp2", ShardedSmallCNN(), None, [DynamicsRecorder(path, probes)])
    run = open_run(path)
    with pytest.warns(UserWarning, match="configure_model"):
        module = rebuild_module(run, trust_recorded_model=True)
    theta0 = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    np.testing.assert_array_equal(theta0.numpy(), run.vector("theta0"))
