"""Stochastic trace estimates: Hutchinson and Hutch++ (Meyer, Musco, Musco & Woodruff, 2021)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dynamics.curvature.krylov import random_vectors
from dynamics.curvature.operator import LinearOperator


@dataclass(frozen=True)
class TraceEstimate:
    """An unbiased trace estimate.

    Attributes:
        trace: the estimate.
        stderr: its standard error, estimated from the spread of the random quadratic forms
            (the sample standard deviation over the square root of their number).
        n_hvp: Hessian-vector products used.
    """

    trace: float
    stderr: float
    n_hvp: int


def hutchinson(operator: LinearOperator, n_hvp: int = 100, *, seed: int = 0) -> TraceEstimate:
    """``tr H ≈ mean of zᵀ H z`` over ``n_hvp`` Rademacher vectors ``z``.

    Its variance is ``2(‖H‖_F² − Σ H_ii²) / n_hvp``: fine for a diagonal-dominated Hessian, poor
    when a few large eigenvalues carry the trace — then use :func:`hutch_plus_plus`.

    Example::

        hutchinson(HessianOperator(loss, params), n_hvp=100).trace
    """
    if n_hvp < 2:
        raise ValueError(f"n_hvp must be at least 2 to state an error, got {n_hvp}")
    samples = _quadratic_forms(operator, random_vectors(n_hvp, operator, seed, rademacher=True))
    return TraceEstimate(samples.mean().item(), _stderr(samples), n_hvp)


def hutch_plus_plus(operator: LinearOperator, n_hvp: int = 100, *, seed: int = 0) -> TraceEstimate:
    """Hutch++: the trace of ``H`` on a sketched top subspace exactly, Hutchinson on the rest.

    A third of the products sketch ``Q = orth(H S)``, a third give ``tr(Qᵀ H Q)`` exactly, and
    the last third estimate ``tr((I − QQᵀ) H (I − QQᵀ))``; the stated error is that of the
    last part, the only random one once ``Q`` is fixed.

    Example::

        estimate = hutch_plus_plus(HessianOperator(loss, params), n_hvp=60)
        estimate.trace, estimate.stderr
    """
    if n_hvp < 4:
        raise ValueError(f"n_hvp must be at least 4 for Hutch++, got {n_hvp}")
    sketch = n_hvp // 3
    draws = random_vectors(n_hvp - sketch, operator, seed, rademacher=True)
    images = torch.stack([operator.matvec(next(draws)) for _ in range(sketch)])
    q = torch.linalg.qr(images.T).Q.T  # (sketch, n) orthonormal rows
    top = _quadratic_forms(operator, q).sum()
    samples = _quadratic_forms(operator, (g - (q @ g) @ q for g in draws))
    return TraceEstimate((top + samples.mean()).item(), _stderr(samples), n_hvp)


def _quadratic_forms(operator: LinearOperator, vectors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.dot(v, operator.matvec(v)) for v in vectors]).double()


def _stderr(samples: torch.Tensor) -> float:
    return samples.std(correction=1).item() / math.sqrt(len(samples))
