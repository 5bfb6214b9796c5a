"""The gradient of a module's training loss at its parameters, taken without side effects."""

from __future__ import annotations

from typing import Any

import torch

from dynamics import world
from dynamics.params.layout import ParameterLayout
from dynamics.params.vectors import flatten
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.passes.loss_rule import LIGHTNING_RULE, LossRule


def initial_gradient(
    module: torch.nn.Module,
    batch: Any,
    layout: ParameterLayout,
    mode: Mode = "eval",
    rule: LossRule = LIGHTNING_RULE,
) -> torch.Tensor:
    """∇L(θ) on ``batch`` as a flat vector, leaving the module, RNG and ``.grad`` as they were.

    The loss is found by ``rule`` (:mod:`dynamics.passes.loss_rule`). Under an initialized
    process group every rank must call this; the result is the average of the ranks' gradients,
    as data-parallel training would apply. ``module`` holds its parameters whole: under FSDP
    pass the whole-parameter copy (:func:`dynamics.sharding.unsharded_copy`), whose gradient
    the average then makes the unsharded run's.

    Example::

        g0 = initial_gradient(module, batch, ParameterLayout.of(module))

    Args:
        module: the model.
        batch: the batch the loss is taken on, on the module's device.
        layout: the parameters differentiated, and the order of the result.
        mode: the :data:`~dynamics.passes.isolation.Mode` the module runs in; by default
            ``"eval"``, the mode in which loss landscapes on the plane of such gradients are drawn.
        rule: how the loss is taken on ``batch``; the Lightning rule by default.

    Raises:
        ~dynamics.passes.loss_rule.LossUnavailable: if the loss rule finds no loss for the module.
        FloatingPointError: if the gradient is NaN or infinite (on any rank).
    """
    params = layout.parameters(module)
    with side_effect_free(module, mode):
        gradient = flatten(torch.autograd.grad(rule(module, batch), params))
    world.average(gradient)
    if not gradient.isfinite().all():
        raise FloatingPointError("the initial gradient is not finite")
    return gradient
