"""The eigensolvers by name: the one vocabulary of ``top_eigenvalues(solver=)`` and
``HessianSpectrum(solver=)``.

A solver is a function of a :class:`~dynamics.curvature.problem.HessianProblem` with the
signature of :class:`SolveFunction`, in its own file; adding one is that file and one entry of
:data:`SOLVERS` (``docs/curvature.md``, "Adding a solver").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.power import solve_power
from dynamics.curvature.problem import HessianProblem
from dynamics.curvature.pyhessian_backend import solve_pyhessian
from dynamics.curvature.restarted_lanczos import solve_lanczos
from dynamics.curvature.subspace_tracking import GUARDS, solve_tracking
from dynamics.errors import ParameterError


class SolveFunction(Protocol):
    """What a solver computes: at least the ``k`` largest eigenpairs, largest first (a solver
    with ``guards`` returns ``k + guards``), each held to ``‖H v − λ v‖ ≤ tol·|λ|`` where it
    reports residuals, within ``max_hvp`` products. ``previous`` are earlier eigenvectors to
    start from, ``basis_size`` the most basis vectors held; None leaves either to the solver."""

    def __call__(
        self,
        problem: HessianProblem,
        k: int,
        tol: float,
        *,
        max_hvp: int,
        previous: torch.Tensor | None,
        basis_size: int | None,
        seed: int,
    ) -> Eigenpairs: ...


@dataclass(frozen=True)
class Solver:
    """One entry of :data:`SOLVERS`: the function and what it can do, so that callers check
    arguments against the entry instead of against a list of names.

    Example::

        SOLVERS["dense"] = Solver(solve_dense, "dense eigh, for tiny models", uses_previous=False)

    Attributes:
        solve: the function.
        summary: one line for error messages and the docs.
        guards: pairs returned beyond the ``k`` asked for (carried to the next solve).
        uses_previous: whether ``previous`` reaches the solve (a warm start or a tracked basis).
        uses_basis: whether ``basis_size`` does.
        certified: whether it reports residuals and convergence (PyHessian does not).
        averages_ranks: whether it works on a Hessian averaged across ranks.
    """

    solve: SolveFunction
    summary: str
    guards: int = 0
    uses_previous: bool = True
    uses_basis: bool = True
    certified: bool = True
    averages_ranks: bool = True


#: The solvers by name. ``"lanczos"`` is the default and the reference.
SOLVERS: dict[str, Solver] = {
    "lanczos": Solver(solve_lanczos, "thick-restart Lanczos; previous eigenvectors warm-start it"),
    "tracking": Solver(
        solve_tracking,
        "refines the previous solve's eigenvectors (block Rayleigh–Ritz, cold Lanczos when lost)",
        guards=GUARDS,
    ),
    "power": Solver(
        solve_power,
        "power iteration with deflation (largest magnitude), the classic baseline",
        uses_previous=False,
        uses_basis=False,
    ),
    "pyhessian": Solver(
        solve_pyhessian,
        "PyHessian 0.1's power iteration, the cross-check (no residuals)",
        uses_previous=False,
        uses_basis=False,
        certified=False,
        averages_ranks=False,
    ),
}


def solver(name: str, parameter: str = "solver") -> Solver:
    """The entry of :data:`SOLVERS` called ``name``.

    Example::

        solver("tracking").guards  # 2

    Raises:
        ParameterError: no solver is called ``name`` (named as ``parameter``).
    """
    if name not in SOLVERS:
        known = ", ".join(repr(n) for n in SOLVERS)
        raise ParameterError(parameter, f"must be one of {known}, got {name!r}")
    return SOLVERS[name]
