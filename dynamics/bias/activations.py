"""Activations with an optional shift that removes their bias (the post-activation mean).

The paper's intervention (seed 002, Eq. 9): subtract a fixed c = E[φ(z)], z ~ N(0, 1), or, in
the adaptive form, each forward's mean across the neuron dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from numpy.polynomial.laguerre import laggauss
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
SHIFTS = ("none", "expected", "adaptive")


def _gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    # GPT-2's "gelu_new": the tanh approximation, written as transformers writes it.
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def _gelu_fast(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1.0 + torch.tanh(z * 0.7978845608 * (1.0 + 0.044715 * z * z)))


class ClippedGELU:
    """GELU clipped to [low, high] (transformers' ``gelu_10``): kinks where GELU meets a
    bound, which :func:`expected_value` integrates around rather than across."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return torch.clip(F.gelu(z), self.low, self.high)


#: GELU's least value (at z ≈ −0.7518): a lower bound below it never clips.
_GELU_MIN = -0.16997


def _clipped_gelu_expectation(phi: ClippedGELU) -> float:
    """E[clip(gelu(z), low, high)] = E[gelu(z)] − E[(gelu(z) − high) 1{z > t}], gelu(t) = high
    (GELU increases past its minimum, so above t it exceeds the bound and below it does not)."""
    if phi.low > _GELU_MIN or phi.high < 0:
        raise ValueError(
            f"ClippedGELU({phi.low}, {phi.high}) clips GELU where it is not monotone: its "
            "expected value is not computed"
        )
    low, high = 0.0, max(phi.high, 1.0) + 1.0  # gelu(high) > phi.high: bisect for t
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if F.gelu(torch.tensor(middle, dtype=torch.float64)) < phi.high
            else (low, middle)
        )
    excess = _tail_expectation(lambda z: F.gelu(z) - phi.high, (low + high) / 2)
    return _folded_expectation(F.gelu) - excess


class GaussianCDF:
    """Φ((z − μ)/σ), transformers' ``LaplaceActivation`` (μ = 0.707107, σ = 0.282095). So steep
    a step is off by ~1e-7 in the folded rule; its expectation has a closed form instead:
    E[Φ((z − μ)/σ)] = P(Y < z) for Y ~ N(μ, σ²), = Φ(−μ / √(1 + σ²))."""

    def __init__(self, mu: float = 0.707107, sigma: float = 0.282095) -> None:
        self.mu, self.sigma = mu, sigma

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return 0.5 * (1.0 + torch.erf((z - self.mu) / (self.sigma * math.sqrt(2.0))))

    def expectation(self) -> float:
        return 0.5 * (1.0 + math.erf(-self.mu / math.sqrt(2.0 * (1.0 + self.sigma**2))))


#: The activation modules of Hugging Face ``transformers.activations``, by class name: each one's
#: φ as a float64 function of the module (for its settings, such as ClippedGELU's bounds), or
#: None where φ is learned (xIELU). Written out here, from transformers' own formulas, so that
#: the core recognises them without importing transformers (a dev dependency only).
#: ``LinearActivation`` (the identity, "no activation") is left out: it is no nonlinearity.
HF_ACTIVATIONS: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None]] = {
    "GELUActivation": lambda m: F.gelu,
    "NewGELUActivation": lambda m: _gelu_tanh,
    "GELUTanh": lambda m: _gelu_tanh,
    "PytorchGELUTanh": lambda m: _gelu_tanh,
    "AccurateGELUActivation": lambda m: _gelu_tanh,
    "FastGELUActivation": lambda m: _gelu_fast,
    "QuickGELUActivation": lambda m: lambda z: z * torch.sigmoid(1.702 * z),
    "ClippedGELUActivation": lambda m: ClippedGELU(m.min, m.max),
    "SiLUActivation": lambda m: F.silu,
    "MishActivation": lambda m: lambda z: z * torch.tanh(F.softplus(z)),
    "LaplaceActivation": lambda m: GaussianCDF(),
    "ReLUSquaredActivation": lambda m: lambda z: F.relu(z).square(),
    "SqrtSoftplusActivation": lambda m: lambda z: F.softplus(z).sqrt(),
    "XIELUActivation": lambda m: None,
}


def is_hf_activation(module: nn.Module) -> bool:
    """Whether ``module`` is one of transformers' activation modules (by class name and module,
    so that a user's own class of the same name elsewhere is not taken for it)."""
    cls = type(module)
    return cls.__module__.split(".")[0] == "transformers" and cls.__name__ in HF_ACTIVATIONS


def hf_activation_phi(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The elementwise φ of a transformers activation module, or None (not one, or learned)."""
    return HF_ACTIVATIONS[type(module).__name__](module) if is_hf_activation(module) else None


#: Nodes of the folded rule; 100 reaches ~1e-13 for every activation above, and numpy's
#: Laguerre weights overflow past ~180.
_QUADRATURE_NODES = 100


@cache
def expected_activation(name: str) -> float:
    """E[φ(z)] for z ~ N(0, 1) of the named activation, by :func:`expected_value`."""
    return expected_value(_activation(name))


def expected_value(phi: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """E[φ(z)] for z ~ N(0, 1), by Gauss quadrature of the Gaussian folded at 0.

    Plain Gauss–Hermite converges only like 1/n at ReLU's kink (8e-4 off with 200 nodes), so
    the Gaussian integral is folded onto the half-line, where the integrand φ(z) + φ(−z) is
    smooth for every activation whose only kink sits at 0, and integrated with Gauss–Laguerre:
    E[φ(z)] = (2π)^(-1/2) ∫₀^∞ [φ(z) + φ(−z)] e^(z − z²/2) e^(−z) dz.

    ``nn.Softplus`` jumps where β·z passes its threshold (it returns z itself there); its
    integral is split at that point, since the fold alone is off by up to ~3e-3 there; so is a
    :class:`ClippedGELU`'s where GELU meets its upper bound.

    Example::

        expected_value(torch.relu)  # 1/√(2π) ≈ 0.3989

    Args:
        phi: any elementwise function of a float64 tensor, e.g. ``F.relu`` or a parametrised
            module such as ``nn.ELU(alpha=0.5)``; other kinks than 0 (or far out in the tail)
            cost the rule its ~1e-13 accuracy.
    """
    if isinstance(phi, nn.Softplus):
        return _softplus_expectation(phi.beta, phi.threshold)
    if isinstance(phi, ClippedGELU):
        return _clipped_gelu_expectation(phi)
    if isinstance(phi, GaussianCDF):
        return phi.expectation()
    return _folded_expectation(phi)


def _folded_expectation(phi: Callable[[torch.Tensor], torch.Tensor]) -> float:
    nodes, weights = laggauss(_QUADRATURE_NODES)
    z = torch.from_numpy(nodes)
    with torch.no_grad():
        folded = (phi(z) + phi(-z)).numpy() * np.exp(nodes - nodes**2 / 2)
    return float(weights @ folded / np.sqrt(2 * np.pi))


def _tail_expectation(g: Callable[[torch.Tensor], torch.Tensor], t: float) -> float:
    """E[g(z) 1{z > t}] by Gauss–Laguerre in u = z − t (g smooth on (t, ∞))."""
    nodes, weights = laggauss(_QUADRATURE_NODES)
    values = g(torch.from_numpy(t + nodes)).numpy() * np.exp(nodes - (t + nodes) ** 2 / 2)
    return float(weights @ values / np.sqrt(2 * np.pi))


def _softplus_expectation(beta: float, threshold: float) -> float:
    """E[softplus_β(z)] with PyTorch's switch to z where β·z > threshold."""

    def smooth(z: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(torch.zeros_like(z), beta * z) / beta

    def excess(z: torch.Tensor) -> torch.Tensor:  # smooth(z) − z, which the switch drops
        return torch.logaddexp(torch.zeros_like(z), -beta * z) / beta

    return _folded_expectation(smooth) - _tail_expectation(excess, threshold / beta)


class ShiftedActivation(nn.Module):
    """φ(x) − shift, applied elementwise.

    Example::

        act = ShiftedActivation("gelu", "expected")  # φ(x) − E[φ(z)], z ~ N(0, 1)
        act(torch.randn(4, 16))

    Args:
        name: one of ``relu``, ``gelu``, ``silu`` (``swish``), ``sigmoid``, ``tanh``; with
            ``phi``, any label for it.
        shift: ``"none"``; ``"expected"`` for the fixed c = E[φ(z)], z ~ N(0, 1);
            ``"adaptive"`` to subtract, at every forward, each sample's mean across the neuron
            dimension ``dim``, so it is exactly zero by construction; or a number to subtract.
        phi: the activation itself (a module such as ``nn.ELU(alpha=0.5)``, or a function),
            instead of looking ``name`` up; c is then computed by :func:`expected_value`.
        dim: the neuron (feature) dimension the adaptive mean runs over: ``-1`` for
            ``(..., features)`` activations, ``1`` for NCHW convolution maps.
        reference: the elementwise function c is integrated from, where ``phi`` is a module
            that cannot itself be evaluated on float64 tensors; default ``phi``.
    """

    def __init__(
        self,
        name: str = "relu",
        shift: str | float = "none",
        *,
        phi: Callable[[torch.Tensor], torch.Tensor] | None = None,
        dim: int = -1,
        reference: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.phi = _activation(name) if phi is None else phi
        self.name = name
        self.dim = dim
        if isinstance(shift, str) and shift not in SHIFTS:
            raise ValueError(f"shift must be one of {SHIFTS} or a number, got {shift!r}")
        self.shift = shift
        self.constant = (
            (expected_activation(name) if phi is None else expected_value(reference or phi))
            if shift == "expected"
            else float(shift)
            if not isinstance(shift, str)
            else 0.0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.phi(x)
        if self.shift == "adaptive":
            return y - y.mean(dim=self.dim, keepdim=True)
        return y - self.constant if self.constant else y

    def extra_repr(self) -> str:
        return f"{self.name}, shift={self.shift!r}" + (
            f" (c={self.constant:.6f})" if self.shift == "expected" else ""
        )


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose from {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def known_phi(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fixed elementwise φ of an activation module, for its expected shift E[φ(z)]:
    transformers' by :data:`HF_ACTIVATIONS`, torch's parameter-free ones (the module's own
    ``forward``, not its ``__call__``: the quadrature must not fire the module's hooks); None
    for learned (PReLU, xIELU), shifted or unknown modules."""
    if is_hf_activation(module):
        return hf_activation_phi(module)
    torch_activation = type(module).__module__ == "torch.nn.modules.activation"
    if torch_activation and not any(True for _ in module.parameters()):
        return module.forward
    return None


def expected_shift(module: nn.Module) -> float | None:
    """E[φ(z)], z ~ N(0, 1), of an activation module whose φ is fixed (:func:`known_phi`), or
    None where it has none or the quadrature cannot be trusted for it."""
    phi = known_phi(module)
    if phi is None:
        return None
    try:
        return expected_value(phi)
    except ValueError:  # e.g. a ClippedGELU bound where GELU is not monotone
        return None
