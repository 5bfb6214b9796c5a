"""The training loss of each recorded step, as the training step returned it."""

from __future__ import annotations

import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.store import View, names


class TrainingLoss(Probe):
    """The loss the module's ``training_step`` returned (tensor or ``dict["loss"]``).

    A step that returned no loss (Lightning's way to skip a batch) records NaN.
    """

    name = names.LOSS

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        view = View("scalar", "Training loss", "loss", log_y=True)
        return {names.LOSS: {names.LOSS_TRAIN: SeriesSpec(view=view)}}

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float("nan"))
        return {names.LOSS: {names.LOSS_TRAIN: loss.detach().float().reshape(())}}
