"""The paper's controlled experiment: a student residual MLP regresses a teacher's outputs.

Both students of a comparison are built from the same seed, so they share θ0 bit-for-bit (the
activation shift adds no parameter), see the same batches in the same order and use the same
optimizer; they differ only in the shift.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dynamics.experiments.progress import logs_training_loss
from dynamics.models import ResidualMLP

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


#: The random streams of the experiment. Each draws from its own spawn of the seed it is given,
#: so equal seed numbers never give equal streams (a student seeded like the teacher would be
#: the teacher: zero loss, zero gradient).
STREAMS = ("student", "teacher", "training data", "held-out data")


def stream_seed(seed: int, stream: str, *extra: int) -> int:
    """A 63-bit torch seed for ``stream``, independent of every other stream's for any seeds.

    Args:
        seed: the user's seed number for that stream.
        stream: one of :data:`STREAMS`.
        extra: further spawn keys (e.g. the DDP rank of a data stream).
    """
    sequence = np.random.SeedSequence(seed, spawn_key=(STREAMS.index(stream), *extra))
    return int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))


def seeded_residual_mlp(seed: int, stream: str, **architecture) -> ResidualMLP:
    """A :class:`ResidualMLP` initialized from ``stream``'s seed, the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, stream))
        return ResidualMLP(**architecture)


def parameter_count(**architecture) -> int:
    """The parameters of a :class:`ResidualMLP` of ``architecture``, counted without allocating
    them (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in ResidualMLP(**architecture).parameters())


class TeacherStudentModule(pl.LightningModule):
    """The student: a residual MLP trained by MSE against the teacher's outputs.

    Args:
        width: residual-stream width.
        expansion: hidden width multiple of each block.
        depth: number of residual blocks.
        activation: ``relu``, ``gelu``, ``silu``, ``sigmoid`` or ``tanh``.
        shift: the student's activation shift: ``none``, ``expected``, ``adaptive`` or a number.
        bias: linear layers with biases.
        seed: initialization seed (equal seeds give bit-equal θ0 whatever the shift).
        lr: learning rate.
        optimizer: ``adam``, ``adamw`` or ``sgd``.
    """

    def __init__(
        self,
        width: int = 64,
        expansion: int = 4,
        depth: int = 4,
        activation: str = "relu",
        shift: str | float = "none",
        bias: bool = True,
        seed: int = 0,
        lr: float = 1e-3,
        optimizer: str = "adam",
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be adam, adamw or sgd, got {optimizer!r}")
        self.save_hyperparameters()
        self.student = seeded_residual_mlp(
            seed,
            "student",
            width=width,
            expansion=expansion,
            depth=depth,
            activation=activation,
            shift=shift,
            bias=bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)

    def dynamics_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.student(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self.dynamics_loss(batch)
        # self.log every step is a large share of Lightning's per-step cost at this model size
        # (benchmarks/bench_training_loop.py): only for a reader; the recorder reads the return.
        if logs_training_loss(self.trainer):
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.dynamics_loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.hparams.optimizer](self.parameters(), lr=self.hparams.lr)


class _TeacherStream(IterableDataset):
    """Endless batches x ~ N(0, I), y = teacher(x), from a seeded generator."""

    def __init__(self, teacher: ResidualMLP, width: int, batch_size: int, seed: int) -> None:
        self.teacher, self.width, self.batch_size, self.seed = teacher, width, batch_size, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randn(self.batch_size, self.width, generator=generator)
            with torch.no_grad():
                y = self.teacher(x)
            yield x, y  # outside no_grad: a suspended generator would leave grad mode off


class TeacherStudentData(pl.LightningDataModule):
    """Fresh Gaussian inputs labelled by a fixed teacher, and a fixed held-out set.

    Args:
        width: input width (must match the student's).
        expansion: teacher's block expansion.
        depth: teacher's depth.
        activation: teacher's activation.
        shift: teacher's activation shift (unshifted by default).
        bias: teacher's linear biases.
        teacher_seed: teacher initialization seed.
        data_seed: seed of the training stream and the held-out set (each DDP rank draws its
            own training stream).
        batch_size: training batch size.
        heldout_size: size of the held-out set.
    """

    def __init__(
        self,
        width: int = 64,
        expansion: int = 4,
        depth: int = 4,
        activation: str = "relu",
        shift: str | float = "none",
        bias: bool = True,
        teacher_seed: int = 1,
        data_seed: int = 2,
        batch_size: int = 128,
        heldout_size: int = 2048,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.teacher = seeded_residual_mlp(
            teacher_seed,
            "teacher",
            width=width,
            expansion=expansion,
            depth=depth,
            activation=activation,
            shift=shift,
            bias=bias,
        ).requires_grad_(False)

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        stream = _TeacherStream(
            self.teacher,
            self.hparams.width,
            self.hparams.batch_size,
            stream_seed(self.hparams.data_seed, "training data", rank),
        )
        return DataLoader(stream, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(
            stream_seed(self.hparams.data_seed, "held-out data")
        )
        x = torch.randn(self.hparams.heldout_size, self.hparams.width, generator=generator)
        with torch.no_grad():
            y = self.teacher(x)
        return DataLoader(TensorDataset(x, y), batch_size=self.hparams.heldout_size)
