"""The recorder for ``transformers.Trainer``: a ``TrainerCallback`` over the recorder's core.

The Trainer hands its callbacks neither the batch nor the loss, and zeroes the gradients before
``on_step_end``. The callback therefore watches the model itself: a forward pre-hook hands each
training micro-batch (as the Trainer passes it to the model) to the recorder before its forward,
a forward hook keeps the loss the model returned, and a step ends at ``on_optimizer_step``, after
``optimizer.step()`` and before ``zero_grad()``. What it records, and its limits:
``docs/loops/huggingface.md``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import accelerate
import torch
import transformers
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from dynamics.callbacks.fit import Fit, Scheduled
from dynamics.callbacks.probe import Probe
from dynamics.callbacks.recording import Recording
from dynamics.passes.loss_rule import FunctionLoss, OutputLoss
from dynamics.sharding import UnsupportedSharding
from dynamics.store import RunFileError, names

__all__ = ["DynamicsCallback", "HuggingFaceFit"]

#: The name of the recorder's state in a Trainer checkpoint folder, after the run file's name.
STATE_FILE = "dynamics-{}.pt"


class HuggingFaceFit(Fit):
    """A ``transformers.Trainer`` fit, as the probes see it.

    The Trainer hands the model ``num_items_in_batch``, the token count of the whole accumulated
    step (of every rank's batches when ``average_tokens_across_devices``): each micro-batch's
    ``.loss`` is then its token sum over that count, and the loss trained on is their sum (times
    the world size, over the ranks' count). :meth:`loss_sum` adds them up so, so that
    ``TrainingLoss`` records the token-weighted mean over the step the gradients are of.

    Example::

        fit = HuggingFaceFit(args, state, model, optimizer, lr_scheduler, loader, OutputLoss())
    """

    def __init__(
        self,
        args: TrainingArguments,
        state: TrainerState,
        model: nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        train_dataloader: Any,
        loss_rule: OutputLoss | FunctionLoss,
    ) -> None:
        super().__init__(
            model,
            "huggingface",
            # accelerate wraps the optimizer (AcceleratedOptimizer); the probes read the torch one
            optimizers=[getattr(optimizer, "optimizer", optimizer)] if optimizer else [],
            schedulers=[Scheduled(lr_scheduler)] if lr_scheduler is not None else [],
            accumulate_grad_batches=args.gradient_accumulation_steps,
            precision="bf16" if args.bf16 else "fp16" if args.fp16 else "32",
            expected_steps=float(state.max_steps),
            loss_rule=loss_rule,
            train_dataloader=train_dataloader,
            versions={
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
            },
        )
        self.global_step = state.global_step
        self.average_tokens_across_devices = args.average_tokens_across_devices
        #: Whether the Trainer passed ``num_items_in_batch``: micro-batch losses are then parts
        #: of the step's loss, not means of their own.
        self.token_normalized = False

    def loss_sum(self, losses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
        if not self.token_normalized:
            return super().loss_sum(losses)  # each a micro-batch's mean, as the Trainer scales
        total, _ = super().loss_sum(losses)
        # Normalized by every rank's tokens, the ranks' totals add up to the step's loss (the
        # Trainer multiplies by the world size, and DDP averages the gradients back); by the
        # rank's own tokens, the step's loss is the mean of the ranks' totals.
        count = 1.0 / self.world_size if self.average_tokens_across_devices else 1.0
        return total, count


class DynamicsCallback(Recording, TrainerCallback):
    """Records a ``transformers.Trainer`` fit into one run file, as ``DynamicsRecorder`` records
    a Lightning fit: the same probes, the same file.

    The probes' loss is ``model(**batch).loss`` (:class:`~dynamics.passes.loss_rule.OutputLoss`)
    unless ``loss_fn(model, batch)`` is given. Gradient accumulation, precision and DDP are the
    Trainer's own settings. Evaluation metrics (``eval_loss``...) are recorded by
    ``LoggedMetrics(["eval_loss"])``. The recorder's state is saved in each Trainer checkpoint
    folder, so ``trainer.train(resume_from_checkpoint=...)`` continues the run file.

    Example::

        callback = DynamicsCallback("runs/gpt2.h5", [TrainingLoss(), HiddenStateNorms()])
        Trainer(model, args, train_dataset=data, callbacks=[callback]).train()

    Args:
        path: the run file to write.
        probes: what to record (default: ``TrainingLoss``, ``HiddenStateNorms``,
            ``ParameterDisplacement``).
        loss_fn: ``loss_fn(model, batch) -> loss`` for the probes' extra passes (``batch``:
            what the Trainer passes the model), in place of ``model(**batch).loss``.
        **recording_options: ``overwrite``, ``config``, ``run_name``, ``flush_interval_s``,
            ``block_rows``, ``on_probe_error``, as for
            :class:`~dynamics.callbacks.recording.Recording`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        probes: Sequence[Probe] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        **recording_options: Any,
    ) -> None:
        super().__init__(path, probes, **recording_options)
        self.loss_rule = FunctionLoss(loss_fn) if loss_fn is not None else OutputLoss()
        self._fit: HuggingFaceFit | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._in_step = False  # between on_step_begin and on_optimizer_step
        self._busy = False  # inside the recorder: the probes' own passes are not training's
        self._batch: Any = None  # the micro-batch whose forward ran, until its batch_end
        self._loss: torch.Tensor | None = None  # the loss its forward returned
        self._final = False  # train_end done

    # -- the Trainer's events ------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._fit is not None:  # the last train() raised: its on_train_end never came
            self.crashed("train() ended without on_train_end (an exception in the fit)")
        _refuse_unsupported(args)
        if args.label_smoothing_factor > 0:
            warnings.warn(
                "DynamicsCallback records nothing of this fit: under label smoothing the Trainer "
                "takes the labels out of the batch and computes a smoothed loss outside the model, "
                "which neither the probes' passes nor TrainingLoss can take",
                UserWarning,
                stacklevel=2,
            )
            return
        fit = HuggingFaceFit(
            args, state, model, optimizer, lr_scheduler, train_dataloader, self.loss_rule
        )
        if state.global_step > 0:  # resumed from a checkpoint, which the Trainer does not name
            folder = _checkpoint_folder(args, state)
            saved = folder / STATE_FILE.format(self.path.name)
            if not folder.is_dir() and self.path.exists() and not self.overwrite:
                raise RunFileError(
                    f"cannot resume {self.path}: the Trainer resumed at step {state.global_step} "
                    f"from a checkpoint outside {args.output_dir}, where DynamicsCallback finds "
                    f"its state ({folder.name}/{saved.name}); resume from the checkpoint folder in "
                    "output_dir, or pass overwrite=True to start a new run file there"
                )
            if saved.is_file():
                self.load_state_dict(torch.load(saved, weights_only=True))
            fit.checkpoint = str(folder)
        self._final = False
        self._call_core(self.begin, fit)
        self._fit = fit
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
        ]

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._fit is not None:
            self._fit.global_step = state.global_step
            self._in_step = True

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self._end_micro_batch()  # accumulating: the optimizer has not stepped

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        # After optimizer.step(), before zero_grad() and before the Trainer counts the step.
        if self._fit is None:
            return
        self._fit.global_step = state.global_step + 1
        self._end_micro_batch()
        self._in_step = False

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if control.should_evaluate or control.should_save:
            self.flush()  # an evaluation can outlast the flush interval by far

    def on_epoch_end(self, args, state, control, **kwargs) -> None:
        self.flush()
        if state.global_step >= state.max_steps or control.should_training_stop:
            self._train_end(state)  # before load_best_model_at_end changes the parameters

    def on_evaluate(
        self, args, state, control, metrics: Mapping[str, float] | None = None, **kwargs
    ) -> None:
        if self._fit is None:
            return
        self._fit.global_step = state.global_step
        self._fit.metrics = {
            key: torch.tensor(float(value))
            for key, value in (metrics or {}).items()
            if isinstance(value, (int, float))
        }
        self._call_core(self.validation_end, self._fit)

    def on_save(self, args, state, control, **kwargs) -> None:
        if self._fit is None:
            return
        recorder_state = self._call_core(self.state_dict)  # every rank: it is collective
        if self._fit.is_global_zero:
            saved = _checkpoint_folder(args, state) / STATE_FILE.format(self.path.name)
            torch.save(recorder_state, saved)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self._fit is None:
            return
        self._train_end(state)
        self._finish(names.FINISHED)

    def crashed(self, error: BaseException | str) -> None:
        """Close the run file as crashed. The Trainer tells its callbacks nothing of an
        exception: a script that catches one around ``train()`` calls this; otherwise the
        file reads ``killed`` once the process is gone, or crashed at the next ``train()``.

        Example::

            try:
                trainer.train()
            except Exception as error:
                callback.crashed(error)
                raise
        """
        if self._fit is None:
            return
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._finish(names.CRASHED, message)

    # -- the model's hooks ---------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._training_forward(module):
            return
        if self._batch is not None:
            return  # a second forward in one micro-batch (a custom compute_loss): not its loss
        fit = self._fit
        fit.token_normalized = "num_items_in_batch" in kwargs
        # The Trainer calls model(**inputs); the token count is the step's, not the batch's.
        batch = (
            {k: v for k, v in kwargs.items() if k != "num_items_in_batch"} if kwargs else args[0]
        )
        self._batch = batch
        self._call_core(self.batch_start, fit, batch)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._batch is None or self._loss is not None or not self._training_forward(module):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            self._step_aside(
                "the model returned no loss on the Trainer's batch: a compute_loss_func computes "
                "it outside the model, from labels the Trainer keeps from it, so neither the "
                "probes' passes nor TrainingLoss can take the loss trained on"
            )
            return
        # A copy: the Trainer scales the loss in place afterwards (by the world size).
        self._loss = loss.detach().clone()

    def _training_forward(self, module: nn.Module) -> bool:
        return self._fit is not None and self._in_step and not self._busy and module.training

    # -- the core's calls ----------------------------------------------------------------------

    def _end_micro_batch(self) -> None:
        if self._fit is None or self._batch is None:
            return
        batch, outputs = self._batch, {"loss": self._loss}
        self._batch = self._loss = None
        self._call_core(self.batch_end, self._fit, batch, outputs)

    def _train_end(self, state: TrainerState) -> None:
        if self._final or self._fit is None:
            return
        self._final = True
        self._fit.global_step = state.global_step
        self._call_core(self.train_end, self._fit)

    def _call_core(self, method: Callable[..., Any], *args: Any) -> Any:
        """A call into the recorder: the model forwards it runs (probe passes) are its own."""
        self._busy = True
        try:
            return method(*args)
        finally:
            self._busy = False

    def _step_aside(self, reason: str) -> None:
        self._fit.warn(
            f"DynamicsCallback stops recording ({self.path} closes as crashed): {reason}"
        )
        self._finish(names.CRASHED, reason)

    def _finish(self, state: str, message: str = "") -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        fit, self._fit = self._fit, None
        self._in_step, self._batch, self._loss = False, None, None
        self._call_core(self.close, fit, state, message)


def _checkpoint_folder(args: TrainingArguments, state: TrainerState) -> Path:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` in, and the one
    ``resume_from_checkpoint=True`` finds (hyperparameter searches' run folders aside)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def _refuse_unsupported(args: TrainingArguments) -> None:
    """Refuse, before the fit costs anything, what the callback cannot record correctly.

    Raises:
        UnsupportedSharding: DeepSpeed, FSDP or DataParallel.
    """
    if args.deepspeed or args.fsdp:
        raise UnsupportedSharding(
            "DynamicsCallback records DDP and single-process Trainer fits; DeepSpeed and FSDP "
            "through the Trainer are not supported (their sharded parameters are laid out by the "
            "Trainer's plugins): record such a fit with Lightning's FSDPStrategy"
        )
    if args.n_gpu > 1:
        raise UnsupportedSharding(
            "DynamicsCallback cannot record DataParallel (several GPUs in one process): "
            "launch one process per GPU (torchrun), which the Trainer runs as DDP"
        )
