"""The controlled experiment's data: fresh Gaussian inputs labelled by a fixed teacher."""

from __future__ import annotations

from collections.abc import Iterator

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dynamics.experiments.teacher_student.model import ResidualMLP
from dynamics.experiments.teacher_student.streams import seeded_residual_mlp, stream_seed


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

    Example::

        data = TeacherStudentData(width=64, batch_size=128)
        x, y = next(iter(data.train_dataloader()))  # y = teacher(x)

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
