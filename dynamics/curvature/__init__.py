"""Curvature of a scalar loss: one operator (Hessian-vector products), algorithms on it.

Start with :func:`top_eigenvalues`; every algorithm takes a :class:`LinearOperator`, of which
:class:`HessianOperator` is the one built from a loss closure. The eigensolvers have one table of
names, :data:`SOLVERS` (``curvature/solvers.py``), shared by ``top_eigenvalues(solver=)`` and
``HessianSpectrum(solver=)``.
"""

from dynamics.curvature.density import SpectralDensity, broadened_density, spectral_density
from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.error_bounds import eigenvalue_error_bounds
from dynamics.curvature.operator import HessianOperator, LinearOperator
from dynamics.curvature.power import power_iteration
from dynamics.curvature.problem import HessianProblem
from dynamics.curvature.pyhessian_backend import pyhessian_eigenpairs
from dynamics.curvature.restarted_lanczos import lanczos
from dynamics.curvature.solvers import SOLVERS, Solver, solver
from dynamics.curvature.subspace_tracking import track_eigenpairs
from dynamics.curvature.top_eigenvalues import top_eigenvalues
from dynamics.curvature.trace import TraceEstimate, hutch_plus_plus, hutchinson

__all__ = [
    "Eigenpairs",
    "HessianOperator",
    "HessianProblem",
    "LinearOperator",
    "SOLVERS",
    "Solver",
    "SpectralDensity",
    "TraceEstimate",
    "broadened_density",
    "eigenvalue_error_bounds",
    "hutch_plus_plus",
    "hutchinson",
    "lanczos",
    "power_iteration",
    "pyhessian_eigenpairs",
    "solver",
    "spectral_density",
    "top_eigenvalues",
    "track_eigenpairs",
]
