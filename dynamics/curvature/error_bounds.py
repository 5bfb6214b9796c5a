"""Eigenvalue error bounds of Ritz pairs from their residuals and gaps (Kato–Temple)."""

from __future__ import annotations

import math

import torch


def eigenvalue_error_bounds(eigenvalues: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """``‖r_i‖² / δ_i`` for each Ritz pair ``(θ_i, r_i)``, largest first: a bound on
    ``|λ_i − θ_i|`` far below the residual bound ``‖r_i‖`` once the gap is resolved.

    ``δ_i = min_{j≠i} (|θ_i − θ_j| − ‖r_j‖)`` over the given pairs. If each ``θ_j`` is within
    ``‖r_j‖`` of ``λ_j``, the ``j``-th largest eigenvalue (what a residual certifies, plus that
    the pairs are the top ones — the assumption every tracking or Krylov answer rests on), then
    no eigenvalue but ``λ_i`` lies closer than ``δ_i`` to ``θ_i``, and the Kato–Temple
    inequality gives ``|λ_i − θ_i| ≤ ‖r_i‖² / δ_i``. The last pair has no known neighbour
    below it, and a pair with ``‖r_i‖ ≥ δ_i`` has an unresolved gap: NaN for those (no bound).

    Example::

        pairs = top_eigenvalues(loss, params, k=5, solver="tracking")
        eigenvalue_error_bounds(pairs.eigenvalues, pairs.residuals)  # NaN where no gap is known

    Args:
        eigenvalues: Ritz values, largest first.
        residuals: ``‖H v − θ v‖`` of each.

    Returns:
        float64 bounds on the CPU, NaN where none holds.
    """
    theta = eigenvalues.double().cpu()
    residual = residuals.double().cpu()
    distance = (theta[:, None] - theta[None, :]).abs() - residual[None, :]
    distance.fill_diagonal_(math.inf)
    gap = distance.min(dim=1).values
    bounds = residual**2 / gap
    bounds[(residual >= gap) | ~gap.isfinite()] = math.nan
    if len(bounds):
        bounds[-1] = math.nan
    return bounds
