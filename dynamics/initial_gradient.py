"""The gradient of a module's training loss at its parameters, taken without side effects."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dynamics.isolation import side_effect_free
from dynamics.loss_rule import module_loss
from dynamics.params import ParameterLayout, flatten


def initial_gradient(module: torch.nn.Module, batch: Any, layout: ParameterLayout) -> torch.Tensor:
    """∇L(θ) on ``batch`` as a flat vector, leaving the module, RNG and ``.grad`` as they were.

    The loss is found by :func:`~dynamics.loss_rule.module_loss`. Under an initialized process
    group every rank must call this; the result is the average of the ranks' gradients, as
    data-parallel training would apply.
    """
    params = layout.parameters(module)
    with side_effect_free(module):
        gradient = flatten(torch.autograd.grad(module_loss(module, batch), params))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(gradient)
        gradient /= dist.get_world_size()
    return gradient
