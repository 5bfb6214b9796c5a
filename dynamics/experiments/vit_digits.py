"""A small vision transformer classifying scikit-learn's 8×8 digits (seed 002, §4's ViT-B on
ImageNet-1K, in miniature).

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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dynamics.experiments.variants import shifted_network
from dynamics.models import MLP_ACTIVATIONS, ViT

#: The split's seed: the same held-out images for every config.
_SPLIT_SEED = 0
#: The 1,797 digits of scikit-learn.
DIGITS = 1797


class ViTDigitsModule(pl.LightningModule):
    """Digit classification with :class:`~dynamics.models.ViT`, cross-entropy loss; logs
    ``val_loss`` and ``val_acc`` (held-out top-1 accuracy).

    Args:
        patch_size: side of a patch of the 8×8 image (1, 2, 4 or 8).
        width: residual-stream width.
        depth: number of transformer blocks.
        heads: attention heads.
        activation: MLP activation.
        shift: ``"none"``, or the shift :func:`dynamics.bias.shift_activations` applies to every
            MLP activation (``"adaptive"``: Eq. 9, each token's mean over the hidden features
            subtracted; ``"expected"`` or a number: a constant).
        seed: initialization seed (equal seeds give equal θ0 whatever the shift).
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        patch_size: int = 2,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        activation: str = "gelu",
        shift: str | float = "none",
        seed: int = 0,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = shifted_network(
            lambda: ViT(8, patch_size, 1, 10, width, depth, heads, activation),
            seed,
            shift,
            include=[MLP_ACTIVATIONS],
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def dynamics_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self.dynamics_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self.model(images)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


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
