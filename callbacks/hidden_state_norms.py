"""Hidden-state norms and activation bias, read from forward hooks during due training steps."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatch
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from dynamics.activations import ACTIVATIONS, ShiftedActivation
from dynamics.callbacks.probe import Probe, Rows, SeriesSpec
from dynamics.isolation import in_extra_pass
from dynamics.store import View, names

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
)


class HiddenStateNorms(Probe):
    """Mean L2 norm of chosen modules' outputs, and the activation bias of activation modules.

    Per chosen module and due step: the L2 norm of the output over its last (feature) axis,
    averaged over every other axis (batch, tokens) and over every call in the step (gradient
    accumulation). Per activation module: the mean of its output across neurons, averaged
    likewise — the paper's activation bias.

    Module choice, when neither ``modules`` nor ``types`` is given: the residual blocks, found as
    the longest ``ModuleList``/``Sequential`` whose children all share one class (a ResidualMLP's
    ``blocks``, a GPT's ``h``, a ViT's ``blocks``); failing that, the module's direct children.

    Args:
        modules: glob patterns on qualified module names (e.g. ``"student.blocks.*"``).
        types: module classes to record.
        activations: also record the activation bias of every activation module.
        every_n_steps: recording period in optimizer steps.
    """

    name = "hidden"

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        types: Sequence[type[nn.Module]] | None = None,
        activations: bool = True,
        every_n_steps: int = 1,
    ) -> None:
        super().__init__(every_n_steps)
        self.patterns = tuple(modules or ())
        self.types = tuple(types or ())
        self.activations = activations
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._norms: dict[str, list[torch.Tensor]] = {}
        self._biases: dict[str, list[torch.Tensor]] = {}
        self._armed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.teardown()
        self.layers = _choose_modules(pl_module, self.patterns, self.types)
        if not self.layers:
            raise ValueError("HiddenStateNorms matched no module; check `modules`/`types`")
        named = dict(pl_module.named_modules())
        self.activation_layers = (
            [n for n, m in named.items() if _is_activation(m)] if self.activations else []
        )
        for layer in self.layers:
            self._handles.append(named[layer].register_forward_hook(self._norm_hook(layer)))
        for layer in self.activation_layers:
            self._handles.append(named[layer].register_forward_hook(self._bias_hook(layer)))

    def series(self) -> dict[str, dict[str, SeriesSpec]]:
        norms = View("panels", "Hidden-state norm per layer", "mean ‖h‖")
        groups = {
            names.HIDDEN_NORMS: {
                names.HIDDEN_NORM: SeriesSpec((len(self.layers),), columns=self.layers, view=norms)
            }
        }
        if self.activation_layers:
            n = len(self.activation_layers)
            bias = View("panels", "Activation bias per layer (mean post-activation)", "mean φ(z)")
            groups[names.ACTIVATION_BIAS] = {
                names.ACTIVATION_MEAN: SeriesSpec(
                    (n,), columns=tuple(self.activation_layers), view=bias
                )
            }
        return groups

    def on_step_start(self, trainer, pl_module, batch, step) -> None:
        self._norms = {layer: [] for layer in self.layers}
        self._biases = {layer: [] for layer in self.activation_layers}
        self._armed = True

    def on_step_end(self, trainer, pl_module, batch, outputs, step) -> Rows:
        self._armed = False
        rows: Rows = {names.HIDDEN_NORMS: {names.HIDDEN_NORM: _means(self._norms, self.layers)}}
        if self.activation_layers:
            biases = _means(self._biases, self.activation_layers)
            rows[names.ACTIVATION_BIAS] = {names.ACTIVATION_MEAN: biases}
        return rows

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False

    def _norm_hook(self, layer: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._armed and not in_extra_pass():  # not a probe's own extra forward
                # Detached device tensors only: no .item(), so no host sync in the hot path.
                hidden = _first_tensor(output).detach()
                norms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
                self._norms[layer].append(norms.mean())

        return hook

    def _bias_hook(self, layer: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._armed and not in_extra_pass():  # not a probe's own extra forward
                self._biases[layer].append(_first_tensor(output).detach().mean(dtype=torch.float32))

        return hook


def _choose_modules(
    root: nn.Module, patterns: tuple[str, ...], types: tuple[type[nn.Module], ...]
) -> tuple[str, ...]:
    named = [(n, m) for n, m in root.named_modules() if n]
    if patterns or types:
        return tuple(
            n
            for n, m in named
            if any(fnmatch(n, p) for p in patterns) or (types and isinstance(m, types))
        )
    stacks = [
        (n, list(m.named_children()))
        for n, m in named
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
    return tuple(n for n, _ in root.named_children())


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, ACTIVATION_TYPES) or type(module).__name__.lower() in ACTIVATIONS


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot read a hidden state from a {type(output).__name__} output")


def _means(values: dict[str, list[torch.Tensor]], layers: Sequence[str]) -> torch.Tensor:
    # A layer not called in this step (a branch not taken) reads NaN rather than a made-up 0.
    # Rows stay on the device; the writer copies a whole block to the host at once.
    device = next((v[0].device for v in values.values() if v), torch.device("cpu"))
    nan = torch.full((), float("nan"), device=device)
    # sum/len rather than stack+mean: one op for the usual single call per step.
    return torch.stack([sum(values[k]) / len(values[k]) if values[k] else nan for k in layers])
