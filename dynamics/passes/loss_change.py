"""The change of a loss over one parameter step, split into one term per parameter group.

Along the segment θ(t) = θ + tΔθ, t ∈ [0, 1], the fundamental theorem of calculus gives

    ΔL = L(θ + Δθ) − L(θ) = ∫₀¹ ∇L(θ(t))·Δθ dt = Σ_g ∫₀¹ ∇_g L(θ(t))·Δθ_g dt,

one term per group g of parameter tensors (their entries of the gradient and of the step). The
integrals are taken by composite Gauss–Legendre quadrature (``nodes`` nodes per panel, from
:func:`numpy.polynomial.legendre.leggauss`), and the quadrature is checked against the measured
ΔL, which two loss evaluations give exactly: panels are bisected until the terms sum to ΔL within
``rtol`` (relative), and a panel whose own loss change its terms miss most is bisected first
(every panel's change is measured, so the check is local too). A smooth loss converges in one
panel of a few nodes (n nodes integrate a polynomial integrand of degree 2n − 1 exactly: a
quadratic loss needs one node). Activations with kinks (ReLU) make the integrand jump where a
unit switches on or off along the segment, where quadrature converges only slowly; when the
budget of gradient evaluations runs out first, the result says so (:attr:`LossChange.converged`
is false and :attr:`LossChange.residual` says by how much) rather than hide it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Below this many roundings of the loss itself (in the coarser of the parameters' and the
#: loss's precision), no quadrature can resolve a residual (a step that barely changes the
#: loss): the tolerance is never tighter than that.
_ROUNDING_FLOOR = 1e3


@dataclass(frozen=True)
class LossChange:
    """One step's loss change and its split.

    Attributes:
        loss_before: L(θ).
        loss_after: L(θ + Δθ).
        terms: one term per group, float64; they sum to :attr:`delta` up to :attr:`residual`.
        gradient_evaluations: gradients of the loss taken (the cost, with ``panels + 1``
            loss-only evaluations).
        panels: quadrature panels the segment ended in.
        tolerance: the largest ``|residual|`` accepted.
        loss_dtype: the dtype the loss came back in (a model may compute it in float32 from
            float64 parameters: a Hugging Face causal LM casts its logits), which bounds the
            precision of ΔL and so the tolerance.
    """

    loss_before: float
    loss_after: float
    terms: np.ndarray
    gradient_evaluations: int
    panels: int
    tolerance: float
    loss_dtype: torch.dtype = torch.float64

    @property
    def delta(self) -> float:
        """The measured loss change ΔL."""
        return self.loss_after - self.loss_before

    @property
    def residual(self) -> float:
        """Σ terms − ΔL: what the quadrature misses."""
        return float(self.terms.sum()) - self.delta

    @property
    def converged(self) -> bool:
        """Whether the terms sum to ΔL within the tolerance."""
        return abs(self.residual) <= self.tolerance


@dataclass(frozen=True)
class _Panel:
    a: float
    b: float
    loss_a: float
    loss_b: float
    terms: np.ndarray

    @property
    def residual(self) -> float:
        return float(self.terms.sum()) - (self.loss_b - self.loss_a)


def split_loss_change(
    loss: Callable[[list[torch.Tensor]], torch.Tensor],
    start: Sequence[torch.Tensor],
    end: Sequence[torch.Tensor],
    groups: Sequence[int],
    *,
    nodes: int = 2,
    rtol: float = 1e-6,
    max_gradient_evaluations: int = 256,
) -> LossChange:
    """Split L(end) − L(start) into one term per group by integrating the gradient.

    Example::

        def loss(tensors):
            return loss_at(module, dict(zip(names, tensors)), batch)

        split = split_loss_change(loss, before, after, groups.index)
        split.terms, split.delta, split.residual, split.converged

    Args:
        loss: the loss at given parameter tensors (a scalar tensor, differentiable in them).
            Called with tensors of ``start``'s dtype; pass float64 tensors to resolve a small
            ΔL to ``rtol``.
        start: θ, one tensor per parameter.
        end: θ + Δθ, shaped like ``start``.
        groups: for each tensor, the index of its group (0, 1, ...).
        nodes: Gauss–Legendre nodes per panel.
        rtol: the relative tolerance of the sum of the terms against ΔL.
        max_gradient_evaluations: the budget; bisection stops when one more would exceed it.

    Raises:
        ValueError: mismatched arguments, or ``nodes`` < 1, or a budget below ``nodes``.
        FloatingPointError: a loss or term that is NaN or infinite.
    """
    if len(start) != len(end) or len(start) != len(groups):
        raise ValueError("start, end and groups need one entry per parameter tensor")
    if nodes < 1 or max_gradient_evaluations < nodes:
        raise ValueError(
            f"need nodes >= 1 and max_gradient_evaluations >= nodes, got {nodes} and "
            f"{max_gradient_evaluations}"
        )
    start = [s.detach() for s in start]
    step = [e.detach() - s for s, e in zip(start, end)]
    index = torch.as_tensor(groups, device=start[0].device)
    n_groups = int(max(groups)) + 1
    x, w = np.polynomial.legendre.leggauss(nodes)
    evaluations = 0
    loss_dtypes = set()  # of every evaluation: the coarsest bounds what ΔL resolves

    def point(t: float) -> list[torch.Tensor]:
        return [s + t * d for s, d in zip(start, step)]

    def value(t: float) -> float:
        with torch.no_grad():
            computed = loss(point(t))
        loss_dtypes.add(computed.dtype)
        result = float(computed)
        if not math.isfinite(result):
            raise FloatingPointError(f"the loss is {result} at t = {t:g} on the step")
        return result

    def panel(a: float, b: float, loss_a: float, loss_b: float) -> _Panel:
        nonlocal evaluations
        terms = torch.zeros(n_groups, dtype=torch.float64, device=index.device)
        for xi, wi in zip(x, w):
            at = [p.requires_grad_() for p in point(a + (b - a) * (xi + 1) / 2)]
            with torch.enable_grad():
                grads = torch.autograd.grad(loss(at), at, allow_unused=True, materialize_grads=True)
            dots = torch.stack([(g * d).sum() for g, d in zip(grads, step)]).to(torch.float64)
            terms.index_add_(0, index, (b - a) * wi / 2 * dots)
            evaluations += 1
        result = terms.cpu().numpy()
        if not np.isfinite(result).all():
            raise FloatingPointError(f"a term is not finite on [{a:g}, {b:g}] of the step")
        return _Panel(a, b, loss_a, loss_b, result)

    loss_before, loss_after = value(0.0), value(1.0)
    loss_dtype = _coarsest(loss_dtypes)
    eps = torch.finfo(_coarsest({start[0].dtype, loss_dtype})).eps
    tolerance = max(
        rtol * abs(loss_after - loss_before),
        _ROUNDING_FLOOR * eps * max(abs(loss_before), abs(loss_after)),
    )
    panels = [panel(0.0, 1.0, loss_before, loss_after)]
    while (
        abs(sum(p.residual for p in panels)) > tolerance
        and evaluations + 2 * nodes <= max_gradient_evaluations
    ):
        worst = max(range(len(panels)), key=lambda k: abs(panels[k].residual))
        whole = panels.pop(worst)
        middle = (whole.a + whole.b) / 2
        loss_middle = value(middle)
        panels[worst:worst] = [
            panel(whole.a, middle, whole.loss_a, loss_middle),
            panel(middle, whole.b, loss_middle, whole.loss_b),
        ]
    terms = np.sum([p.terms for p in panels], axis=0)
    return LossChange(
        loss_before, loss_after, terms, evaluations, len(panels), tolerance, loss_dtype
    )


def _coarsest(dtypes: set[torch.dtype]) -> torch.dtype:
    """The floating dtype of ``dtypes`` with the largest rounding (float64 when none)."""
    floating = [d for d in dtypes if d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=torch.float64)
