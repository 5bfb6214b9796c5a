"""The character transformer with and without adaptive shifting, as the ``dynamics run``
experiment ``char_gpt`` (seed 002, §4's GPT-2 on OpenWebText, in miniature).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift of
their MLP activations. The text is the running Python's standard library (see
:func:`~dynamics.experiments.char_gpt.stdlib_text`); held-out loss and bits per character are
logged at every evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamics.experiments.char_gpt import CharGPTModule, StdlibTextData
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
from dynamics.store import names

#: The bits-per-character key :class:`CharGPTModule` logs.
VAL_BPC = "val_bpc"


@dataclass
class ModelConfig:
    context: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    activation: str = "gelu"


@dataclass
class DataConfig:
    batch_size: int = 32
    train_bytes: int = 2_000_000
    heldout_windows: int = 256
    data_seed: int = 0


@dataclass
class CharGPTConfig(ExperimentConfig):
    """One comparison: character transformers that differ only in their MLP activations' shift.

    Attributes:
        variants: ``{name: shift}``; each becomes ``<out>/<name>.h5``.
    """

    steps: int = 1000
    eval_every: int = 50
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    variants: dict[str, str | float] = field(default_factory=default_variants)

    def validate(self) -> CharGPTConfig:
        super().validate()
        model, data = self.model, self.data
        check_positive(
            {
                "model.context": model.context,
                "model.width": model.width,
                "model.depth": model.depth,
                "data.batch_size": data.batch_size,
                "data.heldout_windows": data.heldout_windows,
            }
        )
        check_seeds({"data.data_seed": data.data_seed})
        if data.train_bytes <= model.context + 1:
            raise ConfigError(
                f"data.train_bytes must exceed model.context + 1 ({model.context + 1}), "
                f"got {data.train_bytes}"
            )
        check_common(
            self.record, self.optimizer, model.activation, model.width, model.heads, self.variants
        )
        return self


class CharGPTExperiment(Experiment[CharGPTConfig]):
    """Character transformers on the standard library's source, one per shift in
    ``config.variants``."""

    name = "char_gpt"
    config_class = CharGPTConfig
    setting = "shift"

    def variants(self, config: CharGPTConfig) -> Mapping[str, str | float]:
        return config.variants

    def build(self, config: CharGPTConfig, variant: str) -> Built:
        module = CharGPTModule(
            **vars(config.model),
            shift=config.variants[variant],
            seed=config.seed,
            lr=config.optimizer.lr,
        )
        return Built(module, StdlibTextData(context=config.model.context, **vars(config.data)))

    def recordings(self, config: CharGPTConfig, built: Mapping[str, Built]) -> dict[str, Recording]:
        probe_batch = shared_probe_batch(built)
        return transformer_recordings(
            config.record, list(built), probe_batch, [names.VAL_LOSS, VAL_BPC]
        )


register(CharGPTExperiment())
