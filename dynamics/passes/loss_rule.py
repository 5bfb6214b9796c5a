"""The one rule by which every probe and every offline tool finds a module's loss.

A module that defines ``dynamics_loss(batch)`` is asked for it. Otherwise its ``training_step``
is called with logging switched off, and the loss is its tensor output or ``output["loss"]`` —
unless the module optimizes manually (``automatic_optimization = False``): such a training step
runs ``manual_backward`` and steps the optimizers and schedulers itself, so calling it would
train the model. A manually optimized module gives a loss only through ``dynamics_loss``; without
it the rule refuses (:class:`LossUnavailable`) before any pass is made. Modules that Lightning
optimizes never have to change to be recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call

#: Where the rule takes a module's loss from.
LossSource = Literal["dynamics_loss", "training_step"]


class LossUnavailable(TypeError):
    """The module offers no loss the rule may take; the message says why and what to add."""


def loss_source(module: nn.Module) -> LossSource:
    """Where the rule takes ``module``'s loss from, decided without calling the module.

    Raises:
        LossUnavailable: if the module has no ``dynamics_loss`` and either has no
            ``training_step`` or optimizes manually.
    """
    if hasattr(module, "dynamics_loss"):
        return "dynamics_loss"
    name = type(module).__name__
    if not hasattr(module, "training_step"):
        raise LossUnavailable(f"{name} has neither dynamics_loss nor training_step")
    if not getattr(module, "automatic_optimization", True):
        raise LossUnavailable(
            f"{name} optimizes manually (automatic_optimization = False), so its training_step "
            "steps the optimizers and is never called for an extra pass; define "
            "dynamics_loss(batch) returning the loss to measure it"
        )
    return "training_step"


def module_loss(module: nn.Module, batch: Any, batch_idx: int = 0) -> torch.Tensor:
    """The scalar training loss of ``module`` on ``batch``, by the rule above.

    Example::

        loss = module_loss(module, batch)  # dynamics_loss(batch), else training_step's loss

    Raises:
        LossUnavailable: if :func:`loss_source` finds no loss the rule may take.
        TypeError: if the loss found is not a scalar tensor (from ``training_step``: neither a
            tensor nor a mapping with a ``"loss"`` tensor).
    """
    if loss_source(module) == "dynamics_loss":
        loss = module.dynamics_loss(batch)
    else:
        with _logging_suppressed(module), _needs_no_trainer(module):
            output = module.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{type(module).__name__}'s loss must be a scalar tensor, got {type(loss).__name__}"
        )
    return loss.reshape(())


@contextmanager
def _needs_no_trainer(module: nn.Module) -> Iterator[None]:
    """A training step that reads ``self.trainer`` (to log the learning rate, to step a
    scheduler) cannot run on a model rebuilt offline, which no Trainer holds: say what to add."""
    try:
        yield
    except RuntimeError as error:
        if "not attached to a `Trainer`" not in str(error):
            raise
        raise LossUnavailable(
            f"{type(module).__name__}.training_step uses self.trainer, and a model rebuilt "
            "offline is attached to no Trainer: define dynamics_loss(batch) returning the loss "
            "(the loss rule, docs/loss-rule.md)"
        ) from None


def loss_at(module: nn.Module, tensors: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """:func:`module_loss` with some of ``module``'s parameters and buffers replaced, by name,
    by ``tensors`` (:func:`torch.func.functional_call`): the loss as a function of them, for
    extra passes that differentiate it or move along a direction without touching the module.

    Example::

        tensors = dict(zip(layout.names, layout.split(theta)))
        loss = loss_at(module, tensors, batch)  # the module's own parameters untouched
    """
    prefixed = {f"module.{name}": tensor for name, tensor in tensors.items()}
    return functional_call(_LossOf(module), prefixed, (batch,))


class _LossOf(nn.Module):
    """The module's loss as a forward, so ``functional_call`` can substitute its tensors."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        return module_loss(self.module, batch)


@contextmanager
def _logging_suppressed(module: nn.Module) -> Iterator[None]:
    # Extra passes must not add points to the user's logs (or trip Lightning's checks on
    # logging from outside a loop), so log/log_dict are shadowed on the instance for the call.
    shadowed = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in shadowed:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in shadowed:
            delattr(module, name)
