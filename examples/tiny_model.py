"""The tiny model every example trains: a residual MLP student of a fixed random teacher.

Small enough that a 100-step fit takes about a second on one CPU thread. Not an example itself:
the scripts beside it import it (a script's own folder is on ``sys.path``).
"""

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyStudent(pl.LightningModule):
    """Two residual ReLU blocks fitting a teacher's outputs, trained with SGD."""

    def __init__(self, width: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()  # recorded init args: offline tools can rebuild the model
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU()) for _ in range(2)
        )
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def teacher_data(samples: int = 512, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Training and held-out loaders of one fixed random teacher, the same for every call."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    teacher = torch.randn(8, 1, generator=generator)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(samples, 1, generator=generator)
    train, held_out = TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:])
    return DataLoader(train, batch_size=32, shuffle=False), DataLoader(held_out, batch_size=64)


def quiet_trainer(steps: int, callbacks: list) -> pl.Trainer:
    """A CPU Trainer that prints nothing and writes nothing but what its callbacks write."""
    return pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        accelerator="cpu",
        val_check_interval=25,
        check_val_every_n_epoch=None,  # validate every 25 steps, across epochs
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
