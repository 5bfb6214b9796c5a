"""Hidden-state norms and activation bias, read from forward hooks during due training steps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

# The private bases are the one way to name every variant (lazy, transposed, sync, instance).
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd

from dynamics.activations import ACTIVATIONS, ShiftedActivation
from dynamics.callbacks.probe import Probe, ProbeUnavailable, Rows, SeriesSpec
from dynamics.callbacks.unit_health import (
    DEAD,
    UnitKind,
    nonfinite_fraction,
    unit_fraction,
    unit_kind,
)
from dynamics.callbacks.unit_health import VIEWS as UNIT_VIEWS
from dynamics.isolation import in_extra_pass
from dynamics.name_globs import glob_any, glob_match, matched
from dynamics.store import names
from dynamics.store.views import standard_view

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

_ASSUMED = "unknown kind: last axis assumed"
_TWO_D_ONLY = "no module fixes it: measured on 2-D outputs (batch, units) only"


@dataclass(frozen=True)
class _Axis:
    """The axis a layer's norm runs over, and why."""

    dim: int
    rule: str  # stored in the run file
    #: The module whose feature count the output must show on ``dim``; None where unchecked.
    source: nn.Module | None = None


class HiddenStateNorms(Probe):
    """Mean L2 norm of chosen modules' outputs, and the activation bias of activation modules.

    Per chosen module and due step: the L2 norm of the output over its feature axis, averaged
    over every other axis (batch, tokens, spatial positions) and over every call in the step
    (gradient accumulation). Per activation module: the mean of its output across neurons,
    averaged likewise — the paper's activation bias.

    **Module choice**, when neither ``modules`` nor ``types`` is given: the residual blocks, found
    as the longest ``ModuleList``/``Sequential`` whose children all share one class (a
    ResidualMLP's ``blocks``, a GPT's ``h``, a ViT's ``blocks``, a CNN's stage of residual conv
    blocks); failing that, the module's direct children (loss modules aside). Containers without
    a ``forward`` (``ModuleList``, ``ModuleDict``) are never recorded: they are never called.

    **Patterns** name modules as ``named_modules()`` does and match whole dot-separated
    segments, as path globs do: ``*``, ``?`` and ``[...]`` match within one segment, and a
    segment ``**`` matches zero or more segments. On a GPT with ``h.0.attn.c_proj``::

        "h.*"          h.0, h.1, ...                          the blocks, not their insides
        "h.**"         h.0, h.0.attn, h.0.attn.c_proj, ...    everything under h
        "h.*.attn"     h.0.attn, h.1.attn, ...                one segment between
        "**.c_proj"    h.0.attn.c_proj, h.0.mlp.c_proj, ...   at any depth

    **Feature axis**, per recorded module, first rule that applies:

    1. ``feature_dims``: the axis of the first pattern matching the module's name;
    2. ``feature_dim``: one axis for every module;
    3. the module's own class: axis 1 for convolutions, BatchNorm, InstanceNorm and GroupNorm
       (``CHANNELS_FIRST``: (N, C, H, W) norms run over C, the mean over N, H and W); the last
       axis for Linear, LayerNorm, Embedding, attention and RNNs (``FEATURES_LAST``);
    4. a block (any other module) takes the class of its last descendant, in registration order,
       that rule 3 knows: a residual conv block ending in BatchNorm2d uses axis 1, a transformer
       block ending in its MLP's Linear the last axis;
    5. otherwise (no known class inside) the last axis is assumed; the run file says so, and a
       warning names the module if its output has 3 or more axes.

    Rules 3 and 4 are checked at every recorded call: the output's size along the axis must equal
    the feature count of the module that set it (out_channels, num_features, out_features, ...).
    Where it does not (an unbatched input, a block whose last registered submodule does not
    produce its output), :meth:`on_step_end` raises :class:`ProbeUnavailable` naming the module
    rather than record a norm over the wrong axis. The axis and rule of every module are stored in
    the run file (``settings()``).

    **Activations**: the built-in classes (``ACTIVATION_TYPES``, and classes named after
    ``dynamics.activations.ACTIVATIONS``) plus any module the user marks by class
    (``activation_types``) or name pattern (``activation_modules``), e.g. a hand-written
    ``CenteredGELU(nn.Module)``. Functional calls (``F.gelu(x)`` inside a ``forward``) have no
    module to hook and are not seen. Which modules were found, and the classes of all the
    modules looked at, are stored in the run file and printed once at setup.

    **Unit health** (``unit_health=True``): per activation module, the fraction of its units
    that were dead (the ReLU family: at the flat value for every sample) or saturated
    (sigmoid/tanh: within 1e-3 of a bound for every sample) over the step's batch, and per
    recorded output (layers and activation modules) the fraction of non-finite values; see
    :mod:`dynamics.callbacks.unit_health` for which activations have which (GELU and the other
    activations without an exact flat region have neither). A unit is one entry along the
    activation's feature axis, over the batch and every other axis: the axis of
    ``feature_dims``/``feature_dim``, else a ``ShiftedActivation``'s ``dim``, else that of the
    last module of a known kind registered before it in its parent (a Linear before it: the last
    axis; a BatchNorm2d: axis 1), else the last axis of 2-D outputs only (other outputs record
    NaN, with a warning event). Off by default: it costs a few device ops per hooked call.

    A pattern or type that matches nothing makes :meth:`setup` raise :class:`ProbeUnavailable`
    with the pattern in its message, so the probe steps aside rather than record the wrong layers.

    Args:
        modules: name patterns of the modules to record (e.g. ``"student.blocks.*"``).
        types: module classes to record.
        feature_dims: ``{pattern: axis}`` overriding the feature axis of matching modules.
        feature_dim: one feature axis for every recorded module (below ``feature_dims``).
        activations: record the activation bias of the built-in activation classes.
        activation_types: further module classes whose output is a post-activation.
        activation_modules: name patterns of further activation modules.
        unit_health: also record dead, saturated and non-finite fractions.
        every_n_steps: recording period in optimizer steps.
    """

    name = "hidden"

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        types: Sequence[type[nn.Module]] | None = None,
        feature_dims: Mapping[str, int] | None = None,
        feature_dim: int | None = None,
        activations: bool = True,
        activation_types: Sequence[type[nn.Module]] | None = None,
        activation_modules: Sequence[str] | None = None,
        unit_health: bool = False,
        every_n_steps: int = 1,
    ) -> None:
        super().__init__(every_n_steps)
        self.patterns = _strings(modules, "modules")
        self.types = _module_classes(types, "types")
        self.feature_dims = dict(feature_dims or {})
        for pattern, dim in self.feature_dims.items():
            _check_dim(dim, f"feature_dims[{pattern!r}]")
        if feature_dim is not None:
            _check_dim(feature_dim, "feature_dim")
        self.feature_dim = feature_dim
        self.activations = activations
        self.activation_types = _module_classes(activation_types, "activation_types")
        self.activation_patterns = _strings(activation_modules, "activation_modules")
        self.unit_health = unit_health
        # What setup found; empty until then, so series() and settings() are defined before it.
        self.layers: tuple[str, ...] = ()
        self.activation_layers: tuple[str, ...] = ()
        self.unit_kinds: dict[str, UnitKind] = {}  # activation modules with dead/saturated units
        self._unit_axes: dict[str, _Axis] = {}
        self._units: dict[str, list[torch.Tensor]] = {}
        self._nonfinite: dict[str, list[torch.Tensor]] = {}
        self._report: dict[str, Any] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._norms: dict[str, list[torch.Tensor]] = {}
        self._biases: dict[str, list[torch.Tensor]] = {}
        self._problems: dict[str, str] = {}
        self._warned: set[str | tuple[str, str]] = set()  # layers (and units) warned about
        self._step = 0  # the due step whose forward the hooks see
        self._armed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Choose the modules, resolve their feature axes and hook them.

        Raises:
            ProbeUnavailable: a pattern or type matches nothing, or there is nothing to record.
        """
        self.teardown()
        self.layers, self.activation_layers, self._report = (), (), {}
        self.unit_kinds, self._unit_axes = {}, {}
        named = {n: m for n, m in pl_module.named_modules() if n}
        layers = _choose_modules(named, self.patterns, self.types)
        activation_layers = tuple(
            n
            for n, m in named.items()
            if (self.activations and _is_activation(m))
            or isinstance(m, self.activation_types)
            or glob_any(n, self.activation_patterns)
        )
        unmatched = [
            *(f"modules pattern {p!r}" for p in self.patterns if not matched(p, named)),
            *(f"types {t.__name__}" for t in self.types if not _has_instance(named, t)),
            *(
                f"activation_modules pattern {p!r}"
                for p in self.activation_patterns
                if not matched(p, named)
            ),
            *(
                f"activation_types {t.__name__}"
                for t in self.activation_types
                if not _has_instance(named, t)
            ),
            *(
                f"feature_dims pattern {p!r} (no recorded module)"
                for p in self.feature_dims
                if not matched(p, layers + (activation_layers if self.unit_health else ()))
            ),
        ]
        if unmatched:
            raise ProbeUnavailable(
                f"HiddenStateNorms: {'; '.join(unmatched)} matched nothing in "
                f"{type(pl_module).__name__}, whose modules are named like {_some(named)}"
            )
        if not layers:
            raise ProbeUnavailable(
                f"HiddenStateNorms: {type(pl_module).__name__} has no submodule to record"
            )
        axes = {n: self._axis(n, named[n]) for n in layers}
        if self.unit_health:
            self.unit_kinds = {
                n: kind for n in activation_layers if (kind := unit_kind(named[n])) is not None
            }
            self._unit_axes = {n: self._unit_axis(n, named, pl_module) for n in self.unit_kinds}
        # One list per layer and value for the whole fit, emptied at each due step: the hooks
        # hold their own lists, so a call appends without looking anything up.
        self._norms = {n: [] for n in layers}
        self._biases = {n: [] for n in activation_layers}
        self._units = {n: [] for n in self.unit_kinds}
        self.layers, self.activation_layers = layers, activation_layers
        self._nonfinite = {n: [] for n in self._recorded_outputs()} if self.unit_health else {}
        for layer in layers:
            hook = self._norm_hook(layer, axes[layer])
            self._handles.append(named[layer].register_forward_hook(hook))
        for layer in activation_layers:
            self._handles.append(named[layer].register_forward_hook(self._bias_hook(layer)))
        self._report = {
            "layers": {
                n: {"class": type(named[n]).__name__, "feature_dim": a.dim, "rule": a.rule}
                for n, a in axes.items()
            },
            "found": {n: type(named[n]).__name__ for n in activation_layers},
            "unit_axes": {
                n: {"feature_dim": a.dim, "rule": a.rule} for n, a in self._unit_axes.items()
            },
            "looked_at": dict(Counter(type(m).__name__ for m in named.values()).most_common()),
        }
        self._announce_activations(len(named))

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        """The norm and bias series of the modules setup chose; empty before setup."""
        if not self.layers:
            return {}
        norms = standard_view(names.HIDDEN_NORMS, names.HIDDEN_NORM)
        groups = {
            names.HIDDEN_NORMS: {
                names.HIDDEN_NORM: SeriesSpec((len(self.layers),), columns=self.layers, view=norms)
            }
        }
        if self.activation_layers:
            n = len(self.activation_layers)
            bias = standard_view(names.ACTIVATION_BIAS, names.ACTIVATION_MEAN)
            groups[names.ACTIVATION_BIAS] = {
                names.ACTIVATION_MEAN: SeriesSpec((n,), columns=self.activation_layers, view=bias)
            }
        if self.unit_health:
            groups[names.UNIT_HEALTH] = {
                series: SeriesSpec(
                    (len(columns),),
                    columns=columns,
                    view=UNIT_VIEWS[series],
                )
                for series, columns in self._health_columns().items()
                if columns
            }
        return groups

    def settings(self) -> dict[str, Any]:
        return {
            "modules": list(self.patterns),
            "types": [_qualname(t) for t in self.types],
            "feature_dims": self.feature_dims,
            "feature_dim": self.feature_dim,
            "layers": self._report.get("layers", {}),
            "activation_bias": {
                "builtin_types": self.activations,
                "types": [_qualname(t) for t in self.activation_types],
                "modules": list(self.activation_patterns),
                "functional_calls": "not seen (F.gelu and the like have no module to hook)",
                "found": self._report.get("found", {}),
                "looked_at": self._report.get("looked_at", {}),
            },
            "unit_health": {
                "enabled": self.unit_health,
                "kinds": {n: k.describe() for n, k in self.unit_kinds.items()},
                "unit_axes": self._report.get("unit_axes", {}),
                "not_reported": "activations without an exact flat region (GELU, SiLU, ...)",
            },
        }

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        for values in (self._norms, self._biases, self._units, self._nonfinite):
            for calls in values.values():
                calls.clear()
        self._problems = {}
        self._step = step
        self._armed = True

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        """The step's rows.

        Raises:
            ProbeUnavailable: an output was no tensor, or lacked the feature axis it should have.
        """
        self._armed = False
        if self._problems:
            raise ProbeUnavailable(
                "HiddenStateNorms: "
                + "; ".join(f"{layer}: {why}" for layer, why in self._problems.items())
                + " (set feature_dims={name pattern: axis}, or leave the module out)"
            )
        if not self.layers:
            return {}
        norms = _mean_norms(self._norms, self.layers)
        rows: Rows = {names.HIDDEN_NORMS: {names.HIDDEN_NORM: norms}}
        if self.activation_layers:
            biases = _means(self._biases, self.activation_layers)
            rows[names.ACTIVATION_BIAS] = {names.ACTIVATION_MEAN: biases}
        if self.unit_health:
            values = {
                names.UNIT_NONFINITE: self._nonfinite,
                **dict.fromkeys((names.UNIT_DEAD, names.UNIT_SATURATED), self._units),
            }
            rows[names.UNIT_HEALTH] = {
                series: _means(values[series], columns)
                for series, columns in self._health_columns().items()
                if columns
            }
        return rows

    def _recorded_outputs(self) -> tuple[str, ...]:
        return self.layers + tuple(n for n in self.activation_layers if n not in self.layers)

    def _health_columns(self) -> dict[str, tuple[str, ...]]:
        kinds = self.unit_kinds
        return {
            names.UNIT_DEAD: tuple(n for n, k in kinds.items() if k.kind == DEAD),
            names.UNIT_SATURATED: tuple(n for n, k in kinds.items() if k.kind != DEAD),
            names.UNIT_NONFINITE: self._recorded_outputs(),
        }

    def _unit_axis(self, name: str, named: Mapping[str, nn.Module], root: nn.Module) -> _Axis:
        """The axis along which an activation module's output holds its units."""
        module = named[name]
        pattern = next((p for p in self.feature_dims if glob_match(name, p)), None)
        if pattern is not None:
            return _Axis(self.feature_dims[pattern], f"feature_dims[{pattern!r}]")
        if self.feature_dim is not None:
            return _Axis(self.feature_dim, "feature_dim")
        if isinstance(module, ShiftedActivation):
            return _Axis(module.dim, "ShiftedActivation dim")
        parent_name, _, own = name.rpartition(".")
        siblings = list((named[parent_name] if parent_name else root).named_children())
        before = [m for _, m in siblings[: [n for n, _ in siblings].index(own)]]
        known = [m for m in before if kind_dim(m) is not None]
        if known:
            last = known[-1]
            return _Axis(kind_dim(last), f"module before it ({type(last).__name__})", last)
        return _Axis(-1, _TWO_D_ONLY)

    def _record_units(self, layer: str, hidden: torch.Tensor) -> None:
        axis = self._unit_axes[layer]
        problem = (
            f"output of shape {tuple(hidden.shape)}: its unit axis {_TWO_D_ONLY}"
            if axis.rule == _TWO_D_ONLY and hidden.dim() != 2
            else "output has no batch axis"
            if hidden.dim() < 2
            else _axis_problem(hidden, hidden, axis)
        )
        if problem:  # NaN, not a fraction over the wrong axis; one event per layer
            if ("units", layer) not in self._warned:
                self._warned.add(("units", layer))
                self.note(self._step, f"unit health of {layer}: {problem}; recorded NaN")
            return
        self._units[layer].append(unit_fraction(hidden, self.unit_kinds[layer], axis.dim))

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False

    def _axis(self, name: str, module: nn.Module) -> _Axis:
        pattern = next((p for p in self.feature_dims if glob_match(name, p)), None)
        if pattern is not None:
            return _Axis(self.feature_dims[pattern], f"feature_dims[{pattern!r}]")
        if self.feature_dim is not None:
            return _Axis(self.feature_dim, "feature_dim")
        dim = kind_dim(module)
        if dim is not None:
            return _Axis(dim, f"{type(module).__name__} output", module)
        known = [(n, m) for n, m in module.named_modules() if n and kind_dim(m) is not None]
        if known:
            sub, last = known[-1]
            return _Axis(
                kind_dim(last), f"last known submodule {sub} ({type(last).__name__})", last
            )
        return _Axis(-1, _ASSUMED)

    def _norm_hook(self, layer: str, axis: _Axis):
        checked: torch.Size | None = None  # the last output shape found right for the axis
        norms_of_calls, dim = self._norms[layer], axis.dim
        nonfinite = self._nonfinite.get(layer)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            nonlocal checked
            if not self._armed or in_extra_pass():  # not a probe's own extra forward
                return
            hidden = output if type(output) is torch.Tensor else _first_tensor(output)
            if hidden is None or hidden.shape != checked:
                problem = _axis_problem(hidden, output, axis)
                if problem:
                    self._problems.setdefault(layer, problem)
                    return
                checked = hidden.shape
                if axis.rule == _ASSUMED and hidden.dim() >= 3 and layer not in self._warned:
                    self._warned.add(layer)
                    rank_zero_warn(
                        f"HiddenStateNorms: {layer} ({type(module).__name__}) outputs "
                        f"{hidden.dim()}-D tensors and contains no module of a known kind; its "
                        "norm runs over the last axis. Set feature_dims={...: axis} if its "
                        "features lie elsewhere."
                    )
            # Detached device tensors only: no .item(), so no host sync in the hot path.
            hidden = hidden.detach()
            # The mean over batch and positions waits for on_step_end, one op for all layers.
            norms_of_calls.append(torch.linalg.vector_norm(hidden, dim=dim, dtype=torch.float32))
            if nonfinite is not None:
                nonfinite.append(nonfinite_fraction(hidden))

        return hook

    def _bias_hook(self, layer: str):
        biases = self._biases[layer]
        # Non-finite values are counted here unless the layer's norm hook counts them.
        nonfinite = self._nonfinite.get(layer) if layer not in self._norms else None
        units = layer in self._units

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._armed or in_extra_pass():  # not a probe's own extra forward
                return
            hidden = output if type(output) is torch.Tensor else _first_tensor(output)
            if hidden is None:
                self._problems.setdefault(layer, f"outputs a {type(output).__name__}, no tensor")
                return
            hidden = hidden.detach()
            biases.append(hidden.mean(dtype=torch.float32))
            if nonfinite is not None:
                nonfinite.append(nonfinite_fraction(hidden))
            if units:
                self._record_units(layer, hidden)

        return hook

    def _announce_activations(self, looked_at: int) -> None:
        classes = ", ".join(f"{c} ×{k}" for c, k in self._report["looked_at"].items())
        if self.activation_layers:
            rank_zero_info(
                f"HiddenStateNorms: activation bias of {len(self.activation_layers)} modules "
                f"({_some(self.activation_layers)}), among {looked_at} modules looked at "
                f"({classes}); functional activations (F.gelu) are not seen"
            )
        elif self.activations:
            rank_zero_warn(
                f"HiddenStateNorms found no activation module among the {looked_at} modules it "
                f"looked at ({classes}); mark yours with activation_types= or "
                "activation_modules= (functional calls such as F.gelu cannot be hooked)"
            )


def _choose_modules(
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
        if len(kids) >= 2
        and len({type(k) for _, k in kids}) == 1
        and not _is_activation(kids[0][1])
    ]
    if stacks:
        prefix, kids = max(stacks, key=lambda s: len(s[1]))
        return tuple(f"{prefix}.{k}" for k, _ in kids)
    # A loss module's output is a scalar, not a hidden state.
    return tuple(
        n for n, m in callable_.items() if "." not in n and not isinstance(m, nn.modules.loss._Loss)
    )


def _has_instance(named: Mapping[str, nn.Module], cls: type[nn.Module]) -> bool:
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


def _width(module: nn.Module) -> int | None:
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


def _axis_problem(hidden: torch.Tensor | None, output: Any, axis: _Axis) -> str | None:
    """Why the norm over ``axis`` of ``output`` would not be a hidden-state norm, if it would not.

    Shapes are host metadata: reading them costs no device sync.
    """
    if hidden is None:
        return f"outputs a {type(output).__name__}, no tensor"
    ndim = max(hidden.dim(), 1)  # a 0-D tensor has one axis for torch's norms
    if not -ndim <= axis.dim < ndim:
        return f"output of shape {tuple(hidden.shape)} has no axis {axis.dim}"
    width = None if axis.source is None else _width(axis.source)
    if width is not None and hidden.dim() > 0 and hidden.shape[axis.dim] != width:
        return (
            f"output of shape {tuple(hidden.shape)} has {hidden.shape[axis.dim]} entries on axis "
            f"{axis.dim}, chosen by its {axis.rule} that has {width} features"
        )
    return None


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, ACTIVATION_TYPES) or type(module).__name__.lower() in ACTIVATIONS


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _mean_norms(values: dict[str, list[torch.Tensor]], layers: Sequence[str]) -> torch.Tensor:
    """Each layer's norms (one tensor per call) averaged over batch and positions, then over
    the step's calls, as in :func:`_means`.

    The usual step calls each layer once with outputs of one shape: its norms are stacked and
    averaged in one op (each row reduced as its own mean would be).
    """
    calls = [values[k] for k in layers]
    shape = calls[0][0].shape if calls[0] else None
    if all(len(c) == 1 and c[0].shape == shape for c in calls):
        stacked = torch.stack([c[0] for c in calls])
        # Norms of 1-D outputs are scalars already (a mean over no dims would reduce them all).
        # (An int dim costs half what a tuple of dims does.)
        return stacked.flatten(1).mean(dim=1) if stacked.dim() > 1 else stacked
    return _means({k: [norms.mean() for norms in values[k]] for k in layers}, layers)


def _means(values: dict[str, list[torch.Tensor]], layers: Sequence[str]) -> torch.Tensor:
    # A layer not called in this step (a branch not taken) reads NaN rather than a made-up 0.
    # Rows stay on the device; the writer copies a whole block to the host at once.
    # The usual step calls each layer once: its value as it is, no op but the stack.
    calls = [values[k] for k in layers]
    if all(len(c) == 1 for c in calls):
        return torch.stack([c[0] for c in calls])
    means = [(c[0] if len(c) == 1 else sum(c) / len(c)) if c else None for c in calls]
    if any(m is None for m in means):  # `None in` would compare tensors with ==
        device = next((m.device for m in means if m is not None), torch.device("cpu"))
        nan = torch.full((), float("nan"), device=device)
        means = [nan if m is None else m for m in means]
    return torch.stack(means)


def _strings(values: Sequence[str] | None, argument: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f"{argument} must be a list of name patterns, got the string {values!r}")
    return tuple(values or ())


def _module_classes(
    values: Sequence[type[nn.Module]] | None, argument: str
) -> tuple[type[nn.Module], ...]:
    classes = tuple(values or ())
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"{argument} must hold nn.Module subclasses, got {cls!r}")
    return classes


def _check_dim(dim: Any, argument: str) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{argument} must be an int axis, got {dim!r}")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _some(names_: Iterable[str], limit: int = 6) -> str:
    listed = list(names_)
    more = f", … ({len(listed)} in all)" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more
