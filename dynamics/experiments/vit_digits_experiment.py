"""The digits vision transformer with and without adaptive shifting, as the ``dynamics run``
experiment ``vit_digits`` (seed 002, §4.1's ViT-B, in miniature).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift of
their MLP activations. Held-out loss and top-1 accuracy are logged at every evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamics.experiments.config import ConfigError, ExperimentConfig, check_positive, check_seeds
from dynamics.experiments.registry import Built, Experiment, Recording, register
from dynamics.experiments.scaleup import (
    OptimizerConfig,
    RecordConfig,
    check_common,
    default_variants,
    transformer_recordings,
)
from dynamics.experiments.variants import shared_probe_batch
from dynamics.experiments.vit_digits import DIGITS, LabelledDigitsData, ViTDigitsModule
from dynamics.store import names

#: The top-1 accuracy key :class:`ViTDigitsModule` logs.
VAL_ACC = "val_acc"
#: Sides of a patch that tile the 8×8 image.
PATCH_SIZES = (1, 2, 4, 8)


@dataclass
class ModelConfig:
    patch_size: int = 2
    width: int = 64
    depth: int = 4
    heads: int = 4
    activation: str = "gelu"


@dataclass
class DataConfig:
    batch_size: int = 64
    heldout_size: int = 360
    data_seed: int = 0


@dataclass
class ViTDigitsConfig(ExperimentConfig):
    """One comparison: vision transformers that differ only in their MLP activations' shift.

    Attributes:
        variants: ``{name: shift}``; each becomes ``<out>/<name>.h5``.
    """

    steps: int = 1500
    eval_every: int = 50
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    variants: dict[str, str | float] = field(default_factory=default_variants)

    def validate(self) -> ViTDigitsConfig:
        super().validate()
        model, data = self.model, self.data
        check_positive(
            {
                "model.width": model.width,
                "model.depth": model.depth,
                "data.batch_size": data.batch_size,
            }
        )
        check_seeds({"data.data_seed": data.data_seed})
        if model.patch_size not in PATCH_SIZES:
            raise ConfigError(
                f"model.patch_size must tile the 8×8 digits ({', '.join(map(str, PATCH_SIZES))}), "
                f"got {model.patch_size}"
            )
        # Stratification needs one held-out and one training image of each of the 10 classes.
        if not 10 <= data.heldout_size <= DIGITS - 10 - data.batch_size:
            raise ConfigError(
                f"data.heldout_size must be from 10 to {DIGITS - 10} minus data.batch_size "
                f"({DIGITS - 10 - data.batch_size}), got {data.heldout_size}"
            )
        check_common(
            self.record, self.optimizer, model.activation, model.width, model.heads, self.variants
        )
        return self


class ViTDigitsExperiment(Experiment[ViTDigitsConfig]):
    """Digits vision transformers, one per shift in ``config.variants``."""

    name = "vit_digits"
    config_class = ViTDigitsConfig
    setting = "shift"

    def variants(self, config: ViTDigitsConfig) -> Mapping[str, str | float]:
        return config.variants

    def build(self, config: ViTDigitsConfig, variant: str) -> Built:
        module = ViTDigitsModule(
            **vars(config.model),
            shift=config.variants[variant],
            seed=config.seed,
            lr=config.optimizer.lr,
        )
        return Built(module, LabelledDigitsData(**vars(config.data)))

    def recordings(
        self, config: ViTDigitsConfig, built: Mapping[str, Built]
    ) -> dict[str, Recording]:
        probe_batch = shared_probe_batch(built)
        return transformer_recordings(
            config.record, list(built), probe_batch, [names.VAL_LOSS, VAL_ACC]
        )


register(ViTDigitsExperiment())
