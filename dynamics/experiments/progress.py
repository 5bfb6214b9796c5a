"""The progress bar of ``dynamics run``, and who needs a module to log its training loss.

At the teacher–student model's size, ``self.log`` of the training loss and a bar redrawn on
every step cost a sizeable share of each step (``benchmarks/bench_training_loop.py``). The
recorder reads the loss ``training_step`` returns, not the logged one, so the run's bar shows
that returned loss itself, redrawn every percent of the run, and the module logs only for a
reader that needs the logged value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar

#: How many redraws of the bar a run makes (at most, plus the last step's).
_REDRAWS = 100


class ReturnedLossBar(TQDMProgressBar):
    """Lightning's tqdm bar, redrawn every ``steps // 100`` steps, showing as ``train_loss``
    the loss ``training_step`` returned at the last redraw.

    Args:
        steps: the run's optimizer steps.
    """

    def __init__(self, steps: int) -> None:
        super().__init__(refresh_rate=max(1, steps // _REDRAWS))
        self._loss: torch.Tensor | None = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._loss = loss if isinstance(loss, torch.Tensor) else None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if self._loss is not None:
            # Lightning divides the returned loss by the accumulation count.
            metrics["train_loss"] = float(self._loss) * trainer.accumulate_grad_batches
        return metrics


def logs_training_loss(trainer: pl.Trainer) -> bool:
    """Whether a module under ``trainer`` should ``self.log`` its training loss: a logger
    records it, or a progress bar other than :class:`ReturnedLossBar` shows it."""
    bar = trainer.progress_bar_callback
    return bool(trainer.loggers) or (bar is not None and not isinstance(bar, ReturnedLossBar))
