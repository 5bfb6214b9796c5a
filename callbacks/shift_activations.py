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

    Namespace-free: :class:`ShiftActivations` is the ``pytorch_lightning`` callback and
    ``dynamics.callbacks.lightning.ShiftActivations`` the ``lightning.pytorch`` one. A user A/Bs
    their own model without editing it, in a LightningCLI config::

        - class_path: dynamics.callbacks.ShiftActivations
          init_args: {shift: expected, exclude: ["head.**"]}

    ``setup`` runs before every ``on_fit_start``, so the module is shifted before the recorder
    records θ0, whatever the order of the callbacks (shifting changes no parameter: θ0 is the
    same). A module that builds layers in ``configure_model`` (Lightning's hook for large
    models, called after ``setup``) is shifted once they exist instead: when fitting,
    validating, testing or predicting starts, or earlier when the recorder asks
    (:meth:`complete_edit`) — an activation holds no parameter, so the optimizer built in
    between is unaffected. It shifts at every stage (fit, validate, test, predict), since the
    model must compute what it trained with; a module it has shifted already is left alone, so a
    second ``setup`` (``trainer.validate`` after ``trainer.fit``) never shifts twice. A
    checkpoint holds parameters only and the shift has none: a fit resumed from one
    (``ckpt_path=``) is shifted again at its setup, as its config lists this callback, and
    continues as if never stopped.
    What was done is kept in ``table`` and stored in the run file by the recorder (see
    :meth:`dynamics_edit`), and ``dynamics plane`` shifts the model it rebuilds the same way.

    The arguments are those of :func:`~dynamics.bias.shift_activations` that a config can
    hold. Its ``custom`` (a callable φ for a module of the user's own) and ``example_input``
    (a traced forward that lists functional calls such as ``F.gelu(x)``) are not: call the
    function in the module's ``__init__`` for those.

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
