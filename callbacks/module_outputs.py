"""The forward-hook machinery of the probes that read module outputs during due training steps:
which modules, one column per call, the padding mask, micro-batches and ranks."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from dynamics import world
from dynamics.bias.activations import ShiftedActivation, expected_shift
from dynamics.callbacks.fit import Fit
from dynamics.callbacks.output_axes import (
    ASSUMED,
    TWO_D_ONLY,
    Axis,
    axis_problem,
    choose_modules,
    first_tensor,
    has_instance,
    is_activation,
    kind_dim,
)
from dynamics.callbacks.position_means import (
    BIAS,
    NONFINITE,
    NORM,
    MaskRule,
    StepValues,
    bias_dim,
    describe_mask,
    per_position_mean,
    ratio,
)
from dynamics.callbacks.probe import (
    Probe,
    ProbeUnavailable,
    Rows,
    SeriesSpec,
    parameter_shards,
)
from dynamics.callbacks.unit_kinds import (
    DEAD,
    UnitKind,
    nonfinite_per_position,
    unit_extremes,
    unit_fraction_of,
    unit_kind,
)
from dynamics.callbacks.unit_kinds import VIEWS as UNIT_VIEWS
from dynamics.params.globs import glob_any, glob_match, matched
from dynamics.params.naming import module_class, named_submodules
from dynamics.params.vectors import module_device
from dynamics.passes.isolation import in_extra_pass, side_effect_free
from dynamics.passes.loss_rule import LIGHTNING_RULE, LossRule
from dynamics.sharding import unsharded_copy
from dynamics.store import names
from dynamics.store.views import standard_view
from dynamics.world import Reduce, checked_reduce


class ModuleOutputs(Probe):
    """Forward hooks on chosen modules and activation modules, one column per call, reduced per
    due step over real positions, micro-batches and ranks; what is recorded of each output is
    the subclass's choice (``norms``, ``bias``, ``unit_health``). The rules (which modules,
    which axis, padding, ranks) are in ``docs/probes/hidden_state_norms.md``.
    """

    name = "module_outputs"

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
        mask: MaskRule = None,
        reduce: Reduce = "global",
        every_n_steps: int = 1,
        *,
        norms: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(every_n_steps)
        self.norms = norms  # record hidden_norms of the chosen modules
        self.bias = bias  # record activation_bias of the activation modules
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
        if not (mask is None or mask is False or callable(mask)):
            raise TypeError(
                f"mask must be None, False or a callable (batch) -> tensor, got {mask!r}"
            )
        self.mask = mask
        self.reduce = checked_reduce(reduce)
        # What setup found; empty until then, so series() and settings() are defined before it.
        self.layers: tuple[str, ...] = ()
        self.activation_layers: tuple[str, ...] = ()
        self.unit_kinds: dict[str, UnitKind] = {}  # activation modules with dead/saturated units
        #: Calls per forward of each hooked module, counted at setup; one column per call.
        self.calls: dict[str, int] = {}
        self._columns: dict[str, tuple[str, ...]] = {}
        self._counted_by = "not set up"
        self._mask_rule = describe_mask(mask, None)
        self._unit_axes: dict[str, Axis] = {}
        self._bias_axes: dict[str, Axis] = {}
        self._report: dict[str, Any] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._series_columns: dict[str, tuple[str, ...]] = {}  # per-position series: columns
        self._device = torch.device("cpu")
        self._steps = StepValues({})
        self._extremes: dict[str, list[torch.Tensor]] = {}  # unit column -> per-unit extremes
        self._calls_now: dict[str, int] = {}  # calls of each module in this micro-batch
        self._hook_mask: torch.Tensor | None = None
        self._mask_known = True  # whether the hooks know this micro-batch's mask
        self._refused: dict[str, str] = {}  # modules whose columns read NaN, and why
        self._problems: dict[str, str] = {}
        self._warned: set[str | tuple[str, str]] = set()  # layers (and units) warned about
        self._step = 0  # the due step whose forward the hooks see
        self._armed = False
        self._fit: Fit | None = None  # the armed step's, to tell validation apart

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        """Choose the modules, resolve their feature axes, count their calls and hook them.

        Raises:
            ProbeUnavailable: a pattern or type matches nothing, or there is nothing to record.
        """
        self.teardown()
        self.layers, self.activation_layers, self._report = (), (), {}
        self.unit_kinds, self._unit_axes = {}, {}
        # Names and classes as the unsharded module has them (no FSDP1 wrappers, not FSDP2's
        # FSDP<Name> classes), so that a sharded run declares the columns an unsharded one does.
        named = dict(named_submodules(pl_module))
        # Chosen modules give norms and the non-finite share; activation modules bias and units.
        wants_layers, wants_activations = (
            self.norms or self.unit_health,
            self.bias or self.unit_health,
        )
        layers = choose_modules(named, self.patterns, self.types) if wants_layers else ()
        activation_layers = tuple(
            n
            for n, m in named.items()
            if wants_activations
            and (
                (self.activations and is_activation(m))
                or isinstance(m, self.activation_types)
                or glob_any(n, self.activation_patterns)
            )
        )
        # A feature_dims pattern must set the axis of a module whose axis is used.
        axis_users = layers + (activation_layers if self.unit_health or not self.norms else ())
        unmatched = [
            *(f"modules pattern {p!r}" for p in self.patterns if not matched(p, named)),
            *(f"types {t.__name__}" for t in self.types if not has_instance(named, t)),
            *(
                f"activation_modules pattern {p!r}"
                for p in self.activation_patterns
                if not matched(p, named)
            ),
            *(
                f"activation_types {t.__name__}"
                for t in self.activation_types
                if not has_instance(named, t)
            ),
            *(
                f"feature_dims pattern {p!r} (no recorded module)"
                for p in self.feature_dims
                if not matched(p, axis_users)
            ),
        ]
        if unmatched:
            raise ProbeUnavailable(
                f"{type(self).__name__}: {'; '.join(unmatched)} matched nothing in "
                f"{type(pl_module).__name__}, whose modules are named like {_some(named)}"
            )
        if wants_layers and not layers:
            raise ProbeUnavailable(
                f"{type(self).__name__}: {type(pl_module).__name__} has no submodule to record"
            )
        if not wants_layers and not activation_layers:
            raise ProbeUnavailable(
                f"{type(self).__name__} found no activation module in "
                f"{type(pl_module).__name__}; mark yours with activation_types= or "
                "activation_modules= (functional calls such as F.gelu cannot be hooked)"
            )
        axes = {n: self._axis(n, named[n]) for n in layers}
        if self.unit_health:
            self.unit_kinds = {
                n: kind for n in activation_layers if (kind := unit_kind(named[n])) is not None
            }
        self._bias_axes = {n: self._unit_axis(n, named, pl_module) for n in activation_layers}
        self._unit_axes = {n: self._bias_axes[n] for n in self.unit_kinds}
        self.layers, self.activation_layers = layers, activation_layers
        hooked = tuple(dict.fromkeys(layers + activation_layers))
        self.calls, self._counted_by = _count_calls(fit, pl_module, batch, hooked)
        self._columns = {n: _call_columns(n, self.calls.get(n, 1)) for n in hooked}
        self._calls_now = dict.fromkeys(hooked, 0)
        self._mask_rule = describe_mask(self.mask, batch)
        self._refused = {}
        self._device = module_device(pl_module)
        health = self._health_columns() if self.unit_health else {}
        series_columns = {
            NORM: self._columns_of(self.layers) if self.norms else (),
            BIAS: self._columns_of(self.activation_layers) if self.bias else (),
            NONFINITE: health.get(names.UNIT_NONFINITE, ()),
        }
        self._series_columns = {s: c for s, c in series_columns.items() if c}
        self._steps = StepValues(self._series_columns)
        for layer in hooked:
            hook = self._hook(layer, axes.get(layer), layer in activation_layers)
            self._handles.append(named[layer].register_forward_hook(hook))
        self._report = {
            "layers": {
                n: {"class": module_class(named[n]).__name__, "feature_dim": a.dim, "rule": a.rule}
                for n, a in axes.items()
            },
            "found": {n: module_class(named[n]).__name__ for n in activation_layers},
            "expected_shift": {
                n: shift
                for n in activation_layers
                if (shift := expected_shift(named[n])) is not None
            },
            "unit_axes": {
                n: {"feature_dim": a.dim, "rule": a.rule} for n, a in self._unit_axes.items()
            },
            "looked_at": dict(
                Counter(module_class(m).__name__ for m in named.values()).most_common()
            ),
        }
        if self.bias:
            self._announce_activations(len(named))
        self._check_ranks_agree(self._device)

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        """The series of the modules setup chose; empty before setup."""
        if not (self.layers or self.activation_layers):
            return {}
        groups = {}
        if self.norms:
            norm_columns = self._columns_of(self.layers)
            norms = self._masked_view(standard_view(names.HIDDEN_NORMS, names.HIDDEN_NORM))
            groups[names.HIDDEN_NORMS] = {
                names.HIDDEN_NORM: SeriesSpec(
                    (len(norm_columns),), columns=norm_columns, view=norms
                )
            }
        if self.bias and self.activation_layers:
            columns = self._columns_of(self.activation_layers)
            bias = self._masked_view(standard_view(names.ACTIVATION_BIAS, names.ACTIVATION_MEAN))
            groups[names.ACTIVATION_BIAS] = {
                names.ACTIVATION_MEAN: SeriesSpec((len(columns),), columns=columns, view=bias)
            }
        if self.unit_health:
            groups[names.UNIT_HEALTH] = {
                series: SeriesSpec(
                    (len(columns),),
                    columns=columns,
                    view=self._masked_view(UNIT_VIEWS[series]),
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
            "calls_per_forward": dict(self.calls),
            "calls_counted_by": self._counted_by,
            "mask": self._mask_rule,
            "reduce": self.reduce,
            "reduction": (
                "mean over every real position of the step's batch: every micro-batch, "
                + ("every rank (sums and counts reduced)" if self.reduce == "global" else "rank 0")
            ),
            "activation_bias": {
                "builtin_types": self.activations,
                "types": [_qualname(t) for t in self.activation_types],
                "modules": list(self.activation_patterns),
                "functional_calls": "not seen (F.gelu and the like have no module to hook)",
                "found": self._report.get("found", {}),
                "expected_shift": self._report.get("expected_shift", {}),
                "looked_at": self._report.get("looked_at", {}),
            },
            "unit_health": {
                "enabled": self.unit_health,
                "kinds": {n: k.describe() for n, k in self.unit_kinds.items()},
                "unit_axes": self._report.get("unit_axes", {}),
                "not_reported": "activations without an exact flat region (GELU, SiLU, ...)",
            },
        }

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        self._steps.clear()
        for extremes in self._extremes.values():
            extremes.clear()
        self._calls_now = dict.fromkeys(self._calls_now, 0)
        self._problems = {}
        self._step = step
        self._fit = fit
        # The hooks see the first micro-batch's mask; a later micro-batch's is known only after
        # its forward (norms and biases wait for it; unit extremes cannot).
        self._hook_mask = self._batch_mask(batch)
        self._mask_known = True
        self._armed = True

    def on_micro_batch_end(self, fit, pl_module, batch, outputs, step) -> None:
        if self._armed:
            self._close_micro_batch(batch)

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        """The step's rows.

        Raises:
            ProbeUnavailable: an output was no tensor, or lacked the feature axis it should have
                (on any rank).
        """
        if self._armed and any(self._calls_now.values()):  # driven without micro-batch ends
            self._close_micro_batch(batch)
        self._armed = False
        if not (self.layers or self.activation_layers):
            return {}
        global_ = self.reduce == "global" and world.is_distributed()
        if self._problems and not global_:
            raise ProbeUnavailable(
                f"{type(self).__name__}: "
                + "; ".join(f"{layer}: {why}" for layer, why in self._problems.items())
                + " (set feature_dims={name pattern: axis}, or leave the module out)"
            )
        # Under DDP a probe disabled on one rank would leave the others waiting in the next
        # collective: there a module with a problem is refused instead, and its NaN sums make
        # its columns NaN on every rank.
        for layer, why in self._problems.items():
            self._refuse(layer, f"{why} (set feature_dims={{name pattern: axis}})")
        device, per_series = self._device, self._series_columns
        unit_columns = self._columns_of(self.unit_kinds)
        extremes = [self._unit_extremes(c, device) for c in unit_columns]
        if global_:  # one collective for every series' sums and counts, one for the extremes
            columns = list(per_series.values())
            totals = [
                self._refused_as_nan(self._steps.totals(s, c, device), c)
                for s, c in per_series.items()
            ]
            totals = world.all_reduce(totals)
            means = dict(zip(per_series, (ratio(t, c) for t, c in zip(totals, columns))))
            if extremes:
                extremes = world.all_reduce(extremes, "max")
        else:
            means = {
                s: self._refused_as_nan(self._steps.means(s, c, device), c)
                for s, c in per_series.items()
            }
        norms, biases, nonfinite = (means.get(s) for s in (NORM, BIAS, NONFINITE))
        rows: Rows = {names.HIDDEN_NORMS: {names.HIDDEN_NORM: norms}} if self.norms else {}
        if self.bias and self.activation_layers:
            rows[names.ACTIVATION_BIAS] = {names.ACTIVATION_MEAN: biases}
        if self.unit_health:
            health = self._health_columns()
            fractions = dict(zip(unit_columns, self._unit_fractions(unit_columns, extremes)))
            values = {names.UNIT_NONFINITE: dict(zip(health[names.UNIT_NONFINITE], nonfinite))}
            for series in (names.UNIT_DEAD, names.UNIT_SATURATED):
                values[series] = {c: fractions[c] for c in health[series]}
            rows[names.UNIT_HEALTH] = {
                series: torch.stack([values[series][c] for c in columns]).reshape(len(columns))
                for series, columns in health.items()
                if columns
            }
        return rows

    def _columns_of(self, modules: Iterable[str]) -> tuple[str, ...]:
        return tuple(c for m in modules for c in self._columns[m])

    def _owner(self, column: str) -> str:
        return column.rpartition("#")[0] if column not in self._columns else column

    def _refused_as_nan(self, values: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
        """``values`` (means, or sums then counts) with refused modules' columns NaN; sums are
        made NaN before the reduction, so that a module refused on one rank reads NaN on all."""
        if not self._refused:
            return values
        refused = [i for i, c in enumerate(columns) if self._owner(c) in self._refused]
        if refused:
            values = values.clone()
            values[refused] = float("nan")
        return values

    def _masked_view(self, view):
        """The view, labelled with the positions it averages over when a mask selects them."""
        if view is None or self._mask_rule.startswith("none") or self._mask_rule == "off":
            return view
        return dataclasses.replace(view, title=f"{view.title} (real positions: {self._mask_rule})")

    def _batch_mask(self, batch: Any) -> torch.Tensor | None:
        """The real (not padded) positions of ``batch``, by the mask rule; None: all of them."""
        if self.mask is False or batch is None:
            return None
        if self.mask is None:
            value = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if not isinstance(value, torch.Tensor):
                return None
        else:
            value = self.mask(batch)
            if not isinstance(value, torch.Tensor):
                raise ProbeUnavailable(
                    f"{type(self).__name__}: mask={self._mask_rule} returned a "
                    f"{type(value).__name__}, not a tensor of the real positions"
                )
        return value.detach() if value.dtype == torch.bool else value.detach() != 0

    def _close_micro_batch(self, batch: Any) -> None:
        """Reduce the micro-batch's per-position values to sums and counts over its mask, and
        check each module was called as often as its columns say."""
        mask = self._batch_mask(batch)
        for layer, count in self._calls_now.items():
            declared = len(self._columns[layer])
            if declared > 1 and count not in (0, declared) and layer not in self._refused:
                self._refuse(layer, f"called {count} times in one forward, not {declared}")
            self._calls_now[layer] = 0
        for column, why in self._steps.close(mask).items():
            self._refuse(self._owner(column), why)
        self._hook_mask, self._mask_known = None, mask is None

    def _refuse(self, layer: str, why: str) -> None:
        if layer in self._refused:
            return
        self._refused[layer] = why
        self.note(
            self._step,
            f"{layer}: {why}; its columns read NaN from now on (a stable column per call "
            "cannot be kept)",
        )

    def _recorded_outputs(self) -> tuple[str, ...]:
        return self.layers + tuple(n for n in self.activation_layers if n not in self.layers)

    def _health_columns(self) -> dict[str, tuple[str, ...]]:
        kinds = self.unit_kinds
        return {
            names.UNIT_DEAD: self._columns_of(n for n, k in kinds.items() if k.kind == DEAD),
            names.UNIT_SATURATED: self._columns_of(n for n, k in kinds.items() if k.kind != DEAD),
            names.UNIT_NONFINITE: self._columns_of(self._recorded_outputs()),
        }

    def _unit_axis(self, name: str, named: Mapping[str, nn.Module], root: nn.Module) -> Axis:
        """The axis along which an activation module's output holds its units."""
        module = named[name]
        pattern = next((p for p in self.feature_dims if glob_match(name, p)), None)
        if pattern is not None:
            return Axis(self.feature_dims[pattern], f"feature_dims[{pattern!r}]")
        if self.feature_dim is not None:
            return Axis(self.feature_dim, "feature_dim")
        if isinstance(module, ShiftedActivation):
            return Axis(module.dim, "ShiftedActivation dim")
        parent_name, _, own = name.rpartition(".")
        parent = named[parent_name] if parent_name else root
        # Its siblings by their unwrapped names (FSDP1 wraps some), in order.
        siblings = [(n, m) for n, m in named_submodules(parent) if "." not in n]
        before = [m for _, m in siblings[: [n for n, _ in siblings].index(own)]]
        known = [m for m in before if kind_dim(m) is not None]
        if known:
            last = known[-1]
            return Axis(kind_dim(last), f"module before it ({module_class(last).__name__})", last)
        return Axis(-1, TWO_D_ONLY)

    def _record_units(self, layer: str, column: str, hidden: torch.Tensor) -> None:
        axis = self._unit_axes[layer]
        problem = (
            f"output of shape {tuple(hidden.shape)}: its unit axis {TWO_D_ONLY}"
            if axis.rule == TWO_D_ONLY and hidden.dim() != 2
            else "output has no batch axis"
            if hidden.dim() < 2
            else axis_problem(hidden, hidden, axis)
        )
        if problem is None and not self._mask_known:
            problem = (
                "a padding mask is in use and a later micro-batch's mask is not known during "
                "its forward (gradient accumulation)"
            )
        extremes = None
        if problem is None:
            extremes = unit_extremes(hidden, self.unit_kinds[layer], axis.dim, self._hook_mask)
            if isinstance(extremes, str):
                problem, extremes = extremes, None
        if problem:  # NaN, not a fraction over the wrong axis; one event per layer
            ndim = max(hidden.dim(), 1)
            units = hidden.shape[axis.dim] if hidden.dim() and -ndim <= axis.dim < ndim else 1
            extremes = hidden.new_full((units,), float("nan"))
            if ("units", layer) not in self._warned:
                self._warned.add(("units", layer))
                self.note(self._step, f"unit health of {layer}: {problem}; recorded NaN")
        self._extremes.setdefault(column, []).append(extremes)

    def _unit_extremes(self, column: str, device: torch.device) -> torch.Tensor:
        """The per-unit extreme of a unit column over the step's calls; NaN where a call was
        not measured (the max keeps NaN) or the column was not called."""
        calls = self._extremes.get(column) or []
        if not calls or any(c.shape != calls[0].shape for c in calls):
            return torch.full((1,), float("nan"), device=device)
        return torch.stack(calls).amax(dim=0)

    def _unit_fractions(
        self, columns: Sequence[str], extremes: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        fractions = []
        for column, extreme in zip(columns, extremes):
            value = unit_fraction_of(extreme, self.unit_kinds[self._owner(column)])
            if self._owner(column) in self._refused:
                value = torch.full_like(value, float("nan"))
            fractions.append(value)
        return fractions

    def _check_ranks_agree(self, device: torch.device) -> None:
        """Under DDP every rank must declare the same columns, or the reduction of each step's
        sums would mix modules; refused on every rank alike (one collective, at setup)."""
        if self.reduce != "global" or not world.is_distributed():
            return
        n = float(
            len(self._columns_of(self.layers)) + len(self._columns_of(self.activation_layers))
        )
        low, high = world.all_reduce([torch.tensor([-n, n], device=device)], "max")[0]
        if -low != high:
            raise ProbeUnavailable(
                f"{type(self).__name__}: the ranks counted different numbers of calls per forward "
                f"(from {-low:.0f} to {high:.0f} columns), so their sums cannot be reduced; "
                "set reduce='rank0'"
            )

    def _validating(self) -> bool:
        return getattr(self._fit, "evaluating", False)

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False

    def _axis(self, name: str, module: nn.Module) -> Axis:
        pattern = next((p for p in self.feature_dims if glob_match(name, p)), None)
        if pattern is not None:
            return Axis(self.feature_dims[pattern], f"feature_dims[{pattern!r}]")
        if self.feature_dim is not None:
            return Axis(self.feature_dim, "feature_dim")
        dim = kind_dim(module)
        if dim is not None:
            return Axis(dim, f"{module_class(module).__name__} output", module)
        known = [(n, m) for n, m in module.named_modules() if n and kind_dim(m) is not None]
        if known:
            sub, last = known[-1]
            return Axis(kind_dim(last), f"last known submodule {sub} ({type(last).__name__})", last)
        return Axis(-1, ASSUMED)

    def _hook(self, layer: str, axis: Axis | None, activation: bool):
        """The one forward hook of a recorded module: its norm (a layer), its bias (an
        activation), non-finite values and units, each into the column of this call."""
        checked: torch.Size | None = None  # the last output shape found right for the axis
        columns = self._columns[layer]
        nonfinite = self.unit_health
        units = layer in self.unit_kinds
        bias_axis = self._bias_axes.get(layer)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            nonlocal checked
            if not self._armed or in_extra_pass() or self._validating():
                return  # not a probe's own extra forward, nor a validation run between two
                # micro-batches of the armed step (val_check_interval counts batches)
            index = self._calls_now[layer]
            self._calls_now[layer] = index + 1
            if layer in self._refused:
                return
            if index >= len(columns):
                self._refuse(
                    layer,
                    f"called more than {len(columns)} times in one forward ({self._counted_by})",
                )
                return
            column = columns[index]
            hidden = output if type(output) is torch.Tensor else first_tensor(output)
            if axis is not None and (hidden is None or hidden.shape != checked):
                problem = axis_problem(hidden, output, axis)
                if problem:
                    self._problems.setdefault(layer, problem)
                    return
                checked = hidden.shape
                if axis.rule == ASSUMED and hidden.dim() >= 3 and layer not in self._warned:
                    self._warned.add(layer)
                    rank_zero_warn(
                        f"{type(self).__name__}: {layer} ({type(module).__name__}) outputs "
                        f"{hidden.dim()}-D tensors and contains no module of a known kind; its "
                        "norm runs over the last axis. Set feature_dims={...: axis} if its "
                        "features lie elsewhere."
                    )
            if hidden is None:
                self._problems.setdefault(layer, f"outputs a {type(output).__name__}, no tensor")
                return
            # Detached device tensors only: no .item(), so no host sync in the hot path. Each
            # value is kept per position (batch, tokens) until the micro-batch's mask is known.
            hidden = hidden.detach()
            feature_dim = axis.dim if axis is not None else bias_dim(hidden, bias_axis)
            if axis is not None and self.norms:
                norms = torch.linalg.vector_norm(hidden, dim=axis.dim, dtype=torch.float32)
                self._steps.pending[NORM][column].append(norms)
            if activation and self.bias:
                bias = per_position_mean(hidden, bias_dim(hidden, bias_axis))
                self._steps.pending[BIAS][column].append(bias)
            if nonfinite:
                flags = nonfinite_per_position(hidden, feature_dim)
                self._steps.pending[NONFINITE][column].append(flags)
            if units:
                self._record_units(layer, column, hidden)

        return hook

    def _announce_activations(self, looked_at: int) -> None:
        classes = ", ".join(f"{c} ×{k}" for c, k in self._report["looked_at"].items())
        if self.activation_layers:
            rank_zero_info(
                f"{type(self).__name__}: activation bias of {len(self.activation_layers)} modules "
                f"({_some(self.activation_layers)}), among {looked_at} modules looked at "
                f"({classes}); functional activations (F.gelu) are not seen"
            )
        elif self.activations:
            rank_zero_warn(
                f"{type(self).__name__} found no activation module among the {looked_at} "
                f"modules it looked at ({classes}); mark yours with activation_types= or "
                "activation_modules= (functional calls such as F.gelu cannot be hooked)"
            )


def _count_calls(
    fit: Fit, pl_module: nn.Module, batch: Any, hooked: Sequence[str]
) -> tuple[dict[str, int], str]:
    """How often one forward calls each ``hooked`` module (a shared ReLU, one dropout used
    twice), from one loss pass on the first batch, and how it was counted.

    Columns must be declared before recording starts, so the count is taken before the first
    training forward: by the loss rule, in train mode, with gradients off, inside
    :func:`side_effect_free` (the pass leaves the run as it was). Every rank calls. Under FSDP
    the pass runs on a whole-parameter copy (peak memory: the parameters once more, at setup).
    """
    if batch is None:
        return {}, "not counted (no batch at setup): one column per module"
    shards = parameter_shards(fit, pl_module)
    frozen = parameter_shards(fit, pl_module, "frozen")
    rule = getattr(fit, "loss_rule", LIGHTNING_RULE)  # a stand-in outside a fit has none
    with unsharded_copy(pl_module, shards, frozen) as whole:
        copied = dict(named_submodules(whole))
        return _counted(whole, batch, {n: copied[n] for n in hooked}, rule)


def _counted(
    pl_module: nn.Module, batch: Any, modules: Mapping[str, nn.Module], rule: LossRule
) -> tuple[dict[str, int], str]:
    """:func:`_count_calls` on a module whose parameters are whole."""
    counts = dict.fromkeys(modules, 0)
    by_id = {id(m): n for n, m in modules.items()}

    def counter(module: nn.Module, args: Any, output: Any) -> None:
        name = by_id.get(id(module))
        if name is not None:
            counts[name] += 1

    # One global hook for the pass: the copy's modules take no hooks of their own.
    handles = [torch.nn.modules.module.register_module_forward_hook(counter)]
    try:
        with side_effect_free(pl_module, "train"), torch.no_grad():
            rule(pl_module, batch)
    except Exception as error:  # any user code: the count is missing, the probe goes on
        return {}, (
            f"not counted ({type(error).__name__}: {error}); one column per module, and a module "
            "called more often is refused"
        )
    finally:
        for handle in handles:
            handle.remove()
    return counts, "one loss pass at setup (the loss rule, train mode, gradients off)"


def _call_columns(name: str, calls: int) -> tuple[str, ...]:
    """One column per call of a module in a forward: its name, or ``name#0``, ``name#1``, ..."""
    return (name,) if calls <= 1 else tuple(f"{name}#{i}" for i in range(calls))


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
