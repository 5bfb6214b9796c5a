"""What a probe may know of the fit it records, whatever loop runs it.

The recorder's core (:class:`~dynamics.callbacks.recording.Recording`) and every probe take a
:class:`Fit` where they once took Lightning's ``Trainer``: the step, the accumulation, the rank,
the optimizers and schedulers, the logged metrics, the precision and the loss rule. Each loop
has its adapter: :class:`LightningFit` reads a Lightning ``Trainer``; the Hugging Face callback,
the accelerate and the plain-loop recorders fill a :class:`Fit` of their own
(:mod:`dynamics.integrations`). A probe written against these attributes runs under all of them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dynamics import world
from dynamics.passes.loss_rule import LIGHTNING_RULE, LossRule


@dataclass(frozen=True)
class Scheduled:
    """A learning-rate scheduler and when the loop steps it (``"step"`` or ``"epoch"``)."""

    scheduler: Any
    interval: str = "step"
    frequency: int = 1


class Fit:
    """The fit a recorder watches, as the probes see it; adapters set or override each field.

    Example::

        fit = Fit(model, loop="plain", optimizers=[optimizer], loss_rule=FunctionLoss(loss_fn))
        fit.global_step += 1  # the loop's adapter advances it after each optimizer step

    Attributes:
        module: the model being trained, unwrapped (no DDP or compile wrapper).
        loop: which loop runs the fit (``"lightning"``, ``"huggingface"``, ``"accelerate"``,
            ``"plain"``); stored in the fit's description, nowhere else.
        global_step: optimizer steps taken so far.
        optimizers: the loop's optimizers (unwrapped ``torch.optim`` objects).
        schedulers: the learning-rate schedulers, as :class:`Scheduled`.
        accumulate_grad_batches: micro-batches per optimizer step.
        metrics: the latest logged values, by name (what a validation run logged).
        validation_loaders: how many validation loaders the loop evaluates.
        precision: the training precision, in the loop's words (``"32-true"``, ``"bf16"``).
        expected_steps: the loop's estimate of the fit's optimizer steps (``nan``: unknown).
        wrapper: the module the loop's sharding wraps (FSDP1's root), else None.
        loss_rule: how an extra pass takes the module's loss on a batch.
        train_dataloader: the training loader(s), for the fit's description.
        datamodule: a Lightning ``LightningDataModule``, for the fit's description.
        evaluating: whether the loop is in a validation run now (forwards there are not
            training's).
        checkpoint: the checkpoint this fit resumed from, for messages (None: a new fit).
        restores_late: whether the loop restores the checkpoint only after the fit has started.
        versions: the loop's packages and their versions, stored with the run.
    """

    #: Whether the loop calls the probes' ``on_before_optimizer_step`` (after AMP unscaling,
    #: before gradient clipping): Lightning does; the other loops have no such point.
    calls_before_optimizer_step = False

    def __init__(
        self,
        module: nn.Module,
        loop: str,
        *,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        schedulers: Sequence[Scheduled] = (),
        accumulate_grad_batches: int = 1,
        precision: str = "32-true",
        expected_steps: float = math.nan,
        wrapper: nn.Module | None = None,
        loss_rule: LossRule = LIGHTNING_RULE,
        train_dataloader: Any = None,
        versions: Mapping[str, str] | None = None,
    ) -> None:
        self.module = module
        self.loop = loop
        self.global_step = 0
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.metrics: Mapping[str, Any] = {}
        self.validation_loaders = 1
        self.precision = precision
        self.expected_steps = expected_steps
        self.wrapper = wrapper
        self.loss_rule = loss_rule
        self.train_dataloader = train_dataloader
        self.datamodule: Any = None
        self.evaluating = False
        self.checkpoint: str | None = None
        self.restores_late = False
        self.versions = dict(versions or {})

    @property
    def global_rank(self) -> int:
        return world.rank()

    @property
    def world_size(self) -> int:
        return world.world_size()

    @property
    def is_global_zero(self) -> bool:
        return world.rank() == 0

    def micro_batch_loss(self, outputs: Any) -> torch.Tensor | None:
        """The unscaled loss a micro-batch's training step returned (``outputs`` is what the
        loop handed the recorder for it), or None if it returned none."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        return loss if isinstance(loss, torch.Tensor) else None

    def loss_sum(self, losses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
        """This rank's part of the step's training loss as ``(total, count)``: the step's loss
        is the sum of the ranks' totals over the sum of their counts. Here every micro-batch
        returned its own mean loss, so the step's is their mean. ``losses`` are detached
        float scalars (``TrainingLoss`` keeps them so)."""
        return torch.stack(list(losses)).sum(), float(len(losses))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Send ``metrics`` to the loop's loggers (none here: only Lightning's are reached)."""

    def model_edits(self) -> list[dict[str, Any]]:
        """What model-editing callbacks did to the module this fit (``dynamics_edit()``)."""
        return []

    def warn(self, message: str) -> None:
        """Warn on rank zero only: every rank sees the same probes and would say it again."""
        if self.is_global_zero:
            warnings.warn(message, UserWarning, stacklevel=3)


class LightningFit(Fit):
    """A Lightning ``Trainer``'s fit (either namespace), read from the Trainer as it goes."""

    calls_before_optimizer_step = True

    def __init__(self, trainer: Any, module: nn.Module, lightning: Any) -> None:
        self.trainer = trainer
        self.module = module
        self.loop = "lightning"
        self.loss_rule = LIGHTNING_RULE
        self.versions = {lightning.__name__: lightning.__version__}
        self.datamodule = getattr(trainer, "datamodule", None)

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    def global_rank(self) -> int:
        return self.trainer.global_rank

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.trainer.is_global_zero

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.trainer.optimizers

    @property
    def schedulers(self) -> list[Any]:
        return self.trainer.lr_scheduler_configs  # with .scheduler, .interval, .frequency

    @property
    def accumulate_grad_batches(self) -> int:
        return self.trainer.accumulate_grad_batches

    @property
    def metrics(self) -> Mapping[str, Any]:
        return self.trainer.callback_metrics

    @property
    def validation_loaders(self) -> int:
        return len(self.trainer.num_val_batches)

    @property
    def precision(self) -> str:
        return str(self.trainer.precision)

    @property
    def expected_steps(self) -> float:
        """Lightning's ``estimated_stepping_batches`` counts batches, but under manual
        optimization ``global_step`` advances at every optimizer's step: a GAN's two optimizers
        take two a batch, and a budget planned on batches would hold twice what it was given.
        There the estimate assumes each optimizer steps once a batch (within ``max_steps``)."""
        trainer = self.trainer
        steps = trainer.estimated_stepping_batches
        if self.module.automatic_optimization or not 0 < steps < math.inf:
            return steps
        steps *= max(1, len(trainer.optimizers))
        return min(steps, trainer.max_steps) if trainer.max_steps > 0 else steps

    @property
    def evaluating(self) -> bool:
        return self.trainer.validating or self.trainer.sanity_checking

    @property
    def wrapper(self) -> nn.Module | None:
        return getattr(self.trainer.strategy, "model", None)

    @property
    def train_dataloader(self) -> Any:
        return self.trainer.train_dataloader

    @property
    def checkpoint(self) -> str | None:
        return self.trainer.ckpt_path

    @property
    def restores_late(self) -> bool:
        return self.trainer.strategy.restore_checkpoint_after_setup

    def micro_batch_loss(self, outputs: Any) -> torch.Tensor | None:
        """Lightning divides what ``training_step`` returned by the accumulation count before
        handing it on (automatic optimization only): the count is multiplied back."""
        loss = super().micro_batch_loss(outputs)
        if loss is not None and self.module.automatic_optimization:
            loss = loss * self.trainer.accumulate_grad_batches
        return loss

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if metrics and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(dict(metrics), step=step)

    def model_edits(self) -> list[dict[str, Any]]:
        """The records of the callbacks that edited the module, in order, once each has
        completed an edit it deferred past ``configure_model`` (``complete_edit``), whatever
        the callbacks' order."""
        callbacks = self.trainer.callbacks
        for callback in callbacks:
            if callable(getattr(callback, "complete_edit", None)):
                callback.complete_edit(self.trainer.lightning_module)
        return [
            edit
            for callback in callbacks
            if callable(getattr(callback, "dynamics_edit", None))
            and (edit := callback.dynamics_edit()) is not None
        ]
