"""The digits experiment's module: digit classification with its vision transformer."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from dynamics.experiments.optimization import module_optimization
from dynamics.experiments.shift_experiment import shifted_network
from dynamics.experiments.transformer import MLP_ACTIVATIONS
from dynamics.experiments.vit_digits.model import ViT


class ViTDigitsModule(pl.LightningModule):
    """Digit classification with :class:`~dynamics.experiments.vit_digits.model.ViT`,
    cross-entropy loss; logs ``val_loss`` and ``val_acc`` (held-out top-1 accuracy).

    Example::

        trainer = pl.Trainer(max_steps=200, callbacks=[DynamicsRecorder("runs/vit.h5")])
        trainer.fit(ViTDigitsModule(shift="adaptive"), LabelledDigitsData())

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
        lr: learning rate.
        optimizer: ``adamw`` by default, or ``adam``, ``adamw`` or ``sgd``.
        optimizer_options: the other ``optimizer.`` keys
            (:meth:`~dynamics.experiments.optimization.OptimizerConfig.options`); None: defaults.
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
        optimizer: str = "adamw",
        optimizer_options: dict[str, Any] | None = None,
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

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        return module_optimization(self)
