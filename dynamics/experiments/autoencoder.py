"""A small VGG-style convolutional autoencoder on scikit-learn's 8×8 digits (seed 002, §3.2).

The digits ship with scikit-learn (``sklearn.datasets.load_digits``): 1,797 images, nothing to
download. Pixels (0–16) are scaled to [0, 1]; a fixed permutation holds out the last
``heldout_size`` images.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynamics.experiments.variants import shifted_network

#: The split's permutation seed: the same held-out images for every config.
_SPLIT_SEED = 0


#: How the convolutions are initialized: ``"kaiming"``, He et al.'s forward-preserving init
#: (Kaiming normal, fan-in, ReLU gain; zero biases), under which the pre-activations on the
#: digits have standard deviations of 0.3–0.8 at θ0, of the order the expected shift
#: c = E[ReLU(z)], z ~ N(0, 1) assumes; ``"pytorch"``: PyTorch's default (Kaiming uniform with
#: a = √5), whose pre-activations here have standard deviations of 0.01–0.35, so the shift far
#: exceeds their ReLU's mean and the shifted hidden states start near the constant −c.
INITS = ("kaiming", "pytorch")


def conv_autoencoder(width: int, init: str = "kaiming") -> nn.Sequential:
    """Two VGG stages down (8×8 → 4×4, ``width`` then ``2·width`` channels), two up.

    Every convolution is 3×3 with padding 1 and followed by a ReLU, except the last, which
    outputs the image. The ReLUs (the hidden states the paper splits) are ``encoder.1``,
    ``encoder.3``, ``encoder.6``, ``encoder.8``, ``decoder.2``, ``decoder.4``.
    """
    w = width
    net = nn.Sequential(
        nn.Sequential(  # encoder
            nn.Conv2d(1, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.ReLU(),
        ),
        nn.Sequential(  # decoder
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(2 * w, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, 1, 3, padding=1),
        ),
    )
    if init == "kaiming":
        for conv in net.modules():
            if isinstance(conv, nn.Conv2d):
                nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(conv.bias)
    return net


class AutoencoderModule(pl.LightningModule):
    """Reconstruction of digit images with :func:`conv_autoencoder`, mean squared error.

    Logs ``val_loss`` (held-out reconstruction MSE).

    Args:
        width: channels of the first stage (the second has twice as many).
        init: one of :data:`INITS`.
        shift: ``"none"``, or the shift :func:`dynamics.bias.shift_activations` applies to every
            ReLU (``"expected"``, ``"adaptive"`` — over channels — or a number).
        seed: initialization seed (equal seeds give equal θ0 whatever the shift).
        lr: Adam learning rate.
    """

    def __init__(
        self,
        width: int = 16,
        init: str = "kaiming",
        shift: str | float = "none",
        seed: int = 0,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        net = shifted_network(lambda: conv_autoencoder(width, init), seed, shift, dim=1)
        self.encoder, self.decoder = net[0], net[1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(images))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (images,) = batch
        loss = F.mse_loss(self(images), images)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (images,) = batch
        self.log("val_loss", F.mse_loss(self(images), images))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def digit_images(heldout: bool, heldout_size: int) -> torch.Tensor:
    """The training or held-out digits as (N, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits  # imported here: only this experiment needs it

    images = load_digits().images.astype(np.float32) / 16.0
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(images))
    chosen = order[-heldout_size:] if heldout else order[:-heldout_size]
    return torch.from_numpy(images[chosen]).unsqueeze(1)


class DigitsData(pl.LightningDataModule):
    """Shuffled training batches (seeded) and the held-out digits in one batch.

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
