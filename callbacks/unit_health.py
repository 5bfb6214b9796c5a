"""Dead, saturated and non-finite units of a recorded output: what each activation's flat
regions are, and the few device ops that count them without a host sync.

**Dead** (the ReLU family: ``nn.ReLU``, ``nn.ReLU6`` and ``ShiftedActivation`` of ``relu`` with a
fixed shift): a unit is dead on a batch when its output equals the activation's flat value (0,
or −c once shifted by c) for every sample — and, for sequences and images, at every position.
That value is the activation's minimum, so the test is one max over the batch: exact, no
threshold.

**Saturated** (``nn.Sigmoid``, ``nn.Tanh``, ``nn.Hardsigmoid``, ``nn.Hardtanh`` and
``ShiftedActivation`` of ``sigmoid``/``tanh`` with a fixed shift): a unit is saturated on a
batch when every sample's output lies within :data:`SATURATION_TOLERANCE` of a bound (either
bound: its gradient vanishes for every sample either way).

Activations without an exact flat region — GELU, SiLU, ELU, LeakyReLU, PReLU, SELU, CELU,
Mish, Softplus, Hardswish, a user's own — get neither: GELU, for one, is exactly 0 only at 0,
and any threshold for "nearly dead" would be a number chosen here rather than measured. So is
an adaptive ``ShiftedActivation``, whose flat value moves with each sample's mean.

**Non-finite**: the fraction of NaN and ±inf entries of every recorded output, counted in float
arithmetic (x − x is 0 exactly for finite x and NaN otherwise), since bool reductions cost
several times more on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dynamics.activations import ShiftedActivation
from dynamics.store import names
from dynamics.store.schema import View

#: How close to a bound (absolute) a saturating activation's output counts as saturated.
SATURATION_TOLERANCE = 1e-3

#: A unit kind's label in the run file's settings.
DEAD, SATURATED = "dead", "saturated"

#: How the unit-health series are drawn (declared with them: files from before views existed
#: cannot hold these series, so the standard views' table of older files leaves them out).
VIEWS = {
    names.UNIT_DEAD: View("lines", "Dead units per activation (flat for every sample)", "fraction"),
    names.UNIT_SATURATED: View(
        "lines", "Saturated units per activation (within 1e-3 of a bound)", "fraction"
    ),
    names.UNIT_NONFINITE: View("lines", "Non-finite values per recorded output", "fraction"),
}


@dataclass(frozen=True)
class UnitKind:
    """What a unit of an activation module can be: dead at ``low`` (the ReLU family) or
    saturated near ``low`` or ``high`` (sigmoid, tanh)."""

    kind: str  # DEAD or SATURATED
    low: float
    high: float = float("inf")

    def describe(self) -> dict[str, float | str]:
        if self.kind == DEAD:
            return {"kind": DEAD, "flat_value": self.low}
        return {"kind": SATURATED, "bounds": [self.low, self.high], "tol": SATURATION_TOLERANCE}


_SATURATING_FUNCTIONS = {torch.sigmoid: (0.0, 1.0), torch.tanh: (-1.0, 1.0)}


def unit_kind(module: nn.Module) -> UnitKind | None:
    """The kind of ``module``'s units, or None where "dead" or "saturated" has no exact meaning."""
    if isinstance(module, (nn.ReLU, nn.ReLU6)):
        return UnitKind(DEAD, 0.0)
    if isinstance(module, nn.Hardtanh):
        return UnitKind(SATURATED, module.min_val, module.max_val)
    if isinstance(module, (nn.Sigmoid, nn.Hardsigmoid)):
        return UnitKind(SATURATED, 0.0, 1.0)
    if isinstance(module, nn.Tanh):
        return UnitKind(SATURATED, -1.0, 1.0)
    if isinstance(module, ShiftedActivation) and module.shift != "adaptive":
        c = module.constant
        if module.phi is F.relu:
            return UnitKind(DEAD, -c)
        if module.phi in _SATURATING_FUNCTIONS:
            low, high = _SATURATING_FUNCTIONS[module.phi]
            return UnitKind(SATURATED, low - c, high - c)
    return None


def nonfinite_fraction(output: torch.Tensor) -> torch.Tensor:
    """The fraction of ``output``'s entries that are NaN or ±inf, as a 0-d float32 tensor."""
    # x − x is +0 for every finite x and NaN for NaN and ±inf; the NaNs become ones.
    flags = (output - output).nan_to_num_(nan=1.0)
    return flags.sum(dtype=torch.float32).div_(max(output.numel(), 1))


def unit_fraction(output: torch.Tensor, kind: UnitKind, unit_dim: int) -> torch.Tensor:
    """The fraction of units (entries along ``unit_dim``) dead or saturated over every other
    axis of ``output`` (the batch, positions), as a 0-d float32 tensor."""
    dims = [d for d in range(output.dim()) if d != unit_dim % output.dim()]
    if kind.kind == DEAD:
        # The flat value is the minimum: every entry equals it exactly when the max does.
        # (max + c == 0 is max == −c in the output's own float arithmetic, as forward shifted.)
        flat = output.amax(dim=dims).add_(-kind.low).eq_(0)
    else:
        middle, half = (kind.low + kind.high) / 2, (kind.high - kind.low) / 2
        nearest = (output - middle).abs_().amin(dim=dims)
        flat = nearest.ge_(half - SATURATION_TOLERANCE)
    return flat.mean(dtype=torch.float32)
