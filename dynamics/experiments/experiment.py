"""What an experiment is: its config, its variants, and how each is built and recorded.

An experiment subclasses :class:`Experiment`; naming it in
:data:`dynamics.experiments.registry.BUILTINS` (or calling
:func:`~dynamics.experiments.registry.register` on an instance) lets a config's ``experiment:``
key pick it. The runner and the CLI need no change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from dynamics.callbacks.probe import Probe
    from dynamics.experiments.config import ExperimentConfig

ConfigT = TypeVar("ConfigT", bound="ExperimentConfig")


class Built(NamedTuple):
    """What one variant trains: its module and its data."""

    module: pl.LightningModule
    data: pl.LightningDataModule


@dataclass(frozen=True)
class Recording:
    """What one variant's recorder records, and how often it flushes."""

    probes: list[Probe]
    flush_interval_s: float = 5.0


class Experiment(ABC, Generic[ConfigT]):
    """An experiment: its config, its variants, and how each variant is built and recorded.

    Each variant is trained for ``config.steps`` steps into ``<out>/<variant>.h5``, with
    held-out evaluation every ``config.eval_every`` steps; all variants must share θ0. The
    summary reads each run's ``loss`` series (:class:`~dynamics.callbacks.TrainingLoss`) and
    its logged ``val_loss`` (:class:`~dynamics.callbacks.LoggedMetrics`).

    Attributes:
        name: the value of a config's ``experiment:`` key.
        config_class: the config dataclass; every field has a default.
        setting: what tells the variants apart (the summary's column header), e.g. ``"shift"``.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ExperimentConfig]]
    setting: ClassVar[str]

    @abstractmethod
    def variants(self, config: ConfigT) -> Mapping[str, object]:
        """``{variant name: its setting}``, in training order."""

    @abstractmethod
    def build(self, config: ConfigT, variant: str) -> Built:
        """The module and data of one variant, untrained."""

    @abstractmethod
    def recordings(self, config: ConfigT, built: Mapping[str, Built]) -> dict[str, Recording]:
        """What each variant records, given every variant built and none trained yet.

        Anything the variants' recordings share (a plane spanned by their initial gradients)
        is computed here, before the first variant trains.
        """
