"""Top-k eigenpairs by power iteration with deflation: the classic baseline (PyHessian's)."""

from __future__ import annotations

import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.krylov import random_vectors
from dynamics.curvature.operator import LinearOperator
from dynamics.curvature.problem import HessianProblem


def power_iteration(
    operator: LinearOperator,
    k: int = 1,
    tol: float = 1e-4,
    *,
    max_hvp: int = 1000,
    seed: int = 0,
) -> Eigenpairs:
    """The ``k`` eigenpairs of largest *magnitude*, one at a time, each orthogonal to the last.

    Each iterate is kept orthogonal to the eigenvectors already found (deflation by projection)
    and stops when the residual of the *deflated* operator ``P H P`` (``P`` projecting out the
    vectors found) is at most ``tol·|λ|``: the full residual ``‖H v − λ v‖`` cannot fall below
    the error left in the earlier vectors, so requiring it would stall. The full residuals are
    reported. Convergence is geometric in ``|λ_{i+1}/λ_i|``, so close eigenvalues cost many
    products; that is why this exists only for comparison.

    Example::

        power_iteration(HessianOperator(loss, params), k=2, tol=1e-6, max_hvp=2000)

    Args:
        operator: symmetric operator.
        k: how many eigenpairs.
        tol: relative residual tolerance.
        max_hvp: product budget over all ``k`` pairs.
        seed: seed of the random start vectors.

    Returns:
        The pairs, sorted largest (algebraic) first; fewer than ``k`` (and
        ``converged=False``) when the budget runs out first.
    """
    if not 1 <= k <= operator.size:
        raise ValueError(f"k must be between 1 and the operator size {operator.size}, got {k}")
    found = torch.empty(0, operator.size, dtype=operator.dtype, device=operator.device)
    values, residuals = [], []
    n_hvp = 0
    converged = True
    for start in random_vectors(k, operator, seed):
        vector = _unit(_deflated(start, found))
        while True:
            product = operator.matvec(vector)
            n_hvp += 1
            if not torch.isfinite(product).all():
                raise FloatingPointError("a Hessian-vector product is not finite")
            value = torch.dot(vector, product).item()
            deflated = _deflated(product, found)
            if torch.linalg.vector_norm(deflated - value * vector) <= tol * abs(value):
                break
            if n_hvp >= max_hvp:
                converged = False
                break
            vector = _unit(deflated)
        found = torch.cat([found, vector[None]])
        values.append(value)
        residuals.append(torch.linalg.vector_norm(product - value * vector).item())
        if n_hvp >= max_hvp and len(found) < k:
            converged = False
            break
    order = torch.argsort(torch.tensor(values, dtype=torch.float64), descending=True)
    return Eigenpairs(
        eigenvalues=torch.tensor(values, dtype=torch.float64)[order],
        eigenvectors=found[order.to(found.device)],
        residuals=torch.tensor(residuals, dtype=torch.float64)[order],
        n_hvp=n_hvp,
        converged=converged,
    )


def solve_power(
    problem: HessianProblem,
    k: int,
    tol: float,
    *,
    max_hvp: int,
    previous: torch.Tensor | None,
    basis_size: int | None,
    seed: int,
) -> Eigenpairs:
    """The ``"power"`` entry of the solver table: :func:`power_iteration` (no start vectors,
    no basis: the table refuses ``previous`` and ``basis_size`` for it)."""
    return power_iteration(problem.operator, k, tol, max_hvp=max_hvp, seed=seed)


def _deflated(vector: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    return vector - (found @ vector) @ found


def _unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / torch.linalg.vector_norm(vector)
