"""Shift the activations of any model so that their output has mean zero (seed 002, Eq. 9).

:func:`shift_activations` swaps each activation module for a
:class:`~dynamics.bias.activations.ShiftedActivation` wrapping it, so φ keeps its parameters
(``ELU(alpha)``, ``GELU(approximate="tanh")``…) and c = E[φ(z)], z ~ N(0, 1), is the
quadrature of that very φ. Activations called as functions inside a ``forward`` (``F.gelu(x)``)
are no modules and cannot be swapped; given an example input, a traced forward finds them and
the returned table names them instead of staying silent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dynamics.bias.activations import ShiftedActivation
from dynamics.errors import DynamicsError
from dynamics.params.batch_tree import call_forward
from dynamics.params.globs import glob_any, glob_match, matched
from dynamics.passes.isolation import side_effect_free

#: Activation modules replaced without being named.
ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Mish,
    nn.ELU,
    nn.LeakyReLU,
    nn.Softplus,
)

#: Functional activations the traced forward reports, by the name the table shows.
_FUNCTIONAL: dict[Callable[..., Any], str] = {
    F.relu: "F.relu",
    F.relu_: "F.relu_",
    torch.relu: "torch.relu",
    torch.relu_: "torch.relu_",
    torch.Tensor.relu: "Tensor.relu",
    F.gelu: "F.gelu",
    F.silu: "F.silu",
    F.mish: "F.mish",
    F.elu: "F.elu",
    F.leaky_relu: "F.leaky_relu",
    F.softplus: "F.softplus",
    F.sigmoid: "F.sigmoid",
    torch.sigmoid: "torch.sigmoid",
    torch.Tensor.sigmoid: "Tensor.sigmoid",
    F.tanh: "F.tanh",
    torch.tanh: "torch.tanh",
    torch.Tensor.tanh: "Tensor.tanh",
}


@dataclass(frozen=True)
class ShiftRow:
    """One activation :func:`shift_activations` found.

    Attributes:
        module: the dotted module path (``""``: the model itself).
        activation: the module's repr, or the function's name for a functional call.
        replaced: whether it now subtracts its shift.
        shift: the shift asked for (``"expected"``, ``"adaptive"`` or the number).
        c: the fixed constant subtracted; ``None`` for adaptive or unreplaced rows.
        note: why a row was not replaced, or the adaptive dimension.
    """

    module: str
    activation: str
    replaced: bool
    shift: str | float | None
    c: float | None
    note: str = ""


class ShiftTable(list[ShiftRow]):
    """The rows :func:`shift_activations` returns; ``str()`` renders them as a table.

    Example::

        table = shift_activations(model, "adaptive", dim=1)
        [row.module for row in table if row.replaced]
    """

    def __str__(self) -> str:
        header = ("module", "activation", "replaced", "shift", "c", "note")
        cells = [
            (
                r.module or "<model>",
                r.activation,
                "yes" if r.replaced else "no",
                "" if r.shift is None else str(r.shift),
                "" if r.c is None else f"{r.c:.12g}",
                r.note,
            )
            for r in self
        ]
        widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *cells]
        )


def pattern_list(what: str, patterns: Sequence[str]) -> list[str]:
    """``patterns`` as a list, refusing a lone string (it would be read letter by letter)."""
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise DynamicsError(f"{what} must be a list of module-name patterns, got {patterns!r}")
    return list(patterns)


def check_shift_settings(
    shift: str | float, include: Sequence[str], exclude: Sequence[str], dim: int
) -> None:
    """Refuse, in one message, settings :func:`shift_activations` cannot apply: an unknown
    or non-finite shift (a NaN would silently make the network NaN), a non-integer ``dim``,
    patterns not given as a list."""
    if isinstance(shift, str):
        if shift not in ("expected", "adaptive"):
            raise DynamicsError(f"shift must be 'expected', 'adaptive' or a number, got {shift!r}")
    elif isinstance(shift, bool) or not isinstance(shift, int | float) or not math.isfinite(shift):
        raise DynamicsError(
            f"shift must be 'expected', 'adaptive' or a finite number, got {shift!r}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise DynamicsError(f"dim must be an integer (the feature dimension), got {dim!r}")
    pattern_list("include", include)
    pattern_list("exclude", exclude)


def shift_activations(
    model: nn.Module,
    shift: str | float = "expected",
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    custom: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    dim: int = -1,
    example_input: Any = None,
) -> ShiftTable:
    """Replace, in place, every activation module by one that subtracts its shift.

    Parameters are untouched (θ0 stays the same): the wrapper holds the original module as φ.

    Example::

        table = shift_activations(model, "expected", exclude=["head.**"], example_input=x)
        print(table)  # one row per activation found: replaced or why not, the shift c

    Args:
        model: any module; its activation modules (:data:`ACTIVATION_MODULES`) are swapped.
        shift: ``"expected"`` subtracts c = E[φ(z)], z ~ N(0, 1), computed by quadrature for
            the module's own parameters; ``"adaptive"`` subtracts, at every forward, the mean
            over dimension ``dim`` (exactly zero there by construction); a number subtracts it.
        include: module-name patterns (``*``: one segment, ``**``: any depth); when given,
            only matching activations are shifted.
        exclude: module-name patterns whose activations are left alone.
        custom: other modules to shift, as pattern -> φ, the elementwise function the
            matching modules compute (c is its quadrature; the module itself stays φ).
        dim: the feature dimension of the adaptive mean: ``-1`` (default) for
            ``(..., features)`` activations as in MLPs and transformers, ``1`` for NCHW
            convolution maps.
        example_input: an input of ``model``; when given, one forward (no grad, train/eval
            flags, buffers and RNG restored) finds activations called as functions, which are
            listed as not replaced.

    Returns:
        A :class:`ShiftTable` with one row per activation found, replaced or not.

    Raises:
        DynamicsError: on an unknown or non-finite ``shift``, a non-integer ``dim``, patterns
            not given as a list, or a pattern that matches no module.
    """
    check_shift_settings(shift, include, exclude, dim)
    custom = dict(custom or {})
    # Every path, so an activation module shared by several parents is shifted at each.
    named = dict(model.named_modules(remove_duplicate=False))
    unmatched = [p for p in (*include, *exclude, *custom) if not matched(p, named)]
    if unmatched:
        raise DynamicsError(f"shift_activations: pattern(s) {unmatched} match no module")
    table = ShiftTable()
    shifted_before = [n for n, m in named.items() if isinstance(m, ShiftedActivation)]
    for name, module in named.items():
        if name in shifted_before:
            note = "already shifted"
            table.append(ShiftRow(name, repr(module), False, module.shift, module.constant, note))
            continue
        phi = next((f for p, f in custom.items() if glob_match(name, p)), None)
        # φ inside a ShiftedActivation is its child: shifting it again would subtract twice.
        inside = any(name.startswith(f"{n}.") for n in shifted_before)
        if inside or not (phi is not None or isinstance(module, ACTIVATION_MODULES)):
            continue
        if (include and not glob_any(name, include)) or glob_any(name, exclude):
            table.append(ShiftRow(name, repr(module), False, None, None, "excluded by pattern"))
            continue
        shifted = ShiftedActivation(
            type(module).__name__, shift, phi=module, dim=dim, reference=phi
        )
        _set(model, name, shifted)
        adaptive = shift == "adaptive"
        c = None if adaptive else shifted.constant
        note = f"mean over dim {dim}" if adaptive else ""
        table.append(ShiftRow(name, repr(module), True, shift, c, note))
    if example_input is not None:
        table.extend(_functional_calls(model, example_input, custom))
    return table


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def functional_activations(model: nn.Module, example_input: Any) -> list[tuple[str, str]]:
    """``(module path, function)`` of each activation function a forward of ``model`` on
    ``example_input`` calls outside an activation module (no gradients; flags, buffers and
    random state restored)."""
    return [(row.module, row.activation) for row in _functional_calls(model, example_input, {})]


def _functional_calls(
    model: nn.Module, example_input: Any, custom: Mapping[str, Callable]
) -> list[ShiftRow]:
    """Rows for the activation functions a forward calls outside any activation module."""
    path: list[str] = []
    calls: dict[tuple[str, str], None] = {}
    names = {m: n for n, m in model.named_modules()}
    wrappers = (ShiftedActivation, *ACTIVATION_MODULES)

    def enter(module: nn.Module, args: Any) -> None:
        path.append(names[module])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        path.pop()

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in _FUNCTIONAL and not any(
                isinstance(model.get_submodule(p), wrappers) or glob_any(p, custom) for p in path
            ):
                calls[(path[-1] if path else "", _FUNCTIONAL[func])] = None
            return func(*args, **(kwargs or {}))

    with _hooks(model, enter, leave), side_effect_free(model), torch.no_grad(), Recorder():
        call_forward(model, example_input)
    return [
        ShiftRow(
            where,
            function,
            False,
            None,
            None,
            f"not replaced (functional call at {where or '<model>'})",
        )
        for where, function in calls
    ]


@contextmanager
def _hooks(model: nn.Module, enter: Callable, leave: Callable) -> Iterator[None]:
    handles = [
        h
        for m in model.modules()
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
