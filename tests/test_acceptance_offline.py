"""Acceptance of the offline views on models that are not ours (issue 10), as a new user runs them.

Each test is a failure found by trying ``dynamics plane`` on a user's own modules; the modules
are defined here and named to the CLI with ``--model this_file.py:Class``.
"""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics.callbacks import DynamicsRecorder, GradientPlane, ParameterDisplacement
from dynamics.cli import main

THIS_FILE = Path(__file__).resolve()


class ManualSGD(pl.LightningModule):
    """Manual optimization; an extra pass through ``training_step`` would train it."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        if not self.trainer.training:  # only the Trainer's own steps may run it
            raise AssertionError("training_step called outside training")
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 5, generator=generator)
        y = torch.randint(0, 3, (32,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=8)


class ManualSGDWithLoss(ManualSGD):
    def dynamics_loss(self, batch) -> torch.Tensor:
        return self.loss(batch)


def record(
    cls: type[pl.LightningModule], lr: float, path: Path, plane: GradientPlane | None = None
) -> Path:
    """Fit ``cls(lr)`` for 3 steps from the seed-0 θ0, recording g0 and the snapshots."""
    pl.seed_everything(0)
    module = cls(lr)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DynamicsRecorder(path, [ParameterDisplacement(), plane or GradientPlane()])],
    )
    trainer.fit(module)
    return path


def plane(capsys, *args) -> tuple[int, str]:
    """``dynamics plane ARGS`` on a tiny grid: exit code and stderr."""
    capsys.readouterr()  # what training printed
    code = main(["plane", *map(str, args), "--grid", "3", "--processes", "1", "--no-progress"])
    return code, capsys.readouterr().err


def test_plane_says_why_a_manually_optimized_run_stored_no_initial_gradient(tmp_path, capsys):
    # Its GradientPlane stepped aside at fit start; "no initial gradient g0 stored" alone sent
    # the user looking for a probe they had attached.
    runs = [record(ManualSGD, lr, tmp_path / f"{n}.h5") for n, lr in (("a", 0.1), ("b", 0.3))]
    model = f"{THIS_FILE}:ManualSGD"
    for kind in ("auto", "pca"):
        code, err = plane(
            capsys, *runs, "-o", tmp_path / "p.html", "--model", model, "--plane", kind
        )
        assert code == 2 and err.count("\n") == 1, err
        assert "optimizes manually" in err and "dynamics_loss" in err, err


def test_plane_refuses_a_manually_optimized_model_without_dynamics_loss(tmp_path, capsys):
    # Recorded with dynamics_loss, rebuilt by a class without it: the loss rule refused deep in
    # the grid evaluation with a LossUnavailable traceback.
    runs = [
        record(ManualSGDWithLoss, lr, tmp_path / f"{n}.h5") for n, lr in (("a", 0.1), ("b", 0.3))
    ]
    model = f"{THIS_FILE}:ManualSGD"
    code, err = plane(capsys, *runs, "-o", tmp_path / "p.html", "--model", model)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("dynamics: error: a.h5: ManualSGD optimizes manually"), err
    assert not (tmp_path / "p.html").exists()


class UnsavedWidth(pl.LightningModule):
    """No ``save_hyperparameters()``: it cannot be rebuilt offline without ``--init-args``."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    train_dataloader = ManualSGD.train_dataloader


def test_plane_names_the_order_in_which_a_partner_runs_stored_views_are_drawn(tmp_path, capsys):
    # c evaluated its views at the end of fit on the plane (u = g0 of its partner a, v = its
    # own): `dynamics plane c a` asks for the same plane in another basis, and was told only
    # that c "stored views on another plane".
    a = record(UnsavedWidth, 0.1, tmp_path / "a.h5")
    x, y = next(iter(ManualSGD.train_dataloader(None)))
    other_batch = (x[:4], y[:4])  # another probe batch: another g0
    at_end = GradientPlane(partner=a, batch=other_batch, at_end=True, grid=3)
    c = record(UnsavedWidth, 0.3, tmp_path / "c.h5", at_end)
    code, err = plane(capsys, c, a, "-o", tmp_path / "p.html")
    assert code == 2 and err.count("\n") == 1, err
    assert f"in the other order: dynamics plane {a} {c}" in err, err
    code, err = plane(capsys, a, c, "-o", tmp_path / "p.html")
    assert code == 0, err
