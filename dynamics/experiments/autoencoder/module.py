"""The autoencoder experiment's module: reconstruction of digit images."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from dynamics.experiments.autoencoder.model import conv_autoencoder
from dynamics.experiments.optimization import module_optimization
from dynamics.experiments.shift_experiment import shifted_network


class AutoencoderModule(pl.LightningModule):
    """Reconstruction of digit images with
    :func:`~dynamics.experiments.autoencoder.model.conv_autoencoder`, mean squared error.

    Logs ``val_loss`` (held-out reconstruction MSE).

    Example::

        trainer = pl.Trainer(max_steps=200, callbacks=[DynamicsRecorder("runs/ae.h5")])
        trainer.fit(AutoencoderModule(shift="expected"), DigitsData())

    Args:
        width: channels of the first stage (the second has twice as many).
        init: one of :data:`~dynamics.experiments.autoencoder.model.INITS`.
        shift: ``"none"``, or the shift :func:`dynamics.bias.shift_activations` applies to every
            ReLU (``"expected"``, ``"adaptive"`` — over channels — or a number).
        seed: initialization seed (equal seeds give equal θ0 whatever the shift).
        lr: learning rate.
        optimizer: ``adam`` by default, or ``adam``, ``adamw`` or ``sgd``.
        optimizer_options: the other ``optimizer.`` keys
            (:meth:`~dynamics.experiments.optimization.OptimizerConfig.options`); None: defaults.
    """

    def __init__(
        self,
        width: int = 16,
        init: str = "kaiming",
        shift: str | float = "none",
        seed: int = 0,
        lr: float = 1e-3,
        optimizer: str = "adam",
        optimizer_options: dict[str, Any] | None = None,
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

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        return module_optimization(self)
