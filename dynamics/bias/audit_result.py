"""The bias audit's result (:func:`dynamics.bias.auditing`): dataclasses, their rendering as lines
and tables, and their JSON form.

Torch-free, so that ``dynamics report`` shows an audit a run recorded without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SETTINGS_KEY", "Activation", "AuditResult", "Layer", "Origin", "ParameterCount"]

#: Key of the audit in a probe's settings in a run file.
SETTINGS_KEY = "bias_audit"


@dataclass(frozen=True)
class ParameterCount:
    """The parameters a module holds itself (not its children's).

    Attributes:
        module: the dotted module path (``""``: the model itself).
        kind: the module's class name.
        bias: how many of them are biases (``bias``, ``bias_*``, ``*_bias``).
        total: how many there are.
    """

    module: str
    kind: str
    bias: int
    total: int


@dataclass(frozen=True)
class Layer:
    """A layer that can carry a bias (:data:`LAYER_TYPES`), and what its bias (or its lack)
    means here.

    Attributes:
        module: the dotted module path.
        kind: the class name.
        bias: whether it has bias parameters.
        followed_by: the modules that follow it (see the module docstring).
        absorbable: with a bias, whether a constant input feature could stand in for it
            exactly; ``None`` without one.
        shift_source: without a bias, the normalization after it whose learned shift
            supplies one; ``None`` otherwise.
        flagged: without a bias and without a shift source.
        note: why.
    """

    module: str
    kind: str
    bias: bool
    followed_by: tuple[str, ...]
    absorbable: bool | None
    shift_source: str | None
    flagged: bool
    note: str


@dataclass(frozen=True)
class Origin:
    """Whether the model maps the origin to the origin, checked numerically: ‖f(0)‖ on a copy
    of the model, eval mode, for each of ``draws`` random weight draws.

    Attributes:
        checked: whether the check ran (``note`` says why not).
        draws: random weight draws tried.
        pinned: ‖f(0)‖ = 0 exactly in every draw; ``None`` if not checked.
        largest_norm: the largest ‖f(0)‖ over the draws.
        note: how it was checked, or why not.
    """

    checked: bool
    draws: int
    pinned: bool | None
    largest_norm: float | None
    note: str


@dataclass(frozen=True)
class Activation:
    """The activation bias of one activation.

    Attributes:
        module: the dotted module path (of the caller, for a functional call).
        activation: the module's repr, or the function's name.
        expected: E[out(z)], z ~ N(0, 1) elementwise, of what the module returns (E[φ(z)]; for
            a shifted activation, E[φ(z)] − c); ``None`` where not computed.
        measured: the mean of its output over the example input's forward (every element,
            every call, pooled: ``note`` says when there were several); ``None`` where not
            measured.
        note: why a value is missing.
    """

    module: str
    activation: str
    expected: float | None
    measured: float | None
    note: str = ""


@dataclass(frozen=True)
class AuditResult:
    """What :func:`dynamics.bias.auditing` found; ``lines()`` and ``tables()`` render it,
    ``to_dict()`` gives it as JSON and ``from_dict()`` takes it back.

    Example::

        result = audit(model, example_input=x)
        result.share(), result.bias_free, [layer.module for layer in result.layers]

    Attributes:
        parameters: one row per module holding parameters.
        origin: the origin check.
        order: what "followed by" and "reads the input" were decided from (a traced forward,
            or the registration order).
        layers: one row per layer that can carry a bias.
        activations: one row per activation module, then per functional activation call.
        input_note: where the example input came from, or why there was none.
    """

    parameters: tuple[ParameterCount, ...]
    origin: Origin
    order: str
    layers: tuple[Layer, ...]
    activations: tuple[Activation, ...]
    input_note: str = field(default="")

    @property
    def bias_parameters(self) -> int:
        return sum(row.bias for row in self.parameters)

    @property
    def total_parameters(self) -> int:
        return sum(row.total for row in self.parameters)

    @property
    def bias_free(self) -> bool:
        """No bias parameters at all (the origin check says what that does to f(0))."""
        return self.bias_parameters == 0

    def share(self) -> str:
        """``906 of 567,434 = 0.16 %``: bias parameters of all parameters."""
        return _share(self.bias_parameters, self.total_parameters)

    def lines(self) -> list[str]:
        """The verdicts in words, one a line."""
        bias_tensors = sum(1 for row in self.parameters if row.bias)
        flagged = [layer.module for layer in self.layers if layer.flagged]
        absorbable = [layer.module for layer in self.layers if layer.absorbable]
        return [
            f"bias parameters: {self.share()}",
            "bias-free: yes"
            if self.bias_free
            else f"bias-free: no ({self.bias_parameters:,} bias parameters in "
            f"{bias_tensors} module(s))",
            f"origin: {self.origin.note}",
            f"absorbable exactly by a constant input feature: {_names(absorbable)}",
            f"no bias and no shift source (flagged): {_names(flagged)}",
            f"order: {self.order}",
            *([f"input: {self.input_note}"] if self.input_note else []),
        ]

    def tables(self) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
        """``(title, header, rows)`` of the parameter, layer and activation tables, as text."""
        parameters = [
            (
                r.module or "<model>",
                r.kind,
                f"{r.bias:,}",
                f"{r.total:,}",
                _percent(r.bias, r.total),
            )
            for r in self.parameters
        ]
        parameters.append(
            (
                "total",
                "",
                f"{self.bias_parameters:,}",
                f"{self.total_parameters:,}",
                _percent(self.bias_parameters, self.total_parameters),
            )
        )
        layers = [
            (
                layer.module or "<model>",
                layer.kind,
                "yes" if layer.bias else "no",
                ", ".join(f or "<model>" for f in layer.followed_by) or "-",
                _verdict(layer),
                layer.note,
            )
            for layer in self.layers
        ]
        activations = [
            (
                a.module or "<model>",
                a.activation,
                "-" if a.expected is None else f"{a.expected:.6f}",
                "-" if a.measured is None else f"{a.measured:.6f}",
                a.note,
            )
            for a in self.activations
        ]
        return [
            ("Parameters", ("module", "layer", "bias", "parameters", "bias share"), parameters),
            (
                "Layers",
                ("module", "layer", "bias", "followed by", "verdict", "why"),
                layers,
            ),
            (
                "Activations",
                ("module", "activation", "E[out(z)], z~N(0,1)", "mean on input", "note"),
                activations,
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible: every field, and the totals and share line."""
        return {
            "bias_parameters": self.bias_parameters,
            "total_parameters": self.total_parameters,
            "share": self.share(),
            "bias_free": self.bias_free,
            **asdict(self),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditResult:
        """The audit :meth:`to_dict` described (the derived keys are ignored)."""
        return cls(
            parameters=tuple(ParameterCount(**row) for row in data["parameters"]),
            origin=Origin(**data["origin"]),
            order=data["order"],
            layers=tuple(
                Layer(**{**row, "followed_by": tuple(row["followed_by"])}) for row in data["layers"]
            ),
            activations=tuple(Activation(**row) for row in data["activations"]),
            input_note=data.get("input_note", ""),
        )


def _share(part: int, whole: int) -> str:
    return f"{part:,} of {whole:,} = {_percent(part, whole)}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f} %" if whole else "-"


def _verdict(layer: Layer) -> str:
    if layer.bias:
        return "absorbable" if layer.absorbable else "not absorbable"
    if layer.shift_source:
        return "sound"
    return "FLAGGED" if layer.flagged else "-"


def _names(modules: list[str]) -> str:
    return ", ".join(m or "<model>" for m in modules) or "none"
