"""Activation bias: the mean of each activation module's output across its units."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from dynamics.callbacks.module_outputs import ModuleOutputs
from dynamics.callbacks.position_means import MaskRule
from dynamics.store import names
from dynamics.world import Reduce


class ActivationBias(ModuleOutputs):
    """Per activation module and due step, the mean of its output across its units, averaged
    over every other axis and the step's micro-batches: the paper's activation bias (group
    ``activation_bias``). Steps aside when the module has no activation module to hook.

    ``HiddenStateNorms()`` records the same group by default; use this one beside
    ``HiddenStateNorms(activations=False)``, or alone. Which modules count as activations and
    the pitfalls (functional calls are not seen): ``docs/probes/activation_bias.md``.

    Example::

        ActivationBias(activation_types=[CenteredGELU], every_n_steps=10)

    Args:
        activations: the built-in activation classes count (``nn.ReLU``, ``nn.GELU``, ...).
        activation_types: further module classes whose output is a post-activation.
        activation_modules: name patterns of further activation modules.
        feature_dims: ``{pattern: axis}``: the unit axis of matching modules.
        feature_dim: one unit axis for every module (below ``feature_dims``).
        mask: the real positions: None (``attention_mask`` of a dict batch), a callable
            ``(batch) -> bool tensor``, or False (every position).
        reduce: ``"global"`` (every rank's batch) or ``"rank0"``.
        every_n_steps: recording period in optimizer steps.
    """

    name = names.ACTIVATION_BIAS

    def __init__(
        self,
        activations: bool = True,
        activation_types: Sequence[type[nn.Module]] | None = None,
        activation_modules: Sequence[str] | None = None,
        feature_dims: Mapping[str, int] | None = None,
        feature_dim: int | None = None,
        mask: MaskRule = None,
        reduce: Reduce = "global",
        every_n_steps: int = 1,
    ) -> None:
        super().__init__(
            None,
            None,
            feature_dims,
            feature_dim,
            activations,
            activation_types,
            activation_modules,
            False,
            mask,
            reduce,
            every_n_steps,
            norms=False,
            bias=True,
        )
