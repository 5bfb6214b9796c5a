"""The top-k Hessian eigenvectors themselves, stored at ``HessianSpectrum`` rows within a budget."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumProbe, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec, expected_steps
from dynamics.store import names

if TYPE_CHECKING:
    import pytorch_lightning as pl


class EigenvectorSnapshots(HessianMeasurement):
    """Group ``hessian_vectors``: the top-k eigenvectors ``vectors`` ``(k, n)`` in float32, at
    rows thinned evenly so that the fit's expected total stays within ``budget_mb`` MiB (the
    first row always among them). When fewer than two records fit, or the fit's length is
    unknown, none are stored and the probe notes why. Under FSDP the vectors are the full ones
    in the unsharded layout, as every rank measures on the whole parameters (rank 0 writes).

    Example::

        HessianSpectrum(k=5, measurements=[EigenvectorSnapshots(budget_mb=64)])
    """

    def __init__(self, budget_mb: float) -> None:
        self.budget_mb = budget_mb
        self.period = 0  # steps between stored eigenvectors; 0: none

    def setup(self, probe: SpectrumProbe, fit: Fit, pl_module: pl.LightningModule) -> None:
        self.period, reason = self._plan(probe, expected_steps(fit))
        if reason:
            probe.note(getattr(fit, "global_step", 0), f"{reason}: no eigenvectors stored")

    def _plan(self, probe: SpectrumProbe, steps: float) -> tuple[int, str]:
        """Steps between stored eigenvectors (0: none) and, when none fit, why."""
        if self.budget_mb <= 0:
            return 0, ""
        each = 4 * probe.k * probe.size
        capacity = int(self.budget_mb * 2**20 // each)
        if capacity < 2:
            return 0, (
                f"an eigenvector budget of {self.budget_mb:g} MiB holds fewer than 2 records of "
                f"{probe.k} eigenvectors of {probe.size:,} parameters ({each / 2**20:.1f} MiB each)"
            )
        if not 0 < steps < math.inf:  # Lightning answers -1 for an unknown length
            return 0, "the run's length is unknown, so stored eigenvectors cannot be spread over it"
        records = (int(steps) - 1) // probe.every_n_steps + 1
        # capacity - 1 intervals between capacity records, the first at step 0.
        return probe.every_n_steps * max(1, math.ceil((records - 1) / (capacity - 1))), ""

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        if not self.period:
            return {}
        return {
            names.HESSIAN_VECTORS: {names.HESSIAN_VECTORS_RITZ: SeriesSpec((k, size), "float32")}
        }

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        if not self.period or row.step % self.period:
            return {}
        vectors = row.pairs.eigenvectors.float()
        return {names.HESSIAN_VECTORS: {names.HESSIAN_VECTORS_RITZ: vectors}}
