"""The digits experiment's data: scikit-learn's labelled 8×8 digits.

The digits ship with scikit-learn (``sklearn.datasets.load_digits``): 1,797 images, nothing to
download. The model reads the 8×8 image itself, cut into non-overlapping patches (2×2 by
default: 16 patch tokens and a class token), not an upsampled copy. Pixels (0–16) are scaled to
[0, 1]; a stratified split (fixed seed) holds out ``heldout_size`` images with the classes in
their overall proportions.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

#: The split's seed: the same held-out images for every config.
_SPLIT_SEED = 0
#: The 1,797 digits of scikit-learn.
DIGITS = 1797


def labelled_digits(heldout: bool, heldout_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training or held-out digits: (N, 1, 8, 8) float32 images in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits  # imported here: only the digit experiments need it
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    split = train_test_split(
        images,
        digits.target,
        test_size=heldout_size,
        stratify=digits.target,
        random_state=_SPLIT_SEED,
    )
    chosen, labels = (split[1], split[3]) if heldout else (split[0], split[2])
    return torch.from_numpy(chosen).unsqueeze(1), torch.from_numpy(labels).long()


class LabelledDigitsData(pl.LightningDataModule):
    """Shuffled training batches (seeded) and the held-out digits in one batch.

    Example::

        data = LabelledDigitsData(batch_size=64)
        data.setup("fit")
        images, labels = next(iter(data.train_dataloader()))  # (64, 1, 8, 8), (64,)

    Args:
        batch_size: training images per batch.
        heldout_size: images held out (stratified by class).
        data_seed: seed of the training order.
    """

    def __init__(self, batch_size: int = 64, heldout_size: int = 360, data_seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = TensorDataset(*labelled_digits(False, self.hparams.heldout_size))
        self.heldout_set = TensorDataset(*labelled_digits(True, self.hparams.heldout_size))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.data_seed)
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.heldout_set, batch_size=len(self.heldout_set))
