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


@pytest.fixture
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
