"""Top-k eigenpairs tracked from an earlier subspace: block Rayleigh–Ritz with residual expansion
(unpreconditioned Davidson). How it works, why guards, and what its residuals certify (not that
the pairs are the top k): ``docs/curvature.md``, "Tracking the top-k during training".
"""

from __future__ import annotations

import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.krylov import project_off
from dynamics.curvature.operator import LinearOperator
from dynamics.curvature.problem import HessianProblem
from dynamics.curvature.restarted_lanczos import lanczos

#: Eigenvectors beyond the top k that the tracking solver carries along: without them the k-th
#: pair of a cluster converges at the rate of its gap to the (k+1)-th eigenvalue, which on the
#: teacher–student model left most records to the cold restart.
GUARDS = 2


def track_eigenpairs(
    operator: LinearOperator,
    previous: torch.Tensor,
    tol: float = 1e-4,
    *,
    k: int | None = None,
    max_basis: int | None = None,
    max_hvp: int = 500,
    seed: int = 0,
) -> Eigenpairs:
    """The ``len(previous)`` largest eigenpairs, refined from the rows of ``previous``, of which
    the top ``k`` are held to ``tol``; the rest are guards.

    Stops when every one of the top ``k`` pairs has ``‖H v − θ v‖ ≤ tol·|θ|`` (the residual rule of
    :func:`~dynamics.curvature.lanczos`, with the same floor for near-zero eigenvalues). When
    the basis reaches ``max_basis`` vectors first, the tracked subspace is judged lost and a
    cold Lanczos from a random vector (``seed``) answers instead, its products counted too.

    Example::

        first = lanczos(operator, k=5)  # the top 3 and two guards
        next_pairs = track_eigenpairs(later_operator, first.eigenvectors, tol=1e-4, k=3)

    Args:
        operator: symmetric operator.
        previous: ``(k + guards, n)`` rows, e.g. the eigenvectors of the previous record; need
            not be orthonormal.
        tol: relative residual tolerance.
        k: how many of the pairs must meet ``tol``; defaults to all.
        max_basis: the most basis vectors before the cold restart; defaults to
            ``5·len(previous)``.
        max_hvp: product budget of the cold restart.
        seed: seed of the cold restart's start vector.

    Returns:
        The top ``len(previous)`` pairs, largest first, with residuals and the products used
        (those of the tracking attempt plus, when it failed, the cold restart's, which holds
        every pair to ``tol``). ``restarted`` on the result tells which; ``converged`` is about
        the top ``k``.
    """
    if previous.ndim != 2 or previous.shape[1] != operator.size:
        raise ValueError(
            f"previous must have shape (k, {operator.size}), got {tuple(previous.shape)}"
        )
    width = previous.shape[0]
    k = width if k is None else k
    if not 1 <= k <= width <= operator.size:
        raise ValueError(
            f"need 1 <= k <= len(previous) <= {operator.size}, got k={k}, len(previous)={width}"
        )
    if tol <= 0:
        raise ValueError(f"tol must be positive, got {tol}")
    max_basis = min(operator.size, max_basis or 5 * width)
    if max_basis < width:
        raise ValueError(f"max_basis must be at least len(previous)={width}, got {max_basis}")
    floor = torch.finfo(operator.dtype).eps ** (2 / 3)

    basis = torch.empty(max_basis, operator.size, dtype=operator.dtype, device=operator.device)
    images = torch.empty_like(basis)  # H @ basis row by row
    projected = torch.zeros(max_basis, max_basis, dtype=torch.float64)  # basis H basisᵀ
    m = 0
    incoming = previous.to(dtype=operator.dtype, device=operator.device, copy=True)
    while True:
        grown, m = m, _extend(operator, basis, images, m, incoming)
        if m == grown:
            break  # nothing new to add: the residuals are (numerically) inside the basis
        # Only the new rows (and, by symmetry, columns): the full product would cost m²·n
        # flops per round, the new rows b·m·n.
        new = (basis[grown:m] @ images[:m].T).double().cpu()
        if not new.isfinite().all():
            raise FloatingPointError("a Hessian-vector product is not finite")
        projected[grown:m, :m] = new
        projected[:m, grown:m] = new.T
        values, coordinates = torch.linalg.eigh(projected[:m, :m])
        top = values.argsort(descending=True)[: min(width, m)]
        mixing = coordinates[:, top].T.to(basis)
        theta = values[top]
        # H v − θ v from the kept products: one pass over the basis and one over the images.
        vectors, residual_vectors = mixing @ basis[:m], mixing @ images[:m]
        residual_vectors.addcmul_(vectors, theta.to(basis)[:, None], value=-1)
        residuals = torch.linalg.vector_norm(residual_vectors, dim=1).double().cpu()
        bound = tol * torch.clamp(theta.abs(), min=floor * values.abs().max().item())
        unconverged = residuals > bound
        unconverged[k:] = False  # guards are not held to tol, nor expanded
        if len(top) == width and not unconverged.any():
            return Eigenpairs(theta, vectors, residuals, m, True)
        if m == max_basis:
            break
        incoming = residual_vectors[unconverged][: max_basis - m]  # a copy: _extend overwrites it

    cold = lanczos(operator, width, tol, max_hvp=max_hvp, seed=seed)
    return Eigenpairs(
        cold.eigenvalues,
        cold.eigenvectors,
        cold.residuals,
        m + cold.n_hvp,
        cold.converged,
        restarted=True,
    )


def solve_tracking(
    problem: HessianProblem,
    k: int,
    tol: float,
    *,
    max_hvp: int,
    previous: torch.Tensor | None,
    basis_size: int | None,
    seed: int,
) -> Eigenpairs:
    """The ``"tracking"`` entry of the solver table: the top ``k`` pairs and :data:`GUARDS`
    guards (``k + GUARDS`` pairs, capped at the operator's size), refined from ``previous`` by
    :func:`track_eigenpairs`.

    ``previous`` must be the ``eigenvectors`` of an earlier tracking result (``k + GUARDS``
    rows); without it, or with another number of rows, the solve is a cold Lanczos of
    ``k + GUARDS`` pairs, whose vectors the next solve then tracks. ``basis_size`` is the most
    basis vectors before a tracked solve gives up and restarts cold.
    """
    operator = problem.operator
    width = min(k + GUARDS, operator.size)
    if previous is None or len(previous) != width:
        return lanczos(operator, width, tol, max_hvp=max_hvp, seed=seed)
    return track_eigenpairs(
        operator, previous, tol, k=k, max_basis=basis_size, max_hvp=max_hvp, seed=seed
    )


def _extend(
    operator: LinearOperator,
    basis: torch.Tensor,
    images: torch.Tensor,
    m: int,
    incoming: torch.Tensor,
) -> int:
    """Append the parts of ``incoming`` orthogonal to ``basis[:m]``, orthonormalised, and their
    products; the new ``m``. ``incoming`` is overwritten.

    The block is projected off the basis at once (one pass over the basis for all its vectors,
    not one per vector: that took a fifth as long as the products in a profile of a
    default-config record), a second time only where needed
    (:func:`~dynamics.curvature.krylov.project_off`: a Ritz residual is orthogonal to the basis
    up to rounding, so one pass nearly always does), then
    its vectors against each other. A direction that is (numerically) already spanned is
    dropped: it adds no information and would only amplify rounding.
    """
    scale = torch.linalg.vector_norm(incoming, dim=1)
    project_off(incoming, basis[:m])
    first = m
    for vector, norm in zip(incoming, scale):
        project_off(vector[None], basis[first:m])
        left = torch.linalg.vector_norm(vector)
        if not left > norm * 1e3 * torch.finfo(vector.dtype).eps:
            continue
        torch.div(vector, left, out=basis[m])
        images[m] = operator.matvec(basis[m])
        m += 1
    return m
