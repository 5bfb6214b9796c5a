"""Top-k algebraic eigenpairs by thick-restart Lanczos with full reorthogonalization."""

from __future__ import annotations

import numpy as np
import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.krylov import KrylovBasis, random_vectors
from dynamics.curvature.operator import LinearOperator


def lanczos(
    operator: LinearOperator,
    k: int = 1,
    tol: float = 1e-4,
    *,
    max_hvp: int = 500,
    basis_size: int | None = None,
    warm_start: torch.Tensor | None = None,
    seed: int = 0,
) -> Eigenpairs:
    """The ``k`` largest (algebraic) eigenvalues of ``operator`` and their eigenvectors.

    Stops when every one of the top ``k`` Ritz pairs has ``‖H v − θ v‖ ≤ tol·|θ|`` — a bound on
    the residual, not on the change between iterates, so a slowly moving estimate is never
    mistaken for a converged one. Pairs with ``|θ|`` below ``ε^(2/3)·max|θ|`` (ε of the
    operator's dtype) are held to that absolute floor instead, as ARPACK does, so that
    (near-)zero eigenvalues can converge.

    A single start vector cannot see more copies of a repeated eigenvalue than the Krylov space
    it generates; when that space becomes invariant before ``k`` pairs exist, a fresh random
    direction is added, but copies beyond the invariant space found first may be missed.

    Args:
        operator: symmetric operator (e.g. :class:`~dynamics.curvature.HessianOperator`).
        k: how many eigenpairs, at most ``operator.size``.
        tol: relative residual tolerance.
        max_hvp: product budget; when it runs out the current Ritz pairs are returned with
            ``converged=False``.
        basis_size: basis vectors held at once (memory ``basis_size × n``); when full, the
            basis is restarted from its best Ritz vectors. Defaults to ``max(2k + 20, 3k)``.
        warm_start: rows of earlier eigenvectors (e.g. the previous training step's); their sum
            is the start vector, so the Krylov space contains their span after a few products.
        seed: seed of the random start vector (and of any fresh direction).

    Returns:
        The top-k pairs, largest first, with residuals and the products used.
    """
    n = operator.size
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the operator size {n}, got {k}")
    if tol <= 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_hvp < k:
        raise ValueError(f"max_hvp must be at least k={k}, got {max_hvp}")
    capacity = min(n, basis_size or max(2 * k + 20, 3 * k))
    if capacity <= k and capacity < n:
        raise ValueError(f"basis_size must exceed k={k}, got {basis_size}")
    keep = k + (capacity - k) // 2
    floor = torch.finfo(operator.dtype).eps ** (2 / 3)

    basis = KrylovBasis(operator, capacity)
    basis.restart_with(_start_vector(operator, warm_start, seed))
    fresh_seed = seed
    while True:
        if basis.m == capacity:
            values, coordinates, _ = basis.ritz()
            basis.compress(coordinates[:, -keep:], values[-keep:])
        if basis.is_invariant():
            fresh_seed += 1
            basis.restart_with(random_vectors(1, operator, fresh_seed)[0])
        basis.step()
        if basis.m < min(k, n) and basis.n_hvp < max_hvp:
            continue
        values, coordinates, residuals = basis.ritz()
        top = np.argsort(values)[::-1][:k]
        bound = tol * np.maximum(np.abs(values[top]), floor * np.abs(values).max())
        converged = bool((residuals[top] <= bound).all())
        if converged or basis.m == n or basis.n_hvp >= max_hvp:
            break

    mixing = torch.from_numpy(coordinates[:, top].T.copy()).to(operator.dtype).to(operator.device)
    return Eigenpairs(
        eigenvalues=torch.from_numpy(values[top].copy()),
        eigenvectors=mixing @ basis.basis,
        residuals=torch.from_numpy(residuals[top].copy()),
        n_hvp=basis.n_hvp,
        converged=converged or basis.m == n,
    )


def _start_vector(
    operator: LinearOperator, warm_start: torch.Tensor | None, seed: int
) -> torch.Tensor:
    if warm_start is None:
        return random_vectors(1, operator, seed)[0]
    if warm_start.shape[-1] != operator.size:
        raise ValueError(
            f"warm_start vectors have length {warm_start.shape[-1]}, operator size {operator.size}"
        )
    start = warm_start.reshape(-1, operator.size).sum(0)
    if not torch.isfinite(start).all() or torch.linalg.vector_norm(start) == 0:
        return random_vectors(1, operator, seed)[0]
    return start
