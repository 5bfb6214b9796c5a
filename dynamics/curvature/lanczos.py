"""Top-k algebraic eigenpairs by thick-restart Lanczos with full reorthogonalization."""

from __future__ import annotations

import numpy as np
import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.krylov import KrylovBasis, random_vectors
from dynamics.curvature.operator import LinearOperator

#: Weight of a random unit vector added to a warm start, so that a direction absent from the
#: earlier eigenvectors still enters the Krylov space early.
WARM_START_NOISE = 0.1


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

    Repeated eigenvalues: the Krylov space of one vector holds one copy of each. When it becomes
    invariant (the residual vanishes) before the whole space is spanned, the search goes on from
    a random vector orthogonal to it — a fresh block, which holds one copy of each eigenvalue
    left — until a fresh block has ``k`` vectors, or turns invariant with every eigenvalue below
    the ``k``-th found so far.

    Args:
        operator: symmetric operator (e.g. :class:`~dynamics.curvature.HessianOperator`).
        k: how many eigenpairs, at most ``operator.size``.
        tol: relative residual tolerance.
        max_hvp: product budget; when it runs out the current Ritz pairs are returned with
            ``converged=False``.
        basis_size: basis vectors held at once (memory ``basis_size × n``); when full, the
            basis is restarted from its best Ritz vectors. Defaults to ``max(2k + 20, 3k)``.
        warm_start: rows of earlier eigenvectors (e.g. the previous training step's). The start
            vector is their normalised sum plus ``WARM_START_NOISE`` times a random unit vector,
            so the Krylov space nearly contains their span after ``len(warm_start)`` products.
        seed: seed of the random start vector (and of any fresh block).

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
    fresh: int | None = None  # where the block after the latest invariant subspace starts
    blocks = 0
    while True:
        if basis.m == capacity:
            values, coordinates, _ = basis.ritz()
            basis.compress(coordinates[:, -keep:], values[-keep:])
            fresh = None  # the kept vectors mix the blocks; go on as one basis
        basis.step()
        values, coordinates, residuals = basis.ritz()
        top = np.argsort(values)[::-1][:k]
        bound = tol * np.maximum(np.abs(values[top]), floor * np.abs(values).max())
        converged = basis.m >= k and bool((residuals[top] <= bound).all())
        if basis.m == n or basis.n_hvp >= max_hvp:
            break
        if basis.is_invariant():
            if fresh is not None and basis.m >= k:
                block_top = np.linalg.eigvalsh(basis.projected[fresh : basis.m, fresh : basis.m])
                if block_top[-1] < values[top[-1]] - bound[-1]:
                    break  # no eigenvalue left outside the basis reaches the top k
            fresh = basis.m
            blocks += 1
            basis.restart_with(random_vectors(1, operator, seed + blocks)[0])
            continue
        if converged and (fresh is None or basis.m - fresh >= k):
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
    noise = random_vectors(1, operator, seed)[0]
    if warm_start is None:
        return noise
    if warm_start.shape[-1] != operator.size:
        raise ValueError(
            f"warm_start vectors have length {warm_start.shape[-1]}, operator size {operator.size}"
        )
    start = warm_start.reshape(-1, operator.size).to(noise).sum(0)
    norm = torch.linalg.vector_norm(start)
    if not torch.isfinite(norm) or norm == 0:
        return noise
    return start / norm + WARM_START_NOISE * noise / torch.linalg.vector_norm(noise)
