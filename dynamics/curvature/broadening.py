"""Gaussian broadening of a quadrature of an eigenvalue distribution into a density.

Numpy alone, so offline tools draw recorded spectral densities without importing torch (the
curvature package, which records them, needs it).
"""

from __future__ import annotations

import numpy as np


def broadened_density(
    nodes: np.ndarray, weights: np.ndarray, grid: np.ndarray, sigma: float
) -> np.ndarray:
    """``(1/runs) Σ_runs Σ_j weights·N(grid; nodes, sigma²)`` for recorded nodes and weights.

    Works offline on what :class:`~dynamics.callbacks.HessianSpectrum` stores.

    Example::

        hessian = open_run("run.h5").series("hessian")
        nodes, weights = hessian["density_nodes"][-1], hessian["density_weights"][-1]
        broadened_density(nodes, weights, np.linspace(-1, 10, 500), sigma=0.1)
    """
    nodes = np.atleast_2d(nodes)
    weights = np.atleast_2d(weights)
    offsets = (grid[:, None, None] - nodes[None]) / sigma
    kernel = np.exp(-0.5 * offsets**2) / (sigma * np.sqrt(2 * np.pi))
    return (kernel * weights[None]).sum(axis=(1, 2)) / nodes.shape[0]
