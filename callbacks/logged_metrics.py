"""Scalars the module logs during validation (a held-out loss, an accuracy), per validation run."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.store import names
from dynamics.store.views import validation_view


class LoggedMetrics(Probe):
    """Copies ``trainer.callback_metrics[key]`` for each key after every validation run.

    Rows are recorded at the optimizer step the validation ran after; a key not logged in a run
    reads NaN, with a warning event the first time. The sanity check is never recorded.

    Args:
        keys: names the module passes to ``self.log`` in its validation step.
    """

    name = names.VALIDATION

    def __init__(self, keys: Sequence[str] = (names.VAL_LOSS,)) -> None:
        super().__init__()
        if not keys:
            raise ValueError("LoggedMetrics needs at least one key")
        self.keys = tuple(keys)
        self._missing: set[str] = set()  # keys already noted as not logged

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        return {names.VALIDATION: {key: SeriesSpec(view=validation_view(key)) for key in self.keys}}

    def is_due(self, step: int) -> bool:
        return False  # validation runs have their own schedule

    def on_validation_end(self, trainer, pl_module) -> Rows:
        metrics = trainer.callback_metrics
        for key in [k for k in self.keys if k not in metrics and k not in self._missing]:
            self._missing.add(key)
            self.note(trainer.global_step, f"{key!r} was not logged in validation; recorded NaN")
        nan = torch.tensor(float("nan"))
        return {
            names.VALIDATION: {k: metrics.get(k, nan).detach().float().cpu() for k in self.keys}
        }
