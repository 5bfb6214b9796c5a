"""The recorder for a training loop the user writes: plain PyTorch, or accelerate's.

:func:`record` returns a :class:`PlainRecorder`, a context manager around the loop; each
training batch runs inside ``with rec.batch(batch) as b:``, which brackets the forward (probes
arm their hooks before it, ``ParameterDisplacement`` copies θ before the optimizer steps) and
records the step once the optimizer has stepped. What it writes is the file a Lightning fit of
the same model, data and optimizer writes (:class:`~dynamics.callbacks.recording.Recording`);
only the fit's description says ``loop="plain"`` (or ``"accelerate"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from dynamics.callbacks.fit import Fit, Scheduled
from dynamics.callbacks.probe import Probe
from dynamics.callbacks.recording import Recording
from dynamics.passes.loss_rule import FunctionLoss, LossRule, LossUnavailable, OutputLoss
from dynamics.store import names

__all__ = ["MicroBatch", "PlainRecorder", "record"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def record(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    loss_fn: LossFn | None = None,
    probes: Sequence[Probe] | None = None,
    accumulate_grad_batches: int = 1,
    schedulers: Sequence[Any] = (),
    expected_steps: float | None = None,
    precision: str = "32-true",
    accelerator: Any = None,
    **recording_options: Any,
) -> PlainRecorder:
    """A recorder for a loop of your own, to use as a context manager around it.

    Example::

        with dynamics.record("runs/a.h5", model, optimizer, loss_fn=loss_fn) as rec:
            for batch in loader:
                with rec.batch(batch) as b:
                    loss = loss_fn(model, batch)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    b.loss(loss)

    Args:
        path: the run file to write.
        model: the model the loop trains; a ``DistributedDataParallel``, ``torch.compile`` or
            FSDP wrapper is seen through (the file describes the model inside).
        optimizer: the optimizer (or optimizers) the loop steps; their settings go into the
            fit's description, and a step is known to have ended when one of them steps.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, which probes making extra passes
            (``HessianSpectrum``, ``GradientPlane``) differentiate; without it a Hugging Face
            model's own ``model(**batch).loss``, and for any other model those probes step aside,
            saying so. A module-level function is kept by import path in the run file, so that
            offline tools can take the same loss.
        probes: what to record (default: ``TrainingLoss``, ``HiddenStateNorms``,
            ``ParameterDisplacement``, every step).
        accumulate_grad_batches: micro-batches per optimizer step; a step also ends early at a
            micro-batch in which the optimizer stepped (a shorter last step of an epoch).
        schedulers: learning-rate schedulers the loop steps once a step (or
            :class:`~dynamics.callbacks.fit.Scheduled`), for the fit's description.
        expected_steps: how many optimizer steps the loop will take, if known (probes with a
            budget plan on it).
        precision: the training precision, in your words (``"32-true"``, ``"bf16-mixed"``).
        accelerator: the ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``:
            its accumulation, its ``sync_gradients`` and its mixed precision are used.
        **recording_options: the :class:`~dynamics.callbacks.recording.Recording` arguments
            (``overwrite``, ``config``, ``run_name``, ``flush_interval_s``, ...).

    Raises:
        TypeError: an argument of the wrong kind (an optimizer prepared by accelerate without
            ``accelerator=``, a ``loss_fn`` that is not callable).
        ValueError: ``accumulate_grad_batches`` below 1.
    """
    return PlainRecorder(
        path,
        model,
        optimizer,
        loss_fn=loss_fn,
        probes=probes,
        accumulate_grad_batches=accumulate_grad_batches,
        schedulers=schedulers,
        expected_steps=expected_steps,
        precision=precision,
        accelerator=accelerator,
        **recording_options,
    )


class MicroBatch:
    """One training batch (a micro-batch under accumulation) inside ``with rec.batch(batch)``;
    hand it the batch's loss with :meth:`loss`."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.open = True

    def loss(self, loss: torch.Tensor) -> None:
        """The batch's own mean loss, unscaled (before any division by the accumulation
        count): what ``TrainingLoss`` records, averaged over a step's micro-batches.

        Raises:
            RuntimeError: after the ``with`` block ended, or given twice.
            TypeError: ``loss`` is not a scalar tensor.
        """
        if not self.open:
            raise RuntimeError("b.loss(loss) after its `with rec.batch(batch) as b:` block ended")
        if self.value is not None:
            raise RuntimeError("b.loss(loss) given twice for one batch")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"b.loss takes the scalar loss tensor, got {type(loss).__name__}")
        self.value = loss


class PlainRecorder(Recording):
    """The recorder of a loop the user writes; made by :func:`record`, whose arguments it takes.

    Use it as a context manager: entering it claims the run file (refusing one it cannot
    write, before any batch); each training batch runs in ``with rec.batch(batch) as b:``;
    leaving it ends the file, finished, or crashed with the exception that left the block.

    Example::

        rec = dynamics.record("runs/a.h5", model, optimizer, loss_fn=loss_fn)
        if checkpoint is not None:  # resume: the same run file continues
            rec.load_state_dict(checkpoint["dynamics"])
        with rec:
            for batch in loader:
                with rec.batch(batch) as b:
                    ...
            torch.save({"model": ..., "dynamics": rec.state_dict()}, "last.ckpt")
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        loss_fn: LossFn | None = None,
        probes: Sequence[Probe] | None = None,
        accumulate_grad_batches: int = 1,
        schedulers: Sequence[Any] = (),
        expected_steps: float | None = None,
        precision: str = "32-true",
        accelerator: Any = None,
        **recording_options: Any,
    ) -> None:
        super().__init__(path, probes, **recording_options)
        optimizers = _listed(optimizer)
        schedulers = list(schedulers)
        loop, versions = "plain", {}
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
            optimizers = [getattr(o, "optimizer", o) for o in optimizers]
            schedulers = [getattr(s, "scheduler", s) for s in schedulers]
            accumulate_grad_batches = accelerator.gradient_accumulation_steps
            precision = str(accelerator.mixed_precision)
            loop, versions = "accelerate", {"accelerate": _accelerate_version()}
        elif any(type(o).__module__.startswith("accelerate") for o in optimizers):
            raise TypeError(
                "record() was given an optimizer prepared by accelerate: pass the Accelerator "
                "too, record(..., accelerator=accelerator), so that the recorder knows when it "
                "really steps"
            )
        if accumulate_grad_batches < 1:
            raise ValueError(
                f"accumulate_grad_batches must be at least 1, got {accumulate_grad_batches}"
            )
        module, wrapper = _unwrapped(model)
        self._fit = Fit(
            module,
            loop,
            optimizers=optimizers,
            schedulers=[s if isinstance(s, Scheduled) else Scheduled(s) for s in schedulers],
            accumulate_grad_batches=accumulate_grad_batches,
            precision=precision,
            expected_steps=float("nan") if expected_steps is None else float(expected_steps),
            wrapper=wrapper,
            loss_rule=_loss_rule(module, loss_fn),
            versions=versions,
        )
        self._accelerator = accelerator
        self._entered = False
        self._ended = False
        self._open: MicroBatch | None = None  # the batch whose `with` block runs now
        self._micro_batches = 0  # of the current optimizer step, ended so far
        self._stepped = False  # whether an optimizer stepped since the last batch began
        self._stray_step = False  # an optimizer stepped outside any `with rec.batch(...)`
        self._hooks: list[Any] = []

    @property
    def fit(self) -> Fit:
        """The fit the probes see (its ``global_step``: optimizer steps taken so far)."""
        return self._fit

    @property
    def global_step(self) -> int:
        """Optimizer steps recorded so far (what a resumed loop restores)."""
        return self._fit.global_step

    def __enter__(self) -> PlainRecorder:
        if self._entered or self._ended:
            raise RuntimeError("a recorder is entered once: make a new one with dynamics.record()")
        self.begin(self._fit)
        self._entered = True
        self._hooks = [
            o.register_step_post_hook(self._optimizer_stepped) for o in self._fit.optimizers
        ]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._entered, self._ended = False, True
        if error is None:
            if self._started:  # a block left before any batch has no θ_T to record
                self.train_end(self._fit)
            self.close(self._fit, names.FINISHED)
        else:
            self.close(self._fit, names.CRASHED, f"{type(error).__name__}: {error}")

    @contextmanager
    def batch(self, batch: Any) -> Iterator[MicroBatch]:
        """One training batch (a micro-batch under accumulation): run its forward, backward
        and, when due, the optimizer's step and ``zero_grad`` inside, and hand its loss to
        ``b.loss(loss)``.

        ``batch`` is what the forward takes, on the model's device: the first batch is kept as
        the probes' probe batch. The step ends (and its rows are recorded) at the batch in
        which the optimizer stepped, or at the ``accumulate_grad_batches``-th (an optimizer step
        that a gradient scaler skipped is still a step, as in Lightning); under accelerate,
        when ``accelerator.sync_gradients`` says so.

        Example::

            with rec.batch(batch) as b:
                loss = loss_fn(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                b.loss(loss)

        Raises:
            RuntimeError: outside ``with rec:``, inside another ``rec.batch``, or after an
                optimizer stepped outside one (the recorder would miscount the steps).
        """
        self._check_usable("rec.batch(batch)")
        if self._open is not None:
            raise RuntimeError("rec.batch(batch) inside another rec.batch block: one at a time")
        fit = self._fit
        self._stepped = False
        self.batch_start(fit, batch)
        micro = self._open = MicroBatch()
        try:
            yield micro
        finally:
            micro.open, self._open = False, None
        # Reached only when the block ended without an exception; otherwise the exception
        # leaves `with rec:` too, which closes the file as crashed.
        self._check_usable("the end of rec.batch(batch)")
        self._micro_batches += 1
        if self._step_ended():
            fit.global_step += 1
            self._micro_batches = 0
        self.batch_end(fit, batch, micro.value)

    def validation(self, metrics: Mapping[str, Any] | None = None) -> None:
        """After an evaluation the loop ran itself: ``metrics`` (name -> number or scalar
        tensor) are what ``LoggedMetrics`` records, at the current step. One before the first
        training batch is not recorded (with a warning): the run file begins there.

        Example::

            rec.validation(metrics={"val_loss": evaluate(model, val_loader)})

        Raises:
            RuntimeError: outside ``with rec:`` or inside a ``rec.batch`` block.
            TypeError: a metric that is not a number.
        """
        self._check_usable("rec.validation(...)")
        if self._open is not None:
            raise RuntimeError(
                "rec.validation(...) inside a rec.batch block: call it between batches"
            )
        values = {}
        for name, value in (metrics or {}).items():
            if not isinstance(value, (int, float, torch.Tensor)) or isinstance(value, bool):
                raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
            values[name] = torch.as_tensor(value).detach().float().reshape(())
        if not self._started:
            self._fit.warn(
                "rec.validation(...) before the first rec.batch is not recorded: the run file "
                "begins at the first training batch"
            )
            return
        self.flush()
        self._fit.metrics = values
        self.validation_end(self._fit)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the recording, to put in your own ``torch.save``; a loop
        resumed from it continues the same run file (no gap, no duplicate row). Take it after
        an optimizer step, not between the micro-batches of one. Under DDP every rank must call
        it together (it gathers the ranks' probe batches), even where only rank zero saves.

        Raises:
            RuntimeError: inside a ``rec.batch`` block or between micro-batches of one step.
        """
        if self._open is not None or self._micro_batches:
            raise RuntimeError(
                "rec.state_dict() in the middle of an optimizer step "
                f"({self._micro_batches} of {self._fit.accumulate_grad_batches} micro-batches "
                "done): save checkpoints after the optimizer has stepped"
            )
        return {"recording": super().state_dict(), "global_step": self._fit.global_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the run of a checkpoint's :meth:`state_dict`: call it before ``with rec:``,
        with the model, the optimizer and the data loader restored to the same step.

        Raises:
            RuntimeError: after the recording began.
            TypeError: ``state_dict`` is not a plain-loop recorder's state.
        """
        if self._entered or self._ended:
            raise RuntimeError(
                "rec.load_state_dict(...) after `with rec:` began: load it first, "
                "rec = dynamics.record(...); rec.load_state_dict(state); with rec: ..."
            )
        if not isinstance(state_dict, Mapping) or not {"recording", "global_step"} <= set(
            state_dict
        ):
            raise TypeError(
                "rec.load_state_dict takes what rec.state_dict() returned, a dict with "
                f"'recording' and 'global_step'; got {type(state_dict).__name__}"
            )
        super().load_state_dict(state_dict["recording"])
        self._fit.global_step = int(state_dict["global_step"])
        self._fit.checkpoint = "the state given to rec.load_state_dict()"

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._stepped = True
        if self._open is None:
            self._stray_step = True

    def _step_ended(self) -> bool:
        """Whether the batch that just ended was the last of its optimizer step."""
        if self._accelerator is not None:
            return bool(self._accelerator.sync_gradients)
        return self._stepped or self._micro_batches >= self._fit.accumulate_grad_batches

    def _check_usable(self, what: str) -> None:
        if not self._entered:
            raise RuntimeError(f"{what} outside `with dynamics.record(...) as rec:`")
        if self._stray_step:
            raise RuntimeError(
                "the optimizer stepped outside `with rec.batch(batch)`: run every training "
                "batch, its optimizer step included, inside one, or the steps are miscounted"
            )


class _NoLoss(LossRule):
    """No loss for extra passes: ``record()`` was given no ``loss_fn`` for a model that
    computes none itself; the probes that need one step aside, saying why."""

    def __init__(self, module: nn.Module) -> None:
        self.reason = (
            f"record() was given no loss_fn, and {type(module).__name__} is no Hugging Face model "
            "computing its own loss: pass loss_fn=lambda model, batch: ... to measure it"
        )

    def check(self, module: nn.Module) -> None:
        raise LossUnavailable(self.reason)

    def source(self, module: nn.Module) -> str:
        return "none (no loss_fn)"

    def __call__(self, module: nn.Module, batch: Any) -> torch.Tensor:
        raise LossUnavailable(self.reason)

    def to_dict(self) -> dict[str, str]:
        return {"rule": "none"}


def _loss_rule(module: nn.Module, loss_fn: LossFn | None) -> LossRule:
    if loss_fn is not None:
        return FunctionLoss(loss_fn)
    # A Hugging Face model returns its loss when the batch holds labels, as the Trainer takes it.
    if any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
        return OutputLoss()
    return _NoLoss(module)


def _unwrapped(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """The model inside DDP, ``torch.compile`` and FSDP1 wrappers, and the FSDP1 wrapper
    (what :class:`~dynamics.sharding.ParameterShards` reads the flat parameters from)."""
    wrapper = None
    while True:
        kind = type(model).__name__
        if kind == "OptimizedModule":  # torch.compile
            model = model._orig_mod
        elif kind == "DistributedDataParallel":
            model = model.module
        elif kind == "FullyShardedDataParallel":
            wrapper = wrapper or model
            model = model.module
        else:
            return model, wrapper


def _listed(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    return [optimizer]


def _accelerate_version() -> str:
    import accelerate  # only where an Accelerator was given, which proves it is installed

    return accelerate.__version__
