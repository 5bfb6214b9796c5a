"""Spectral density by stochastic Lanczos quadrature (Golub & Meurant; Ghorbani et al., 2019)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.curvature.broadening import broadened_density
from dynamics.curvature.krylov import KrylovBasis, random_vectors
from dynamics.curvature.operator import LinearOperator


@dataclass(frozen=True)
class SpectralDensity:
    """A quadrature of the eigenvalue distribution and its Gaussian-broadened density.

    Attributes:
        nodes: Ritz values per run, shape ``(runs, steps)``.
        weights: their quadrature weights, each row summing to 1; a run whose Krylov space
            became invariant early pads its row with zero weights.
        grid: where the density is evaluated.
        density: ``(1/runs) Σ weights·N(grid; nodes, sigma²)``: integrates to 1 over the grid.
        sigma: the broadening.
        n_hvp: Hessian-vector products used.
    """

    nodes: np.ndarray
    weights: np.ndarray
    grid: np.ndarray
    density: np.ndarray
    sigma: float
    n_hvp: int


def spectral_density(
    operator: LinearOperator,
    runs: int = 4,
    steps: int = 40,
    *,
    n_grid: int = 1000,
    sigma: float | None = None,
    seed: int = 0,
) -> SpectralDensity:
    """Estimate the density of the eigenvalues of ``operator`` from ``runs × steps`` products.

    Each run is ``steps`` Lanczos steps from a normalised Rademacher vector ``v``; the Ritz
    values ``θ_j`` and the squared first components ``τ_j`` of their coordinate vectors form a
    Gauss quadrature of ``vᵀ f(H) v``, whose mean over runs estimates ``tr f(H) / n``.

    Example::

        density = spectral_density(HessianOperator(loss, params), runs=4, steps=40)
        plt.plot(density.grid, density.density)

    Args:
        operator: symmetric operator.
        runs: independent start vectors.
        steps: Lanczos steps per run (resolution of the quadrature).
        n_grid: grid points of the broadened density.
        sigma: Gaussian broadening; defaults to 1 % of the spread of the nodes.
        seed: seed of the start vectors.
    """
    if runs < 1 or steps < 1:
        raise ValueError(f"runs and steps must be positive, got {runs} and {steps}")
    steps = min(steps, operator.size)
    nodes = np.zeros((runs, steps))
    weights = np.zeros((runs, steps))
    filled = np.zeros((runs, steps), dtype=bool)
    n_hvp = 0
    for run, start in enumerate(random_vectors(runs, operator, seed, rademacher=True)):
        basis = KrylovBasis(operator, steps)
        basis.restart_with(start)
        while basis.m < steps and not (basis.m and basis.is_invariant()):
            basis.step()
        values, coordinates, _ = basis.ritz()
        nodes[run, : basis.m] = values.numpy()
        weights[run, : basis.m] = coordinates[0].square().numpy()
        filled[run, : basis.m] = True
        n_hvp += basis.n_hvp
    live = nodes[filled]
    spread = live.max() - live.min()
    sigma = sigma or 0.01 * (spread if spread > 0 else max(abs(live.max()), 1.0))
    grid = np.linspace(live.min() - 6 * sigma, live.max() + 6 * sigma, n_grid)
    return SpectralDensity(
        nodes, weights, grid, broadened_density(nodes, weights, grid, sigma), sigma, n_hvp
    )
