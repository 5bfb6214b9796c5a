"""Which modules' outputs are hidden states, and along which axis their features lie: the rules
shared by the probes that hook module outputs (``HiddenStateNorms``, ``ActivationBias``,
``UnitHealth``, ``BiasComponent``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The private bases are the one way to name every variant (lazy, transposed, sync, instance).
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd

from dynamics.bias.activations import ACTIVATIONS, ShiftedActivation, is_hf_activation
from dynamics.params.globs import glob_any

#: Module types whose output is a post-activation, for the activation-bias series.
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    ShiftedActivation,
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.PReLU,
    nn.SELU,
    nn.CELU,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,  # and ReLU6, its subclass
)


#: Module types whose batched output is (N, C, *spatial): features (channels) on axis 1.
#: ``_NormBase`` covers BatchNorm1d/2d/3d (axis 1 also for BatchNorm1d's 2-D input),
#: SyncBatchNorm and InstanceNorm1d/2d/3d; ``_ConvNd`` every convolution.
CHANNELS_FIRST: tuple[type[nn.Module], ...] = (_ConvNd, _NormBase, nn.GroupNorm)


#: Module types whose output is (..., F): features on the last axis.
FEATURES_LAST: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.MultiheadAttention,
    nn.RNNBase,
)


ASSUMED = "unknown kind: last axis assumed"
TWO_D_ONLY = "no module fixes it: measured on 2-D outputs (batch, units) only"


@dataclass(frozen=True)
class Axis:
    """The axis a layer's norm runs over, and why."""

    dim: int
    rule: str  # stored in the run file
    #: The module whose feature count the output must show on ``dim``; None where unchecked.
    source: nn.Module | None = None


def choose_modules(
    named: Mapping[str, nn.Module], patterns: tuple[str, ...], types: tuple[type[nn.Module], ...]
) -> tuple[str, ...]:
    callable_ = {n: m for n, m in named.items() if type(m).forward is not nn.Module.forward}
    if patterns or types:
        return tuple(
            n for n, m in callable_.items() if glob_any(n, patterns) or isinstance(m, types)
        )
    stacks = [
        (n, list(m.named_children()))
        for n, m in named.items()
        if isinstance(m, (nn.ModuleList, nn.Sequential))
    ]
    stacks = [
        (n, kids)
        for n, kids in stacks
        if len(kids) >= 2 and len({type(k) for _, k in kids}) == 1 and not is_activation(kids[0][1])
    ]
    if stacks:
        prefix, kids = max(stacks, key=lambda s: len(s[1]))
        return tuple(f"{prefix}.{k}" for k, _ in kids)
    # A loss module's output is a scalar, not a hidden state.
    return tuple(
        n for n, m in callable_.items() if "." not in n and not isinstance(m, nn.modules.loss._Loss)
    )


def has_instance(named: Mapping[str, nn.Module], cls: type[nn.Module]) -> bool:
    return any(isinstance(m, cls) for m in named.values())


def kind_dim(module: nn.Module) -> int | None:
    """The feature axis of ``module``'s batched output where its class fixes one."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and len(module.normalized_shape) != 1:
        return None  # normalises several trailing axes at once: no single feature axis
    if isinstance(module, CHANNELS_FIRST):
        return 1
    if isinstance(module, FEATURES_LAST):
        return -1
    return None


def feature_count(module: nn.Module) -> int | None:
    """How many features ``module`` outputs along its feature axis, where its config says.

    Read at each call rather than at setup: lazy modules learn their sizes in the first forward.
    """
    if isinstance(module, _ConvNd):
        return module.out_channels
    if isinstance(module, _NormBase):
        return module.num_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    if isinstance(module, (nn.Linear, nn.Bilinear)):
        return module.out_features
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return module.normalized_shape[-1]
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return module.embedding_dim
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim
    return None  # RNNs: the size depends on direction and projection


def axis_problem(hidden: torch.Tensor | None, output: Any, axis: Axis) -> str | None:
    """Why the norm over ``axis`` of ``output`` would not be a hidden-state norm, if it would not.

    Shapes are host metadata: reading them costs no device sync.
    """
    if hidden is None:
        return f"outputs a {type(output).__name__}, no tensor"
    ndim = max(hidden.dim(), 1)  # a 0-D tensor has one axis for torch's norms
    if not -ndim <= axis.dim < ndim:
        return f"output of shape {tuple(hidden.shape)} has no axis {axis.dim}"
    width = None if axis.source is None else feature_count(axis.source)
    if width is not None and hidden.dim() > 0 and hidden.shape[axis.dim] != width:
        return (
            f"output of shape {tuple(hidden.shape)} has {hidden.shape[axis.dim]} entries on axis "
            f"{axis.dim}, chosen by its {axis.rule} that has {width} features"
        )
    return None


def is_activation(module: nn.Module) -> bool:
    return (
        isinstance(module, ACTIVATION_TYPES)
        or type(module).__name__.lower() in ACTIVATIONS
        or is_hf_activation(module)
    )


def first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None
