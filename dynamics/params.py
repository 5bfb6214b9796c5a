"""Parameter-vector math: one flat vector per model state, in a fixed, recorded order.

Every vector the toolkit stores or projects (θ0, snapshots, gradients, plane bases) is laid out
by a :class:`ParameterLayout`, so a vector written during training can be mapped back onto the
parameters offline, and two runs can be checked for the same layout before they are compared.
A module's buffers (BatchNorm running statistics, counters) are stored beside them, laid out
by a :class:`BufferLayout`.

Names are those of the module as written, without ``torch.compile``'s wrapper: a compiled
submodule (``self.net = torch.compile(net)``) holds its module as ``_orig_mod``, which adds
``_orig_mod.`` to every name below it but is no layer, so a compiled and an uncompiled run of one
model have one layout (and a run file rebuilds into either).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod

import numpy as np
import torch
from torch import nn

#: The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the compiled module.
COMPILE_WRAPPER = "_orig_mod"


def unwrapped_name(name: str) -> str:
    """``name`` of a parameter, buffer or submodule without ``torch.compile``'s wrapper."""
    return ".".join(part for part in name.split(".") if part != COMPILE_WRAPPER)


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper around another (its only child)."""
    return COMPILE_WRAPPER in module._modules


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under their :func:`unwrapped_name`."""
    return [(unwrapped_name(n), p) for n, p in module.named_parameters()]


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module.named_modules()`` under their :func:`unwrapped_name`, ``torch.compile``'s
    wrappers left out (the module they wrap stands under the wrapper's name)."""
    return [
        (unwrapped_name(name), child)
        for name, child in module.named_modules()
        if not is_compile_wrapper(child)
    ]


def named_submodules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`named_modules` but ``module`` itself."""
    return [(name, child) for name, child in named_modules(module) if name]


def compiled_modules(module: nn.Module) -> list[str]:
    """The names of ``module``'s parts ``torch.compile`` compiled: ``""`` for the module itself
    (Lightning unwraps ``trainer.fit(torch.compile(model))`` and compiles its steps in place),
    else each wrapped submodule's :func:`unwrapped_name`."""
    whole = getattr(module, "_compiler_ctx", None) is not None or is_compile_wrapper(module)
    inner = [unwrapped_name(n) for n, m in module.named_modules() if n and is_compile_wrapper(m)]
    return [""] + inner if whole else inner


#: The methods Lightning replaces with compiled ones on the instance when it unwraps
#: ``trainer.fit(torch.compile(model))`` (``pytorch_lightning.utilities.compile.from_compiled``).
_LIGHTNING_COMPILED_METHODS = (
    "forward",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
)


def module_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that computes with its own parameters.

    Lightning compiles a LightningModule in place: its instance's ``forward`` and steps become
    compiled functions bound to that instance, which a plain ``copy.deepcopy`` keeps, so the
    copy's forward would compute with the original's parameters (another loss, silently). The
    copy's methods are its class's again, uncompiled; compiled submodules copy correctly.
    """
    twin = copy.deepcopy(module)
    for copied in twin.modules():
        if getattr(copied, "_compiler_ctx", None) is not None:
            for method in _LIGHTNING_COMPILED_METHODS:
                copied.__dict__.pop(method, None)
            copied._compiler_ctx = None
    return twin


@dataclass(frozen=True)
class ParameterLayout:
    """Names and shapes of the trainable parameters, in flattening order."""

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


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one detached flat vector (a copy), half precision as exact
    float32 (:func:`storable`): differences of half-precision vectors would be rounded to it."""
    return storable(torch.cat([t.detach().reshape(-1) for t in tensors]))


def storable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as numpy and run files can hold it: half-precision floats (a "bf16-true"
    fit's parameters and inputs) as float32, exactly; any other dtype as it is."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def parameter_vector(module: nn.Module, layout: ParameterLayout | None = None) -> torch.Tensor:
    """A detached flat copy of ``module``'s trainable parameters."""
    layout = layout or ParameterLayout.of(module)
    return flatten(layout.parameters(module))


@torch.no_grad()
def load_vector(module: nn.Module, vector: torch.Tensor, layout: ParameterLayout) -> None:
    """Copy a flat ``vector`` into ``module``'s parameters in place."""
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
    """SHA-256 of a vector's float32 little-endian bytes: equal hashes mean bit-equal θ0."""
    # Through float32 in torch: numpy has no bfloat16.
    array = vector.detach().float().cpu().numpy() if isinstance(vector, torch.Tensor) else vector
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def frozen_hash(module: nn.Module) -> str | None:
    """:func:`vector_hash` of ``module``'s frozen parameters (``requires_grad=False``, by name),
    which a run file does not store; None when it has none."""
    frozen = [p for _, p in sorted(named_parameters(module)) if not p.requires_grad]
    return vector_hash(flatten(frozen)) if frozen else None
