"""The character experiment's text: the standard library's own source, which ships with Python.

The text is every ``.py`` file of the running Python's standard library (``sysconfig``'s
``stdlib`` path), read in sorted order; files are split between training and held-out text by a
hash of their name, so the split is the same on every machine with the same Python.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def stdlib_text(heldout: bool, max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's source files, training or held-out part, as uint8.

    A file is held out when the first byte of the sha256 of its relative path is below 26
    (about a tenth of the files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        digest = hashlib.sha256(path.name.encode()).digest()[0]
        if (digest < 26) != heldout:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class _Windows(IterableDataset):
    """Endless batches of random windows of ``text`` from a seeded generator."""

    def __init__(self, text: torch.Tensor, context: int, batch_size: int, seed: int) -> None:
        self.text, self.context, self.batch_size, self.seed = text, context, batch_size, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        span = torch.arange(self.context + 1)
        while True:
            starts = torch.randint(
                len(self.text) - self.context - 1, (self.batch_size, 1), generator=generator
            )
            windows = self.text[starts + span]
            yield windows[:, :-1], windows[:, 1:]


class StdlibTextData(pl.LightningDataModule):
    """Random training windows and fixed held-out windows of the standard library's source.

    Example::

        data = StdlibTextData(context=64, batch_size=32)
        data.setup("fit")
        tokens, targets = next(iter(data.train_dataloader()))  # targets: tokens shifted by one

    Args:
        context: sequence length (must match the model's).
        batch_size: training windows per batch.
        train_bytes: bytes of training text read.
        heldout_windows: held-out windows (evaluated in one batch).
        data_seed: seed of the training windows (each DDP rank adds its rank).
    """

    def __init__(
        self,
        context: int = 64,
        batch_size: int = 32,
        train_bytes: int = 2_000_000,
        heldout_windows: int = 256,
        data_seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_text = torch.from_numpy(stdlib_text(False, self.hparams.train_bytes).copy())
        needed = self.hparams.heldout_windows * (self.hparams.context + 1)
        self.heldout_text = torch.from_numpy(stdlib_text(True, needed).copy())

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        stream = _Windows(
            self.train_text.long(),
            self.hparams.context,
            self.hparams.batch_size,
            self.hparams.data_seed + rank,
        )
        return DataLoader(stream, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        windows = self.heldout_text.long().view(-1, self.hparams.context + 1)
        return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=len(windows))
