"""The autoencoder experiment's config; every key is optional (defaults below)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamics.experiments.autoencoder.model import INITS
from dynamics.experiments.config import ConfigError, check_positive, check_seeds
from dynamics.experiments.optimization import OptimizerConfig
from dynamics.experiments.shift_experiment import RecordConfig, ShiftConfig

#: The 1,797 digits of scikit-learn.
_DIGITS = 1797


@dataclass
class ModelConfig:
    width: int = 16
    init: str = "kaiming"


@dataclass
class DataConfig:
    batch_size: int = 64
    heldout_size: int = 297
    data_seed: int = 0


@dataclass
class AutoencoderRecordConfig(RecordConfig):
    every_n_steps: int = 5
    snapshot_budget_mb: float = 8.0
    hessian_top_k: int = 3  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 250
    bias_every_n_steps: int = 10
    layers: list[str] = field(default_factory=lambda: ["encoder.3", "encoder.8", "decoder.4"])
    examples: int = 4
    image_rows: int = 16
    split_every_n_steps: int = 0  # LossChangeSplit period; 0 records no split

    def validate(self) -> None:
        super().validate()
        check_positive(
            {"record.bias_every_n_steps": self.bias_every_n_steps, "record.examples": self.examples}
        )
        for key, value in (
            ("record.split_every_n_steps", self.split_every_n_steps),
            ("record.image_rows", self.image_rows),
        ):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if not self.layers or not all(isinstance(n, str) for n in self.layers):
            raise ConfigError(f"record.layers must be a list of module names, got {self.layers!r}")


@dataclass
class AutoencoderOptimizerConfig(OptimizerConfig):
    """The autoencoder's ``optimizer:`` section: Adam at 2e-3 by default."""

    lr: float = 2e-3


@dataclass
class AutoencoderConfig(ShiftConfig):
    """One comparison: autoencoders that differ only in their ReLUs' shift (the variants are
    :class:`~dynamics.experiments.shift_experiment.ShiftConfig`'s).

    Example::

        experiment, config = load_config("autoencoder", steps=100)
        config.record.layers  # ["encoder.3", "encoder.8", "decoder.4"]
    """

    variant_kind = "autoencoder"
    moved_keys = {"lr": "optimizer.lr"}

    steps: int = 1500
    eval_every: int = 50
    optimizer: AutoencoderOptimizerConfig = field(default_factory=AutoencoderOptimizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    record: AutoencoderRecordConfig = field(default_factory=AutoencoderRecordConfig)

    def validate(self) -> AutoencoderConfig:
        super().validate()
        check_positive(
            {
                "model.width": self.model.width,
                "data.batch_size": self.data.batch_size,
                "data.heldout_size": self.data.heldout_size,
            }
        )
        check_seeds({"data.data_seed": self.data.data_seed})
        if self.data.heldout_size + self.data.batch_size > _DIGITS:
            raise ConfigError(
                f"data.heldout_size + data.batch_size must be at most the {_DIGITS} digits, got "
                f"{self.data.heldout_size + self.data.batch_size}"
            )
        self.optimizer.validate(self.steps)
        if self.model.init not in INITS:
            raise ConfigError(
                f"model.init must be one of {', '.join(INITS)}, got {self.model.init!r}"
            )
        return self
