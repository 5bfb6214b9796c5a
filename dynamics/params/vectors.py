"""Flat parameter vectors: one detached vector per model state, laid out by a
:class:`~dynamics.params.layout.ParameterLayout`, and their hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

from dynamics.params.layout import BufferLayout, ParameterLayout
from dynamics.params.naming import named_parameters


def module_device(module: nn.Module) -> torch.device:
    """Where ``module``'s first parameter lives (the CPU for a module with none): the device
    a probe batch and a probe's own tensors go to, for any ``nn.Module``.

    Example::

        batch = move_data_to_device(batch, module_device(model))
    """
    parameter = next(module.parameters(), None) if isinstance(module, nn.Module) else None
    return parameter.device if parameter is not None else torch.device("cpu")


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one detached flat vector (a copy), half precision as exact
    float32 (:func:`storable`): differences of half-precision vectors would be rounded to it.

    Example::

        g = flatten(torch.autograd.grad(loss, params))
    """
    return storable(torch.cat([t.detach().reshape(-1) for t in tensors]))


def storable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as numpy and run files can hold it: half-precision floats (a "bf16-true"
    fit's parameters and inputs) as float32, exactly; any other dtype as it is."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def parameter_vector(module: nn.Module, layout: ParameterLayout | None = None) -> torch.Tensor:
    """A detached flat copy of ``module``'s trainable parameters.

    Example::

        theta = parameter_vector(model)  # float32 for half-precision parameters
    """
    layout = layout or ParameterLayout.of(module)
    return flatten(layout.parameters(module))


@torch.no_grad()
def load_vector(module: nn.Module, vector: torch.Tensor, layout: ParameterLayout) -> None:
    """Copy a flat ``vector`` into ``module``'s parameters in place.

    Example::

        load_vector(model, theta0, ParameterLayout.of(model))
    """
    for p, chunk in zip(layout.parameters(module), layout.split(vector)):
        p.copy_(chunk)


def load_state(
    module: nn.Module,
    theta: np.ndarray | torch.Tensor,
    layout: ParameterLayout,
    buffers: Mapping[str, np.ndarray] | None = None,
    buffer_layout: BufferLayout | None = None,
) -> None:
    """Copy a stored state into ``module``: flat parameters ``theta`` and, when given, its
    flat ``buffers`` (``{stored dtype: vector}``).

    Raises:
        ValueError: the module's parameters or buffers differ from the layouts.
    """
    load_vector(module, torch.as_tensor(np.asarray(theta)), layout)
    if buffers is not None and buffer_layout is not None:
        buffer_layout.load(module, buffers)


def vector_hash(vector: torch.Tensor | np.ndarray) -> str:
    """SHA-256 of a vector's float32 little-endian bytes: equal hashes mean bit-equal θ0.

    Example::

        vector_hash(parameter_vector(model)) == run.theta0_sha256  # a model at θ0
    """
    # Through float32 in torch: numpy has no bfloat16.
    array = vector.detach().float().cpu().numpy() if isinstance(vector, torch.Tensor) else vector
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def frozen_hash(module: nn.Module) -> str | None:
    """:func:`vector_hash` of ``module``'s frozen parameters (``requires_grad=False``, by name),
    which a run file does not store; None when it has none."""
    frozen = [p for _, p in sorted(named_parameters(module)) if not p.requires_grad]
    return vector_hash(flatten(frozen)) if frozen else None
