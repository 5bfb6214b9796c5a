"""What the scale-up experiments in miniature (seed 002, §4) share: their optimizer, recording
and variant keys, and the probes each variant records.

Both (``char_gpt``, ``vit_digits``) train a pre-LN transformer whose variants differ only in the
shift :func:`dynamics.bias.shift_activations` applies to the MLP activations; by default
``unshifted`` and ``adaptive`` (Eq. 9: each token's mean over the hidden features subtracted at
every forward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamics.callbacks import (
    HiddenStateNorms,
    LoggedMetrics,
    ParameterDisplacement,
    TrainingLoss,
)
from dynamics.experiments.config import ConfigError, check_positive, check_shift_variants
from dynamics.experiments.registry import Recording
from dynamics.experiments.variants import hessian_probes
from dynamics.models import ACTIVATION_MODULES

#: The residual stream after each block: the blocks' outputs (HiddenStateNorms' own default on
#: these models, named here so a renamed container fails loudly instead of recording elsewhere).
RESIDUAL_STREAM = "model.blocks.*"


def default_variants() -> dict[str, str | float]:
    """The two variants §4 compares: plain MLP activations and Eq. 9 on each."""
    return {"unshifted": "none", "adaptive": "adaptive"}


@dataclass
class OptimizerConfig:
    lr: float = 1e-3


@dataclass
class RecordConfig:
    every_n_steps: int = 10
    snapshot_budget_mb: float = 16.0
    flush_interval_s: float = 5.0
    hessian_top_k: int = 3  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 250


def check_common(
    record: RecordConfig,
    optimizer: OptimizerConfig,
    activation: str,
    width: int,
    heads: int,
    variants: Mapping[str, Any],
) -> None:
    """Refuse out-of-range recording, optimizer, attention and variant settings.

    Raises:
        ConfigError: naming the first bad key.
    """
    check_positive(
        {
            "model.heads": heads,
            "record.every_n_steps": record.every_n_steps,
            "record.hessian_every_n_steps": record.hessian_every_n_steps,
        }
    )
    if width % heads:
        raise ConfigError(f"model.heads ({heads}) must divide model.width ({width})")
    for key, value in (
        ("optimizer.lr", optimizer.lr),
        ("record.flush_interval_s", record.flush_interval_s),
    ):
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    for key, value in (
        ("record.hessian_top_k", record.hessian_top_k),
        ("record.snapshot_budget_mb", record.snapshot_budget_mb),
    ):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if activation not in ACTIVATION_MODULES:
        known = ", ".join(ACTIVATION_MODULES)
        raise ConfigError(f"model.activation must be one of {known}, got {activation!r}")
    check_shift_variants(variants, "model")


def transformer_recordings(
    record: RecordConfig, variants: Sequence[str], probe_batch: Any, metrics: Sequence[str]
) -> dict[str, Recording]:
    """Per variant: training loss, residual-stream norms per block (and the activation bias of
    every activation), displacement, the logged ``metrics``, and the top Hessian eigenvalues
    of ``probe_batch`` every ``record.hessian_every_n_steps``."""
    every = record.every_n_steps
    recordings = {}
    for variant in variants:
        probes = [
            TrainingLoss(every),
            HiddenStateNorms(modules=[RESIDUAL_STREAM], every_n_steps=every),
            ParameterDisplacement(every, snapshot_budget_mb=record.snapshot_budget_mb),
            LoggedMetrics(metrics),
        ]
        probes += hessian_probes(record.hessian_top_k, record.hessian_every_n_steps, probe_batch)
        recordings[variant] = Recording(probes, record.flush_interval_s)
    return recordings
