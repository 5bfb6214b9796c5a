"""Curvature of a scalar loss: one operator (Hessian-vector products), algorithms on it.

Start with :func:`top_eigenvalues`; every algorithm takes a :class:`LinearOperator`, of which
:class:`HessianOperator` is the one built from a loss closure. The eigensolvers have one table of
names, :data:`SOLVERS` (``curvature/solvers.py``), shared by ``top_eigenvalues(solver=)`` and
``HessianSpectrum(solver=)``.

The names load on first use: spectral broadening (``curvature/broadening.py``) is torch-free, so
that offline pages drawing densities never import torch.
"""

from dynamics.exports import lazy_exports

_HOMES = {
    "BlockOperator": "dynamics.curvature.blocks",
    "layout_coordinates": "dynamics.curvature.blocks",
    "SpectralDensity": "dynamics.curvature.density",
    "broadened_density": "dynamics.curvature.density",
    "spectral_density": "dynamics.curvature.density",
    "Eigenpairs": "dynamics.curvature.eigenpairs",
    "eigenvalue_error_bounds": "dynamics.curvature.error_bounds",
    "HessianOperator": "dynamics.curvature.operator",
    "LinearOperator": "dynamics.curvature.operator",
    "MeanHessianOperator": "dynamics.curvature.mean_operator",
    "power_iteration": "dynamics.curvature.power",
    "HessianProblem": "dynamics.curvature.problem",
    "pyhessian_eigenpairs": "dynamics.curvature.pyhessian_backend",
    "lanczos": "dynamics.curvature.restarted_lanczos",
    "SOLVERS": "dynamics.curvature.solvers",
    "Solver": "dynamics.curvature.solvers",
    "solver": "dynamics.curvature.solvers",
    "track_eigenpairs": "dynamics.curvature.subspace_tracking",
    "top_eigenvalues": "dynamics.curvature.top",
    "TraceEstimate": "dynamics.curvature.trace",
    "hutch_plus_plus": "dynamics.curvature.trace",
    "hutchinson": "dynamics.curvature.trace",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _HOMES)
