"""The digits experiment's config; every key is optional (defaults below)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamics.experiments.config import ConfigError
from dynamics.experiments.scaleup import ScaleupConfig, TransformerModelConfig
from dynamics.experiments.vit_digits.data import DIGITS

#: Sides of a patch that tile the 8×8 image.
PATCH_SIZES = (1, 2, 4, 8)


@dataclass
class ModelConfig(TransformerModelConfig):
    depth: int = 4
    patch_size: int = 2  # side of a patch of the 8×8 image: one of PATCH_SIZES


@dataclass
class DataConfig:
    batch_size: int = 64
    heldout_size: int = 360
    data_seed: int = 0


@dataclass
class ViTDigitsConfig(ScaleupConfig):
    """One comparison: vision transformers that differ only in their MLP activations' shift
    (the record section, optimizer and variants are
    :class:`~dynamics.experiments.scaleup.ScaleupConfig`'s).

    Example::

        experiment, config = load_config("vit_digits", steps=100)
        config.model.patch_size  # 2: 16 patch tokens and a class token
    """

    steps: int = 1500
    eval_every: int = 50
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> ViTDigitsConfig:
        super().validate()
        model, data = self.model, self.data
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
        return self
