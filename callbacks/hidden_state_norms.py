"""Hidden-state norms: the mean L2 norm of chosen modules' outputs over their feature axis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from dynamics.callbacks.module_outputs import ModuleOutputs
from dynamics.callbacks.output_axes import kind_dim
from dynamics.callbacks.position_means import MaskRule, position_weights
from dynamics.world import Reduce

__all__ = ["HiddenStateNorms", "MaskRule", "kind_dim", "position_weights"]


class HiddenStateNorms(ModuleOutputs):
    """Per chosen module and due step, the L2 norm of its output over the feature axis, averaged
    over every other axis and the step's micro-batches (group ``hidden_norms``, one column per
    call of a module).

    By default (``activations=True``) it also records the activation bias of activation modules
    (group ``activation_bias``, what :class:`~dynamics.callbacks.ActivationBias` records alone),
    and with ``unit_health=True`` the unit-health group
    (:class:`~dynamics.callbacks.UnitHealth`), as files before those probes had it: one set of
    hooks serves all three. Module choice, feature axes, padding, ranks and pitfalls:
    ``docs/probes/hidden_state_norms.md``.

    Example::

        HiddenStateNorms(modules=["blocks.*"], every_n_steps=10)
        HiddenStateNorms(activations=False)  # norms only, beside ActivationBias() or UnitHealth()

    Args:
        modules: name patterns of the modules to record (e.g. ``"student.blocks.*"``).
        types: module classes to record.
        feature_dims: ``{pattern: axis}`` overriding the feature axis of matching modules.
        feature_dim: one feature axis for every recorded module (below ``feature_dims``).
        activations: also record the activation bias of the built-in activation classes.
        activation_types: further module classes whose output is a post-activation.
        activation_modules: name patterns of further activation modules.
        unit_health: also record dead, saturated and non-finite fractions.
        mask: the real positions: None (``attention_mask`` of a dict batch), a callable
            ``(batch) -> bool tensor``, or False (every position).
        reduce: ``"global"`` (every rank's batch) or ``"rank0"``.
        every_n_steps: recording period in optimizer steps.
    """

    name = "hidden"

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        types: Sequence[type[nn.Module]] | None = None,
        feature_dims: Mapping[str, int] | None = None,
        feature_dim: int | None = None,
        activations: bool = True,
        activation_types: Sequence[type[nn.Module]] | None = None,
        activation_modules: Sequence[str] | None = None,
        unit_health: bool = False,
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
            unit_health,
            mask,
            reduce,
            every_n_steps,
            norms=True,
            bias=True,
        )
