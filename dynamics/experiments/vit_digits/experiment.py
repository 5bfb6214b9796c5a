"""The digits vision transformer with and without adaptive shifting, as the ``dynamics run``
experiment ``vit_digits`` (seed 002, §4.1's ViT-B, in miniature).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift of
their MLP activations. Held-out loss and top-1 accuracy are logged at every evaluation.
"""

from __future__ import annotations

from dynamics.experiments.scaleup import ScaleupExperiment
from dynamics.experiments.vit_digits.config import ViTDigitsConfig
from dynamics.experiments.vit_digits.data import LabelledDigitsData
from dynamics.experiments.vit_digits.module import ViTDigitsModule
from dynamics.store import names

#: The top-1 accuracy key :class:`ViTDigitsModule` logs.
VAL_ACC = "val_acc"


class ViTDigitsExperiment(ScaleupExperiment[ViTDigitsConfig]):
    """Digits vision transformers, one per shift in ``config.variants``.

    Example::

        experiment, config = load_config("vit_digits", steps=100)
        run_experiment(experiment, config, "runs/vit_digits")
    """

    name = "vit_digits"
    config_class = ViTDigitsConfig
    metrics = (names.VAL_LOSS, VAL_ACC)

    def module(self, config: ViTDigitsConfig, shift: str | float) -> ViTDigitsModule:
        return ViTDigitsModule(
            **vars(config.model),
            shift=shift,
            seed=config.seed,
            **config.optimizer.module_kwargs(),
        )

    def data(self, config: ViTDigitsConfig) -> LabelledDigitsData:
        return LabelledDigitsData(**vars(config.data))
