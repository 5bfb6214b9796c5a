"""Hidden-state norms and activation bias, read from forward hooks during due training steps."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

# The private bases are the one way to name every variant (lazy, transposed, sync, instance).
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd

from dynamics import world
from dynamics.bias.activations import (
    ACTIVATIONS,
    ShiftedActivation,
    expected_shift,
    is_hf_activation,
)
from dynamics.callbacks.probe import Probe, ProbeUnavailable, Rows, SeriesSpec
from dynamics.callbacks.unit_health import (
    DEAD,
    UnitKind,
    nonfinite_per_position,
    unit_extremes,
    unit_fraction_of,
    unit_kind,
)
from dynamics.callbacks.unit_health import VIEWS as UNIT_VIEWS
from dynamics.params.globs import glob_any, glob_match, matched
from dynamics.passes.isolation import in_extra_pass, side_effect_free
from dynamics.passes.loss_rule import module_loss
from dynamics.store import names
from dynamics.store.views import standard_view
from dynamics.world import Reduce, checked_reduce

#: Which positions of a batch count: None finds ``attention_mask`` in a dict batch, False
#: counts every position, a callable returns the real positions of a batch (a bool tensor).
MaskRule = Callable[[Any], torch.Tensor] | bool | None

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
    over every other axis (batch, tokens, spatial positions) and over the step's micro-batches
    (gradient accumulation) as one mean over all their positions. Per activation module: the
    mean of its output across neurons, averaged likewise — the paper's activation bias.

    **Calls.** A module called more than once per forward (one ``nn.ReLU`` shared by several
    layers, an LSTM model's one ``self.drop`` on the embedding and on the output) gets one
    column per call, ``drop#0``, ``drop#1``, ... in call order: the calls are counted at setup by
    one loss pass on the first batch (:mod:`dynamics.passes.loss_rule`, train mode, gradients off,
    inside :func:`~dynamics.passes.isolation.side_effect_free`), since columns are declared before
    recording starts. A module later called another number of times (a data-dependent loop),
    or called twice where the calls could not be counted (no loss rule), is refused: its
    columns read NaN from then on, with a warning event saying why. Calls are never averaged.

    **Padding.** ``mask`` picks the real positions: by default ``batch["attention_mask"]`` of a
    dict batch (Hugging Face's), a callable ``mask(batch) -> bool tensor`` of your own, or
    ``False`` for every position. Norms, activation biases, non-finite and unit fractions then
    run over real positions only: an output's positions (its axes but the feature axis) must
    start with the mask's (batch, positions) shape, or have no positions beyond the batch
    (a pooled output); another output is refused as above. The rule used is stored in the run
    file (``settings()["mask"]``) and named in the views' titles. Unit health needs the mask
    during the forward, which under gradient accumulation is known for the first micro-batch
    only: later micro-batches record NaN there, with a warning event.

    **Ranks.** Under DDP the default ``reduce="global"`` records the global batch: each rank's
    sums and counts of positions (and, for unit health, per-unit extremes) are added up across
    ranks in one collective per series kind and due step, through :mod:`dynamics.world`, with
    no host sync; ``reduce="rank0"`` records rank zero's micro-batches alone. A module with an
    axis problem on any rank is refused (NaN on every rank) rather than the probe disabled on
    one rank, which would leave the others waiting in the next collective.

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

    **Activations**: the built-in classes (``ACTIVATION_TYPES``, classes named after
    ``dynamics.bias.activations.ACTIVATIONS``, and Hugging Face's activation modules,
    ``dynamics.bias.activations.HF_ACTIVATIONS``, with their expected shift E[φ(z)] stored) plus any
    module the user marks by class
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
        mask: the real positions: None (``attention_mask`` of a dict batch), a callable
            ``(batch) -> bool tensor``, or False (every position).
        reduce: ``"global"`` (every rank's batch) or ``"rank0"``.
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
        mask: MaskRule = None,
        reduce: Reduce = "global",
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
        self._mask_rule = _mask_rule(mask, None)
        self._unit_axes: dict[str, _Axis] = {}
        self._bias_axes: dict[str, _Axis] = {}
        self._report: dict[str, Any] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._series_columns: dict[str, tuple[str, ...]] = {}  # per-position series: columns
        self._device = torch.device("cpu")
        self._steps = _StepValues({})
        self._extremes: dict[str, list[torch.Tensor]] = {}  # unit column -> per-unit extremes
        self._calls_now: dict[str, int] = {}  # calls of each module in this micro-batch
        self._hook_mask: torch.Tensor | None = None
        self._mask_known = True  # whether the hooks know this micro-batch's mask
        self._refused: dict[str, str] = {}  # modules whose columns read NaN, and why
        self._problems: dict[str, str] = {}
        self._warned: set[str | tuple[str, str]] = set()  # layers (and units) warned about
        self._step = 0  # the due step whose forward the hooks see
        self._armed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Choose the modules, resolve their feature axes, count their calls and hook them.

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
        self._bias_axes = {n: self._unit_axis(n, named, pl_module) for n in activation_layers}
        self._unit_axes = {n: self._bias_axes[n] for n in self.unit_kinds}
        self.layers, self.activation_layers = layers, activation_layers
        hooked = tuple(dict.fromkeys(layers + activation_layers))
        self.calls, self._counted_by = _count_calls(pl_module, batch, {n: named[n] for n in hooked})
        self._columns = {n: _call_columns(n, self.calls.get(n, 1)) for n in hooked}
        self._calls_now = dict.fromkeys(hooked, 0)
        self._mask_rule = _mask_rule(self.mask, batch)
        self._refused = {}
        self._device = _device(pl_module)
        health = self._health_columns() if self.unit_health else {}
        series_columns = {
            NORM: self._columns_of(self.layers),
            BIAS: self._columns_of(self.activation_layers),
            NONFINITE: health.get(names.UNIT_NONFINITE, ()),
        }
        self._series_columns = {s: c for s, c in series_columns.items() if c}
        self._steps = _StepValues(self._series_columns)
        for layer in hooked:
            hook = self._hook(layer, axes.get(layer), layer in activation_layers)
            self._handles.append(named[layer].register_forward_hook(hook))
        self._report = {
            "layers": {
                n: {"class": type(named[n]).__name__, "feature_dim": a.dim, "rule": a.rule}
                for n, a in axes.items()
            },
            "found": {n: type(named[n]).__name__ for n in activation_layers},
            "expected_shift": {
                n: shift
                for n in activation_layers
                if (shift := expected_shift(named[n])) is not None
            },
            "unit_axes": {
                n: {"feature_dim": a.dim, "rule": a.rule} for n, a in self._unit_axes.items()
            },
            "looked_at": dict(Counter(type(m).__name__ for m in named.values()).most_common()),
        }
        self._announce_activations(len(named))
        self._check_ranks_agree(self._device)

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        """The norm and bias series of the modules setup chose; empty before setup."""
        if not self.layers:
            return {}
        norm_columns = self._columns_of(self.layers)
        norms = self._masked_view(standard_view(names.HIDDEN_NORMS, names.HIDDEN_NORM))
        groups = {
            names.HIDDEN_NORMS: {
                names.HIDDEN_NORM: SeriesSpec(
                    (len(norm_columns),), columns=norm_columns, view=norms
                )
            }
        }
        if self.activation_layers:
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

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        self._steps.clear()
        for extremes in self._extremes.values():
            extremes.clear()
        self._calls_now = dict.fromkeys(self._calls_now, 0)
        self._problems = {}
        self._step = step
        # The hooks see the first micro-batch's mask; a later micro-batch's is known only after
        # its forward (norms and biases wait for it; unit extremes cannot).
        self._hook_mask = self._batch_mask(batch)
        self._mask_known = True
        self._armed = True

    def on_micro_batch_end(self, trainer, pl_module, batch, outputs, step) -> None:
        if self._armed:
            self._close_micro_batch(batch)

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        """The step's rows.

        Raises:
            ProbeUnavailable: an output was no tensor, or lacked the feature axis it should have
                (on any rank).
        """
        if self._armed and any(self._calls_now.values()):  # driven without micro-batch ends
            self._close_micro_batch(batch)
        self._armed = False
        if not self.layers:
            return {}
        global_ = self.reduce == "global" and world.is_distributed()
        if self._problems and not global_:
            raise ProbeUnavailable(
                "HiddenStateNorms: "
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
            means = dict(zip(per_series, (_ratio(t, c) for t, c in zip(totals, columns))))
            if extremes:
                extremes = world.all_reduce(extremes, "max")
        else:
            means = {
                s: self._refused_as_nan(self._steps.means(s, c, device), c)
                for s, c in per_series.items()
            }
        norms, biases, nonfinite = (means.get(s) for s in (NORM, BIAS, NONFINITE))
        rows: Rows = {names.HIDDEN_NORMS: {names.HIDDEN_NORM: norms}}
        if self.activation_layers:
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
                    f"HiddenStateNorms: mask={self._mask_rule} returned a "
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

    def _record_units(self, layer: str, column: str, hidden: torch.Tensor) -> None:
        axis = self._unit_axes[layer]
        problem = (
            f"output of shape {tuple(hidden.shape)}: its unit axis {_TWO_D_ONLY}"
            if axis.rule == _TWO_D_ONLY and hidden.dim() != 2
            else "output has no batch axis"
            if hidden.dim() < 2
            else _axis_problem(hidden, hidden, axis)
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
                "HiddenStateNorms: the ranks counted different numbers of calls per forward "
                f"(from {-low:.0f} to {high:.0f} columns), so their sums cannot be reduced; "
                "set reduce='rank0'"
            )

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

    def _hook(self, layer: str, axis: _Axis | None, activation: bool):
        """The one forward hook of a recorded module: its norm (a layer), its bias (an
        activation), non-finite values and units, each into the column of this call."""
        checked: torch.Size | None = None  # the last output shape found right for the axis
        columns = self._columns[layer]
        nonfinite = self.unit_health
        units = layer in self.unit_kinds
        bias_axis = self._bias_axes.get(layer)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            nonlocal checked
            if not self._armed or in_extra_pass():  # not a probe's own extra forward
                return
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
            hidden = output if type(output) is torch.Tensor else _first_tensor(output)
            if axis is not None and (hidden is None or hidden.shape != checked):
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
            if hidden is None:
                self._problems.setdefault(layer, f"outputs a {type(output).__name__}, no tensor")
                return
            # Detached device tensors only: no .item(), so no host sync in the hot path. Each
            # value is kept per position (batch, tokens) until the micro-batch's mask is known.
            hidden = hidden.detach()
            feature_dim = axis.dim if axis is not None else _bias_dim(hidden, bias_axis)
            if axis is not None:
                norms = torch.linalg.vector_norm(hidden, dim=axis.dim, dtype=torch.float32)
                self._steps.pending[NORM][column].append(norms)
            if activation:
                bias = _per_position_mean(hidden, _bias_dim(hidden, bias_axis))
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
    return (
        isinstance(module, ACTIVATION_TYPES)
        or type(module).__name__.lower() in ACTIVATIONS
        or is_hf_activation(module)
    )


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


#: The per-position series a step accumulates, as :class:`_StepValues` keys.
NORM, BIAS, NONFINITE = "norm", "bias", "nonfinite"


class _StepValues:
    """A due step's per-position values (norms, means, non-finite flags), per series and
    column: those of the micro-batch in flight, and those of the micro-batches closed, as
    sums and counts over their real positions."""

    def __init__(self, columns: Mapping[str, Sequence[str]]) -> None:
        # One list per series and column for the whole fit, emptied at each due step: the
        # hooks append without building anything.
        self.pending = {s: {c: [] for c in cs} for s, cs in columns.items()}
        # Closed without a mask: kept whole, so the usual step is one stack and one mean.
        self.unmasked = {s: {c: [] for c in cs} for s, cs in columns.items()}
        self.masked: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def clear(self) -> None:
        for lists in (*self.pending.values(), *self.unmasked.values()):
            for values in lists.values():
                values.clear()
        self.masked = {}

    def close(self, mask: torch.Tensor | None) -> dict[str, str]:
        """Close the micro-batch with its mask of real positions (None: all); the columns
        whose values do not line up with the mask, and why."""
        problems: dict[str, str] = {}
        for series, columns in self.pending.items():
            for column, values in columns.items():
                if mask is None:
                    self.unmasked[series][column].extend(values)
                    values.clear()
                    continue
                for value in values:
                    weights = position_weights(value.shape, mask)
                    if isinstance(weights, str):
                        problems[column] = weights
                    elif weights is None:
                        self.unmasked[series][column].append(value)
                    else:
                        kept = torch.where(weights, value, 0).sum(dtype=torch.float32)
                        count = weights.sum(dtype=torch.float32) * (value.numel() / weights.numel())
                        self.masked.setdefault(series, {}).setdefault(column, []).append(
                            (kept, count)
                        )
                values.clear()
        return problems

    def means(self, series: str, columns: Sequence[str], device: torch.device) -> torch.Tensor:
        """Each column's mean over its real positions (NaN for a column without values)."""
        calls = [self.unmasked.get(series, {}).get(c, ()) for c in columns]
        if series not in self.masked and all(len(c) == 1 for c in calls):
            shape = calls[0][0].shape
            if all(c[0].shape == shape for c in calls):  # the usual step: one op per series
                stacked = torch.stack([c[0] for c in calls])
                # Norms of 1-D outputs are scalars already (a mean over no dims would reduce
                # them all). (An int dim costs half what a tuple of dims does.)
                return stacked.flatten(1).mean(dim=1) if stacked.dim() > 1 else stacked
        return _ratio(self.totals(series, columns, device), columns)

    def totals(self, series: str, columns: Sequence[str], device: torch.device) -> torch.Tensor:
        """Each column's sum, then each column's count: one (2 × columns,) float32 tensor."""
        unmasked, masked = self.unmasked.get(series, {}), self.masked.get(series, {})
        sums, counts = [], []
        zero = torch.zeros((), device=device)
        for column in columns:
            whole, parts = unmasked.get(column, ()), masked.get(column, ())
            sums.append(
                sum([v.sum(dtype=torch.float32) for v in whole] + [s for s, _ in parts], zero)
            )
            counts.append(sum([c for _, c in parts], zero) + float(sum(v.numel() for v in whole)))
        return torch.cat([torch.stack(sums), torch.stack(counts)]).float()


def position_weights(shape: torch.Size, mask: torch.Tensor) -> torch.Tensor | None | str:
    """Which entries of a per-position value of ``shape`` are real by ``mask`` (batch,
    positions): a bool tensor broadcastable to ``shape``; None where the value has no
    positions beyond the batch (a pooled output has no padding); or why they do not line up."""
    m = tuple(mask.shape)
    if tuple(shape[: len(m)]) == m:
        return mask.reshape(*m, *([1] * (len(shape) - len(m))))
    if len(shape) < len(m) and tuple(shape) == m[: len(shape)]:
        return None
    return (
        f"values per position of shape {tuple(shape)} do not start with the mask's shape {m} "
        "(batch, positions)"
    )


def _count_calls(
    pl_module: nn.Module, batch: Any, modules: Mapping[str, nn.Module]
) -> tuple[dict[str, int], str]:
    """How often one forward calls each module (a shared ReLU, one dropout used twice), from
    one loss pass on the first batch, and how it was counted.

    Columns must be declared before recording starts, so the count is taken before the first
    training forward: by the loss rule, in train mode, with gradients off, inside
    :func:`side_effect_free` (the pass leaves the run as it was).
    """
    if batch is None:
        return {}, "not counted (no batch at setup): one column per module"
    counts = dict.fromkeys(modules, 0)

    def counter(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            counts[name] += 1

        return hook

    handles = [m.register_forward_hook(counter(n)) for n, m in modules.items()]
    try:
        with side_effect_free(pl_module, "train"), torch.no_grad():
            module_loss(pl_module, batch)
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


def _mask_rule(mask: MaskRule, batch: Any) -> str:
    """Which positions count, in words, as stored in the run file and shown in the views."""
    if mask is False:
        return "off"
    if callable(mask):
        return f"mask={getattr(mask, '__qualname__', type(mask).__qualname__)}"
    if batch is None:
        return "batch['attention_mask'] where a dict batch has one"
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return "batch['attention_mask']"
    return "none: every position (the first batch has no attention_mask)"


def _bias_dim(hidden: torch.Tensor, axis: _Axis | None) -> int:
    ndim = hidden.dim()
    return axis.dim if axis is not None and -ndim <= axis.dim < ndim else -1


def _per_position_mean(hidden: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean across features at each position (the activation bias before averaging)."""
    if hidden.dim() < 2:
        return hidden.float()
    return hidden.mean(dim=dim, dtype=torch.float32)


def _ratio(totals: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """Sums over counts per column (0/0: a module not called reads NaN)."""
    return totals[: len(columns)] / totals[len(columns) :]


def _device(module: Any) -> torch.device:
    parameter = next(module.parameters(), None) if isinstance(module, nn.Module) else None
    return parameter.device if parameter is not None else torch.device("cpu")


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
