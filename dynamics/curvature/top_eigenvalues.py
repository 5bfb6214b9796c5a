"""The top Hessian eigenvalues of a loss, by any of the eigensolvers on one operator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Literal

import torch
from torch import nn

from dynamics.curvature.eigenpairs import Eigenpairs
from dynamics.curvature.operator import HessianOperator
from dynamics.curvature.power import power_iteration
from dynamics.curvature.pyhessian_backend import pyhessian_eigenpairs
from dynamics.curvature.restarted_lanczos import lanczos
from dynamics.passes.isolation import side_effect_free

Backend = Literal["lanczos", "power", "pyhessian"]


def top_eigenvalues(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    k: int = 1,
    tol: float = 1e-4,
    *,
    backend: Backend = "lanczos",
    max_hvp: int = 500,
    warm_start: torch.Tensor | None = None,
    seed: int = 0,
    module: nn.Module | None = None,
    average_across_ranks: bool = False,
) -> Eigenpairs:
    """The ``k`` largest Hessian eigenvalues (and eigenvectors) of ``loss_fn()`` in ``params``.

    Example::

        params = [p for p in model.parameters() if p.requires_grad]
        pairs = top_eigenvalues(lambda: F.mse_loss(model(x), y), params, k=5, module=model)
        pairs.eigenvalues, pairs.n_hvp

    Args:
        loss_fn: zero-argument closure returning the scalar loss, computed through ``params``
            (all float32 or all float64). Called once: its gradient graph serves every product.
            Attention in it runs on the math backend of ``F.scaled_dot_product_attention``, the
            only one that can be differentiated twice (see
            :func:`~dynamics.curvature.operator.twice_differentiable`).
        params: the tensors the Hessian is taken with respect to.
        k: how many eigenvalues.
        tol: for ``"lanczos"`` and ``"power"``, stop when ``‖H v − λ v‖ ≤ tol·|λ|`` for every
            pair; for ``"pyhessian"``, PyHessian's own rule (relative change between iterates).
        backend: ``"lanczos"`` (thick-restart Lanczos, the default), ``"power"`` (power
            iteration with deflation; largest *magnitude*) or ``"pyhessian"`` (PyHessian 0.1,
            the cross-check; ``max_hvp // k`` iterations per eigenvalue).
        max_hvp: product budget.
        warm_start: earlier eigenvectors, rows of length ``sum(p.numel())``, to start from
            (``"lanczos"`` only), e.g. the ``eigenvectors`` of the previous training step.
        seed: seed of the random start vectors (the global RNG is not used).
        module: the module ``loss_fn`` runs through; if given, the computation runs inside
            :func:`~dynamics.passes.isolation.side_effect_free`, so dropout draws, BatchNorm buffers
            and
            train/eval flags are as before. ``.grad`` is never changed, module or not.
        average_across_ranks: take the Hessian of the loss averaged over the ranks of the
            initialised ``torch.distributed`` group (every rank must call this).

    Raises:
        FloatingPointError: if the loss or a product is NaN or infinite.
    """
    if backend not in ("lanczos", "power", "pyhessian"):
        raise ValueError(f"backend must be 'lanczos', 'power' or 'pyhessian', got {backend!r}")
    if warm_start is not None and backend != "lanczos":
        raise ValueError(f"warm_start needs backend='lanczos', got {backend!r}")
    with side_effect_free(module) if module is not None else nullcontext():
        if backend == "pyhessian":
            if average_across_ranks:
                raise ValueError("the pyhessian backend cannot average across ranks")
            return pyhessian_eigenpairs(loss_fn, params, k, tol, max_iter=max(1, max_hvp // k))
        operator = HessianOperator(loss_fn, params, average_across_ranks=average_across_ranks)
        if backend == "power":
            return power_iteration(operator, k, tol, max_hvp=max_hvp, seed=seed)
        return lanczos(operator, k, tol, max_hvp=max_hvp, warm_start=warm_start, seed=seed)
