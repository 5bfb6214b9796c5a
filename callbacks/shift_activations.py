"""A callback that shifts the module's activations when it is set up, for configs."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from torch import nn

from dynamics.bias.shift import ShiftTable, check_shift_settings, shift_activations
from dynamics.errors import DynamicsError
from dynamics.model.record import builds_in_configure_model, class_path
from dynamics.store import names


class ShiftActivationsBase:
    """Apply :func:`dynamics.bias.shift_activations` to the module when it is set up.

    When it shifts, how a resume replays it, and pitfalls: ``docs/probes/shift_activations.md``.

    Example::

        trainer = pl.Trainer(callbacks=[ShiftActivations("expected"), DynamicsRecorder("run.h5")])

    Args:
        shift: ``"expected"`` (c = E[φ(z)], z ~ N(0, 1), by quadrature of each module's own
            φ), ``"adaptive"`` (each forward's mean over ``dim``) or a number.
        include: module-name patterns (``*``: one segment, ``**``: any depth); when given,
            only matching activations are shifted.
        exclude: module-name patterns whose activations are left alone.
        dim: the feature dimension of the adaptive mean: ``-1`` for ``(..., features)``
            (MLPs, transformers), ``1`` for NCHW convolution maps.

    Raises:
        DynamicsError: at construction, on an unknown ``shift``; at setup, when a pattern
            matches no module or no activation was shifted (a model whose activations are all
            functional calls, excluded or shifted already), since a run that silently shifts
            nothing reads as a shifted one.
    """

    def __init__(
        self,
        shift: str | float = "expected",
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        dim: int = -1,
    ) -> None:
        check_shift_settings(shift, include or [], exclude or [], dim)
        self.shift = shift
        self.include = list(include or [])
        self.exclude = list(exclude or [])
        self.dim = dim
        self.table = ShiftTable()
        self._shifted: weakref.ref[nn.Module] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not builds_in_configure_model(pl_module):
            self.complete_edit(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.complete_edit(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.complete_edit(pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.complete_edit(pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.complete_edit(pl_module)

    def complete_edit(self, pl_module: nn.Module) -> None:
        """Shift ``pl_module`` unless it is shifted already (by this callback: once only)."""
        if self._shifted is not None and self._shifted() is pl_module:
            return
        table = shift_activations(
            pl_module, self.shift, include=self.include, exclude=self.exclude, dim=self.dim
        )
        if not any(row.replaced for row in table):
            why = (
                "; ".join(f"{row.module or '<model>'}: {row.note}" for row in table)
                if table
                else "it has no activation module (a functional call such as F.gelu(x) "
                "cannot be swapped)"
            )
            raise DynamicsError(
                f"ShiftActivations shifted no activation of {type(pl_module).__name__}: {why}"
            )
        self.table = table
        self._shifted = weakref.ref(pl_module)

    def dynamics_edit(self) -> dict[str, Any] | None:
        """What the recorder stores about this edit: the settings and one row per activation
        found (module path, activation, replaced, shift, c, note); None before any setup."""
        if self._shifted is None:
            return None
        return {
            "class_path": class_path(self),
            "edit": names.EDIT_SHIFT,
            "settings": {
                "shift": self.shift,
                "include": self.include,
                "exclude": self.exclude,
                "dim": self.dim,
            },
            "table": [dataclasses.asdict(row) for row in self.table],
        }


class ShiftActivations(ShiftActivationsBase, Callback):
    """The activation-shifting callback for ``pytorch_lightning``; see
    :class:`ShiftActivationsBase`."""
