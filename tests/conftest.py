"""Shared fixtures: small models and a quiet Trainer, so the suite stays fast on 2 cores."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics.callbacks import (
    DynamicsRecorder,
    HessianSpectrum,
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    Probe,
    SeriesSpec,
    TrainingLoss,
)
from dynamics.store import View

torch.set_num_threads(1)
for _name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*IterableDataset.*")


class SmallCNN(pl.LightningModule):
    """A conv net with BatchNorm and dropout whose training_step returns a dict."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return {"loss": loss, "logits_mean": loss.detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 1, 8, 8, generator=generator)
        y = torch.randint(0, 3, (64,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=generator)


@pytest.fixture
def small_cnn() -> type[SmallCNN]:
    return SmallCNN


def make_quiet_trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer with no logger, checkpointing, progress bar or summary unless asked."""
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


@pytest.fixture(scope="session")
def quiet_trainer():
    return make_quiet_trainer


DYNAMICS = str(Path(sys.executable).with_name("dynamics"))
TINY_EXPERIMENT = {
    "steps": 30,
    "eval_every": 10,
    "model": {"width": 8, "expansion": 2, "depth": 2},
    "data": {"batch_size": 16, "heldout_size": 64},
    "record": {"snapshot_budget_mb": 1, "hessian_every_n_steps": 10},
}


def run_dynamics(*args, cwd=None) -> subprocess.CompletedProcess:
    """The installed ``dynamics`` console script, as a user runs it."""
    return subprocess.run([DYNAMICS, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dynamics"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def dynamics():
    return run_dynamics


@pytest.fixture
def one_line_error():
    return assert_one_line_error


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """``dynamics run`` on a tiny teacher–student config: (folder, completed process)."""
    folder = tmp_path_factory.mktemp("demo")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    result = run_dynamics(
        "run", folder / "tiny.yaml", "--out", folder / "runs", "--no-progress", "--lr", "3e-3"
    )
    assert result.returncode == 0, result.stderr
    return folder, result


class HeadNorms(Probe):
    """A user's own probe, known to no module of the package: the norms of the head's weight
    and bias, drawn as the view it declares says."""

    name = "head_norms"
    view = View("lines", "Head parameter norms (a user's probe)", "‖p‖ of the head", units="au")

    def series(self):
        spec = SeriesSpec((2,), columns=("weight", "bias"), view=self.view)
        return {self.name: {"norm": spec}}

    def on_step_end(self, trainer, pl_module, batch, outputs, step):
        head = pl_module.head
        return {self.name: {"norm": torch.stack([head.weight.norm(), head.bias.norm()]).detach()}}


class TinyClassifier(pl.LightningModule):
    """An MLP classifier whose validation step logs ``val_loss`` and ``val_acc``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return self._data(0, shuffle=True)

    def val_dataloader(self):
        return self._data(1, shuffle=False)

    def _data(self, seed: int, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(96, 6, generator=generator)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=shuffle, generator=generator)


@pytest.fixture
def user_view() -> View:
    """The view the user's own probe of :func:`recorded_runs` declares."""
    return HeadNorms.view


@pytest.fixture(scope="session")
def recorded_runs(tmp_path_factory) -> list[Path]:
    """Two tiny fits sharing θ0 and differing in the learning rate, recorded with every
    standard probe (the Hessian's trace, gradient share, spectral density and eigenspace overlap
    included), the validation metrics ``val_loss`` and ``val_acc``, and a user's own probe
    (:class:`HeadNorms`).
    """
    folder = tmp_path_factory.mktemp("recorded")
    paths = []
    for lr in (0.3, 0.1):
        torch.manual_seed(0)
        probes = [
            TrainingLoss(),
            HiddenStateNorms(),
            ParameterDisplacement(),
            HessianSpectrum(
                k=2,
                every_n_steps=4,
                trace_hvp=8,
                gradient_share=True,
                density_runs=2,
                eigenspace_overlap=True,
            ),
            LoggedMetrics(keys=["val_loss", "val_acc"]),
            HeadNorms(),
        ]
        path = folder / f"lr{lr}.h5"
        recorder = DynamicsRecorder(path, probes, config={"lr": lr})
        trainer = make_quiet_trainer(max_steps=24, num_sanity_val_steps=0, callbacks=[recorder])
        trainer.fit(TinyClassifier(lr))
        paths.append(path)
    return paths


def cli_in_process(capsys, *args) -> tuple[int, str]:
    """``dynamics ARGS`` run in this process: its exit code and what it wrote on stderr."""
    from dynamics.cli import main

    capsys.readouterr()
    code = main([*map(str, args)])
    return code, capsys.readouterr().err
