"""Parameter-vector math: one flat vector per model state, in a fixed, recorded order.

Every vector the toolkit stores or projects (θ0, snapshots, gradients, plane bases) is laid out
by a :class:`ParameterLayout`, so a vector written during training can be mapped back onto the
parameters offline, and two runs can be checked for the same layout before they are compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ParameterLayout:
    """Names and shapes of the trainable parameters, in flattening order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module: nn.Module) -> ParameterLayout:
        """The layout of ``module``'s trainable parameters, in ``named_parameters`` order."""
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        """Length of the flat vector."""
        return sum(self.numels)

    def to_dict(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, data: Mapping) -> ParameterLayout:
        return cls(tuple(data["names"]), tuple(tuple(s) for s in data["shapes"]))

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """``module``'s parameters in this layout's order (raises if the module differs)."""
        found = dict(module.named_parameters())
        missing = [n for n in self.names if n not in found]
        if missing:
            raise ValueError(f"module has no parameter {missing[0]!r} of the recorded layout")
        params = [found[n] for n in self.names]
        for name, p, shape in zip(self.names, params, self.shapes):
            if tuple(p.shape) != shape:
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, layout {shape}")
        return params

    def split(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat ``vector`` shaped like each parameter."""
        if vector.numel() != self.size:
            raise ValueError(f"vector has {vector.numel()} entries, layout has {self.size}")
        return [c.view(s) for c, s in zip(torch.split(vector, self.numels), self.shapes)]


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one detached flat vector (a copy)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def parameter_vector(module: nn.Module, layout: ParameterLayout | None = None) -> torch.Tensor:
    """A detached flat copy of ``module``'s trainable parameters."""
    layout = layout or ParameterLayout.of(module)
    return flatten(layout.parameters(module))


@torch.no_grad()
def load_vector(module: nn.Module, vector: torch.Tensor, layout: ParameterLayout) -> None:
    """Copy a flat ``vector`` into ``module``'s parameters in place."""
    for p, chunk in zip(layout.parameters(module), layout.split(vector)):
        p.copy_(chunk)


def vector_hash(vector: torch.Tensor | np.ndarray) -> str:
    """SHA-256 of a vector's float32 little-endian bytes: equal hashes mean bit-equal θ0."""
    array = vector.detach().cpu().numpy() if isinstance(vector, torch.Tensor) else vector
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()
