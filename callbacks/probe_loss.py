"""The loss that probes making extra passes (HessianSpectrum, GradientPlane) differentiate."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.apply_func import move_data_to_device

from dynamics.callbacks.probe import ProbeUnavailable, detached_copy, require_unsharded
from dynamics.isolation import Mode, checked_mode
from dynamics.loss_rule import LossSource, LossUnavailable, loss_source


class ProbeLoss:
    """The module's loss by the loss rule, on a fixed probe batch, in a chosen mode.

    At setup it refuses, with :class:`~dynamics.callbacks.ProbeUnavailable`, a module the loss
    rule (:mod:`dynamics.loss_rule`) gives no loss for, such as a manually optimized module
    without ``dynamics_loss``: decided before any extra pass, so no training step that steps an
    optimizer is ever called.

    Args:
        probe: the owning probe's class name, for messages.
        mode: the :data:`~dynamics.isolation.Mode` extra passes run the module in.
        batch: the probe batch; default: a copy of the fit's first training batch.

    Attributes:
        batch: the probe batch, on the module's device after setup.
        source: where the loss rule takes the loss from; ``None`` before setup.
    """

    def __init__(self, probe: str, mode: Mode, batch: Any = None) -> None:
        self.probe = probe
        self.mode = checked_mode(mode)
        self.batch = None if batch is None else detached_copy(batch)
        self.source: LossSource | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Check the strategy and the loss rule, and keep the probe batch.

        Raises:
            ProbeUnavailable: if the loss rule gives no loss for ``pl_module``.
            ValueError: under a strategy that shards parameters.
        """
        require_unsharded(trainer, self.probe)
        try:
            self.source = loss_source(pl_module)
        except LossUnavailable as error:
            raise ProbeUnavailable(f"{self.probe}: {error}") from None
        if self.batch is None:  # neither given nor restored from a checkpoint
            self.batch = detached_copy(batch)
        self.batch = move_data_to_device(self.batch, pl_module.device)

    def settings(self) -> dict[str, Any]:
        """The mode and the loss's source, as stored in the run file."""
        return {"mode": self.mode, "loss": self.source}

    def state_dict(self) -> dict[str, Any]:
        # The probe batch, so a resumed run keeps measuring the same loss.
        return {} if self.batch is None else {"batch": move_data_to_device(self.batch, "cpu")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batch" in state:
            self.batch = state["batch"]
