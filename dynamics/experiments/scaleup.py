"""What the scale-up experiments in miniature (seed 002, §4) share: their config sections and
checks, and the probes each variant records.

Both (``char_gpt``, ``vit_digits``) train a pre-LN transformer whose variants differ only in the
shift :func:`dynamics.bias.shift_activations` applies to the MLP activations; by default
``unshifted`` and ``adaptive`` (Eq. 9: each token's mean over the hidden features subtracted at
every forward). Each states its model and data sections, its extra checks and its metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from dynamics.callbacks import (
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.config import ConfigError, check_positive, check_seeds
from dynamics.experiments.experiment import Built, Recording
from dynamics.experiments.optimization import OptimizerConfig
from dynamics.experiments.shift_experiment import (
    RecordConfig,
    ShiftConfig,
    ShiftConfigT,
    ShiftExperiment,
    hessian_probes,
    shared_probe_batch,
)
from dynamics.experiments.transformer import ACTIVATION_MODULES

#: The residual stream after each block: the blocks' outputs (HiddenStateNorms' own default on
#: these models, named here so a renamed container fails loudly instead of recording elsewhere).
RESIDUAL_STREAM = "model.blocks.*"


def default_variants() -> dict[str, str | float]:
    """The two variants §4 compares: plain MLP activations and Eq. 9 on each."""
    return {"unshifted": "none", "adaptive": "adaptive"}


@dataclass
class TransformerModelConfig:
    """A config's ``model`` section: what both transformers have (each adds its own keys)."""

    width: int = 64
    depth: int = 2
    heads: int = 4
    activation: str = "gelu"


@dataclass
class AdamWConfig(OptimizerConfig):
    """The transformers' ``optimizer:`` section: AdamW (torch's weight decay, 0.01) by default."""

    name: str = "adamw"


@dataclass
class ScaleupRecordConfig(RecordConfig):
    every_n_steps: int = 10
    snapshot_budget_mb: float = 16.0
    hessian_top_k: int = 3  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 250


@dataclass
class ScaleupConfig(ShiftConfig):
    """One comparison: transformers that differ only in their MLP activations' shift.

    A subclass declares its ``model`` (a :class:`TransformerModelConfig`) and ``data`` sections;
    ``data`` has ``batch_size`` and ``data_seed``.
    """

    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    record: ScaleupRecordConfig = field(default_factory=ScaleupRecordConfig)
    variants: dict[str, str | float] = field(default_factory=default_variants)

    def validate(self) -> ScaleupConfig:
        super().validate()
        model = self.model
        check_positive(
            {
                "model.width": model.width,
                "model.depth": model.depth,
                "model.heads": model.heads,
                "data.batch_size": self.data.batch_size,
            }
        )
        check_seeds({"data.data_seed": self.data.data_seed})
        if model.width % model.heads:
            raise ConfigError(
                f"model.heads ({model.heads}) must divide model.width ({model.width})"
            )
        self.optimizer.validate(self.steps)
        if model.activation not in ACTIVATION_MODULES:
            known = ", ".join(ACTIVATION_MODULES)
            raise ConfigError(f"model.activation must be one of {known}, got {model.activation!r}")
        return self


class ScaleupExperiment(ShiftExperiment[ShiftConfigT]):
    """A transformer per shift. Each variant records training loss, residual-stream norms per
    block (and the activation bias of every activation), displacement, the logged
    :attr:`metrics`, and the top Hessian eigenvalues of one shared training batch every
    ``record.hessian_every_n_steps``.

    Attributes:
        metrics: the validation metrics the module logs.
    """

    metrics: ClassVar[tuple[str, ...]]

    def recordings(self, config: ShiftConfigT, built: Mapping[str, Built]) -> dict[str, Recording]:
        probe_batch = shared_probe_batch(built)
        record = config.record
        every = record.every_n_steps
        recordings = {}
        for variant in built:
            probes = [
                TrainingLoss(every),
                HiddenStateNorms(modules=[RESIDUAL_STREAM], every_n_steps=every),
                ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
                LoggedMetrics(list(self.metrics)),
            ]
            probes += hessian_probes(
                record.hessian_top_k, record.hessian_every_n_steps, probe_batch
            )
            recordings[variant] = Recording(probes, record.flush_interval_s)
        return recordings
