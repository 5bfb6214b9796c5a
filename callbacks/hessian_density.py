"""The spectral density (stochastic Lanczos quadrature) at each ``HessianSpectrum`` row."""

from __future__ import annotations

from typing import Any

import numpy as np

from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec
from dynamics.curvature import spectral_density
from dynamics.errors import ParameterError
from dynamics.store import names


class HessianDensity(HessianMeasurement):
    """``density_nodes`` and ``density_weights`` (runs, steps): the quadrature of ``runs``
    Lanczos runs of ``steps`` steps (:func:`dynamics.curvature.spectral_density`);
    :func:`dynamics.curvature.broadened_density` turns it into a density on any grid.

    Example::

        HessianSpectrum(k=5, measurements=[HessianDensity(runs=4, steps=40)])
    """

    def __init__(self, runs: int, steps: int = 40) -> None:
        if runs < 1:
            raise ParameterError("runs", f"must be at least 1, got {runs}")
        if steps < 1:
            raise ParameterError("steps", f"must be at least 1, got {steps}")
        self.runs = runs
        self.steps = steps

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        shape = (self.runs, self.steps)
        specs = {
            names.HESSIAN_DENSITY_NODES: SeriesSpec(shape),
            names.HESSIAN_DENSITY_WEIGHTS: SeriesSpec(shape),
        }
        return {names.HESSIAN: specs}

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        density = spectral_density(row.operator, self.runs, self.steps, seed=row.seed)
        return {
            names.HESSIAN: {
                names.HESSIAN_DENSITY_NODES: density.nodes.astype(np.float32),
                names.HESSIAN_DENSITY_WEIGHTS: density.weights.astype(np.float32),
            }
        }
