"""A callback that applies a bias initialization recipe when fitting starts, for configs."""

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from dynamics.bias.init import RECIPES, BiasSet, init_biases
from dynamics.errors import DynamicsError


class InitBiasesBase:
    """Apply the ``dynamics.bias.init`` recipe ``recipe`` to the module at fit setup.

    Namespace-free: :class:`InitBiases` is the ``pytorch_lightning`` callback and
    ``dynamics.callbacks.lightning.InitBiases`` the ``lightning.pytorch`` one.

    ``options`` are the recipe's keyword arguments (a dict rather than ``**kwargs``, which
    LightningCLI cannot check against a config).

    ``setup`` runs before every ``on_fit_start``, so the recorder's θ0 already has these biases,
    whatever the order of the callbacks; a fit resumed from a checkpoint then loads the
    checkpoint's biases over them. What was set is kept in ``table``. In a LightningCLI config::

        - class_path: dynamics.callbacks.InitBiases
          init_args: {recipe: log_odds, options: {priors: [0.9, 0.1]}}
    """

    def __init__(self, recipe: str, options: dict[str, Any] | None = None) -> None:
        if recipe not in RECIPES:
            raise DynamicsError(f"unknown bias recipe {recipe!r}; choose from {', '.join(RECIPES)}")
        self.recipe = recipe
        self.options = dict(options or {})
        self.table: list[BiasSet] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.table = init_biases(pl_module, self.recipe, **self.options)


class InitBiases(InitBiasesBase, Callback):
    """The bias initialization callback for ``pytorch_lightning``; see :class:`InitBiasesBase`."""
