"""How much of the network's output its hidden states' activation-bias component carries.

The paper (seed 002, §3.2, Fig. 5) splits a hidden state h into its activation-bias component,
the mean of h across its features times the all-ones direction, and the remainder, and decodes
each part alone through the rest of the network: early in training the bias-only decode of an
unshifted autoencoder shows the images, later it departs from the full reconstruction.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.output_axes import kind_dim
from dynamics.callbacks.probe import (
    Probe,
    ProbeUnavailable,
    Rows,
    SeriesSpec,
    expected_steps,
)
from dynamics.callbacks.probe_loss import ProbeLoss
from dynamics.params.globs import glob_any, glob_match, matched
from dynamics.passes.isolation import Mode, side_effect_free
from dynamics.store import View, names

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: Losses that compare the prediction with a target of the same kind (a value to reproduce):
#: for these the decodes are also compared with the target directly.
SAME_SPACE_LOSSES = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)
#: Losses whose target lives elsewhere than the prediction (class indices, probabilities against
#: logits): cosine or relative error to the target would compare unlike things, so only the
#: decode's loss measures it against the target.
OTHER_LOSSES = (
    F.cross_entropy,
    F.nll_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.kl_div,
    F.poisson_nll_loss,
    F.gaussian_nll_loss,
)
#: The decodes: each layer's hidden state replaced by one part of it.
PARTS = ("bias", "remainder")


@dataclass(frozen=True)
class _LossCall:
    """What the module's loss function was called with in one pass, and what it returned."""

    function: str
    prediction: torch.Tensor
    target: torch.Tensor
    loss: torch.Tensor


class _LossCalls(TorchFunctionMode):
    """Records every call of a known loss function (``F.mse_loss``, ``nn.CrossEntropyLoss``, …).

    The loss rule knows how a batch becomes a loss, not which tensors are the network's output
    and target; the loss function's arguments are exactly those. Calls nested inside a loss
    function (``cross_entropy`` calling ``nll_loss``) are not seen: a mode is off while it
    handles a call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_LossCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in SAME_SPACE_LOSSES or func in OTHER_LOSSES:
            bound = inspect.signature(func).bind(*args, **(kwargs or {})).arguments
            self.calls.append(_LossCall(func.__name__, bound["input"], bound["target"], result))
        return result


class BiasComponent(Probe):
    """Decodes of each chosen layer's activation-bias component and remainder, compared with the
    full output and with the target.

    What it records, cost, when it steps aside and pitfalls: ``docs/probes/bias_component.md``.

    Example::

        DynamicsRecorder("run.h5", probes=[BiasComponent(layers=["encoder.*"], every_n_steps=100)])

    Args:
        layers: module-name patterns (as ``named_modules()``; ``*`` one segment, ``**`` any
            depth) of the layers whose output is split.
        every_n_steps: recording period.
        feature_dim: the feature axis of every layer's output.
        feature_dims: ``{pattern: axis}``, overriding ``feature_dim`` per layer.
        batch: the probe batch; default: a copy of the fit's first training batch.
        mode: ``"eval"`` (default: dropout off, BatchNorm on running statistics, so a decode is
            a function of θ alone) or ``"train"``.
        examples: images kept per decode.
        image_rows: most image rows stored.
        image_budget_mb: bytes (MiB) for image rows.
    """

    name = names.BIAS_COMPONENT

    def __init__(
        self,
        layers: Sequence[str],
        every_n_steps: int = 1,
        feature_dim: int | None = None,
        feature_dims: Mapping[str, int] | None = None,
        batch: Any = None,
        mode: Mode = "eval",
        examples: int = 4,
        image_rows: int = 16,
        image_budget_mb: float = 2.0,
    ) -> None:
        super().__init__(every_n_steps)
        if isinstance(layers, str) or not layers:
            raise ValueError(f"layers must be a non-empty list of name patterns, got {layers!r}")
        if examples < 1 or image_rows < 0 or image_budget_mb < 0:
            raise ValueError("examples must be >= 1, image_rows and image_budget_mb >= 0")
        self.patterns = tuple(layers)
        self.feature_dim = feature_dim
        self.feature_dims = dict(feature_dims or {})
        self.examples = examples
        self.image_rows = image_rows
        self.image_budget_mb = image_budget_mb
        self._loss = ProbeLoss("BiasComponent", mode, batch)
        self.layers: tuple[str, ...] = ()
        self._classes: dict[str, str] = {}  # of each layer, for the settings
        self._axes: dict[str, tuple[int, str]] = {}
        self._function = ""
        self._same_space = False
        self._image_shape: tuple[int, ...] | None = None
        self._image_steps: frozenset[int] = frozenset()
        self._target_images: np.ndarray | None = None
        self._rows: Rows = {}

    def setup(self, fit: Fit, pl_module: pl.LightningModule, batch: Any) -> None:
        """Find the layers, keep the probe batch, and make one full pass to find the output
        and target.

        Raises:
            ProbeUnavailable: a pattern matches no module; the loss rule gives no loss; the
                loss calls no known loss function, or several; a layer is not called by the
                loss pass or outputs no tensor, or lacks its feature axis.
        """
        self._loss.setup(fit, pl_module, batch)
        with self._loss.whole(pl_module) as module:  # under sharding a plain copy, unwrapped
            self._find_layers(fit, module)

    def _find_layers(self, fit: Fit, pl_module: pl.LightningModule) -> None:
        named = {n: m for n, m in pl_module.named_modules() if n}
        unmatched = [p for p in self.patterns if not matched(p, named)]
        unmatched += [f"feature_dims {p!r}" for p in self.feature_dims if not matched(p, named)]
        if unmatched:
            some = ", ".join(list(named)[:8])
            raise ProbeUnavailable(
                f"BiasComponent: {', '.join(map(repr, unmatched))} matched no module of "
                f"{type(pl_module).__name__}, whose modules are named like {some}"
            )
        # Containers without a forward (ModuleList) are never called: nothing to replace.
        self.layers = tuple(
            n
            for n, m in named.items()
            if glob_any(n, self.patterns) and type(m).forward is not nn.Module.forward
        )
        self._axes = {n: self._axis(n, named) for n in self.layers}
        call, shapes = self._pass(pl_module, None, "full")
        # A module called more than once a pass (one ReLU shared by several layers) would have
        # every call replaced at once: its decodes split no single hidden state.
        reused = {n: len(shapes[n]) for n in self.layers if len(shapes.get(n, ())) > 1}
        for layer, calls in reused.items():
            self.note(
                fit.global_step if fit is not None else 0,
                f"BiasComponent leaves out {layer}: {layer} is called {calls} times in one "
                "forward, so replacing its output would split several hidden states at once",
            )
        self.layers = tuple(n for n in self.layers if n not in reused)
        if not self.layers:
            raise ProbeUnavailable(
                f"BiasComponent: every layer is called more than once a forward ({reused})"
            )
        self._classes = {n: type(named[n]).__name__ for n in self.layers}
        self._axes = {n: self._axes[n] for n in self.layers}
        for layer in self.layers:
            shape = shapes[layer][0] if layer in shapes else None
            dim, rule = self._axes[layer]
            if shape is None:
                raise ProbeUnavailable(
                    f"BiasComponent: layer {layer} is not called when the loss is computed, so "
                    "its output cannot be replaced"
                )
            if len(shape) < 2 or not -len(shape) <= dim < len(shape):
                raise ProbeUnavailable(
                    f"BiasComponent: layer {layer} outputs shape {shape}, which has no feature "
                    f"axis {dim} ({rule}) beside a batch axis; set feature_dims"
                )
        self._function = call.function
        self._same_space = call.function in {f.__name__ for f in SAME_SPACE_LOSSES}
        self._plan_images(fit, call)

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        if not self.layers:
            return {}

        def per_layer(title: str, label: str) -> SeriesSpec:
            return SeriesSpec(
                (len(self.layers),), columns=self.layers, view=View("panels", title, label)
            )

        def scalar(title: str, label: str) -> SeriesSpec:
            return SeriesSpec(view=View("scalar", title, label))

        # Short titles: a panel's title is "<title>: <layer>".
        group = {
            "bias_share": per_layer("Bias share ‖h̄·1‖²/‖h‖²", "share"),
            "full_loss": scalar(f"Full decode: {self._function}", "loss"),
        }
        for part in PARTS:
            what = f"{part.capitalize()}-only"
            group[f"{part}_cos_full"] = per_layer(f"{what}: cos to full", "cos")
            group[f"{part}_relerr_full"] = per_layer(f"{what}: rel. error to full", "‖d − f‖/‖f‖")
            group[f"{part}_loss"] = per_layer(f"{what}: {self._function}", "loss")
        if self._same_space:
            group["full_cos_target"] = scalar("Full decode: cos to target", "cos")
            group["full_corr_target"] = scalar("Full decode: corr. with target", "corr")
            group["full_relerr_target"] = scalar("Full decode: rel. error to target", "‖f − y‖/‖y‖")
            for part in PARTS:
                what = f"{part.capitalize()}-only"
                group[f"{part}_cos_target"] = per_layer(f"{what}: cos to target", "cos")
                group[f"{part}_corr_target"] = per_layer(f"{what}: corr. with target", "corr")
                group[f"{part}_relerr_target"] = per_layer(
                    f"{what}: rel. error to target", "‖d − y‖/‖y‖"
                )
        groups = {names.BIAS_COMPONENT: group}
        if self._image_steps:
            groups[names.BIAS_COMPONENT_IMAGES] = {
                names.BIAS_COMPONENT_DECODES: SeriesSpec(self._image_row_shape())
            }
        return groups

    def vectors(self) -> dict[str, SeriesSpec]:
        if self._target_images is None:
            return {}
        return {names.BIAS_COMPONENT_TARGET: SeriesSpec(self._target_images.shape)}

    def initial_vectors(self) -> dict[str, np.ndarray]:
        if self._target_images is None:
            return {}
        return {names.BIAS_COMPONENT_TARGET: self._target_images}

    def settings(self) -> dict[str, Any]:
        return {
            "layers": {
                n: {"class": self._classes[n], "feature_dim": d, "rule": r}
                for n, (d, r) in self._axes.items()
            },
            "patterns": list(self.patterns),
            **self._loss.settings(),
            "loss_function": self._function,
            "target_similarity": (
                "cosine and relative error to the target, and the loss"
                if self._same_space
                else f"the loss only ({self._function} compares the output with a target "
                "of another kind, so cosine and relative error to it are not defined)"
            ),
            "bias_component": "mean across the feature axis times the all-ones direction",
            "cosine": "per example (first axis of the output), averaged over the batch; "
            "over the whole batch as one vector when each example has one value",
            "correlation": "cosine of each example's values minus their mean, averaged "
            "(of the batch's values minus their mean with one value per example)",
            "relative_error": "‖d − r‖ / ‖r‖ over the whole batch",
            "image_steps": sorted(self._image_steps),
            "examples": self.examples if self._image_steps else 0,
        }

    def on_step_start(self, fit, pl_module, batch, step) -> None:
        # Measured before the step's forward, so the row describes θ_step (the contract).
        with self._loss.whole(pl_module) as module:
            self._rows = self._measure(module, step)

    def on_step_end(self, fit, pl_module, batch, outputs, step) -> Rows:
        rows, self._rows = self._rows, {}
        return rows

    def state_dict(self) -> dict[str, Any]:
        return self._loss.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss.load_state_dict(state)

    def _measure(self, pl_module: pl.LightningModule, step: int) -> Rows:
        full, shares = self._pass(pl_module, None, "share")
        row: dict[str, torch.Tensor] = {
            "bias_share": torch.stack([shares[n] for n in self.layers]),
            "full_loss": full.loss.detach().float().reshape(()),
        }
        if self._same_space:
            row["full_cos_target"] = _cosine(full.prediction, full.target)
            row["full_corr_target"] = _cosine(full.prediction, full.target, centred=True)
            row["full_relerr_target"] = _relative_error(full.prediction, full.target)
        decodes = {}
        for part in PARTS:
            calls = {layer: self._pass(pl_module, layer, part)[0] for layer in self.layers}
            decodes[part] = calls
            pairs = [(c.prediction, full.prediction) for c in calls.values()]
            row[f"{part}_cos_full"] = torch.stack([_cosine(d, f) for d, f in pairs])
            row[f"{part}_relerr_full"] = torch.stack([_relative_error(d, f) for d, f in pairs])
            row[f"{part}_loss"] = torch.stack(
                [c.loss.detach().float().reshape(()) for c in calls.values()]
            )
            if self._same_space:
                targets = [(c.prediction, c.target) for c in calls.values()]
                row[f"{part}_cos_target"] = torch.stack([_cosine(d, y) for d, y in targets])
                row[f"{part}_corr_target"] = torch.stack(
                    [_cosine(d, y, centred=True) for d, y in targets]
                )
                row[f"{part}_relerr_target"] = torch.stack(
                    [_relative_error(d, y) for d, y in targets]
                )
        rows: Rows = {names.BIAS_COMPONENT: row}
        if step in self._image_steps:
            k = self.examples
            grid = [
                torch.stack(
                    [full.prediction[:k]] + [decodes[part][layer].prediction[:k] for part in PARTS]
                )
                for layer in self.layers
            ]
            rows[names.BIAS_COMPONENT_IMAGES] = {
                names.BIAS_COMPONENT_DECODES: torch.stack(grid).float()
            }
        return rows

    def _pass(
        self, pl_module: pl.LightningModule, layer: str | None, part: str
    ) -> tuple[_LossCall, dict[str, Any]]:
        """One loss pass with ``layer``'s output replaced by its ``part`` (None: unchanged).

        With ``part`` ``"full"`` the second value is each layer's output shapes (one per call),
        with ``"share"`` its bias share; otherwise empty.
        """
        seen: dict[str, Any] = {}
        handles = []

        def observe(name: str, dim: int):
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if not isinstance(output, torch.Tensor):
                    raise ProbeUnavailable(
                        f"BiasComponent: layer {name} ({type(module).__name__}) outputs a "
                        f"{type(output).__name__}, not a tensor, so it cannot be split"
                    )
                if part == "share":
                    seen[name] = _bias_share(output, dim)
                else:
                    seen.setdefault(name, []).append(tuple(output.shape))

            return hook

        def replace(dim: int):
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
                bias = output.mean(dim=dim, keepdim=True).expand_as(output)
                return bias if part == "bias" else output - bias

            return hook

        try:
            if layer is None:
                for name in self.layers:
                    hook = observe(name, self._axes[name][0])
                    handles.append(pl_module.get_submodule(name).register_forward_hook(hook))
            else:
                hook = replace(self._axes[layer][0])
                handles.append(pl_module.get_submodule(layer).register_forward_hook(hook))
            with _loss_calls(pl_module, self._loss.mode) as calls:
                self._loss.rule(pl_module, self._loss.batch)
        finally:
            for handle in handles:
                handle.remove()
        if len(calls) != 1:
            found = ", ".join(c.function for c in calls) or "none"
            known = ", ".join(f.__name__ for f in (*SAME_SPACE_LOSSES, *OTHER_LOSSES))
            raise ProbeUnavailable(
                f"BiasComponent: the loss of {type(pl_module).__name__} calls {found} of the "
                f"loss functions it knows ({known}); it needs exactly one, whose first two "
                "arguments are the network's output and the target"
            )
        return calls[0], seen

    def _axis(self, layer: str, named: Mapping[str, nn.Module]) -> tuple[int, str]:
        pattern = next((p for p in self.feature_dims if glob_match(layer, p)), None)
        if pattern is not None:
            return self.feature_dims[pattern], f"feature_dims[{pattern!r}]"
        if self.feature_dim is not None:
            return self.feature_dim, "feature_dim"
        module = named[layer]
        inside = [(n, m) for n, m in module.named_modules() if kind_dim(m) is not None]
        if inside:
            sub, last = inside[-1]
            where = "its class" if not sub else f"its last known submodule {sub}"
            return kind_dim(last), f"{where} ({type(last).__name__})"
        order = list(named)
        before = [n for n in order[: order.index(layer)] if kind_dim(named[n]) is not None]
        if before:
            source = named[before[-1]]
            return kind_dim(source), (
                f"the known module registered before it, {before[-1]} ({type(source).__name__})"
            )
        return -1, "no known module before it: last axis assumed"

    def _plan_images(self, fit: Fit, call: _LossCall) -> None:
        shape = tuple(call.prediction.shape)
        imagelike = len(shape) == 4 and shape[1] in (1, 3)
        if not (imagelike and self._same_space and call.target.shape == call.prediction.shape):
            self._image_steps = frozenset()
            return
        self._image_shape = shape[1:]
        self.examples = min(self.examples, shape[0])
        row_bytes = 4 * math.prod(self._image_row_shape())
        capacity = min(self.image_rows, int(self.image_budget_mb * 2**20 // row_bytes))
        expected = expected_steps(fit)
        if capacity < 2 or not 0 < expected < math.inf:
            why = (
                "the run's length is unknown"
                if capacity >= 2
                else f"image_budget_mb and image_rows hold {capacity} rows of {row_bytes:,} bytes"
            )
            self.note(fit.global_step, f"BiasComponent stores no decoded images: {why}")
            self._image_steps = frozenset()
            return
        self._image_steps = image_steps(int(expected), self.every_n_steps, capacity)
        target = call.target[: self.examples].detach().float().cpu().numpy()
        self._target_images = np.ascontiguousarray(target)

    def _image_row_shape(self) -> tuple[int, ...]:
        return (len(self.layers), 1 + len(PARTS), self.examples, *self._image_shape)


def image_steps(steps: int, every: int, rows: int) -> frozenset[int]:
    """At most ``rows`` due steps (multiples of ``every`` below ``steps``) from 0 to the last,
    spaced geometrically, so that early training, where the bias component is used, is dense."""
    last = (steps - 1) // every * every
    if rows < 2 or last == 0:
        return frozenset({0})
    spaced = np.geomspace(every, last, rows - 1) if last > every else np.array([every])
    return frozenset({0, *(int(s) // every * every for s in spaced), last})


@contextmanager
def _loss_calls(module: nn.Module, mode: Mode):
    calls = _LossCalls()
    with side_effect_free(module, mode), torch.no_grad(), calls:
        yield calls.calls


def _rows(x: torch.Tensor) -> torch.Tensor:
    """One row per example; with one value per example (an (N,) or (N, 1) output) a row's
    cosine would only be the sign agreement, so the batch is one row."""
    x = x.detach().float()
    if x.dim() >= 2 and x[0].numel() > 1:
        return x.reshape(x.shape[0], -1)
    return x.reshape(1, -1)


def _cosine(a: torch.Tensor, b: torch.Tensor, centred: bool = False) -> torch.Tensor:
    """Cosine of each example's flattened values, averaged; NaN where a norm is zero.
    ``centred``: of the values minus each example's mean (Pearson's correlation)."""
    a, b = _rows(a), _rows(b)
    if centred:
        a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    norms = torch.linalg.vector_norm(a, dim=1) * torch.linalg.vector_norm(b, dim=1)
    return ((a * b).sum(1) / norms).mean()  # 0/0 -> NaN: no direction, no cosine


def _relative_error(a: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    a, reference = a.detach().float(), reference.detach().float()
    return torch.linalg.vector_norm(a - reference) / torch.linalg.vector_norm(reference)


def _bias_share(h: torch.Tensor, dim: int) -> torch.Tensor:
    h = h.detach().float()
    bias = h.mean(dim=dim, keepdim=True).expand_as(h)
    return bias.square().sum() / h.square().sum()
