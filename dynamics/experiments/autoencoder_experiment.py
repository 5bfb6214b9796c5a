"""The digits autoencoder with and without shifted activations, as the ``dynamics run``
experiment ``autoencoder`` (seed 002, §3.2, Fig. 5: the transient use of the bias component).

Every variant is built from the config's seed, so all share θ0; they differ only in the shift
:func:`dynamics.bias.shift_activations` applies to their ReLUs. Each records
:class:`~dynamics.callbacks.BiasComponent` at the ReLUs of ``record.layers`` on a fixed probe
batch (the same for every variant), the bias audit at θ0, the loss change of every
``record.split_every_n_steps``-th step split into biases, weights and normalization
(:class:`~dynamics.callbacks.LossChangeSplit`), and the usual probes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamics.callbacks import (
    BiasAudit,
    BiasComponent,
    HiddenStateNorms,
    LoggedMetrics,
    LossChangeSplit,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.autoencoder import INITS, AutoencoderModule, DigitsData
from dynamics.experiments.config import (
    ConfigError,
    ExperimentConfig,
    check_positive,
    check_seeds,
    check_shift_variants,
)
from dynamics.experiments.registry import Built, Experiment, Recording, register
from dynamics.experiments.variants import hessian_probes, shared_probe_batch
from dynamics.store import names

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
class RecordConfig:
    every_n_steps: int = 5
    bias_every_n_steps: int = 10
    layers: list[str] = field(default_factory=lambda: ["encoder.3", "encoder.8", "decoder.4"])
    examples: int = 4
    image_rows: int = 16
    snapshot_budget_mb: float = 8.0
    flush_interval_s: float = 5.0
    hessian_top_k: int = 3  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 250
    split_every_n_steps: int = 0  # LossChangeSplit period; 0 records no split


@dataclass
class AutoencoderConfig(ExperimentConfig):
    """One comparison: autoencoders that differ only in their ReLUs' shift.

    Attributes:
        variants: ``{name: shift}``; each becomes ``<out>/<name>.h5``.
    """

    steps: int = 1500
    eval_every: int = 50
    lr: float = 2e-3
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    variants: dict[str, str | float] = field(
        default_factory=lambda: {"unshifted": "none", "shifted": "expected"}
    )

    def validate(self) -> AutoencoderConfig:
        super().validate()
        record = self.record
        check_positive(
            {
                "model.width": self.model.width,
                "data.batch_size": self.data.batch_size,
                "data.heldout_size": self.data.heldout_size,
                "record.every_n_steps": record.every_n_steps,
                "record.bias_every_n_steps": record.bias_every_n_steps,
                "record.examples": record.examples,
                "record.hessian_every_n_steps": record.hessian_every_n_steps,
            }
        )
        check_seeds({"data.data_seed": self.data.data_seed})
        if self.data.heldout_size + self.data.batch_size > _DIGITS:
            raise ConfigError(
                f"data.heldout_size + data.batch_size must be at most the {_DIGITS} digits, got "
                f"{self.data.heldout_size + self.data.batch_size}"
            )
        for key, value in (("lr", self.lr), ("record.flush_interval_s", record.flush_interval_s)):
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        for key, value in (
            ("record.hessian_top_k", record.hessian_top_k),
            ("record.split_every_n_steps", record.split_every_n_steps),
            ("record.image_rows", record.image_rows),
            ("record.snapshot_budget_mb", record.snapshot_budget_mb),
        ):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if not record.layers or not all(isinstance(n, str) for n in record.layers):
            raise ConfigError(
                f"record.layers must be a list of module names, got {record.layers!r}"
            )
        if self.model.init not in INITS:
            raise ConfigError(
                f"model.init must be one of {', '.join(INITS)}, got {self.model.init!r}"
            )
        check_shift_variants(self.variants, "autoencoder")
        return self


class Autoencoder(Experiment[AutoencoderConfig]):
    """Digits autoencoders, one per activation shift in ``config.variants``."""

    name = "autoencoder"
    config_class = AutoencoderConfig
    setting = "shift"

    def variants(self, config: AutoencoderConfig) -> Mapping[str, str | float]:
        return config.variants

    def build(self, config: AutoencoderConfig, variant: str) -> Built:
        module = AutoencoderModule(
            width=config.model.width,
            init=config.model.init,
            shift=config.variants[variant],
            seed=config.seed,
            lr=config.lr,
        )
        data = DigitsData(**vars(config.data))
        return Built(module, data)

    def recordings(
        self, config: AutoencoderConfig, built: Mapping[str, Built]
    ) -> dict[str, Recording]:
        probe_batch = shared_probe_batch(built)
        record = config.record
        every = record.every_n_steps
        recordings = {}
        for variant in built:
            probes = [
                TrainingLoss(every),
                HiddenStateNorms(modules=record.layers, feature_dim=1, every_n_steps=every),
                ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
                LoggedMetrics([names.VAL_LOSS]),
                BiasAudit(),
                BiasComponent(
                    record.layers,
                    every_n_steps=record.bias_every_n_steps,
                    batch=probe_batch,
                    examples=record.examples,
                    image_rows=record.image_rows,
                ),
            ]
            if record.split_every_n_steps:
                probes.append(
                    LossChangeSplit(every_n_steps=record.split_every_n_steps, batch=probe_batch)
                )
            probes += hessian_probes(
                record.hessian_top_k, record.hessian_every_n_steps, probe_batch
            )
            recordings[variant] = Recording(probes, record.flush_interval_s)
        return recordings


register(Autoencoder())
