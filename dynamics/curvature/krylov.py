"""An orthonormal Krylov basis grown one Hessian-vector product at a time.

Shared by the top-k Lanczos solver and stochastic Lanczos quadrature. Each new direction is
orthogonalised against the whole basis twice (classical Gram–Schmidt, "twice is enough"), which
keeps the basis orthonormal to working precision: no ghost eigenvalues, at O(m·n) per step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dynamics.curvature.operator import LinearOperator


def random_vectors(
    count: int, operator: LinearOperator, seed: int, *, rademacher: bool = False
) -> torch.Tensor:
    """``count`` Gaussian (or ±1) rows of length ``operator.size``, from a private generator.

    The global RNG is never touched, and every rank of a data-parallel run draws the same
    vectors, so their Lanczos iterations stay in lockstep.
    """
    generator = torch.Generator().manual_seed(seed)
    if rademacher:
        draws = torch.randint(0, 2, (count, operator.size), generator=generator) * 2 - 1
    else:
        draws = torch.randn(count, operator.size, generator=generator, dtype=torch.float64)
    return draws.to(operator.dtype).to(operator.device)


class KrylovBasis:
    """Orthonormal rows ``Q[:m]`` with the projected matrix ``T = Q H Qᵀ`` and a residual ``r``.

    Invariant after every :meth:`step`: ``H Qᵀ = Qᵀ T + r e_mᵀ`` with ``r ⟂ Q``, so the residual
    of a Ritz pair ``(θ_i, Qᵀ s_i)`` is exactly ``‖r‖·|s_i[m-1]|``.

    Args:
        operator: the symmetric operator.
        capacity: the most basis vectors held at once.
    """

    def __init__(self, operator: LinearOperator, capacity: int) -> None:
        self.operator = operator
        self.capacity = capacity
        self.rows = torch.empty(
            capacity, operator.size, dtype=operator.dtype, device=operator.device
        )
        self.projected = np.zeros((capacity, capacity))
        self.m = 0
        self.residual = torch.zeros(operator.size, dtype=operator.dtype, device=operator.device)
        self.beta = 0.0
        self.n_hvp = 0

    @property
    def basis(self) -> torch.Tensor:
        return self.rows[: self.m]

    def restart_with(self, vector: torch.Tensor) -> None:
        """Make (the part of ``vector`` orthogonal to the basis) the next direction to expand."""
        self.residual = self._orthogonalized(vector.to(self.rows.dtype).clone())[0]
        self.beta = torch.linalg.vector_norm(self.residual).item()

    def step(self) -> None:
        """Expand the basis by the normalised residual: one Hessian-vector product.

        Raises:
            FloatingPointError: if the product is not finite.
        """
        if self.m == self.capacity:
            raise RuntimeError("the Krylov basis is full; compress it first")
        self.rows[self.m] = self.residual / self.beta
        self.m += 1
        product = self.operator.matvec(self.rows[self.m - 1])
        self.n_hvp += 1
        if not torch.isfinite(product).all():
            raise FloatingPointError("a Hessian-vector product is not finite")
        self.residual, coefficients = self._orthogonalized(product)
        column = coefficients.double().cpu().numpy()
        self.projected[: self.m, self.m - 1] = column
        self.projected[self.m - 1, : self.m] = column
        self.beta = torch.linalg.vector_norm(self.residual).item()

    def ritz(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ritz values (ascending), their coordinate vectors in the basis, and their residuals."""
        values, coordinates = np.linalg.eigh(self.projected[: self.m, : self.m])
        return values, coordinates, self.beta * np.abs(coordinates[-1])

    def is_invariant(self) -> bool:
        """Whether the basis spans an invariant subspace (the residual vanished)."""
        scale = np.abs(self.projected[: self.m, : self.m]).max(initial=0.0)
        return self.beta <= math.sqrt(torch.finfo(self.rows.dtype).eps) * max(scale, 1e-300)

    def compress(self, coordinates: np.ndarray, values: np.ndarray) -> None:
        """Thick restart: keep only the Ritz vectors with the given coordinates and values.

        The residual stays as it is (it is orthogonal to every Ritz vector); the couplings
        ``‖r‖·s_i[m-1]`` between the kept vectors and it reappear in ``T`` at the next step.
        """
        kept = len(values)
        mixing = torch.from_numpy(coordinates.T).to(self.rows.dtype).to(self.rows.device)
        self.rows[:kept] = mixing @ self.basis
        self.projected[:] = 0.0
        self.projected[np.arange(kept), np.arange(kept)] = values
        self.m = kept

    def _orthogonalized(self, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coefficients = torch.zeros(self.m, dtype=vector.dtype, device=vector.device)
        for _ in range(2):
            if self.m == 0:
                break
            step = self.basis @ vector
            vector = vector - step @ self.basis
            coefficients += step
        return vector, coefficients
