"""The top Hessian eigenvalues of a loss, by any solver of the table on one operator."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.problem import HessianProblem
from dynamics.curvature.solvers import Solver, solver
from dynamics.errors import ParameterError
from dynamics.passes.isolation import side_effect_free


def top_eigenvalues(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    k: int = 1,
    tol: float = 1e-4,
    *,
    solver: str = "lanczos",
    max_hvp: int = 500,
    previous: torch.Tensor | None = None,
    basis_size: int | None = None,
    seed: int = 0,
    module: nn.Module | None = None,
    average_across_ranks: bool = False,
    backend: str | None = None,
    warm_start: torch.Tensor | None = None,
) -> Eigenpairs:
    """The ``k`` largest Hessian eigenvalues (and eigenvectors) of ``loss_fn()`` in ``params``.

    Example::

        params = [p for p in model.parameters() if p.requires_grad]
        pairs = top_eigenvalues(lambda: F.mse_loss(model(x), y), params, k=5, module=model)
        pairs.eigenvalues, pairs.n_hvp
        # a step later: refine those eigenvectors instead of starting cold
        pairs = top_eigenvalues(loss, params, k=5, solver="tracking", previous=pairs.eigenvectors)

    Args:
        loss_fn: zero-argument closure returning the scalar loss, computed through ``params``
            (all float32 or all float64). Called once: its gradient graph serves every product.
            Attention in it runs on the math backend of ``F.scaled_dot_product_attention``
            (see :func:`~dynamics.curvature.operator.twice_differentiable`).
        params: the tensors the Hessian is taken with respect to.
        k: how many eigenvalues.
        tol: stop when ``‖H v − λ v‖ ≤ tol·|λ|`` for every pair; for ``"pyhessian"``,
            PyHessian's own rule (relative change between iterates).
        solver: a name of :data:`~dynamics.curvature.solvers.SOLVERS`: ``"lanczos"`` (the
            default), ``"tracking"`` (refine ``previous``; returns ``k + 2`` pairs, the last two
            guards to pass on), ``"power"`` or ``"pyhessian"`` (the cross-check).
        max_hvp: product budget.
        previous: earlier eigenvectors, rows of length ``sum(p.numel())``, e.g. the
            ``eigenvectors`` of the previous training step's result: the start of
            ``"lanczos"``, the basis ``"tracking"`` refines.
        basis_size: the most basis vectors held (``"lanczos"``, ``"tracking"``); None: the
            solver's default.
        seed: seed of the random start vectors (the global RNG is not used).
        module: the module ``loss_fn`` runs through; if given, the computation runs inside
            :func:`~dynamics.passes.isolation.side_effect_free`, so dropout draws, BatchNorm buffers
            and train/eval flags are as before. ``.grad`` is never changed, module or not.
        average_across_ranks: take the Hessian of the loss averaged over the ranks of the
            initialised ``torch.distributed`` group (every rank must call this).
        backend: the old name of ``solver`` (accepted for this release, with a warning).
        warm_start: the old name of ``previous`` (accepted for this release, with a warning).

    Raises:
        ParameterError: an unknown solver, or an argument the chosen solver does not take.
        FloatingPointError: if the loss or a product is NaN or infinite.
    """
    name = _renamed("backend", backend, "solver", solver, solver != "lanczos")
    previous = _renamed("warm_start", warm_start, "previous", previous, previous is not None)
    entry = _checked(name, "solver" if backend is None else "backend", previous, basis_size)
    if average_across_ranks and not entry.averages_ranks:
        raise ParameterError("average_across_ranks", f"is not supported by solver {name!r}")
    problem = HessianProblem(loss_fn, params, average_across_ranks=average_across_ranks)
    with side_effect_free(module) if module is not None else nullcontext():
        return entry.solve(
            problem,
            k,
            tol,
            max_hvp=max_hvp,
            previous=previous,
            basis_size=basis_size,
            seed=seed,
        )


def _checked(
    name: str, parameter: str, previous: torch.Tensor | None, basis_size: int | None
) -> Solver:
    entry = solver(name, parameter)
    if previous is not None and not entry.uses_previous:
        raise ParameterError("previous", f"is not used by solver {name!r} (it starts at random)")
    if basis_size is not None and not entry.uses_basis:
        raise ParameterError("basis_size", f"is not used by solver {name!r} (it keeps no basis)")
    return entry


def _renamed(old: str, old_value: Any, new: str, new_value: Any, new_given: bool) -> Any:
    """The value of a renamed argument: the new one, or the old one with a warning."""
    if old_value is None:
        return new_value
    if new_given:
        raise ParameterError(old, f"is the old name of {new}; pass {new} alone")
    warnings.warn(
        f"top_eigenvalues({old}=) is now {new}=; {old}= goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value
