"""What every top-k eigensolver returns."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Eigenpairs:
    """Top-k eigenpairs of a symmetric operator, largest first.

    Example::

        pairs = top_eigenvalues(loss, params, k=3)
        pairs.eigenvalues, pairs.residuals, pairs.converged

    Attributes:
        eigenvalues: shape ``(k,)``, float64 on the CPU.
        eigenvectors: shape ``(k, n)``, orthonormal rows, the operator's dtype and device.
        residuals: ``‖H v − λ v‖`` per pair, shape ``(k,)``; ``None`` when the backend does not
            report them (PyHessian).
        n_hvp: Hessian-vector products used.
        converged: whether the stopping rule was met for every pair within the product budget;
            ``None`` when the backend cannot tell (PyHessian).
        restarted: whether a tracking solve lost its subspace and fell back to a cold start
            (:func:`~dynamics.curvature.track_eigenpairs`); ``False`` for every other solver.
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    residuals: torch.Tensor | None
    n_hvp: int
    converged: bool | None
    restarted: bool = False

    def top(self, k: int) -> Eigenpairs:
        """The first ``k`` pairs (a tracking solve's result without its guards).

        Example::

            pairs = top_eigenvalues(loss, params, k=5, solver="tracking")
            pairs.top(5).eigenvalues  # the five asked for; pairs itself also holds two guards
        """
        residuals = None if self.residuals is None else self.residuals[:k]
        return replace(
            self,
            eigenvalues=self.eigenvalues[:k],
            eigenvectors=self.eigenvectors[:k],
            residuals=residuals,
        )
