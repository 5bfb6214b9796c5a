"""Unit health: dead and saturated units of activation modules, non-finite values of outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from dynamics.callbacks.module_outputs import ModuleOutputs
from dynamics.callbacks.position_means import MaskRule
from dynamics.callbacks.unit_kinds import (
    DEAD,
    SATURATED,
    SATURATION_TOLERANCE,
    VIEWS,
    UnitKind,
    nonfinite_per_position,
    unit_extremes,
    unit_fraction,
    unit_fraction_of,
    unit_kind,
)
from dynamics.store import names
from dynamics.world import Reduce

__all__ = [
    "DEAD",
    "SATURATED",
    "SATURATION_TOLERANCE",
    "VIEWS",
    "UnitHealth",
    "UnitKind",
    "nonfinite_per_position",
    "unit_extremes",
    "unit_fraction",
    "unit_fraction_of",
    "unit_kind",
]


class UnitHealth(ModuleOutputs):
    """Per due step (group ``unit_health``): the fraction of each activation module's units that
    were dead (the ReLU family) or saturated (sigmoid, tanh) for every sample of the batch, and
    the fraction of non-finite values of every recorded output (the chosen modules and the
    activation modules). Activations without an exact flat region (GELU, SiLU, ...) get neither
    fraction (:mod:`dynamics.callbacks.unit_kinds`).

    ``HiddenStateNorms(unit_health=True)`` records the same group; use this one beside
    ``HiddenStateNorms()``, or alone. Cost, unit axes and pitfalls:
    ``docs/probes/unit_health.md``.

    Example::

        UnitHealth(every_n_steps=10)

    Args:
        modules: name patterns of the modules whose non-finite values are counted (default:
            the residual blocks, as ``HiddenStateNorms`` chooses).
        types: module classes to count likewise.
        feature_dims: ``{pattern: axis}``: the feature (unit) axis of matching modules.
        feature_dim: one feature axis for every module (below ``feature_dims``).
        activations: the built-in activation classes count.
        activation_types: further module classes whose output is a post-activation.
        activation_modules: name patterns of further activation modules.
        mask: the real positions: None (``attention_mask`` of a dict batch), a callable
            ``(batch) -> bool tensor``, or False (every position).
        reduce: ``"global"`` (every rank's batch) or ``"rank0"``.
        every_n_steps: recording period in optimizer steps.
    """

    name = names.UNIT_HEALTH

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        types: Sequence[type[nn.Module]] | None = None,
        feature_dims: Mapping[str, int] | None = None,
        feature_dim: int | None = None,
        activations: bool = True,
        activation_types: Sequence[type[nn.Module]] | None = None,
        activation_modules: Sequence[str] | None = None,
        mask: MaskRule = None,
        reduce: Reduce = "global",
        every_n_steps: int = 1,
    ) -> None:
        super().__init__(
            modules,
            types,
            feature_dims,
            feature_dim,
            activations,
            activation_types,
            activation_modules,
            True,
            mask,
            reduce,
            every_n_steps,
            norms=False,
            bias=False,
        )
