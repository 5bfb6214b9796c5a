"""A folder of runs read by ``report DIR`` / ``compare DIR``: the toolkit's own other outputs
beside the runs (``dynamics plane``'s ``X.plane.h5`` grids) are not taken for runs."""

import h5py
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics.analysis.output import PLANE_GRID_SCHEMA
from dynamics.callbacks import (
    DynamicsRecorder,
    GradientPlane,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.cli import main


class TinyRegression(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_report_and_compare_of_a_folder_leave_out_its_plane_grids(tmp_path, quiet_trainer):
    runs = []
    for name, lr in {"a": 0.1, "b": 0.3}.items():
        torch.manual_seed(0)  # one θ0; plane draws g0 and the endpoints' direction
        probes = [
            TrainingLoss(),
            ParameterDisplacement(),
            GradientPlane(partner=runs[0] if runs else None),
        ]
        recorder = DynamicsRecorder(tmp_path / f"{name}.h5", probes)
        quiet_trainer(max_steps=2, callbacks=[recorder]).fit(TinyRegression(lr))
        runs.append(tmp_path / f"{name}.h5")
    page = tmp_path / "plane.html"
    model = f"{__file__}:TinyRegression"
    plane = [
        "plane",
        *map(str, runs),
        "--model",
        model,
        "--grid",
        "3",
        "--processes",
        "1",
        "--no-progress",
    ]
    assert main([*plane, "-o", str(page)]) == 0
    with h5py.File(tmp_path / "plane.plane.h5") as grid:  # the grid lies among the runs
        assert grid.attrs["schema"] == PLANE_GRID_SCHEMA
    for command in ("report", "compare"):
        out = tmp_path / f"{command}.html"
        assert main([command, str(tmp_path), "-o", str(out)]) == 0
        text = out.read_text()
        assert ">a<" in text and ">b<" in text and "plane.plane" not in text
