"""The autoencoder experiment's data: scikit-learn's 8×8 digits (the images alone).

The digits ship with scikit-learn (``sklearn.datasets.load_digits``): 1,797 images, nothing to
download. Pixels (0–16) are scaled to [0, 1]; a fixed permutation holds out the last
``heldout_size`` images.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

#: The split's permutation seed: the same held-out images for every config.
_SPLIT_SEED = 0


def digit_images(heldout: bool, heldout_size: int) -> torch.Tensor:
    """The training or held-out digits as (N, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits  # imported here: only this experiment needs it

    images = load_digits().images.astype(np.float32) / 16.0
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(images))
    chosen = order[-heldout_size:] if heldout else order[:-heldout_size]
    return torch.from_numpy(images[chosen]).unsqueeze(1)


class DigitsData(pl.LightningDataModule):
    """Shuffled training batches (seeded) and the held-out digits in one batch.

    Example::

        data = DigitsData(batch_size=64)
        data.setup("fit")
        (images,) = next(iter(data.train_dataloader()))  # (64, 1, 8, 8) in [0, 1]

    Args:
        batch_size: training images per batch.
        heldout_size: images held out.
        data_seed: seed of the training order.
    """

    def __init__(self, batch_size: int = 64, heldout_size: int = 297, data_seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_images = digit_images(False, self.hparams.heldout_size)
        self.heldout_images = digit_images(True, self.hparams.heldout_size)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.data_seed)
        return DataLoader(
            TensorDataset(self.train_images),
            batch_size=self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.heldout_images), batch_size=len(self.heldout_images))
