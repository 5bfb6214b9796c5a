"""What a measurement of ``HessianSpectrum`` is: one quantity computed at each row on the row's
shared Hessian operator and eigenpairs, declared and stored under the probe's run-file names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dynamics.callbacks.fit import Fit
from dynamics.curvature import Eigenpairs, HessianOperator, MeanHessianOperator

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from dynamics.callbacks.probe import SeriesSpec


class SpectrumProbe(Protocol):
    """What a measurement may read of its ``HessianSpectrum`` at setup."""

    k: int
    size: int  # trainable parameters
    every_n_steps: int

    def note(self, step: int, message: str) -> None: ...


@dataclass(frozen=True)
class SpectrumRow:
    """What one row of ``HessianSpectrum`` hands its measurements.

    Attributes:
        operator: the Hessian of the probe-batch loss at θ_step, or of the mean loss over the
            probe set (its products are the row's).
        pairs: the top ``k`` eigenpairs of this row.
        previous: the top ``k`` eigenvectors of the previous row; None on a fit's first row.
        step: the optimizer step the row describes.
        seed: the probe's seed (random vectors of a measurement are drawn from it).
    """

    operator: HessianOperator | MeanHessianOperator
    pairs: Eigenpairs
    previous: torch.Tensor | None
    step: int
    seed: int


class HessianMeasurement:
    """One extra quantity of a ``HessianSpectrum`` row (trace, density, gradient share, ...).

    A subclass declares its series (:meth:`series`, keyed by group: the probe's own ``hessian``
    group, or a group of its own) and returns their values from :meth:`measure`; state that
    must survive a checkpoint goes through :meth:`state_dict`. Series that may hold NaN by
    design are named in ``may_be_nan``; any other non-finite value fails the row. Under FSDP
    the row's operator, parameters and vectors are whole on every rank (the probe measures on a
    whole-parameter copy), so a measurement computes as it would unsharded.

    Example::

        class LossOnly(HessianMeasurement):
            def series(self, k, size):
                return {"hessian": {"loss_again": SeriesSpec()}}

            def measure(self, row):
                return {"hessian": {"loss_again": row.operator.loss}}
    """

    may_be_nan: tuple[str, ...] = ()

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        """The series this measurement adds, by group, for ``k`` pairs of ``size`` parameters
        (``size`` is 0 before setup)."""
        raise NotImplementedError

    def setup(self, probe: SpectrumProbe, fit: Fit, pl_module: pl.LightningModule) -> None:
        """Called from the probe's setup, once its parameters are known (``probe.size``)."""

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        """This row's values by group (an empty dict where it records nothing this row)."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Drop what the fit held (tensors of θ or vectors)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
