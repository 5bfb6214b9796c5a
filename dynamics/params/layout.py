"""Layouts of a model's state: the order in which parameters (and persistent buffers) are
flattened into one vector.

Every vector the toolkit stores or projects (θ0, snapshots, gradients, plane bases) is laid out
by a :class:`ParameterLayout`, so a vector written during training can be mapped back onto the
parameters offline, and two runs can be checked for the same layout before they are compared.
A module's buffers (BatchNorm running statistics, counters) are stored beside them, laid out
by a :class:`BufferLayout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from torch import nn

from dynamics.params.naming import named_parameters, unwrapped_name


@dataclass(frozen=True)
class ParameterLayout:
    """Names and shapes of the trainable parameters, in flattening order.

    Example::

        layout = ParameterLayout.of(model)  # trainable parameters, in named_parameters order
        layout.size, layout.names[0]
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module: nn.Module) -> ParameterLayout:
        """The layout of ``module``'s trainable parameters, in ``named_parameters`` order."""
        named = [(n, p) for n, p in named_parameters(module) if p.requires_grad]
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
        found = dict(named_parameters(module))
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


@dataclass(frozen=True)
class BufferLayout:
    """Names, shapes and dtypes of a module's persistent buffers, in ``named_buffers`` order.

    Persistent buffers are those a ``state_dict`` holds (BatchNorm's running mean, variance and
    ``num_batches_tracked``, ...); non-persistent ones (caches a module rebuilds itself) are
    not state and are left out. A module's buffers are stored as one flat vector per storage
    dtype (:attr:`stored_dtypes`), each buffer in its own dtype, so integer counters and float
    statistics round-trip exactly; bfloat16 buffers are stored as float32 (exact). Buffers of
    other dtypes (complex, float8, quantized) are not stored and are named in :attr:`unstored`.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # torch dtype names without "torch.", e.g. "float32", "int64"
    unstored: tuple[str, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> BufferLayout:
        """The layout of ``module``'s persistent buffers."""
        named, unstored = [], []
        for name, buffer in _persistent_buffers(module).items():
            dtype = str(buffer.dtype).removeprefix("torch.")
            (named if _storage(dtype) else unstored).append((name, buffer, dtype))
        return cls(
            tuple(n for n, _, _ in named),
            tuple(tuple(b.shape) for _, b, _ in named),
            tuple(d for _, _, d in named),
            tuple(n for n, _, _ in unstored),
        )

    @property
    def stored_dtypes(self) -> tuple[str, ...]:
        """The dtypes of the flat vectors the buffers are stored in, in order of appearance."""
        return tuple(dict.fromkeys(_storage(d) for d in self.dtypes))

    def sizes(self) -> dict[str, int]:
        """``{stored dtype: entries of its flat vector}``."""
        sizes = dict.fromkeys(self.stored_dtypes, 0)
        for shape, dtype in zip(self.shapes, self.dtypes):
            sizes[_storage(dtype)] += prod(shape)
        return sizes

    @property
    def nbytes(self) -> int:
        """Bytes of one stored copy of every buffer."""
        return sum(n * np.dtype(d).itemsize for d, n in self.sizes().items())

    def to_dict(self) -> dict:
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "unstored": list(self.unstored),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> BufferLayout:
        return cls(
            tuple(data["names"]),
            tuple(tuple(s) for s in data["shapes"]),
            tuple(data["dtypes"]),
            tuple(data.get("unstored", ())),
        )

    def vectors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Detached flat copies of ``module``'s buffers, ``{stored dtype: vector}``."""
        buffers = self._buffers(module)
        vectors = {}
        for stored in self.stored_dtypes:
            chunks = [
                b.detach().reshape(-1).to(getattr(torch, stored))
                for b, d in zip(buffers, self.dtypes)
                if _storage(d) == stored
            ]
            vectors[stored] = torch.cat(chunks)
        return vectors

    @torch.no_grad()
    def load(self, module: nn.Module, vectors: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Copy stored flat ``vectors`` (``{stored dtype: vector}``) into ``module``'s buffers.

        Raises:
            ValueError: the module lacks a buffer of the layout, has it in another shape, or a
                vector has the wrong length.
        """
        buffers = self._buffers(module)
        offsets = dict.fromkeys(self.stored_dtypes, 0)
        sizes = self.sizes()
        for stored, size in sizes.items():
            if len(vectors[stored]) != size:
                raise ValueError(f"{stored} buffers: {len(vectors[stored])} entries, layout {size}")
        for buffer, shape, dtype in zip(buffers, self.shapes, self.dtypes):
            stored = _storage(dtype)
            start, offsets[stored] = offsets[stored], offsets[stored] + prod(shape)
            chunk = torch.as_tensor(np.asarray(vectors[stored][start : offsets[stored]]))
            buffer.copy_(chunk.reshape(shape))

    def _buffers(self, module: nn.Module) -> list[torch.Tensor]:
        found = _persistent_buffers(module)
        missing = [n for n in self.names if n not in found]
        if missing:
            raise ValueError(f"module has no buffer {missing[0]!r} of the recorded buffers")
        buffers = [found[n] for n in self.names]
        for name, b, shape in zip(self.names, buffers, self.shapes):
            if tuple(b.shape) != shape:
                raise ValueError(f"buffer {name!r} has shape {tuple(b.shape)}, recorded {shape}")
        return buffers


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    # As state_dict decides, without calling it (a module may override state_dict).
    buffers = {}
    for prefix, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                full = unwrapped_name(f"{prefix}.{name}" if prefix else name)
                buffers.setdefault(full, buffer)
    return buffers


def _storage(dtype: str) -> str:
    """The NumPy dtype a buffer of torch dtype ``dtype`` is stored in; "" when none holds it."""
    if dtype == "bfloat16":
        return "float32"  # every bfloat16 is a float32
    try:
        return np.dtype(dtype).name if np.dtype(dtype).kind in "biuf" else ""
    except TypeError:
        return ""
