"""The probes split off for one job each: ActivationBias and UnitHealth, each alone beside
HiddenStateNorms(activations=False), record exactly what HiddenStateNorms(unit_health=True) did
in its one probe, under the same group names; ActivationBias steps aside with nothing to hook;
they and HessianSpectrum with every measurement keep the probe contract (check_probe)."""

from __future__ import annotations

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
    ActivationBias,
    DynamicsRecorder,
    EigenspaceOverlap,
    EigenvectorSnapshots,
    GradientShare,
    HessianDensity,
    HessianSpectrum,
    HessianTrace,
    HiddenStateNorms,
    UnitHealth,
    check_probe,
)


class Net(pl.LightningModule):
    def __init__(self, activation: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Linear(4, 8), activation(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )

    def training_step(self, batch, _):
        return F.mse_loss(self.blocks(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 4, generator=generator), torch.randn(48, 2, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16)


def _record(path, probes, quiet_trainer, module=None) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    recorder = DynamicsRecorder(path, probes)
    quiet_trainer(max_steps=6, callbacks=[recorder]).fit(module or Net())
    with h5py.File(path) as file:
        series = file.get("series", {})
        return {
            f"{group}/{name}": series[group][name][()] for group in series for name in series[group]
        }


def test_the_split_probes_record_what_the_one_probe_did(tmp_path, quiet_trainer) -> None:
    modules = ["blocks.0", "blocks.2"]
    one = _record(
        tmp_path / "one.h5", [HiddenStateNorms(modules=modules, unit_health=True)], quiet_trainer
    )
    split = _record(
        tmp_path / "split.h5",
        [
            HiddenStateNorms(modules=modules, activations=False),
            ActivationBias(),
            UnitHealth(modules=modules),
        ],
        quiet_trainer,
    )
    assert set(one) == set(split)
    assert {k.split("/")[0] for k in one} == {"hidden_norms", "activation_bias", "unit_health"}
    for name, values in one.items():
        np.testing.assert_array_equal(split[name], values, err_msg=name)
    assert np.isfinite(one["activation_bias/mean"]).all()
    assert one["unit_health/dead"].shape == (6, 1)  # the one ReLU
    columns = open_run(tmp_path / "split.h5").columns("activation_bias", "mean")
    assert list(columns) == ["blocks.1", "blocks.3"]


def test_activation_bias_steps_aside_with_no_activation_module(tmp_path, quiet_trainer) -> None:
    class Linear(Net):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))

    with pytest.warns(UserWarning, match="ActivationBias found no activation module"):
        _record(tmp_path / "run.h5", [ActivationBias()], quiet_trainer, Linear())
    run = open_run(tmp_path / "run.h5")
    assert run.recorded("activation_bias") is None
    assert any("found no activation module" in e.message for e in run.events())


@pytest.mark.parametrize(
    "probe",
    [
        ActivationBias(),
        UnitHealth(),
        HessianSpectrum(
            k=2,
            every_n_steps=2,
            measurements=[
                HessianTrace(6),
                GradientShare(),
                HessianDensity(2, 4),
                EigenspaceOverlap(),
                EigenvectorSnapshots(budget_mb=1),
            ],
        ),
    ],
    ids=lambda probe: type(probe).__name__,
)
def test_the_new_probes_and_measurements_keep_the_contract(small_cnn, probe):
    torch.manual_seed(0)
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))
    series = check_probe(probe, small_cnn(), batch, steps=3)
    assert all(len(rows) for rows in series.values())
