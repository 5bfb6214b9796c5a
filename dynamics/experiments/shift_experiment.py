"""The shift experiments' base: variants that differ only in an activation shift.

Every built-in experiment compares networks built from one seed (so all share θ0 whatever the
shift) that differ only in the shift :func:`dynamics.bias.shift_activations` applies to some of
their activations. :class:`ShiftConfig` holds what their configs share (the ``variants`` table,
the ``record`` section) and checks it once; :class:`ShiftExperiment` turns each variant into its
module and data; each experiment states only its model, data and probes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from dynamics.bias import shift_activations
from dynamics.callbacks import HessianSpectrum
from dynamics.experiments.config import (
    ConfigError,
    ExperimentConfig,
    check_positive,
    check_shift_variants,
)
from dynamics.experiments.experiment import Built, Experiment

if TYPE_CHECKING:
    import pytorch_lightning as pl

NetworkT = TypeVar("NetworkT", bound=nn.Module)
ShiftConfigT = TypeVar("ShiftConfigT", bound="ShiftConfig")


@dataclass
class RecordConfig:
    """A config's ``record`` section: how often the variants record, and their budgets.

    The defaults are the controlled experiment's; each experiment's own section subclasses this
    one with its defaults (and any keys of its own).
    """

    every_n_steps: int = 1
    snapshot_budget_mb: float = 32.0
    flush_interval_s: float = 5.0
    hessian_top_k: int = 5  # 0 records no Hessian spectrum
    hessian_every_n_steps: int = 100

    def validate(self) -> None:
        """Refuse a period below 1, a flush interval not above 0, a negative budget or k.

        Raises:
            ConfigError: naming the first bad key.
        """
        check_positive(
            {
                "record.every_n_steps": self.every_n_steps,
                "record.hessian_every_n_steps": self.hessian_every_n_steps,
            }
        )
        if self.flush_interval_s <= 0:
            raise ConfigError(f"record.flush_interval_s must be > 0, got {self.flush_interval_s}")
        for key, value in (
            ("record.hessian_top_k", self.hessian_top_k),
            ("record.snapshot_budget_mb", self.snapshot_budget_mb),
        ):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")


@dataclass
class ShiftConfig(ExperimentConfig):
    """What every shift experiment's config has: its variants and its ``record`` section.

    Attributes:
        variants: ``{name: shift}``; each becomes ``<out>/<name>.h5``.
        record: how often and what the variants record.
        variant_kind: what a variant trains, as a config without variants is told
            ("variants must name at least one student").
    """

    variant_kind: ClassVar[str] = "model"

    record: RecordConfig = field(default_factory=RecordConfig)
    variants: dict[str, str | float] = field(
        default_factory=lambda: {"unshifted": "none", "shifted": "expected"}
    )

    def validate(self) -> ShiftConfig:
        super().validate()
        self.record.validate()
        check_shift_variants(self.variants, self.variant_kind)
        return self


class ShiftExperiment(Experiment[ShiftConfigT]):
    """An experiment whose variants are ``config.variants``, one module per shift on one data.

    A subclass names its ``name`` and ``config_class`` and says how one shift's module and the
    (shared) data are built, and what each variant records (:meth:`Experiment.recordings`).
    """

    setting = "shift"

    def variants(self, config: ShiftConfigT) -> Mapping[str, str | float]:
        return config.variants

    def build(self, config: ShiftConfigT, variant: str) -> Built:
        return Built(self.module(config, config.variants[variant]), self.data(config))

    @abstractmethod
    def module(self, config: ShiftConfigT, shift: str | float) -> pl.LightningModule:
        """The untrained module of the variant with ``shift``, built from ``config.seed``."""

    @abstractmethod
    def data(self, config: ShiftConfigT) -> pl.LightningDataModule:
        """The data every variant trains on."""


def shifted_network(
    build: Callable[[], NetworkT],
    seed: int,
    shift: str | float,
    *,
    include: Sequence[str] = (),
    dim: int = -1,
) -> NetworkT:
    """``build()`` under ``seed`` (the global random state left as it was), then its
    activations shifted unless ``shift`` is ``"none"``.

    Surgery keeps the parameters, so equal seeds give equal θ0 whatever the shift.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = build()
    if shift != "none":
        shift_activations(network, shift, include=include, dim=dim)
    return network


def shared_probe_batch(built: Mapping[str, Built]) -> Any:
    """The first variant's first training batch: the probe batch every variant records on
    (their data are built alike, so any variant's would do)."""
    data = next(iter(built.values())).data
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def hessian_probes(top_k: int, every_n_steps: int, probe_batch: Any) -> list[HessianSpectrum]:
    """The top-``top_k`` Hessian probe on the shared probe batch, or none when ``top_k`` is 0
    (an experiment's ``record.hessian_top_k``)."""
    if not top_k:
        return []
    return [HessianSpectrum(k=top_k, every_n_steps=every_n_steps, batch=probe_batch)]
