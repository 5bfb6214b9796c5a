"""PyHessian (Yao et al., 2020) behind the closure interface: the cross-check and the baseline."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from pyhessian import hessian as PyHessian
from torch import nn

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.operator import twice_differentiable
from dynamics.curvature.problem import HessianProblem
from dynamics.params.vectors import flatten
from dynamics.passes.isolation import side_effect_free


def pyhessian_eigenpairs(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    k: int = 1,
    tol: float = 1e-3,
    *,
    max_iter: int = 100,
) -> Eigenpairs:
    """Top-k eigenpairs from PyHessian 0.1's deflated power iteration.

    PyHessian switches its model to eval mode, fills ``.grad`` through ``backward`` and draws
    start vectors from the global RNG; here it runs on a shim model holding ``params`` inside
    :func:`~dynamics.passes.isolation.side_effect_free`, so all of that is undone, and in the
    parameters' dtype. The products it makes are counted with a gradient hook on the first
    parameter (one call per product, plus one for its initial gradient).

    Example::

        pyhessian_eigenpairs(lambda: F.mse_loss(model(x), y), list(model.parameters()), k=2)

    Args:
        loss_fn: zero-argument closure returning the scalar loss, computed through ``params``.
        params: the tensors the Hessian is taken with respect to.
        k: how many eigenpairs (PyHessian's ``top_n``).
        tol: PyHessian's stopping rule — the relative change of the estimate between two
            iterations — not a residual bound.
        max_iter: PyHessian's iteration cap per eigenvalue.

    Returns:
        The pairs, largest first, with ``residuals=None`` and ``converged=None``: PyHessian
        reports neither.
    """
    shim = _ClosureModel(loss_fn, params)
    calls = [0]
    hook = shim.tensors[0].register_hook(lambda grad: calls.__setitem__(0, calls[0] + 1))
    default_dtype = torch.get_default_dtype()
    try:
        with side_effect_free(shim), twice_differentiable(), warnings.catch_warnings():
            # PyHessian's backward(create_graph=True) ties .grad to the graph; restoring .grad on
            # exit breaks that cycle, so torch's warning about it does not apply.
            warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph")
            # PyHessian draws its vectors with the default dtype.
            torch.set_default_dtype(shim.tensors[0].dtype)
            engine = PyHessian(
                shim,
                lambda loss, _: loss,
                data=(torch.empty(0), torch.empty(0)),
                cuda=shim.tensors[0].is_cuda,
            )
            values, vectors = engine.eigenvalues(maxIter=max_iter, tol=tol, top_n=k)
            del engine  # its copy of the gradient holds the double-backward graph
    finally:
        torch.set_default_dtype(default_dtype)
        hook.remove()
    order = torch.argsort(torch.tensor(values, dtype=torch.float64), descending=True)
    return Eigenpairs(
        eigenvalues=torch.tensor(values, dtype=torch.float64)[order],
        eigenvectors=torch.stack([flatten(v) for v in vectors])[order],
        residuals=None,
        n_hvp=calls[0] - 1,
        converged=None,
    )


def solve_pyhessian(
    problem: HessianProblem,
    k: int,
    tol: float,
    *,
    max_hvp: int,
    previous: torch.Tensor | None,
    basis_size: int | None,
    seed: int,
) -> Eigenpairs:
    """The ``"pyhessian"`` entry of the solver table: :func:`pyhessian_eigenpairs` on the
    problem's closure (it builds its own products), ``max_hvp // k`` iterations per pair; it
    draws its start vectors itself, so ``seed`` does not reach it."""
    return pyhessian_eigenpairs(
        problem.loss_fn, problem.params, k, tol, max_iter=max(1, max_hvp // k)
    )


class _ClosureModel(nn.Module):
    """PyHessian wants ``model(inputs)``, ``criterion(outputs, targets)`` and
    ``model.parameters()``: the forward is the closure, the parameters are the given tensors."""

    def __init__(self, loss_fn: Callable[[], torch.Tensor], tensors: Sequence[torch.Tensor]):
        super().__init__()
        self.loss_fn = loss_fn
        self.tensors = list(tensors)

    def forward(self, _inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn()

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return iter(self.tensors)
