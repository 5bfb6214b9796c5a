"""Top-k algebraic eigenpairs by thick-restart Lanczos with full reorthogonalization."""

from __future__ import annotations

import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.krylov import KrylovBasis, random_vectors
from dynamics.curvature.operator import LinearOperator
from dynamics.curvature.problem import HessianProblem


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

    Repeated eigenvalues are found by fresh blocks (``docs/curvature.md``, "Repeated
    eigenvalues").

    Example::

        operator = HessianOperator(lambda: F.mse_loss(model(x), y), list(model.parameters()))
        pairs = lanczos(operator, k=5, tol=1e-6)
        again = lanczos(operator, k=5, warm_start=pairs.eigenvectors)  # fewer products

    Args:
        operator: symmetric operator (e.g. :class:`~dynamics.curvature.HessianOperator`).
        k: how many eigenpairs, at most ``operator.size``.
        tol: relative residual tolerance.
        max_hvp: product budget; when it runs out the current Ritz pairs are returned with
            ``converged=False``.
        basis_size: basis vectors held at once (memory ``basis_size × n``); when full, the
            basis is restarted from its best Ritz vectors. Defaults to ``max(2k + 20, 3k)``.
        warm_start: rows of earlier eigenvectors (e.g. the previous training step's); their sum
            is the start vector, so the Krylov space nearly contains their span after
            ``len(warm_start)`` products. (Adding a random component measured no better on the
            benchmark's training trajectory, and worse when the Hessian had not changed.) A
            direction missing from them is still found: if their span is invariant, the
            search goes on in a fresh block, as for repeated eigenvalues.
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
        top = values.argsort(descending=True)[:k]
        bound = tol * torch.clamp(values[top].abs(), min=floor * values.abs().max().item())
        converged = basis.m >= k and bool((residuals[top] <= bound).all())
        if basis.m == n or basis.n_hvp >= max_hvp:
            break
        if basis.is_invariant():
            if fresh is not None and basis.m >= k:
                block = basis.projected[fresh : basis.m, fresh : basis.m]
                if torch.linalg.eigvalsh(block)[-1] < values[top[-1]] - bound[-1]:
                    break  # no eigenvalue left outside the basis reaches the top k
            fresh = basis.m
            blocks += 1
            basis.restart_with(next(random_vectors(1, operator, seed + blocks)))
            continue
        if converged and (fresh is None or basis.m - fresh >= k):
            break

    mixing = coordinates[:, top].T.to(operator.dtype).to(operator.device)
    return Eigenpairs(
        eigenvalues=values[top],
        eigenvectors=mixing @ basis.basis,
        residuals=residuals[top],
        n_hvp=basis.n_hvp,
        converged=converged or basis.m == n,
    )


def solve_lanczos(
    problem: HessianProblem,
    k: int,
    tol: float,
    *,
    max_hvp: int,
    previous: torch.Tensor | None,
    basis_size: int | None,
    seed: int,
) -> Eigenpairs:
    """The ``"lanczos"`` entry of the solver table: :func:`lanczos`, warm-started from
    ``previous`` (earlier eigenvectors) when given."""
    return lanczos(
        problem.operator,
        k,
        tol,
        max_hvp=max_hvp,
        basis_size=basis_size,
        warm_start=previous,
        seed=seed,
    )


def _start_vector(
    operator: LinearOperator, warm_start: torch.Tensor | None, seed: int
) -> torch.Tensor:
    if warm_start is None:
        return next(random_vectors(1, operator, seed))
    if warm_start.shape[-1] != operator.size:
        raise ValueError(
            f"warm_start vectors have length {warm_start.shape[-1]}, operator size {operator.size}"
        )
    start = warm_start.reshape(-1, operator.size).to(operator.dtype).to(operator.device).sum(0)
    if not torch.isfinite(start).all() or torch.linalg.vector_norm(start) == 0:
        return next(random_vectors(1, operator, seed))
    return start
