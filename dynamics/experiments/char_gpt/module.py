"""The character experiment's module: next-byte prediction with its transformer."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from dynamics.experiments.char_gpt.model import CharGPT
from dynamics.experiments.optimization import module_optimization
from dynamics.experiments.shift_experiment import shifted_network
from dynamics.experiments.transformer import MLP_ACTIVATIONS


class CharGPTModule(pl.LightningModule):
    """Next-byte prediction with :class:`~dynamics.experiments.char_gpt.model.CharGPT`; logs
    ``val_loss`` and ``val_bpc`` (bits per character).

    Example::

        trainer = pl.Trainer(max_steps=200, callbacks=[DynamicsRecorder("runs/gpt.h5")])
        trainer.fit(CharGPTModule(shift="adaptive"), StdlibTextData(context=64))

    Args:
        context: sequence length.
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
        context: int = 64,
        width: int = 64,
        depth: int = 2,
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
            lambda: CharGPT(256, context, width, depth, heads, activation),
            seed,
            shift,
            include=[MLP_ACTIVATIONS],
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def dynamics_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self.dynamics_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self.dynamics_loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_bpc", loss / math.log(2))

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        return module_optimization(self)
