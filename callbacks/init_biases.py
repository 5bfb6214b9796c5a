"""A callback that applies a bias initialization recipe when fitting starts, for configs."""

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from dynamics.bias.init import BiasSet, check_recipe, init_biases
from dynamics.callbacks.fit_description import plain
from dynamics.errors import DynamicsError
from dynamics.model.record import builds_in_configure_model, class_path
from dynamics.store import names


class InitBiasesBase:
    """Apply the ``dynamics.bias.init`` recipe ``recipe`` to the module at fit setup.

    Namespace-free: :class:`InitBiases` is the ``pytorch_lightning`` callback and
    ``dynamics.callbacks.lightning.InitBiases`` the ``lightning.pytorch`` one.

    ``options`` are the recipe's keyword arguments (a dict rather than ``**kwargs``, which
    LightningCLI cannot check against a config).

    ``setup`` runs before every ``on_fit_start``, so the recorder's θ0 already has these biases,
    whatever the order of the callbacks; a fit resumed from a checkpoint then loads the
    checkpoint's biases over them. What was set is kept in ``table`` and stored in the run file
    by the recorder (see :meth:`dynamics_edit`). In a LightningCLI config::

        - class_path: dynamics.callbacks.InitBiases
          init_args: {recipe: log_odds, options: {priors: [0.9, 0.1]}}

    ``zeros``, ``constant`` and ``normal`` take ``include`` and ``exclude`` module-name
    patterns among their options, e.g. only the hidden layers' biases::

          init_args: {recipe: constant, options: {value: 0.01, exclude: [head]}}

    Example::

        trainer = pl.Trainer(callbacks=[InitBiases("zeros"), DynamicsRecorder("run.h5")])
    """

    def __init__(self, recipe: str, options: dict[str, Any] | None = None) -> None:
        check_recipe(recipe, dict(options or {}))
        self.recipe = recipe
        self.options = dict(options or {})
        self.table: list[BiasSet] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            if builds_in_configure_model(pl_module):
                # Its layers do not exist yet and would keep their default biases; set after
                # the optimizer is built, a random recipe would differ between DDP ranks.
                raise DynamicsError(
                    f"InitBiases sets biases at setup, before {type(pl_module).__name__}."
                    "configure_model builds its layers; call dynamics.bias.init_biases(self, "
                    f"{self.recipe!r}, ...) at the end of configure_model instead"
                )
            self.table = init_biases(pl_module, self.recipe, **self.options)

    def dynamics_edit(self) -> dict[str, Any] | None:
        """What the recorder stores about this edit: the recipe, its options and one row per
        parameter set (module, parameter, value); None before the fit's setup. θ0 holds the
        biases it set, so a rebuilt model needs nothing replayed."""
        if not self.table:
            return None
        return {
            "class_path": class_path(self),
            "edit": names.EDIT_INIT_BIASES,
            "settings": {"recipe": self.recipe, "options": plain(self.options)},
            "table": [row._asdict() for row in self.table],
        }


class InitBiases(InitBiasesBase, Callback):
    """The bias initialization callback for ``pytorch_lightning``; see :class:`InitBiasesBase`."""
