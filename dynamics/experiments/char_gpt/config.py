"""The character experiment's config; every key is optional (defaults below)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamics.experiments.config import ConfigError, check_positive
from dynamics.experiments.scaleup import ScaleupConfig, TransformerModelConfig


@dataclass
class ModelConfig(TransformerModelConfig):
    context: int = 64  # bytes per window


@dataclass
class DataConfig:
    batch_size: int = 32
    train_bytes: int = 2_000_000
    heldout_windows: int = 256
    data_seed: int = 0


@dataclass
class CharGPTConfig(ScaleupConfig):
    """One comparison: character transformers that differ only in their MLP activations' shift
    (the record section, optimizer and variants are
    :class:`~dynamics.experiments.scaleup.ScaleupConfig`'s).

    Example::

        experiment, config = load_config("char_gpt", steps=100)
        config.model.context, config.variants  # 64, {"unshifted": "none", "adaptive": ...}
    """

    steps: int = 1000
    eval_every: int = 50
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> CharGPTConfig:
        super().validate()
        model, data = self.model, self.data
        check_positive(
            {"model.context": model.context, "data.heldout_windows": data.heldout_windows}
        )
        if data.train_bytes <= model.context + 1:
            raise ConfigError(
                f"data.train_bytes must exceed model.context + 1 ({model.context + 1}), "
                f"got {data.train_bytes}"
            )
        return self
