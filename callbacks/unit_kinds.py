"""Dead, saturated and non-finite units of a recorded output: what each activation's flat
regions are, and the few device ops that count them without a host sync. Which activations have
which, and why GELU has neither: ``docs/probes/unit_health.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dynamics.bias.activations import ShiftedActivation
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


def unit_fraction(output: torch.Tensor, kind: UnitKind, unit_dim: int) -> torch.Tensor:
    """The fraction of units (entries along ``unit_dim``) dead or saturated over every other
    axis of ``output`` (the batch, positions), as a 0-d float32 tensor."""
    return unit_fraction_of(unit_extremes(output, kind, unit_dim), kind)


def nonfinite_per_position(output: torch.Tensor, feature_dim: int) -> torch.Tensor:
    """The fraction of NaN and ±inf entries across the features at each position (float32), so
    that padded positions can be left out before the mean; a 0-D or 1-D output as it is."""
    flags = (output - output).nan_to_num_(nan=1.0)
    if output.dim() < 2:
        return flags.float()
    return flags.mean(dim=feature_dim, dtype=torch.float32)


def unit_extremes(
    output: torch.Tensor, kind: UnitKind, unit_dim: int, mask: torch.Tensor | None = None
) -> torch.Tensor | str:
    """Per unit (entry along ``unit_dim``), the extreme over every other axis that decides it:
    for dead units the maximum output, for saturated ones minus the least distance from the
    middle of the bounds. Both combine over micro-batches and ranks by a maximum, and
    :func:`unit_fraction_of` turns them into the fraction. ``mask`` (batch, positions) leaves
    padded positions out; where the output's positions do not start with the mask's shape, why.
    """
    out = output.movedim(unit_dim, -1)
    keep = None
    if mask is not None:
        positions, m = tuple(out.shape[:-1]), tuple(mask.shape)
        if positions[: len(m)] == m:
            keep = mask.reshape(*m, *([1] * (out.dim() - len(m))))
        elif not (len(positions) < len(m) and positions == m[: len(positions)]):
            return f"positions of shape {positions} do not start with the mask's shape {m}"
    if kind.kind == DEAD:
        values = out
    else:
        values = (out - (kind.low + kind.high) / 2).abs_().neg_()
    if keep is not None:
        values = values.masked_fill(~keep, float("-inf"))
    return values.reshape(-1, out.shape[-1]).amax(dim=0)


def unit_fraction_of(extremes: torch.Tensor, kind: UnitKind) -> torch.Tensor:
    """The fraction of dead or saturated units from :func:`unit_extremes` (0-d float32); NaN
    where any extreme is NaN (a call not measured)."""
    if kind.kind == DEAD:
        # The flat value is the minimum: every entry equals it exactly when the max does.
        # (max + c == 0 is max == −c in the output's own float arithmetic, as forward shifted.)
        flat = extremes.add(-kind.low).eq_(0)
    else:
        half = (kind.high - kind.low) / 2
        flat = extremes.neg().ge_(half - SATURATION_TOLERANCE)
    fraction = flat.mean(dtype=torch.float32)
    return torch.where(extremes.isnan().any(), float("nan"), fraction)
