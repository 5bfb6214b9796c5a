"""The rules by which every probe and every offline tool finds a module's loss.

A fit recorded from Lightning follows the Lightning rule (:func:`module_loss`); other loops name
theirs (:class:`LossRule`): a Hugging Face model's ``model(**batch).loss``, or a function the user
gives. The run file keeps the rule (:meth:`LossRule.to_dict`), so offline tools take the loss the
probes took.

The Lightning rule: a module that defines ``dynamics_loss(batch)`` is asked for it. Otherwise its
``training_step`` is called with logging switched off, and the loss is its tensor output or
``output["loss"]`` — unless the module optimizes manually (``automatic_optimization = False``): such
a training step runs ``manual_backward`` and steps the optimizers and schedulers itself, so calling
it would train the model. A manually optimized module gives a loss only through ``dynamics_loss``;
without it the rule refuses (:class:`LossUnavailable`) before any pass is made. Modules that
Lightning optimizes never have to change to be recorded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
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


class LossRule:
    """How a module's scalar loss on a batch is taken; the default is the Lightning rule.

    Example::

        rule = OutputLoss()  # model(**batch).loss, a Hugging Face model's
        rule.check(model)
        loss = rule(model, batch)
    """

    def check(self, module: nn.Module) -> None:
        """Refuse, before any pass, a module this rule gives no loss for.

        Raises:
            LossUnavailable: saying why and what to add.
        """
        loss_source(module)

    def source(self, module: nn.Module) -> str:
        """Where the loss comes from, in words the run file stores (probe settings)."""
        return loss_source(module)

    def __call__(self, module: nn.Module, batch: Any) -> torch.Tensor:
        return module_loss(module, batch)

    def to_dict(self) -> dict[str, str]:
        """The rule as the run file keeps it; :func:`loss_rule_from_dict` reads it back."""
        return {"rule": "lightning"}


class OutputLoss(LossRule):
    """``module(**batch).loss`` for a mapping batch (``module(batch)`` otherwise): the loss a
    Hugging Face model computes from its ``labels``, as ``transformers.Trainer`` takes it.

    ``num_items_in_batch`` (the Trainer's token count over an accumulated step) is left out of
    the batch, so the loss is the batch's own mean.
    """

    def check(self, module: nn.Module) -> None:
        pass  # whether the output holds a loss is known only by calling it

    def source(self, module: nn.Module) -> str:
        return "model(**batch).loss"

    def __call__(self, module: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            output = module(**{k: v for k, v in batch.items() if k != "num_items_in_batch"})
        else:
            output = module(batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss = output[0]
        return _scalar(module, loss, "model(**batch).loss")

    def to_dict(self) -> dict[str, str]:
        return {"rule": "output"}


class FunctionLoss(LossRule):
    """``loss_fn(module, batch)``: a plain loop's own loss function.

    The run file keeps the function's import path when it has one (a module-level function),
    so offline tools can import it (trusted runs only); a lambda or a local function is kept by
    name, and the tools that need the loss again then say so.
    """

    def __init__(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    def check(self, module: nn.Module) -> None:
        pass

    def source(self, module: nn.Module) -> str:
        return f"loss_fn {function_path(self.loss_fn)}"

    def __call__(self, module: nn.Module, batch: Any) -> torch.Tensor:
        return _scalar(module, self.loss_fn(module, batch), "loss_fn(model, batch)")

    def to_dict(self) -> dict[str, str]:
        return {"rule": "function", "function": function_path(self.loss_fn)}


#: The rule of Lightning fits, and of run files that name none (written before rules were kept).
LIGHTNING_RULE = LossRule()


def function_path(function: Callable[..., Any]) -> str:
    """``module:qualname`` of a function; ``<locals>`` in it marks one no import can reach."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', '?')}"


def loss_rule_from_dict(
    record: Mapping[str, Any] | None, importable: Callable[[str], bool] = lambda module: False
) -> LossRule:
    """The rule a run file keeps (``None``: the Lightning rule, for files that keep none).

    A function rule imports its function only when ``importable(module_name)`` allows it (the
    caller's trust check): a run file is untrusted data.

    Raises:
        LossUnavailable: the record names an unknown rule, or a function that cannot or may not
            be imported.
    """
    rule = (record or {}).get("rule", "lightning")
    if rule == "lightning":
        return LIGHTNING_RULE
    if rule == "output":
        return OutputLoss()
    if rule == "none":
        raise LossUnavailable(
            "the run was recorded without a loss function (a plain loop's record() given no "
            "loss_fn), so its loss cannot be taken again offline"
        )
    if rule != "function":
        raise LossUnavailable(f"the run file names an unknown loss rule {rule!r}")
    path = str(record.get("function", ""))
    module_name, _, qualname = path.partition(":")
    if "<" in path or not module_name or not qualname:
        raise LossUnavailable(
            f"the run's loss function {path} cannot be imported (a lambda or a local "
            "function): pass a module-level function to record() to take its loss offline"
        )
    if not importable(module_name):
        raise LossUnavailable(
            f"the run's loss function {path} is outside the installed packages; trust the run "
            "(--trust) to import it"
        )
    function: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise LossUnavailable(f"the run's loss function {path} is not found")
    return FunctionLoss(function)


def _scalar(module: nn.Module, loss: Any, where: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{type(module).__name__}: {where} must be a scalar tensor, got {type(loss).__name__}"
        )
    return loss.reshape(())


def loss_at(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    batch: Any,
    rule: LossRule = LIGHTNING_RULE,
) -> torch.Tensor:
    """The loss by ``rule`` with some of ``module``'s parameters and buffers replaced, by name,
    by ``tensors`` (:func:`torch.func.functional_call`): the loss as a function of them, for
    extra passes that differentiate it or move along a direction without touching the module.

    Example::

        tensors = dict(zip(layout.names, layout.split(theta)))
        loss = loss_at(module, tensors, batch)  # the module's own parameters untouched
    """
    prefixed = {f"module.{name}": tensor for name, tensor in tensors.items()}
    return functional_call(_LossOf(module, rule), prefixed, (batch,))


class _LossOf(nn.Module):
    """The module's loss as a forward, so ``functional_call`` can substitute its tensors."""

    def __init__(self, module: nn.Module, rule: LossRule) -> None:
        super().__init__()
        self.module = module
        self.rule = rule

    def forward(self, batch: Any) -> torch.Tensor:
        return self.rule(self.module, batch)


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
