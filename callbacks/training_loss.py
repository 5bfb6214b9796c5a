"""The training loss of each recorded step: what the step's micro-batches returned, unscaled."""

from __future__ import annotations

from typing import Any

import torch

from dynamics import world
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.params.vectors import module_device
from dynamics.store import names
from dynamics.store.views import standard_view
from dynamics.world import Reduce, checked_reduce


class TrainingLoss(Probe):
    """The loss of each recorded optimizer step, as ``training_step`` computed it.

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/training_loss.md``.

    Example::

        TrainingLoss(loss_key="train_loss", every_n_steps=1)

    Args:
        loss_key: the logged metric that stands in for a loss ``training_step`` did not return.
        reduce: ``"global"`` (every rank's batch) or ``"rank0"``.
        every_n_steps: recording period in optimizer steps.
    """

    name = names.LOSS

    def __init__(
        self, loss_key: str = "train_loss", reduce: Reduce = "global", every_n_steps: int = 1
    ) -> None:
        super().__init__(every_n_steps)
        self.loss_key = loss_key
        self.reduce = checked_reduce(reduce)
        self._losses: list[torch.Tensor] = []  # unscaled, one per micro-batch of the due step
        self._noted: set[str] = set()  # the notes already made: each is made once per run

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        view = standard_view(names.LOSS, names.LOSS_TRAIN)
        return {names.LOSS: {names.LOSS_TRAIN: SeriesSpec(view=view)}}

    def settings(self) -> dict[str, Any]:
        ranks = "every rank's" if self.reduce == "global" else "rank 0's"
        return {
            "loss_key": self.loss_key,
            "reduce": self.reduce,
            "reduction": f"mean of {ranks} unscaled micro-batch losses",
        }

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        self._losses = []

    def on_micro_batch_end(self, fit, pl_module, batch, outputs, step) -> None:
        loss = fit.micro_batch_loss(outputs)  # unscaled, in the loop's own terms
        if loss is None:
            loss = self._logged_loss(fit, step)
        if loss is not None:
            self._losses.append(loss.detach().float().reshape(()))

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        if self._losses:
            total, count = fit.loss_sum(self._losses)
            count = torch.full_like(total, count)
        else:  # every rank joins the collective, with or without a loss of its own
            total = count = torch.zeros((), device=module_device(pl_module))
        if self.reduce == "global":
            total, count = world.all_reduce([total, count])
        if self._losses or world.is_distributed():
            loss = total / count  # 0/0 is NaN: no rank had a loss
        else:
            self._note_once(
                step,
                f"training_step returned no loss and logged no {self.loss_key!r}; recorded NaN "
                "(return the loss, or set TrainingLoss(loss_key=...) to what the step logs)",
            )
            loss = torch.tensor(float("nan"))
        self._losses = []
        return {names.LOSS: {names.LOSS_TRAIN: loss}}

    def _logged_loss(self, fit, step: int) -> torch.Tensor | None:
        metrics = fit.metrics
        # With on_step and on_epoch logging, the bare key may hold the last epoch's mean.
        for key in (f"{self.loss_key}_step", self.loss_key):
            if isinstance(metrics.get(key), torch.Tensor):
                self._note_once(
                    step,
                    f"training_step returned no loss; recording the logged {key!r} instead",
                )
                return metrics[key]
        return None

    def _note_once(self, step: int, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            self.note(step, message)
