"""Scalars the module logs during validation (a held-out loss, an accuracy), per validation run."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.store import names
from dynamics.store.views import validation_view

#: How Lightning names a metric logged from one of several validation loaders
#: (``self.log(..., add_dataloader_idx=True)``, its default).
LOADER_SUFFIX = "/dataloader_idx_{}"
_HAS_LOADER = re.compile(r"/dataloader_idx_\d+$")


class LoggedMetrics(Probe):
    """Copies ``fit.metrics[key]`` for each key after every validation run.

    Rows are recorded at the optimizer step the validation ran after; a key not logged in a run
    reads NaN, with a warning event the first time. The sanity check is never recorded. A key
    may be any text Lightning logs (slashes, dots, spaces, unicode): the run file stores it as
    given and names its dataset by :func:`dynamics.store.names.series_name`.

    With several validation loaders Lightning logs ``key`` once per loader, as
    ``key/dataloader_idx_<i>``; each such key is then recorded as its own series, so the
    default records the held-out loss of every loader.

    Example::

        LoggedMetrics(keys=["val_loss", "val_acc"])

    Args:
        keys: names the module passes to ``self.log`` in its validation step.
        per_loader: with several validation loaders, record each key without a loader suffix
            once per loader (``key/dataloader_idx_<i>``); False records the keys as given (for
            metrics logged with ``add_dataloader_idx=False``).
    """

    name = names.VALIDATION

    def __init__(self, keys: Sequence[str] = (names.VAL_LOSS,), per_loader: bool = True) -> None:
        super().__init__()
        if isinstance(keys, str) or not keys:
            raise ValueError("LoggedMetrics needs a sequence of at least one key")
        if not all(isinstance(key, str) for key in keys):
            raise ValueError(f"LoggedMetrics keys must be text, got {list(keys)!r}")
        self.keys = tuple(keys)
        self.per_loader = per_loader
        self.recorded_keys = tuple(dict.fromkeys(self.keys))  # resolved at setup
        self._missing: set[str] = set()  # keys already noted as not logged

    def setup(self, fit, pl_module, batch) -> None:
        loaders = fit.validation_loaders if self.per_loader else 1
        expanded = [k for key in self.keys for k in _keys(key, loaders)]
        self.recorded_keys = tuple(dict.fromkeys(expanded))  # once each, in the order given

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        return {
            names.VALIDATION: {
                key: SeriesSpec(view=validation_view(key)) for key in self.recorded_keys
            }
        }

    def settings(self) -> dict[str, object]:
        return {"keys": list(self.recorded_keys), "per_loader": self.per_loader}

    def is_due(self, step: int) -> bool:
        return False  # validation runs have their own schedule

    def on_validation_end(self, fit, pl_module) -> Rows:
        metrics = fit.metrics
        for key in [k for k in self.recorded_keys if k not in metrics and k not in self._missing]:
            self._missing.add(key)
            self.note(fit.global_step, _not_logged(key, metrics))
        nan = torch.tensor(float("nan"))
        return {
            names.VALIDATION: {
                k: metrics.get(k, nan).detach().float().cpu() for k in self.recorded_keys
            }
        }


def _keys(key: str, loaders: int) -> list[str]:
    """The keys Lightning logs for ``key`` with ``loaders`` validation loaders."""
    if loaders <= 1 or _HAS_LOADER.search(key):
        return [key]
    return [key + LOADER_SUFFIX.format(i) for i in range(loaders)]


def _not_logged(key: str, metrics: dict) -> str:
    bare = _HAS_LOADER.sub("", key)
    if bare != key and bare in metrics:
        return (
            f"{key!r} was not logged in validation, {bare!r} was (logged with "
            "add_dataloader_idx=False?); recorded NaN: pass LoggedMetrics(per_loader=False)"
        )
    return f"{key!r} was not logged in validation; recorded NaN"
