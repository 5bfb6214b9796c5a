"""An orthonormal Krylov basis grown one Hessian-vector product at a time.

Shared by the top-k Lanczos solver and stochastic Lanczos quadrature. Each product is reduced
by the couplings Lanczos already knows (the three-term recurrence, or the arrowhead after a
thick restart), then orthogonalised against the whole basis once more — twice when that pass
removed much (Daniel–Gragg–Kaufman–Stewart) — which keeps the basis orthonormal to working
precision: no ghost eigenvalues, at one pass over the basis per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from dynamics.curvature.operator import LinearOperator


def project_off(block: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Remove from each row of ``block``, in place, its components along the orthonormal
    ``rows``: one pass, and a second only where the first removed most of a vector
    (Daniel–Gragg–Kaufman–Stewart), which is when rounding in the first can matter.

    Returns:
        The coefficients removed, ``(len(block), len(rows))`` in float64.
    """
    removed = torch.zeros(len(block), len(rows), dtype=torch.float64, device=block.device)
    if not len(rows):
        return removed
    norm = torch.linalg.vector_norm(block, dim=1)
    for _ in range(2):
        correction = block @ rows.T
        block -= correction @ rows
        removed += correction.double()
        shrunk = torch.linalg.vector_norm(block, dim=1)
        if (shrunk > norm / math.sqrt(2)).all():
            break
        norm = shrunk
    return removed


def random_vectors(
    count: int, operator: LinearOperator, seed: int, *, rademacher: bool = False
) -> Iterator[torch.Tensor]:
    """``count`` Gaussian (or ±1) vectors of length ``operator.size``, one at a time (a block
    of them can outweigh the model), from a private generator.

    The global RNG is never touched, and every rank of a data-parallel run draws the same
    vectors, so their Lanczos iterations stay in lockstep.
    """
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        if rademacher:
            draw = torch.randint(0, 2, (operator.size,), generator=generator) * 2 - 1
        else:
            draw = torch.randn(operator.size, generator=generator, dtype=torch.float64)
        yield draw.to(operator.dtype).to(operator.device)


class KrylovBasis:
    """Orthonormal rows ``Q[:m]`` with the projected matrix ``T = Q H Qᵀ`` and a residual ``r``.

    Invariant after every :meth:`step`: ``H Qᵀ = Qᵀ T + r e_mᵀ`` with ``r ⟂ Q``, so the residual
    of a Ritz pair ``(θ_i, Qᵀ s_i)`` is exactly ``‖r‖·|s_i[m-1]|``. ``T`` is a small float64
    CPU tensor.

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
        self.projected = torch.zeros(capacity, capacity, dtype=torch.float64)
        self.m = 0
        self.residual = torch.zeros(operator.size, dtype=operator.dtype, device=operator.device)
        self.beta = 0.0
        # Known couplings ``q_i·H r/‖r‖`` of the residual direction with the basis vectors.
        self.couplings = torch.zeros(0, dtype=torch.float64)
        self.n_hvp = 0

    @property
    def basis(self) -> torch.Tensor:
        return self.rows[: self.m]

    def restart_with(self, vector: torch.Tensor) -> None:
        """Make (the part of ``vector`` orthogonal to the basis) the next direction to expand.

        Used at the start and after the basis became invariant, when the couplings vanish.
        """
        vector = vector.to(self.rows.dtype).clone()
        for _ in range(2):
            vector -= (self.basis @ vector) @ self.basis
        self.residual = vector
        self.beta = torch.linalg.vector_norm(vector).item()
        self.couplings = torch.zeros(self.m, dtype=torch.float64)

    def step(self) -> None:
        """Expand the basis by the normalised residual: one Hessian-vector product.

        Raises:
            FloatingPointError: if the product is not finite.
        """
        if self.m == self.capacity:
            raise RuntimeError("the Krylov basis is full; compress it first")
        j = self.m
        self.rows[j] = self.residual / self.beta
        self.m += 1
        vector = self.operator.matvec(self.rows[j])
        self.n_hvp += 1
        known = self.couplings.nonzero().flatten()
        if len(known):
            vector -= self.couplings[known].to(vector) @ self.rows[known]
        alpha = torch.dot(self.rows[j], vector)
        vector -= alpha * self.rows[j]
        column = torch.zeros(self.m, dtype=torch.float64)
        column[:j] = self.couplings
        column[j] = alpha.item()
        column += project_off(vector[None], self.basis)[0].cpu()
        self.beta = torch.linalg.vector_norm(vector).item()
        if not (math.isfinite(self.beta) and column.isfinite().all()):
            raise FloatingPointError("a Hessian-vector product is not finite")
        self.projected[: self.m, j] = column
        self.projected[j, : self.m] = column
        self.residual = vector
        self.couplings = torch.zeros(self.m, dtype=torch.float64)
        self.couplings[j] = self.beta

    def ritz(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ritz values (ascending), their coordinate vectors in the basis, and their residuals."""
        values, coordinates = torch.linalg.eigh(self.projected[: self.m, : self.m])
        return values, coordinates, self.beta * coordinates[-1].abs()

    def is_invariant(self) -> bool:
        """Whether the basis spans an invariant subspace (the residual all but vanished)."""
        scale = self.projected[: self.m, : self.m].abs().max().item() if self.m else 0.0
        return self.beta <= math.sqrt(torch.finfo(self.rows.dtype).eps) * scale

    def compress(self, coordinates: torch.Tensor, values: torch.Tensor) -> None:
        """Thick restart: keep only the Ritz vectors with the given coordinates and values.

        The residual stays as it is (it is orthogonal to every Ritz vector); its couplings with
        the kept vectors become ``‖r‖·s_i[m-1]`` (an arrowhead instead of a tridiagonal).
        """
        kept = len(values)
        mixing = coordinates.T.to(self.rows)
        self.rows[:kept] = mixing @ self.basis
        self.couplings = self.beta * coordinates[-1]
        self.projected.zero_()
        self.projected.diagonal()[:kept] = values
        self.m = kept
