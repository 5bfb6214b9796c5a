"""The Hessian one solve is about: a loss closure, its parameters, and the operator on them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dynamics.curvature.operator import HessianOperator


class HessianProblem:
    """What every solver in :data:`~dynamics.curvature.solvers.SOLVERS` is given.

    The operator is built on first use, so a solver that builds its own products (PyHessian)
    costs no extra gradient graph; a caller that already has one (``HessianSpectrum``, whose
    trace and density share it) passes it in.

    Example::

        problem = HessianProblem(lambda: F.mse_loss(model(x), y), list(model.parameters()))
        problem.operator.matvec(torch.ones(problem.operator.size))
    """

    def __init__(
        self,
        loss_fn: Callable[[], torch.Tensor],
        params: Sequence[torch.Tensor],
        *,
        average_across_ranks: bool = False,
        operator: HessianOperator | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.params = list(params)
        self.average_across_ranks = average_across_ranks
        self._operator = operator

    @property
    def operator(self) -> HessianOperator:
        """The Hessian-vector products of the loss (built at the first call)."""
        if self._operator is None:
            self._operator = HessianOperator(
                self.loss_fn, self.params, average_across_ranks=self.average_across_ranks
            )
        return self._operator
